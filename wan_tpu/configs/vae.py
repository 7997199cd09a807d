"""Wan VAE variants: one frozen config, values from the checkpoints' `vae/config.json`.

Field names are diffusers' (`AutoencoderKLWan`), misspellings included (`temperal_downsample`), so a
`config.json` maps onto the dataclass one to one.

- wan2.1: Wan-AI/Wan2.1-T2V-1.3B-Diffusers/vae/config.json (also 14B, I2V; 8× spatial, 4× temporal)
- wan2.2: Wan-AI/Wan2.2-TI2V-5B-Diffusers/vae/config.json (residual blocks, 2×2 patchify, 16× spatial)
- tiny, tiny-2.2: the same structures with a few channels, for tests and the `tiny` preset
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from wan_tpu.errors import WanInputError

WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916,
)  # fmt: skip
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip


@dataclass(frozen=True)
class WanVAEConfig:
    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int = 4
    scale_factor_spatial: int = 8
    # Present in Wan 2.2's config.json; diffusers clamps the decoded video whatever its value, and so do we.
    clip_output: bool = True

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        p = self.patch_size or 1
        problems = []
        if self.base_dim <= 0 or self.z_dim <= 0 or (self.decoder_base_dim or 1) <= 0:
            problems.append("base_dim, decoder_base_dim and z_dim must be positive")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            problems.append(f"temperal_downsample has {len(self.temperal_downsample)} entries, dim_mult needs {len(self.dim_mult) - 1}")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            problems.append(f"latents_mean/latents_std have {len(self.latents_mean)}/{len(self.latents_std)} entries, "
                            f"z_dim is {self.z_dim}")
        if any(s <= 0 for s in self.latents_std):
            problems.append("latents_std entries must be positive")
        if self.in_channels % (p * p) or self.out_channels % (p * p):
            problems.append(f"in_channels/out_channels ({self.in_channels}/{self.out_channels}) must be multiples of patch_size² ({p * p})")
        if self.scale_factor_spatial != 2 ** (len(self.dim_mult) - 1) * p:
            problems.append(f"scale_factor_spatial {self.scale_factor_spatial} != 2^{len(self.dim_mult) - 1}·patch_size")
        if self.scale_factor_temporal != 2 ** sum(self.temperal_downsample):
            problems.append(f"scale_factor_temporal {self.scale_factor_temporal} != 2^(number of temporal downsamples)")
        if self.scale_factor_temporal != 4:
            problems.append("only 4× temporal compression is supported (frames are encoded as 1 + chunks of 4)")
        if problems:
            raise WanInputError(f"inconsistent VAE config: {'; '.join(problems)}; fix the vae config.json")

    @property
    def video_channels(self) -> int:
        """Channels of the public video tensor (the encoder sees them patchified)."""
        p = self.patch_size or 1
        return self.in_channels // (p * p)

    @property
    def decoder_dim(self) -> int:
        return self.decoder_base_dim or self.base_dim


_TINY_MEAN = (0.1, -0.2, 0.3, -0.1, 0.05, 0.2, -0.3, 0.15)
_TINY_STD = (1.5, 0.8, 2.0, 1.2, 0.9, 1.1, 1.3, 0.7)

VAE_PRESETS: dict[str, WanVAEConfig] = {
    "wan2.1": WanVAEConfig(),
    "wan2.2": WanVAEConfig(
        base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
        patch_size=2, scale_factor_spatial=16, latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD,
        clip_output=False,
    ),
    "tiny": WanVAEConfig(base_dim=8, z_dim=4, num_res_blocks=1, latents_mean=_TINY_MEAN[:4], latents_std=_TINY_STD[:4]),
    "tiny-2.2": WanVAEConfig(
        base_dim=8, decoder_base_dim=12, z_dim=8, num_res_blocks=1, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, latents_mean=_TINY_MEAN, latents_std=_TINY_STD, clip_output=False,
    ),
}


def config_from_json(d: dict) -> WanVAEConfig:
    """A diffusers `vae/config.json` dict → WanVAEConfig (keys starting with `_` are ignored)."""
    known = {f.name for f in dataclasses.fields(WanVAEConfig)}
    fields = {k: v for k, v in d.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise WanInputError(f"VAE config.json has unknown fields {unknown}; is this an AutoencoderKLWan config?")
    if fields.get("scale_factor_temporal") is None:
        fields.pop("scale_factor_temporal", None)
    if fields.get("scale_factor_spatial") is None:
        fields.pop("scale_factor_spatial", None)
    return WanVAEConfig(**fields)

# The tiny VAE structure with the 16 latent channels of Wan 2.1, which the tiny DiTs (Wan, Matrix-Game) consume.
TINY_VAE = dataclasses.replace(VAE_PRESETS["tiny"], z_dim=16, latents_mean=WAN21_LATENTS_MEAN,
                               latents_std=WAN21_LATENTS_STD)
