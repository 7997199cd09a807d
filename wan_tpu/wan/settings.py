"""Which Wan model a checkpoint folder holds, and the validated settings of one run.

Defaults follow the official Wan `generate.py` for the model (see `wan_tpu.configs.models`): size,
frames, steps (50 for T2V/TI2V, 40 for I2V and the A14B models), guidance 5.0 (A14B: 4.0/3.0 T2V,
3.5/3.5 I2V), shift 5.0 — except Wan 2.1 I2V at 480p, where generate.py uses 3.0, and Wan 2.2 T2V
A14B, 12.0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from wan_tpu.configs import vae as vae_configs
from wan_tpu.configs.models import VARIANTS, WanVariant, config_from_json
from wan_tpu.configs.vae import WanVAEConfig
from wan_tpu.errors import WanInputError


@dataclass(frozen=True)
class RunSettings:
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    guidance_scale_2: float | None
    flow_shift: float

    @property
    def do_cfg(self) -> bool:
        """Classifier-free guidance runs when guidance > 1 (diffusers' rule)."""
        return self.guidance_scale > 1.0

    @property
    def size(self) -> str:
        return f"{self.width}*{self.height}"


def _number(name: str, value, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WanInputError(f"{name} must be a finite number, got {value!r}; pass {flag}")
    return float(value)


def _positive_int(name: str, value, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WanInputError(f"{name} must be a positive integer, got {value!r}; pass {flag}")
    return value


def default_shift(variant: WanVariant, width: int, height: int) -> float:
    if variant.name.startswith("wan2.1"):
        # Wan 2.1 by size: 3.0 up to 480p, 5.0 above (diffusers' Wan recommendation, and the official
        # generate.py's choice for I2V at 480p); Wan 2.2 models carry their own in the table.
        return 3.0 if width * height <= 832 * 480 else 5.0
    return variant.sample_shift


def resolve_settings(variant: WanVariant, vae: WanVAEConfig, *, height=None, width=None, num_frames=None,
                     num_inference_steps=None, guidance_scale=None, guidance_scale_2=None,
                     flow_shift=None) -> RunSettings:
    """Fill None settings with the model's defaults and check every value; WanInputError names the fix."""
    default_w, default_h = variant.sample_size
    width = _positive_int("width", default_w if width is None else width, "--size W*H")
    height = _positive_int("height", default_h if height is None else height, "--size W*H")
    multiple = vae.scale_factor_spatial * variant.transformer.patch_size[1]
    if width % multiple or height % multiple:
        fix_w, fix_h = max(multiple, round(width / multiple) * multiple), max(multiple, round(height / multiple) * multiple)
        raise WanInputError(
            f"size {width}*{height} is not a multiple of {multiple} (VAE stride {vae.scale_factor_spatial} x patch "
            f"{variant.transformer.patch_size[1]}); use e.g. --size {fix_w}*{fix_h}"
        )
    num_frames = _positive_int("frames", variant.sample_frames if num_frames is None else num_frames, "--frames 4n+1")
    t = vae.scale_factor_temporal
    if (num_frames - 1) % t:
        n = max(1, round((num_frames - 1) / t) * t + 1)
        raise WanInputError(f"frames {num_frames} is not {t}n+1 (the VAE packs {t} frames per latent); use e.g. --frames {n}")
    steps = _positive_int("steps", variant.sample_steps if num_inference_steps is None else num_inference_steps,
                          "--steps N")
    if guidance_scale is None:
        guidance_scale = variant.guidance_scale
        if guidance_scale_2 is None:
            guidance_scale_2 = variant.guidance_scale_2
    guidance_scale = _number("guidance", guidance_scale, "--guidance G")
    if variant.boundary_ratio is not None:
        # diffusers: the low-noise expert takes the same guidance unless told otherwise.
        guidance_scale_2 = _number("guidance_2", guidance_scale if guidance_scale_2 is None else guidance_scale_2,
                                   "--guidance-2 G")
    else:
        guidance_scale_2 = None
    shift = _number("shift", default_shift(variant, width, height) if flow_shift is None else flow_shift, "--shift S")
    if shift <= 0:
        raise WanInputError(f"shift must be positive, got {shift}; pass --shift S with S > 0 (Wan uses 3 to 12)")
    return RunSettings(height, width, num_frames, steps, guidance_scale, guidance_scale_2, shift)


# ---- checkpoint folders -------------------------------------------------------------------------


def _read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise WanInputError(f"{path} is missing; {what}")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WanInputError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from None


def read_model_index(path: str) -> dict:
    """model_index.json of a checkpoint folder ({} when absent: then a plain Wan 2.1 layout is assumed)."""
    index = os.path.join(path, "model_index.json")
    return _read_json(index, "") if os.path.isfile(index) else {}


def resolve_variant(path: str) -> tuple[WanVariant, WanVAEConfig]:
    """The variant and VAE config of a diffusers-format folder (transformer/ and vae/ config.json,
    model_index.json).

    A transformer architecture not in the table (e.g. a small test checkpoint) gets a `custom`
    variant with Wan 2.1 T2V 1.3B sampling defaults.
    """
    fix = "point --model at a complete diffusers-format Wan checkpoint folder"
    for part in ("transformer", "vae"):
        if not os.path.isdir(os.path.join(path, part)):
            raise WanInputError(f"checkpoint {path} has no {part}/ folder; {fix}")
    cfg = config_from_json(_read_json(os.path.join(path, "transformer", "config.json"), fix))
    index = read_model_index(path)
    boundary = index.get("boundary_ratio")
    expand = bool(index.get("expand_timesteps", False))
    cfg_2 = None
    if boundary is not None:
        cfg_2 = config_from_json(_read_json(os.path.join(path, "transformer_2", "config.json"),
                                            f"model_index.json sets boundary_ratio={boundary}, which needs transformer_2/; {fix}"))
    vae_cfg = vae_configs.config_from_json(_read_json(os.path.join(path, "vae", "config.json"), fix))
    vae = "wan2.2" if vae_cfg.is_residual else "wan2.1"
    for v in VARIANTS.values():
        if v.transformer == cfg and v.transformer_2 == cfg_2 and v.expand_timesteps == expand and v.vae == vae:
            return (v if boundary is None else dataclasses.replace(v, boundary_ratio=float(boundary))), vae_cfg
    task = "ti2v" if expand else ("i2v" if cfg.in_channels > cfg.out_channels else "t2v")
    return WanVariant(
        "custom", "", cfg, task, vae, 24 if vae == "wan2.2" else 16,
        sample_shift=5.0, sample_size=(832, 480), sample_frames=81, sample_steps=50, guidance_scale=5.0,
        transformer_2=cfg_2, boundary_ratio=None if boundary is None else float(boundary),
        guidance_scale_2=None if boundary is None else 5.0, expand_timesteps=expand,
        uses_clip_image=cfg.image_dim is not None,
    ), vae_cfg


def model_parts(variant: WanVariant) -> dict[str, str]:
    """Component name → sub-folder of a diffusers-format checkpoint that this variant needs."""
    parts = {"transformer": "transformer", "vae": "vae", "text_encoder": "text_encoder", "tokenizer": "tokenizer"}
    if variant.boundary_ratio is not None:
        parts["transformer_2"] = "transformer_2"
    if variant.uses_clip_image:
        parts["image_encoder"] = "image_encoder"
        parts["image_processor"] = "image_processor"
    return parts


OFFLOAD_CHOICES = "auto, none, blocks or blocks:N"


def parse_offload(value) -> str | int | None:
    """`--offload` / `offload=`: "auto" (the estimate chooses), "none" (None: every weight on the device),
    "blocks" (every DiT block streamed from host memory: 0 resident) or "blocks:N" (the first N blocks
    resident, the rest streamed); an int N is "blocks:N"."""
    if value is None or value == "none":
        return None
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and (value == "blocks" or value.startswith("blocks:")):
        count = value.partition(":")[2] or "0"
        if not count.isdigit():
            raise WanInputError(f"--offload {value}: N in blocks:N must be a whole number of resident blocks (0 or more)")
        count = int(count)
    else:
        raise WanInputError(f"--offload {value!r} is not one of {OFFLOAD_CHOICES}")
    if count < 0:
        raise WanInputError(f"--offload blocks:{count}: the resident block count cannot be negative")
    return count
