"""`load_vae(path, dtype, mesh)`: a diffusers-format `vae/` folder, or one VAE file, → `WanVAE`.

Files: the official `Wan2.1_VAE.pth` / `Wan2.2_VAE.pth` (the authors' `WanVAE_` state dict, read
weights-only and memory-mapped) and ComfyUI's `vae/wan_2.1_vae.safetensors` / `wan2.2_vae.safetensors`
(the same original names, fp32/fp16/bf16); the layout is told from the names, the config from the shapes
(`original_wan21_vae_config`, `original_wan22_vae_config`), and each tensor is read under its diffusers
name (`original_wan21_vae_name`, `original_wan22_vae_name`, the tables of diffusers'
`scripts/convert_wan_to_diffusers.py`).

Every parameter of our model is read from exactly one checkpoint tensor, streamed one at a time
(memory-mapped, converted, placed), and checked: a missing, unexpected or wrongly shaped tensor is a
`WanInputError` that names it. Names are diffusers' with the list indices that only wrap one module
dropped (`resample.1.` → `resample.`, 2.1's `upsamplers.0.` → `upsampler.`) and `weight` → `kernel`.
Layouts: conv weights (out, in, t, h, w) → (t, h, w, in, out); 1x1 Conv2d (out, in, 1, 1) → (in, out);
RMS-norm gamma (C, 1, 1[, 1]) → (C,).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from wan_tpu.configs.vae import VAE_PRESETS, WanVAEConfig, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import MappedSource, open_checkpoint, read_config
from wan_tpu.loading.component_files import is_weights_file, open_weights_file, strip_prefix, weights_in_dtype, wrong_component
from wan_tpu.loading.params import Layout, StoredParam, load_params
from wan_tpu.parallel.sharding import put
from wan_tpu.vae.model import WanVAE, width_mesh


def diffusers_name(path: tuple, is_residual: bool) -> str:
    name = ".".join(str(p) for p in path)
    name = name.replace("resample.", "resample.1.")
    if not is_residual:
        name = name.replace(".upsampler.", ".upsamplers.0.")
    return name[: -len("kernel")] + "weight" if name.endswith("kernel") else name


def diffusers_shape(name: str, shape: tuple) -> tuple:
    """The checkpoint shape of one of our parameters (our shape in diffusers' layout)."""
    if name.endswith("gamma"):
        return (shape[0], 1, 1) if ".attentions." in name else (shape[0], 1, 1, 1)
    if len(shape) == 5:
        return (shape[4], shape[3], *shape[:3])
    if len(shape) == 4:
        return (shape[3], shape[2], *shape[:2])
    if len(shape) == 2:
        return (shape[1], shape[0], 1, 1)
    return shape


def layout(stored: tuple, shape: tuple) -> Layout:
    """Stored (diffusers) layout → ours, for a parameter of our `shape` stored as `stored`."""
    if len(shape) == 5:
        return Layout(perm=(2, 3, 4, 1, 0))
    if len(shape) == 4:
        return Layout(perm=(2, 3, 1, 0))
    if len(shape) == 2:
        return Layout(reshape=tuple(stored[:2]), perm=(1, 0))
    return Layout() if tuple(stored) == tuple(shape) else Layout(reshape=tuple(shape))


_ORIGINAL_RESIDUAL = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.", "residual.6.": "conv2.",
                      "shortcut.": "conv_shortcut."}
_ORIGINAL_TOP = {"conv1.": "quant_conv.", "conv2.": "post_quant_conv.", "encoder.conv1.": "encoder.conv_in.",
                 "decoder.conv1.": "decoder.conv_in.", "encoder.head.0.": "encoder.norm_out.",
                 "encoder.head.2.": "encoder.conv_out.", "decoder.head.0.": "decoder.norm_out.",
                 "decoder.head.2.": "decoder.conv_out."}


def original_wan21_vae_name(name: str, num_res_blocks: int) -> str:
    """The diffusers `AutoencoderKLWan` name of a tensor of the original Wan 2.1 VAE (`Wan2.1_VAE.pth`).

    The original keeps each part as a flat `nn.Sequential`: `middle.{0,1,2}` (resnet, attention, resnet),
    `head.{0,2}` (norm, conv), residual blocks as `residual.{0,2,3,6}` + `shortcut`, the encoder's
    `downsamples.i` (already diffusers' flat `down_blocks.i`), and the decoder's `upsamples.k`: per level
    `num_res_blocks + 1` resnets then one upsampler, which diffusers nests as `up_blocks.l.resnets.j` /
    `up_blocks.l.upsamplers.0`."""
    def levels(part: str, rest: str) -> str | None:
        if rest.startswith("downsamples."):
            index, rest = rest[len("downsamples."):].split(".", 1)
            return f"{part}.down_blocks.{index}." + _residual(rest)
        if rest.startswith("upsamples."):
            index, rest = rest[len("upsamples."):].split(".", 1)
            level, j = divmod(int(index), num_res_blocks + 2)
            block = "upsamplers.0." if j == num_res_blocks + 1 else f"resnets.{j}."
            return f"{part}.up_blocks.{level}.{block}" + _residual(rest)
        return None

    return _original_vae_name(name, levels, "Wan2.1_VAE.pth")


