"""`load_vae(path, dtype, mesh)`: a diffusers-format `vae/` folder → `WanVAE`.

Every parameter of our model is read from exactly one checkpoint tensor, streamed one at a time
(memory-mapped, converted, placed), and checked: a missing, unexpected or wrongly shaped tensor is a
`WanInputError` that names it. Names are diffusers' with the list indices that only wrap one module
dropped (`resample.1.` → `resample.`, 2.1's `upsamplers.0.` → `upsampler.`) and `weight` → `kernel`.
Layouts: conv weights (out, in, t, h, w) → (t, h, w, in, out); 1x1 Conv2d (out, in, 1, 1) → (in, out);
RMS-norm gamma (C, 1, 1[, 1]) → (C,).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from wan_tpu.configs.vae import WanVAEConfig, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import open_checkpoint, read_config
from wan_tpu.loading.params import Layout, StoredParam, load_params
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
    for old, new in _ORIGINAL_TOP.items():
        if name.startswith(old):
            return new + name[len(old):]
    part, rest = name.split(".", 1)
    if rest.startswith("middle."):
        index, rest = rest[len("middle."):].split(".", 1)
        block = "attentions.0" if index == "1" else f"resnets.{int(index) // 2}"
        head = f"{part}.mid_block.{block}."
    elif rest.startswith("downsamples."):
        index, rest = rest[len("downsamples."):].split(".", 1)
        head = f"{part}.down_blocks.{index}."
    elif rest.startswith("upsamples."):
        index, rest = rest[len("upsamples."):].split(".", 1)
        level, j = divmod(int(index), num_res_blocks + 2)
        head = f"{part}.up_blocks.{level}." + ("upsamplers.0." if j == num_res_blocks + 1 else f"resnets.{j}.")
    else:
        raise WanInputError(f"tensor {name!r} is not part of an original Wan 2.1 VAE; is this Wan2.1_VAE.pth?")
    for old, new in _ORIGINAL_RESIDUAL.items():
        if rest.startswith(old):
            return head + new + rest[len(old):]
    return head + rest


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


def vae_config(path: str) -> WanVAEConfig:
    """The `WanVAEConfig` of a diffusers `AutoencoderKLWan` folder, from its config.json alone (no tensor read)."""
    return config_from_json(read_config(path, "VAE"))


def abstract_vae(config: WanVAEConfig, dtype=jnp.float32) -> WanVAE:
    """The VAE `load_vae` fills, without weights (`nnx.eval_shape`): its graphdef is the loaded one's, so
    programs compiled for it serve the loaded VAE. Read back from the executable cache when built before
    with the same config and dtype (0.27 s of tracing on a 2-core CPU)."""
    from wan_tpu.runtime import executable_cache

    return executable_cache.cached_abstract("wan-vae", (config, jnp.dtype(dtype).name),
                                            lambda: WanVAE(config, dtype=dtype, rngs=nnx.Rngs(0)))


def load_vae(path: str, dtype=jnp.float32, mesh=None) -> WanVAE:
    """Load a diffusers `AutoencoderKLWan` folder; with a mesh, weights are replicated on all its devices."""
    config_dict, tensors = open_checkpoint(path, "VAE")
    config = config_from_json(config_dict)
    abstract = abstract_vae(config, dtype)
    graphdef, state = nnx.split(abstract)
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
                f"{path}: tensor {name!r} (shape {expected}) is missing; the weights do not match config.json — "
                "re-save with save_pretrained"
            )
        if tuple(tensors.shape(name)) != expected:
            raise WanInputError(
                f"{path}: tensor {name!r} has shape {tuple(tensors.shape(name))}, expected {expected} for this "
                "config.json; re-save with save_pretrained"
            )
        stored.append(StoredParam(tensors, [name], layout(expected, shape), np.dtype(var.dtype)))
        used.add(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise WanInputError(
            f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all); the weights do not match "
            "config.json — check the folder"
        )
    place = None if sharding is None else (lambda i, host: jax.device_put(host, sharding))
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.mesh = mesh
    return model
