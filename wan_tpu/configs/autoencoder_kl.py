"""The image `AutoencoderKL` (Stable Diffusion's VAE) used by UnifoLM-WMA: one frozen config.

Field names are diffusers' (`AutoencoderKL`'s `config.json`), so a diffusers `vae/` folder maps onto
the dataclass one to one. Only the SD layout is supported: `DownEncoderBlock2D` / `UpDecoderBlock2D`
blocks (no attention outside the mid block), SiLU, both quant convs.

- unifolm: UnifoLM-WMA-0's `first_stage_config` (wan_tpu/configs/inference/*.yaml: ch 128, ch_mult 1-2-4-4,
  2 res blocks, z 4, double_z, no `attn_resolutions`; the mid block has its attention regardless),
  which is also Stable Diffusion 2.x's VAE; latents are scaled by 0.18215.
- tiny: the same structure with a few channels, for tests and the `unifolm-tiny` preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from wan_tpu.errors import WanInputError


@dataclass(frozen=True)
class AutoencoderKLConfig:
    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    mid_block_add_attention: bool = True

    @property
    def downscale(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


AUTOENCODER_KL_CONFIGS = {
    "unifolm": AutoencoderKLConfig(),
    "tiny": AutoencoderKLConfig(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4),
}

# Values of diffusers' AutoencoderKL config.json that this implementation computes (anything else is refused).
_FIXED = {
    "act_fn": "silu",
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "shift_factor": None,
    "latents_mean": None,
    "latents_std": None,
}


def config_from_json(cfg: dict) -> AutoencoderKLConfig:
    """An `AutoencoderKLConfig` from a diffusers `AutoencoderKL` config.json dict."""
    if cfg.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        raise WanInputError(f"vae config.json is for {cfg['_class_name']!r}; pass the folder of a diffusers AutoencoderKL")
    n = len(cfg.get("block_out_channels", ()))
    blocks = {"down_block_types": "DownEncoderBlock2D", "up_block_types": "UpDecoderBlock2D"}
    for key, kind in blocks.items():
        if key in cfg and tuple(cfg[key]) != (kind,) * n:
            raise WanInputError(f"vae config.json: {key} {cfg[key]} is not supported; only {n} x {kind!r} (the SD VAE)")
    for key, value in _FIXED.items():
        if cfg.get(key, value) != value:
            raise WanInputError(f"vae config.json: {key}={cfg[key]!r} is not supported; only {value!r} (the SD VAE)")
    names = {f.name for f in dataclasses.fields(AutoencoderKLConfig)}
    kwargs = {k: v for k, v in cfg.items() if k in names}
    if "block_out_channels" in kwargs:
        kwargs["block_out_channels"] = tuple(kwargs["block_out_channels"])
    return AutoencoderKLConfig(**kwargs)


def config_to_json(config: AutoencoderKLConfig) -> dict:
    """The diffusers config.json dict of `config` (diffusers' `AutoencoderKL.from_pretrained` reads it)."""
    n = len(config.block_out_channels)
    out = dataclasses.asdict(config)
    out["block_out_channels"] = list(config.block_out_channels)
    out.update(
        _class_name="AutoencoderKL",
        down_block_types=["DownEncoderBlock2D"] * n,
        up_block_types=["UpDecoderBlock2D"] * n,
        **_FIXED,
    )
    return out


def config_from_ldm(ddconfig: dict, embed_dim: int, scale_factor: float) -> AutoencoderKLConfig:
    """The config of the authors' `AutoencoderKL(ddconfig, embed_dim)` (the LDM form in their YAML)."""
    if not ddconfig.get("double_z", True) or ddconfig.get("attn_resolutions"):
        raise WanInputError("first_stage_config: only double_z with empty attn_resolutions (the SD VAE) is supported")
    if embed_dim != ddconfig["z_channels"]:
        raise WanInputError(f"first_stage_config: embed_dim {embed_dim} != z_channels {ddconfig['z_channels']} is not supported")
    return AutoencoderKLConfig(
        in_channels=ddconfig["in_channels"],
        out_channels=ddconfig["out_ch"],
        block_out_channels=tuple(ddconfig["ch"] * m for m in ddconfig["ch_mult"]),
        layers_per_block=ddconfig["num_res_blocks"],
        latent_channels=ddconfig["z_channels"],
        scaling_factor=float(scale_factor),
    )
