"""`load_vae(path, dtype, mesh)`: a diffusers-format `vae/` folder → `WanVAE`.

Every parameter of our model is read from exactly one checkpoint tensor, streamed one at a time
(memory-mapped, converted, placed), and checked: a missing, unexpected or wrongly shaped tensor is a
`WanInputError` that names it. Names are diffusers' with the list indices that only wrap one module
dropped (`resample.1.` → `resample.`, 2.1's `upsamplers.0.` → `upsampler.`) and `weight` → `kernel`.
Layouts: conv weights (out, in, t, h, w) → (t, h, w, in, out); 1x1 Conv2d (out, in, 1, 1) → (in, out);
RMS-norm gamma (C, 1, 1[, 1]) → (C,).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from wan_tpu.checkpoint import open_checkpoint
from wan_tpu.configs.vae import config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.models.vae import WanVAE, _width_mesh


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


def to_ours(array: np.ndarray, shape: tuple) -> np.ndarray:
    if len(shape) == 5:
        return array.transpose(2, 3, 4, 1, 0)
    if len(shape) == 4:
        return array.transpose(2, 3, 1, 0)
    if len(shape) == 2:
        return array.reshape(array.shape[:2]).T
    return array.reshape(shape)


def load_vae(path: str, dtype=jnp.float32, mesh=None) -> WanVAE:
    """Load a diffusers `AutoencoderKLWan` folder; with a mesh, weights are replicated on all its devices."""
    config_dict, tensors = open_checkpoint(path, "VAE")
    config = config_from_json(config_dict)
    abstract = nnx.eval_shape(lambda: WanVAE(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    wmesh = _width_mesh(mesh)
    sharding = None if wmesh is None else NamedSharding(wmesh, PartitionSpec())
    flat = nnx.to_flat_state(state)
    used = set()
    for key, var in flat:
        name = diffusers_name(key, config.is_residual)
        shape = tuple(var.shape)
        expected = diffusers_shape(name, shape)
        if name not in tensors:
            raise WanInputError(
                f"{path}: tensor {name!r} (shape {expected}) is missing; the weights do not match config.json — re-save with save_pretrained"
            )
        if tuple(tensors.shape(name)) != expected:
            raise WanInputError(
                f"{path}: tensor {name!r} has shape {tuple(tensors.shape(name))}, expected {expected} for this config.json; re-save with save_pretrained"
            )
        value = jnp.asarray(np.ascontiguousarray(to_ours(np.asarray(tensors[name]), shape)), dtype=var.dtype)
        var.set_value(value if sharding is None else jax.device_put(value, sharding))
        used.add(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise WanInputError(
            f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all); the weights do not match config.json — check the folder"
        )
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.mesh = mesh
    return model
