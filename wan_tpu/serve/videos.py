"""Wan jobs of the OpenAI Videos API: a create request checked into a stored job request, and a job run.

Fields (multipart form, as the `openai` client sends them, or a JSON object): `prompt`; `size` `WxH`;
`seconds` (frames at the model's fps, rounded to the 4n+1 the VAE takes); `input_reference` (an image
upload, or `{"image_url": "data:image/...;base64,..."}`) for image-to-video models; `model` (this
server's model name, or left out). Ours, as extra body fields: `negative_prompt`, `frames` (instead of
`seconds`), `steps`, `seed`, `guidance`, `guidance_2`, `shift`, `scheduler`, `cache`, `cache_threshold`,
`lora` (names given to `--lora NAME=PATH` at start, each optionally `NAME:SCALE`). Every check is the
pipeline's own (`WanPipeline.settings`, `sampling`, `check_run`): the same one-line messages as the CLI.
"""

from __future__ import annotations

import base64
import io
import math
import os

from wan_tpu.errors import WanInputError

OPENAI_FIELDS = ("prompt", "model", "size", "seconds", "input_reference")
OUR_FIELDS = ("negative_prompt", "frames", "steps", "seed", "guidance", "guidance_2", "shift", "scheduler", "cache",
              "cache_threshold", "lora")
MAX_IMAGE_PIXELS = 4096 * 4096


def frames_for_seconds(seconds: float, fps: int, temporal: int = 4) -> int:
    """The `temporal`·n+1 frame count nearest to `seconds` of video at `fps` (at least one latent step)."""
    return max(1, round(seconds * fps / temporal)) * temporal + 1


