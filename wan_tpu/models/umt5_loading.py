"""`load_umt5`: a diffusers `text_encoder/` folder (transformers' `UMT5EncoderModel`) → `UMT5Encoder`.

    model = load_umt5("Wan2.1-T2V-1.3B-Diffusers/text_encoder", dtype=jnp.bfloat16, mesh=None)

config.json gives the `UMT5Config`; the safetensors (one file, or shards listed by an index) are read
through `wan_tpu.checkpoint`. Every parameter's checkpoint names and shapes are checked against
config.json before any data is read. Tensors keep their torch layout, so each parameter goes to the
device as stored through the loaders' one placement path (`wan_tpu.models.param_loading`; per-layer
tensors `encoder.block.{i}.…` stacked on the leading layer axis); with a mesh each is placed by the
`umt5` rules of `wan_tpu.configs.sharding`, each device receiving its slice.
The embedding is tied: `shared.weight` or `encoder.embed_tokens.weight`, whichever the file holds.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.checkpoint import TensorSource, open_checkpoint
from wan_tpu.errors import WanInputError
from wan_tpu.models.param_loading import Layout, StoredParam, load_params
from wan_tpu.models.umt5 import UMT5Config, UMT5Encoder

# Our block submodules → transformers' (`encoder.block.{i}.` + this).
_BLOCK_MODULES = {
    "attention_norm": "layer.0.layer_norm",
    "attention": "layer.0.SelfAttention",
    "ffn_norm": "layer.1.layer_norm",
    "ffn": "layer.1.DenseReluDense",
}
_EMBEDDING = ("shared.weight", "encoder.embed_tokens.weight")


def checkpoint_names(path: tuple[str, ...], num_layers: int) -> list[str]:
    """Our parameter path → its transformers tensor name(s): one per layer for the stacked blocks,
    the tied embedding's two names for `shared.weight` (either may be stored)."""
    if path == ("shared", "weight"):
        return list(_EMBEDDING)
    if path[0] == "blocks":
        rest = ".".join((_BLOCK_MODULES[path[1]], *path[2:]))
        return [f"encoder.block.{i}.{rest}" for i in range(num_layers)]
    return ["encoder." + ".".join(path)]


def _sources(tensors: TensorSource, folder: str, flat, cfg: UMT5Config) -> list[list[str]]:
    """The names to read for each parameter, every one checked (present, shape as config.json implies)."""
    sources = []
    for key, var in flat:
        path = tuple(str(p) for p in key)
        target = var.get_value()
        names = checkpoint_names(path, cfg.num_layers)
        shape = target.shape[1:] if path[0] == "blocks" else target.shape
        if path == ("shared", "weight"):
            names = [n for n in names if n in tensors][:1] or names[:1]
        for n in names:
            if n not in tensors:
                raise WanInputError(f"{folder}: tensor {n!r} (shape {tuple(shape)}) is missing; the weights do not match "
                                    "config.json — re-download or re-save the text encoder")
            if tuple(tensors.shape(n)) != tuple(shape):
                raise WanInputError(f"{folder}: tensor {n!r} has shape {tuple(tensors.shape(n))}, but config.json "
                                    f"implies {tuple(shape)}; the weights do not match config.json")
        sources.append(names)
    expected = {n for names in sources for n in names} | set(_EMBEDDING)
    for name in tensors:
        if name not in expected:
            raise WanInputError(f"{folder}: unexpected tensor {name!r} (shape {tuple(tensors.shape(name))}) is not a "
                                "parameter of the UMT5 encoder that config.json describes; check that config.json "
                                "belongs to these weights")
    return sources


def load_umt5(path, dtype=jnp.bfloat16, mesh=None) -> UMT5Encoder:
    """Load a diffusers `text_encoder/` folder into a `UMT5Encoder` with weights in `dtype`.

    With a `mesh`, each parameter is placed sharded as it is read (`wan_tpu.sharding.place_param`,
    rule table "umt5").
    """
    path = os.fspath(path)
    config, tensors = open_checkpoint(path, "text_encoder")
    cfg = UMT5Config.from_json(config, os.path.join(path, "config.json"))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: UMT5Encoder(cfg, dtype)))
    flat = nnx.to_flat_state(state)
    sources = _sources(tensors, path, flat, cfg)
    place = None
    if mesh is not None:
        from wan_tpu.sharding import place_param

        paths = [".".join(str(k) for k in key) for key, _ in flat]
        place = lambda i, host: place_param(mesh, "umt5", paths[i], host)  # noqa: E731
    stored = [StoredParam(tensors, names, Layout(), np.dtype(var.get_value().dtype), str(key[0]) == "blocks")
              for names, (key, var) in zip(sources, flat)]
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
