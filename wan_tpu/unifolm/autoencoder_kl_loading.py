"""`load_autoencoder_kl(path, dtype, mesh)`: a diffusers-format `AutoencoderKL` folder → our Flax model.

`wan-convert-unifolm` (`wan_tpu/unifolm/convert.py`) writes UnifoLM's first stage in this format (the LDM names
renamed with `ldm_to_diffusers_name`), so one loader serves both. Every parameter is read from exactly
one checkpoint tensor, streamed (memory-mapped, converted, placed: `wan_tpu.loading.params`) and checked: a
missing, unexpected or wrongly shaped tensor is a `WanInputError` naming it. Names are diffusers' with the
one-module list indices dropped (`downsamplers.0.` → `downsampler.`, `upsamplers.0.` → `upsampler.`,
`attentions.0.` → `attention.`, `to_out.0.` → `to_out.`) and `kernel` for `weight`. Layouts: conv
(out, in, kh, kw) → (kh, kw, in, out); linear (out, in) → (in, out) (old 1x1-conv attention weights
(out, in, 1, 1) are accepted too).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from wan_tpu.configs.autoencoder_kl import config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import open_checkpoint
from wan_tpu.loading.params import Layout, StoredParam, load_params
from wan_tpu.unifolm.autoencoder_kl import AutoencoderKL
from wan_tpu.unifolm.model import KeyCounter  # nnx.Rngs' traced counter makes eval_shape quadratic

_RENAMES = (
    (".downsampler.", ".downsamplers.0."),
    (".upsampler.", ".upsamplers.0."),
    (".attention.", ".attentions.0."),
    (".to_out.", ".to_out.0."),
)


def diffusers_name(path: tuple) -> str:
    name = "." + ".".join(str(p) for p in path)
    for ours, theirs in _RENAMES:
        name = name.replace(ours, theirs)
    name = name[1:]
    return name[: -len("kernel")] + "weight" if name.endswith("kernel") else name


def _layout(stored: tuple, shape: tuple) -> Layout:
    """Stored (diffusers) layout → ours for a parameter of our `shape` stored as `stored`."""
    if len(shape) == 4:
        return Layout(perm=(2, 3, 1, 0))
    if len(shape) == 2:
        return Layout(reshape=tuple(stored[:2]), perm=(1, 0))
    return Layout()


def _checkpoint_shapes(shape: tuple) -> list[tuple]:
    if len(shape) == 4:
        return [(shape[3], shape[2], *shape[:2])]
    if len(shape) == 2:
        return [(shape[1], shape[0]), (shape[1], shape[0], 1, 1)]
    return [shape]


def abstract_autoencoder_kl(config, dtype=jnp.float32, *, split: bool = False):
    """The VAE `load_autoencoder_kl` fills, without weights (`nnx.eval_shape`), read back from the executable
    cache after the first build (`cached_abstract`; a warm start built it beside the weights' loads: 0.7 s of
    the interpreter's time) and shared with the pipeline's `prepare`, which compiles for it."""
    from wan_tpu.runtime import executable_cache

    return executable_cache.cached_abstract("autoencoder-kl", (config, jnp.dtype(dtype).name),
                                            lambda: AutoencoderKL(config, dtype=dtype, rngs=KeyCounter(0)), split=split)


def load_autoencoder_kl(path: str, dtype=jnp.float32, mesh=None) -> AutoencoderKL:
    """Load a diffusers `AutoencoderKL` folder; with a mesh, weights are replicated on all its devices."""
    config_dict, tensors = open_checkpoint(path, "VAE")
    config = config_from_json(config_dict)
    graphdef, state = abstract_autoencoder_kl(config, dtype, split=True)
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    flat = nnx.to_flat_state(state)
    used, stored = set(), []
    for key, var in flat:
        name = diffusers_name(key)
        shape = tuple(var.shape)
        expected = _checkpoint_shapes(shape)
        if name not in tensors:
            raise WanInputError(f"{path}: tensor {name!r} (shape {expected[0]}) is missing; the weights do not match config.json")
        if tuple(tensors.shape(name)) not in expected:
            raise WanInputError(
                f"{path}: tensor {name!r} has shape {tuple(tensors.shape(name))}, expected {expected[0]} for this config.json"
            )
        stored.append(StoredParam(tensors, [name], _layout(tuple(tensors.shape(name)), shape), np.dtype(var.dtype)))
        used.add(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise WanInputError(f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all); "
                            "the weights do not match config.json")
    # The shared placement path (`wan_tpu.loading.params`): read in threads from the memory map, large kernels
    # laid out on the device. Converted and put one by one in this thread, they took 3.1 s of it in a warm
    # UnifoLM start, beside the UNet's load (H200 host, a sampling profile).
    place = None if sharding is None else (lambda i, host: jax.device_put(host, sharding))
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---- the authors' (LDM) names → diffusers' -------------------------------------------------------

_LDM_RESNET = {"nin_shortcut": "conv_shortcut"}
_LDM_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def ldm_to_diffusers_name(name: str, num_levels: int) -> str:
    """One tensor name of the authors' `AutoencoderKL` state dict (LDM layout) → diffusers' name.

    `encoder.down.{i}.block.{j}` → `encoder.down_blocks.{i}.resnets.{j}`; the decoder's `up.{i}` is
    `up_blocks.{num_levels-1-i}` (diffusers lists them from the lowest resolution); `mid.block_{1,2}` →
    `mid_block.resnets.{0,1}`; `mid.attn_1.{norm,q,k,v,proj_out}` → `mid_block.attentions.0.{group_norm,
    to_q,to_k,to_v,to_out.0}`; `norm_out` → `conv_norm_out`; `nin_shortcut` → `conv_shortcut`.
    """
    parts = name.split(".")
    m = re.fullmatch(r"(encoder|decoder)\.(down|up)\.(\d+)\.(block|downsample|upsample)\.(.*)", name)
    if m:
        side, _, level, kind, rest = m.groups()
        level = int(level) if side == "encoder" else num_levels - 1 - int(level)
        blocks = "down_blocks" if side == "encoder" else "up_blocks"
        if kind == "block":
            j, sub, leaf = rest.split(".")
            return f"{side}.{blocks}.{level}.resnets.{j}.{_LDM_RESNET.get(sub, sub)}.{leaf}"
        return f"{side}.{blocks}.{level}.{kind}rs.0.{rest}"
    if len(parts) >= 3 and parts[1] == "mid":
        side, _, sub, *rest = parts
        if sub in ("block_1", "block_2"):
            j = int(sub[-1]) - 1
            return f"{side}.mid_block.resnets.{j}.{_LDM_RESNET.get(rest[0], rest[0])}.{rest[1]}"
        if sub == "attn_1":
            return f"{side}.mid_block.attentions.0.{_LDM_ATTN[rest[0]]}.{rest[1]}"
    if len(parts) == 3 and parts[1] == "norm_out":
        return f"{parts[0]}.conv_norm_out.{parts[2]}"
    return name


def ldm_to_diffusers_tensor(name: str, array: np.ndarray) -> np.ndarray:
    """LDM's mid-block attention projections are 1x1 convs; diffusers' are linears: drop the 1x1."""
    if ".mid_block.attentions.0.to_" in name and array.ndim == 4:
        return array.reshape(array.shape[:2])
    return array