def original_wan22_vae_name(name: str) -> str:
    """The diffusers `AutoencoderKLWan` name of a tensor of the original Wan 2.2 VAE (`Wan2.2_VAE.pth`,
    `wan/modules/vae2_2.py`): each level is a block of its own, `downsamples.i.downsamples.j` /
    `upsamples.i.upsamples.j`, whose residual blocks diffusers calls `resnets.j` and whose last entry, a
    resample, `downsampler` / `upsampler` (diffusers' `convert_vae_22`)."""

    def levels(part: str, rest: str) -> str | None:
        kind = rest.split(".", 1)[0]
        if kind not in ("downsamples", "upsamples"):
            return None
        parts = rest.split(".", 4)
        if len(parts) < 5 or parts[2] != kind or not parts[3].isdigit():
            return None
        level, index, rest = parts[1], parts[3], parts[4]
        blocks, sampler = ("down_blocks", "downsampler") if kind == "downsamples" else ("up_blocks", "upsampler")
        if rest.startswith(("resample.", "time_conv.")):
            return f"{part}.{blocks}.{level}.{sampler}.{rest}"
        return f"{part}.{blocks}.{level}.resnets.{index}." + _residual(rest)

    return _original_vae_name(name, levels, "Wan2.2_VAE.pth")


def _residual(rest: str) -> str:
    for old, new in _ORIGINAL_RESIDUAL.items():
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def _original_vae_name(name: str, levels, file: str) -> str:
    """The renames both original VAEs share (top-level convs, heads, middle blocks) around `levels`, the
    version's down/up blocks."""
    for old, new in _ORIGINAL_TOP.items():
        if name.startswith(old):
            return new + name[len(old):]
    part, _, rest = name.partition(".")
    if part in ("encoder", "decoder") and rest.startswith("middle."):
        index, rest = rest[len("middle."):].split(".", 1)
        block = "attentions.0" if index == "1" else f"resnets.{int(index) // 2}"
        return f"{part}.mid_block.{block}." + _residual(rest)
    renamed = levels(part, rest) if part in ("encoder", "decoder") else None
    if renamed is None:
        raise WanInputError(f"tensor {name!r} is not part of an original Wan {file[3:6]} VAE; is this {file}?")
    return renamed


def original_wan21_vae_config(state_dict) -> dict:
    """The diffusers `config.json` of an original Wan 2.1 VAE state dict (its widths read from the tensors)."""
    try:
        base_dim = int(state_dict["encoder.conv1.weight"].shape[0])
        z_dim = int(state_dict["conv2.weight"].shape[0])
    except KeyError as e:
        raise WanInputError(f"the VAE state dict has no {e.args[0]!r}; is this Wan2.1_VAE.pth?") from None
    ups = {int(k.split(".")[2]) for k in state_dict if k.startswith("decoder.upsamples.")}
    levels = len(WanVAEConfig().dim_mult)
    # The decoder has `levels` groups of num_res_blocks + 1 resnets, and levels - 1 upsamplers.
    per_level, extra = divmod(len(ups) - (levels - 1), levels)
    if extra or per_level < 2 or z_dim != 16:
        raise WanInputError(f"the VAE state dict ({len(ups)} decoder upsample entries, z_dim {z_dim}) is not a Wan 2.1 VAE's; "
                            f"is this Wan2.1_VAE.pth?")
    config = dataclasses.asdict(WanVAEConfig(base_dim=base_dim, num_res_blocks=per_level - 1))
    del config["clip_output"]  # ours, not a diffusers field
    return {"_class_name": "AutoencoderKLWan", **{k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}}