def decode_image(data: bytes, what: str = "input_reference", fix: str = "pass a PNG or JPEG file"):
    """An uploaded image (`what`: how the message names it) as a PIL RGB image, or a one-line
    `WanInputError` ending in `fix`. The API's `input_reference` and the live page's start image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise WanInputError(f"{what} is {img.width}x{img.height}, over {MAX_IMAGE_PIXELS} pixels; {fix}")
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        # PIL names an unknown format by the buffer's repr, which tells the client nothing.
        why = "not a format PIL reads" if isinstance(e, UnidentifiedImageError) else " ".join(str(e).split())[:120]
        raise WanInputError(f"{what} cannot be read as an image ({why}); {fix}") from None


def image_from_reference(value) -> bytes | None:
    """The bytes of `input_reference` given as `{"image_url": "data:...;base64,..."}` (the server fetches no URL)."""
    url = value.get("image_url") if isinstance(value, dict) else None
    if value.get("file_id") if isinstance(value, dict) else False:
        raise WanInputError("input_reference file_id is not supported; upload the image or pass a base64 data URL")
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise WanInputError("input_reference must be an image upload or {\"image_url\": \"data:image/png;base64,...\"}; "
                            "this server fetches no URL")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except ValueError:
        raise WanInputError("input_reference's data URL is not valid base64") from None


def _number(fields: dict, name: str, kind=float):
    value = fields.get(name)
    if value is None or value == "":
        return None
    try:
        number = kind(value) if kind is float else int(str(value))
    except (TypeError, ValueError):
        raise WanInputError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if kind is float and not math.isfinite(number):
        raise WanInputError(f"{name} must be a finite number, got {value!r}")
    return number


def _size(value) -> tuple[int | None, int | None]:
    if value is None:
        return None, None
    parts = str(value).lower().replace("*", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise WanInputError(f"size {value!r} is not WIDTHxHEIGHT; pass e.g. size=832x480")
    return int(parts[0]), int(parts[1])


class WanVideos:
    """Create requests → job requests, and job runs, for one loaded `WanPipeline`.

    `loras`: name → (path, scale) given at start; `default_steps`: the steps of a request that does not say."""

    def __init__(self, pipe, model_name: str, loras: dict[str, tuple[str, float]] | None = None,
                 default_steps: int | None = None, default_seed: int = 0):
        self.pipe = pipe
        self.model_name = model_name
        self.loras = dict(loras or {})
        self.default_steps = default_steps
        self.default_seed = default_seed
        self.fps = pipe.variant.fps

    def check(self, fields: dict, image) -> dict:
        """The stored request of a create call (`fields`: the form or JSON body, `image`: a PIL image or None);
        `WanInputError` (one line) on anything the run would refuse."""
        unknown = sorted(set(fields) - set(OPENAI_FIELDS) - set(OUR_FIELDS))
        if unknown:
            raise WanInputError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; this server takes "
                                f"{', '.join(OPENAI_FIELDS + OUR_FIELDS)}")
        prompt = fields.get("prompt")
        if not isinstance(prompt, str):
            raise WanInputError("prompt is required: pass prompt=TEXT")
        model = fields.get("model")
        if model not in (None, "", self.model_name):
            raise WanInputError(f"this server serves {self.model_name!r}; pass model={self.model_name} or leave it out")
        negative = fields.get("negative_prompt")
        if negative is not None and not isinstance(negative, str):
            raise WanInputError("negative_prompt must be a string")
        width, height = _size(fields.get("size"))
        frames, seconds = _number(fields, "frames", int), _number(fields, "seconds")
        if frames is not None and seconds is not None:
            raise WanInputError("pass seconds or frames, not both")
        if seconds is not None:
            if seconds <= 0:
                raise WanInputError(f"seconds must be positive, got {fields['seconds']!r}")
            frames = frames_for_seconds(seconds, self.fps, self.pipe.vae_config.scale_factor_temporal)
        steps = _number(fields, "steps", int)
        s = self.pipe.settings(height=height, width=width, num_frames=frames,
                               num_inference_steps=self.default_steps if steps is None else steps,
                               guidance_scale=_number(fields, "guidance"), guidance_scale_2=_number(fields, "guidance_2"),
                               flow_shift=_number(fields, "shift"))
        scheduler = str(fields.get("scheduler") or "unipc")
        if scheduler not in ("unipc", "dpm++", "euler"):
            raise WanInputError(f"scheduler {scheduler!r} is not one of unipc, dpm++, euler")
        cache = fields.get("cache") or None
        cache_threshold = _number(fields, "cache_threshold")
        self.pipe.sampling(s, scheduler, None, None, cache, cache_threshold, with_image=image is not None)
        self.pipe.check_run(s, image, prompt=prompt, negative_prompt=negative)
        seed = _number(fields, "seed", int)
        if seed is not None and not 0 <= seed < 2**32:
            raise WanInputError(f"seed must be an integer from 0 to {2**32 - 1}, got {seed}")
        return {"prompt": prompt, "negative_prompt": negative, "width": s.width, "height": s.height,
                "frames": s.num_frames, "steps": s.num_inference_steps, "guidance": s.guidance_scale,
                "guidance_2": s.guidance_scale_2, "shift": s.flow_shift, "scheduler": scheduler, "cache": cache,
                "cache_threshold": cache_threshold, "lora": self._loras(fields.get("lora")),
                "seed": self.default_seed if seed is None else seed, "image": image is not None,
                "seconds": str(fields["seconds"]) if seconds is not None else f"{s.num_frames / self.fps:g}"}

    def _loras(self, value) -> list[tuple[str, float]]:
        if value in (None, "", []):
            return []
        items = value if isinstance(value, list) else str(value).split(",")
        out = []
        for item in items:
            name, _, scale = str(item).strip().partition(":")
            if name not in self.loras:
                known = ", ".join(sorted(self.loras)) or "none (start the server with --lora NAME=PATH)"
                raise WanInputError(f"LoRA {name!r} was not loaded at start; loaded: {known}")
            try:
                out.append((name, float(scale) if scale else self.loras[name][1]))
            except ValueError:
                raise WanInputError(f"LoRA scale {scale!r} of {name!r} is not a number; pass NAME or NAME:SCALE") from None
        return out

    def run(self, request: dict, image_path: str | None, video_path: str, thumbnail_path: str, on_step) -> None:
        """Generate the job's video and write the mp4 and its first frame (JPEG), each renamed into place."""
        from wan_tpu.runtime.video import write_video

        pipe = self.pipe
        try:
            for name, scale in request["lora"]:
                pipe.load_lora_weights(self.loras[name][0], scale)
            frames = pipe(request["prompt"], negative_prompt=request["negative_prompt"], height=request["height"],
                          width=request["width"], num_frames=request["frames"], num_inference_steps=request["steps"],
                          guidance_scale=request["guidance"], guidance_scale_2=request["guidance_2"],
                          flow_shift=request["shift"], seed=request["seed"], image=image_path, progress=False,
                          scheduler=request["scheduler"], cache=request["cache"],
                          cache_threshold=request["cache_threshold"], on_step=on_step)
        finally:
            if request["lora"]:
                pipe.unload_lora_weights()
        write_video(video_path, frames, self.fps, overwrite=True)
        write_jpeg(thumbnail_path, frames[0])


def write_jpeg(path: str, frame) -> None:
    from PIL import Image

    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.partial")
    try:
        Image.fromarray(frame).save(tmp, format="JPEG", quality=90)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_png(path: str, image) -> None:
    """An uploaded image, decoded and written again as PNG (never the client's bytes), renamed into place."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.partial")
    try:
        image.save(tmp, format="PNG")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
