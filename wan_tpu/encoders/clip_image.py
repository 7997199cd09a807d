"""The CLIP vision encoder of Wan 2.1 I2V and Matrix-Game-2, native JAX (`wan_tpu.encoders.clip`).

As diffusers' `WanImageToVideoPipeline.encode_image`: the image processor of the checkpoint's
`image_processor/` folder prepares the image and the DiT's image branch takes the penultimate hidden
state (`hidden_states[-2]`, 257 tokens at 224 px), not the pooled output; the tower is loaded without its
last block, whose output nobody reads. Weights go file → device (`load_clip_vision`); neither torch nor
transformers is imported.

    encoder = CLIPImageEncoder.from_pretrained("ckpt/image_encoder", "ckpt/image_processor")
    encoder = CLIPImageEncoder.from_pretrained("clip_vision_h.safetensors")   # one file: default preprocessing
    tokens = encoder.encode([pil_image])          # (B, 257, 1280)

`ImageProcessor` is transformers' `CLIPImageProcessor` (its PIL backend, which diffusers' pipelines
get without torchvision) bit for bit: RGB (transparency onto white), a PIL resize of the shortest edge
(`int(size · long / short)` for the other), a centre crop, ·rescale_factor in float64 then float32, and
(x − mean) / std in float32.

Wan's own CLIP (`models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`, which Matrix-Game-2 uses
with `use_31_block`) is the same vision transformer: `clip_vision_from_original` maps its visual tower
onto a `CLIPVisionModel` folder (no image processor), and `preprocess_tensor` prepares images the way
that code does (a bicubic resize of the [-1, 1] tensor, no antialiasing); `encode_pixels` takes them.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu.encoders.clip_loading import clip_vision_from_original  # noqa: F401 - re-exported (converters)
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import require_file
from wan_tpu.loading.component_files import is_weights_file

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageProcessor:
    """`processor(images) -> (B, 3, H, W)` float32 pixel values, as transformers' `CLIPImageProcessor` makes them."""

    def __init__(self, config: dict | None = None):
        c = {"do_resize": True, "size": {"shortest_edge": 224}, "resample": 3, "do_center_crop": True,
             "crop_size": {"height": 224, "width": 224}, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), **(config or {})}
        for key in ("size", "crop_size"):
            if isinstance(c[key], int):  # old configs: one int, a square for crop_size, the shortest edge for size
                c[key] = {"shortest_edge": c[key]} if key == "size" else {"height": c[key], "width": c[key]}
        if c["do_resize"] and set(c["size"]) not in ({"shortest_edge"}, {"height", "width"}):
            raise WanInputError(f"image processor size {c['size']} is not supported; use shortest_edge or height/width")
        self.config = c

    @classmethod
    def from_pretrained(cls, folder) -> ImageProcessor:
        require_file(folder, "preprocessor_config.json", "image_processor")
        path = os.path.join(os.fspath(folder), "preprocessor_config.json")
        try:
            with open(path) as f:
                return cls(json.load(f))
        except json.JSONDecodeError as e:
            raise WanInputError(f"{path}: not valid JSON ({e}); re-download it") from None

    def __call__(self, images) -> np.ndarray:
        return np.stack([self.one(image) for image in images])

    def one(self, image) -> np.ndarray:
        from PIL import Image

        c = self.config
        if isinstance(image, np.ndarray):
            image = Image.fromarray(np.asarray(image, np.uint8))
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            image = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image)
        image = image.convert("RGB")
        if c["do_resize"]:
            w, h = image.size
            if "shortest_edge" in c["size"]:
                short, long = (w, h) if w <= h else (h, w)
                new_short, new_long = c["size"]["shortest_edge"], int(c["size"]["shortest_edge"] * long / short)
                new_h, new_w = (new_long, new_short) if w <= h else (new_short, new_long)
            else:
                new_h, new_w = c["size"]["height"], c["size"]["width"]
            image = image.resize((new_w, new_h), resample=c["resample"])
        x = np.asarray(image).transpose(2, 0, 1)
        if c["do_center_crop"]:
            x = _center_crop(x, c["crop_size"]["height"], c["crop_size"]["width"])
        if c["do_rescale"]:
            x = (x.astype(np.float64) * c["rescale_factor"]).astype(np.float32)
        if c["do_normalize"]:
            x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
            mean, std = (np.asarray(c[k], x.dtype)[:, None, None] for k in ("image_mean", "image_std"))
            x = (x - mean) / std
        return x.astype(np.float32)


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, H, W) centre crop, zero-padding an image smaller than the crop (as transformers' `center_crop`)."""
    h, w = x.shape[1:]
    if h < height or w < width:
        nh, nw = max(h, height), max(w, width)
        padded = np.zeros((x.shape[0], nh, nw), x.dtype)
        top, left = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
        padded[:, top : top + h, left : left + w] = x
        x, h, w = padded, nh, nw
    top, left = (h - height) // 2, (w - width) // 2
    return x[:, top : top + height, left : left + width]


class CLIPImageEncoder:
    """`encode(images) -> (B, tokens, hidden_size)` jax array: CLIP's penultimate hidden state."""

    def __init__(self, model, image_processor: ImageProcessor | None = None):
        self.model = model  # a `CLIPVisionTransformer` without the checkpoint's last block
        self.image_processor = image_processor
        self.config = model.config

    @classmethod
    def from_pretrained(
        cls, image_encoder, image_processor_dir=None, dtype=jnp.float32, mesh=None, attention_impl=None
    ) -> CLIPImageEncoder:
        """diffusers' I2V layout: `image_encoder/` (weights) and `image_processor/` (preprocessing; None:
        only `encode_pixels`, for callers that prepare the pixels themselves). Or one CLIP file (Wan's
        `models_clip_…vit-huge-14.pth`, ComfyUI's `clip_vision_h.safetensors`; the config from its shapes,
        `wan_tpu.encoders.clip_loading`): it carries no preprocessing, so without `image_processor_dir` it
        gets `CLIPImageProcessor`'s defaults, which every Wan I2V checkpoint's `image_processor/` holds
        (224 px, bicubic, CLIP's mean and std)."""
        from wan_tpu.encoders.clip_loading import load_clip_vision

        single_file = is_weights_file(image_encoder)
        if not single_file:
            require_file(image_encoder, "config.json", "image_encoder")
        image_processor = (ImageProcessor.from_pretrained(image_processor_dir) if image_processor_dir is not None
                           else ImageProcessor() if single_file else None)
        model = load_clip_vision(image_encoder, dtype=dtype, mesh=mesh, num_layers=-1, attention_impl=attention_impl)
        return cls(model, image_processor)

    def preprocess(self, images) -> np.ndarray:
        """Pixel values (B, 3, H, W) float32 from PIL images or uint8 HWC arrays, as the processor makes them."""
        if self.image_processor is None:
            raise WanInputError("this CLIP encoder was loaded without an image_processor/ folder; prepare the pixels "
                                "(e.g. with preprocess_tensor) and call encode_pixels")
        return self.image_processor(images)

    def encode(self, images) -> jax.Array:
        # float32 pixels, as diffusers passes them: CLIP casts them to its weight dtype itself.
        return self.encode_pixels(self.preprocess(images))

    def encode_pixels(self, pixel_values) -> jax.Array:
        """Prepared pixel values (B, 3, S, S), S the model's image size → the penultimate hidden state."""
        return self.model(jnp.asarray(pixel_values, jnp.float32))


def preprocess_tensor(images, size: int) -> np.ndarray:
    """(B, 3, H, W) in [-1, 1] → CLIP pixel values (B, 3, size, size) float32, as Wan's own CLIP code
    prepares them (`CLIPModel.visual` / `encode_video`): torch's bicubic resize (`F.interpolate`,
    align_corners False, no antialiasing) of the tensor, then [0, 1] and the CLIP mean/std."""
    x = np.asarray(images, np.float32)
    rows, cols = _bicubic_matrix(x.shape[2], size), _bicubic_matrix(x.shape[3], size)
    x = np.einsum("sh,bchw,tw->bcst", rows, x, cols, optimize=True) * 0.5 + 0.5
    mean, std = (np.asarray(v, np.float32).reshape(1, 3, 1, 1) for v in (CLIP_MEAN, CLIP_STD))
    return ((x - mean) / std).astype(np.float32)


def _bicubic_matrix(n_in: int, n_out: int, a: float = -0.75) -> np.ndarray:
    """(n_out, n_in) weights of torch's bicubic interpolation along one axis: Keys' kernel with a = -0.75,
    source coordinate (i + 0.5)·n_in/n_out - 0.5, the four taps' indices clamped to the edge."""
    m = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        src = (i + 0.5) * n_in / n_out - 0.5
        base = math.floor(src)
        t = src - base
        for k, d in enumerate((t + 1, t, 1 - t, 2 - t)):
            w = ((a + 2) * d - (a + 3)) * d * d + 1 if d <= 1 else ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
            m[i, min(max(base - 1 + k, 0), n_in - 1)] += w
    return m.astype(np.float32)
