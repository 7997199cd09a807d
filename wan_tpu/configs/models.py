"""Every Wan variant in one table (big_vision style): transformer configs and model-level facts.

Transformer values are the `transformer/config.json` of the diffusers checkpoints on the Hugging Face
Hub (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan2.1-T2V-14B-Diffusers, Wan2.1-I2V-14B-480P-Diffusers,
Wan2.1-I2V-14B-720P-Diffusers, Wan2.2-TI2V-5B-Diffusers, Wan2.2-T2V-A14B-Diffusers,
Wan2.2-I2V-A14B-Diffusers), as written by diffusers' `scripts/convert_wan_to_diffusers.py`.
Sampling defaults (shift, size, frames, steps, guidance, fps) are the official repos' configs:
Wan-Video/Wan2.1 `wan/configs/*.py` + `generate.py`, Wan-Video/Wan2.2 `wan/configs/*.py`.

    from wan_tpu.configs.models import VARIANTS, config_from_json, variant_for_config
    VARIANTS["wan2.1-t2v-1.3b"].transformer.num_layers   # 30
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from wan_tpu.errors import WanInputError


@dataclass(frozen=True)
class WanTransformerConfig:
    """The fields of diffusers' `WanTransformer3DModel` config.json, same names and defaults."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self):
        patch = self.patch_size
        if not isinstance(patch, (tuple, list)) or len(patch) != 3 or not all(_is_pos_int(p) for p in patch):
            _bad("patch_size", patch, "three positive integers (t, h, w), e.g. [1, 2, 2]")
        object.__setattr__(self, "patch_size", tuple(int(p) for p in patch))
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                     "freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len"):
            if not _is_pos_int(getattr(self, name)):
                _bad(name, getattr(self, name), "a positive integer")
        for name in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            value = getattr(self, name)
            if value is not None and not _is_pos_int(value):
                _bad(name, value, "a positive integer or null")
        if self.attention_head_dim % 2:
            _bad("attention_head_dim", self.attention_head_dim, "even (rotary embeddings rotate pairs of channels)")
        if self.freq_dim % 2:
            _bad("freq_dim", self.freq_dim, "even (half sine, half cosine)")
        if self.out_channels > self.in_channels:
            _bad("out_channels", self.out_channels,
                 f"at most in_channels={self.in_channels} (inputs are the latent plus optional conditioning channels)")
        if not isinstance(self.cross_attn_norm, bool):
            _bad("cross_attn_norm", self.cross_attn_norm, "true or false")
        if self.qk_norm != "rms_norm_across_heads":
            _bad("qk_norm", self.qk_norm, '"rms_norm_across_heads" (the only q/k norm Wan uses)')
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not 0 < self.eps < 1:
            _bad("eps", self.eps, "a small positive float such as 1e-06")
        object.__setattr__(self, "eps", float(self.eps))
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            _bad("added_kv_proj_dim", self.added_kv_proj_dim,
                 f"set together with image_dim (image_dim={self.image_dim}): both for the CLIP image branch, "
                 "or both null")
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.inner_dim:
            _bad("added_kv_proj_dim", self.added_kv_proj_dim,
                 f"equal to num_attention_heads*attention_head_dim={self.inner_dim} "
                 "(it projects the embedded image tokens)")
        if self.pos_embed_seq_len is not None and self.image_dim is None:
            _bad("pos_embed_seq_len", self.pos_embed_seq_len, "null when image_dim is null")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)


def _is_pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _bad(field: str, value, expected: str):
    raise WanInputError(f"transformer config field {field!r} is {value!r}; it must be {expected} — fix config.json")


_FIELDS = {f.name for f in dataclasses.fields(WanTransformerConfig)}


def config_from_json(config: dict) -> WanTransformerConfig:
    """Build a config from a checkpoint's `transformer/config.json` (metadata keys `_...` ignored)."""
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise WanInputError(
            f"transformer config.json has unknown field {unknown[0]!r}; this is not a WanTransformer3DModel config "
            f"(known fields: {', '.join(sorted(_FIELDS))})"
        )
    if fields.get("out_channels", 0) is None:
        fields["out_channels"] = fields.get("in_channels", WanTransformerConfig.in_channels)  # diffusers: `out or in`
    if isinstance(fields.get("patch_size"), list):
        fields["patch_size"] = tuple(fields["patch_size"])
    return WanTransformerConfig(**fields)


def config_to_json(cfg: WanTransformerConfig) -> dict:
    out = dataclasses.asdict(cfg)
    out["patch_size"] = list(cfg.patch_size)
    return out