def original_wan22_vae_config(state_dict) -> dict:
    """The diffusers `config.json` of an original Wan 2.2 VAE state dict: widths, levels, residual blocks per
    level, temporal downsampling and patch size read from the tensors' names and shapes (no data)."""
    def shape(name):
        if name not in state_dict:
            raise WanInputError(f"the VAE state dict has no {name!r}; is this Wan2.2_VAE.pth?")
        return tuple(state_dict.shape(name)) if hasattr(state_dict, "shape") else tuple(state_dict[name].shape)

    base_dim, in_channels = shape("encoder.conv1.weight")[:2]
    z_dim = shape("conv2.weight")[0]
    names = list(state_dict)
    levels = 1 + max(int(n.split(".")[2]) for n in names if n.startswith("encoder.downsamples."))
    dim_mult = [shape(f"encoder.downsamples.{i}.downsamples.0.residual.2.weight")[0] // base_dim for i in range(levels)]
    res_blocks = {n.split(".")[4] for n in names if n.startswith("encoder.downsamples.0.downsamples.") and ".residual." in n}
    temporal = [any(n.startswith(f"encoder.downsamples.{i}.downsamples.") and ".time_conv." in n for n in names)
                for i in range(levels - 1)]
    patch = math.isqrt(in_channels // 3)
    stats = {48: VAE_PRESETS["wan2.2"], 16: VAE_PRESETS["wan2.1"]}.get(z_dim)
    if stats is None or 3 * patch * patch != in_channels:
        raise WanInputError(f"the VAE state dict (z_dim {z_dim}, {in_channels} input channels) is not a Wan 2.2 VAE's; "
                            "is this Wan2.2_VAE.pth?")
    config = dataclasses.replace(
        VAE_PRESETS["wan2.2"], base_dim=base_dim, decoder_base_dim=shape("decoder.conv1.weight")[0] // dim_mult[-1],
        z_dim=z_dim, dim_mult=tuple(dim_mult), num_res_blocks=len(res_blocks), temperal_downsample=tuple(temporal),
        in_channels=in_channels, out_channels=shape("decoder.head.2.weight")[0], patch_size=patch,
        scale_factor_spatial=2 ** (levels - 1) * patch, scale_factor_temporal=2 ** sum(temporal),
        latents_mean=stats.latents_mean, latents_std=stats.latents_std)
    fields = dataclasses.asdict(config)
    del fields["clip_output"]  # ours, not a field of diffusers' AutoencoderKLWan
    return {"_class_name": "AutoencoderKLWan", **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}


def open_vae(path, dtype=jnp.float32) -> tuple[dict, object]:
    """(diffusers config dict, tensors under diffusers names) of a VAE folder or file (the module docstring);
    a file's layout and config come from its header alone."""
    path = os.fspath(path)
    if not is_weights_file(path):
        return open_checkpoint(path, "VAE")
    raw = strip_prefix(open_weights_file(path, "VAE"), "decoder.middle.0.residual.0.gamma")
    if "decoder.upsamples.0.upsamples.0.residual.0.gamma" in raw:
        config, rename = original_wan22_vae_config(raw), original_wan22_vae_name
    elif "decoder.middle.0.residual.0.gamma" in raw:
        config = original_wan21_vae_config(raw)
        rename = lambda n: original_wan21_vae_name(n, config["num_res_blocks"])  # noqa: E731
    else:
        raise wrong_component(path, "vae", raw)
    raw = weights_in_dtype(raw, dtype)
    return config, MappedSource(raw, {rename(n): n for n in raw})


def vae_config(path: str) -> WanVAEConfig:
    """The `WanVAEConfig` of a diffusers `AutoencoderKLWan` folder (its config.json) or of a VAE file (its
    header), reading no tensor."""
    if is_weights_file(path):
        return config_from_json(open_vae(path)[0])
    return config_from_json(read_config(path, "VAE"))


def abstract_vae(config: WanVAEConfig, dtype=jnp.float32, *, split: bool = False):
    """The VAE `load_vae` fills, without weights (`nnx.eval_shape`): its graphdef is the loaded one's, so
    programs compiled for it serve the loaded VAE. Read back from the executable cache when built before
    with the same config and dtype (0.27 s of tracing on a 2-core CPU)."""
    from wan_tpu.runtime import executable_cache

    return executable_cache.cached_abstract("wan-vae", (config, jnp.dtype(dtype).name),
                                            lambda: WanVAE(config, dtype=dtype, rngs=nnx.Rngs(0)), split=split)


def load_vae(path: str, dtype=jnp.float32, mesh=None) -> WanVAE:
    """Load a diffusers `AutoencoderKLWan` folder or a VAE file (the module docstring); with a mesh, weights
    are replicated on all its devices."""
    config_dict, tensors = open_vae(path, dtype)
    fix = "re-download the file" if is_weights_file(path) else "re-save with save_pretrained"
    config = config_from_json(config_dict)
    graphdef, state = abstract_vae(config, dtype, split=True)
    wmesh = width_mesh(mesh)
    sharding = None if wmesh is None else NamedSharding(wmesh, PartitionSpec())
    flat = nnx.to_flat_state(state)
    used, stored = set(), []
    for key, var in flat:
        name = diffusers_name(key, config.is_residual)
        shape = tuple(var.shape)
        expected = diffusers_shape(name, shape)
        if name not in tensors:
            raise WanInputError(
                f"{path}: tensor {name!r} (shape {expected}) is missing; the weights do not match their config — {fix}"
            )
        if tuple(tensors.shape(name)) != expected:
            raise WanInputError(
                f"{path}: tensor {name!r} has shape {tuple(tensors.shape(name))}, expected {expected} for this "
                f"config; {fix}"
            )
        stored.append(StoredParam(tensors, [name], layout(expected, shape), np.dtype(var.dtype)))
        used.add(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise WanInputError(
            f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all); the weights do not match "
            "their config — check the folder or file"
        )
    place = None if sharding is None else (lambda i, host: put(host, sharding))
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.mesh = mesh
    return model