@dataclass(frozen=True)
class WanVariant:
    """Model-level facts a pipeline needs. For two-expert (A14B) models `transformer` is the high-noise
    expert, used while t >= boundary_ratio * 1000, and `transformer_2` the low-noise one (diffusers'
    naming); `guidance_scale` goes with `transformer`, `guidance_scale_2` with `transformer_2`."""

    name: str
    repo: str
    transformer: WanTransformerConfig
    task: str  # "t2v", "i2v" or "ti2v"
    vae: str  # "wan2.1" (16 latent channels, 4x8x8) or "wan2.2" (48 channels, 4x16x16)
    fps: int
    sample_shift: float
    sample_size: tuple[int, int]  # (width, height)
    sample_frames: int
    sample_steps: int
    guidance_scale: float
    transformer_2: WanTransformerConfig | None = None
    boundary_ratio: float | None = None
    guidance_scale_2: float | None = None
    expand_timesteps: bool = False
    uses_clip_image: bool = False

    def __post_init__(self):
        if (self.transformer_2 is None) != (self.boundary_ratio is None):
            raise ValueError(f"{self.name}: transformer_2 and boundary_ratio go together")
        if self.uses_clip_image != (self.transformer.image_dim is not None):
            raise ValueError(f"{self.name}: uses_clip_image must match transformer.image_dim")


_T2V_1_3B = WanTransformerConfig(num_attention_heads=12, ffn_dim=8960, num_layers=30)
_T2V_14B = WanTransformerConfig()
_I2V_14B = WanTransformerConfig(in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
_TI2V_5B = WanTransformerConfig(num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30)
_I2V_A14B = WanTransformerConfig(in_channels=36)
# Small enough for CPU tests and the built-in `tiny` preset; every code path of T2V is exercised.
_TINY = WanTransformerConfig(num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32, ffn_dim=128,
                             num_layers=2)
# The tiny DiT over the tiny Wan 2.2 VAE's 8 latent channels: the TI2V image path (first frame at t=0, no CLIP).
_TINY_TI2V = dataclasses.replace(_TINY, in_channels=8, out_channels=8)

_VARIANTS = (
    WanVariant("wan2.1-t2v-1.3b", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", _T2V_1_3B, "t2v", "wan2.1", 16,
               # Wan 2.1 shift: 3.0 at 480p, 5.0 at 720p (`wan_tpu.wan.settings.default_shift` applies the
               # rule to other sizes too).
               sample_shift=3.0, sample_size=(832, 480), sample_frames=81, sample_steps=50, guidance_scale=5.0),
    WanVariant("wan2.1-t2v-14b", "Wan-AI/Wan2.1-T2V-14B-Diffusers", _T2V_14B, "t2v", "wan2.1", 16,
               sample_shift=5.0, sample_size=(1280, 720), sample_frames=81, sample_steps=50, guidance_scale=5.0),
    WanVariant("wan2.1-i2v-14b-480p", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", _I2V_14B, "i2v", "wan2.1", 16,
               sample_shift=3.0, sample_size=(832, 480), sample_frames=81, sample_steps=40, guidance_scale=5.0,
               uses_clip_image=True),
    WanVariant("wan2.1-i2v-14b-720p", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers", _I2V_14B, "i2v", "wan2.1", 16,
               sample_shift=5.0, sample_size=(1280, 720), sample_frames=81, sample_steps=40, guidance_scale=5.0,
               uses_clip_image=True),
    WanVariant("wan2.2-ti2v-5b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", _TI2V_5B, "ti2v", "wan2.2", 24,
               sample_shift=5.0, sample_size=(1280, 704), sample_frames=121, sample_steps=50, guidance_scale=5.0,
               expand_timesteps=True),
    # Wan2.2's A14B configs keep the shared sample_fps of 16; only TI2V-5B samples at 24.
    WanVariant("wan2.2-t2v-a14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", _T2V_14B, "t2v", "wan2.1", 16,
               sample_shift=12.0, sample_size=(1280, 720), sample_frames=81, sample_steps=40, guidance_scale=4.0,
               transformer_2=_T2V_14B, boundary_ratio=0.875, guidance_scale_2=3.0),
    WanVariant("wan2.2-i2v-a14b", "Wan-AI/Wan2.2-I2V-A14B-Diffusers", _I2V_A14B, "i2v", "wan2.1", 16,
               sample_shift=5.0, sample_size=(1280, 720), sample_frames=81, sample_steps=40, guidance_scale=3.5,
               transformer_2=_I2V_A14B, boundary_ratio=0.9, guidance_scale_2=3.5),
    WanVariant("tiny", "", _TINY, "t2v", "wan2.1", 16,
               sample_shift=5.0, sample_size=(64, 64), sample_frames=5, sample_steps=4, guidance_scale=5.0),
    WanVariant("tiny-ti2v", "", _TINY_TI2V, "ti2v", "wan2.2", 24,
               sample_shift=5.0, sample_size=(64, 64), sample_frames=5, sample_steps=4, guidance_scale=5.0,
               expand_timesteps=True),
)

VARIANTS: dict[str, WanVariant] = {v.name: v for v in _VARIANTS}


def variant_for_config(cfg: WanTransformerConfig) -> WanVariant | None:
    """The first variant (table order) whose transformer has this config, else None.

    Several variants share one transformer architecture (I2V 480p/720p; T2V 14B and each A14B expert),
    so the match names the architecture, not the checkpoint.
    """
    for v in _VARIANTS:
        if cfg in (v.transformer, v.transformer_2):
            return v
    return None
