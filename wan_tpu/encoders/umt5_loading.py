"""`load_umt5`: a diffusers `text_encoder/` folder (transformers' `UMT5EncoderModel`) → `UMT5Encoder`
and its host-side `UMT5Embedding`.

    model, embed_tokens = load_umt5("Wan2.1-T2V-1.3B-Diffusers/text_encoder", dtype=jnp.bfloat16, mesh=None)

config.json gives the `UMT5Config`; the safetensors (one file, or shards listed by an index) are read
through `wan_tpu.loading.checkpoint`. Every parameter's checkpoint names and shapes are checked against
config.json before any data is read. Tensors keep their torch layout, so each parameter goes to the
device as stored through the loaders' one placement path (`wan_tpu.loading.params`; per-layer
tensors `encoder.block.{i}.…` stacked on the leading layer axis); with a mesh each is placed by the
`umt5` rules of `wan_tpu.configs.sharding`, each device receiving its slice.
The embedding is tied: `shared.weight` or `encoder.embed_tokens.weight`, whichever the file holds; it
stays in the checkpoint's memory map (see `wan_tpu.encoders.umt5.UMT5Embedding`).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.encoders.umt5 import UMT5Config, UMT5Embedding, UMT5Encoder
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import TensorSource, open_checkpoint
from wan_tpu.loading.params import Layout, StoredParam, load_params

# Our block submodules → transformers' (`encoder.block.{i}.` + this).
_BLOCK_MODULES = {
    "attention_norm": "layer.0.layer_norm",
    "attention": "layer.0.SelfAttention",
    "ffn_norm": "layer.1.layer_norm",
    "ffn": "layer.1.DenseReluDense",
}
_EMBEDDING = ("shared.weight", "encoder.embed_tokens.weight")


def checkpoint_names(path: tuple[str, ...], num_layers: int) -> list[str]:
    """Our parameter path → its transformers tensor name(s): one per layer for the stacked blocks."""
    if path[0] == "blocks":
        rest = ".".join((_BLOCK_MODULES[path[1]], *path[2:]))
        return [f"encoder.block.{i}.{rest}" for i in range(num_layers)]
    return ["encoder." + ".".join(path)]


def _check(tensors: TensorSource, folder: str, name: str, shape) -> None:
    if name not in tensors:
        raise WanInputError(f"{folder}: tensor {name!r} (shape {tuple(shape)}) is missing; the weights do not match "
                            "config.json — re-download or re-save the text encoder")
    if tuple(tensors.shape(name)) != tuple(shape):
        raise WanInputError(f"{folder}: tensor {name!r} has shape {tuple(tensors.shape(name))}, but config.json "
                            f"implies {tuple(shape)}; the weights do not match config.json")


def _sources(tensors: TensorSource, folder: str, flat, cfg: UMT5Config) -> tuple[list[list[str]], str]:
    """The names to read for each parameter and the embedding's name, every one checked (present, shape
    as config.json implies)."""
    sources = []
    for key, var in flat:
        path = tuple(str(p) for p in key)
        target = var.get_value()
        names = checkpoint_names(path, cfg.num_layers)
        for n in names:
            _check(tensors, folder, n, target.shape[1:] if path[0] == "blocks" else target.shape)
        sources.append(names)
    embedding = next((n for n in _EMBEDDING if n in tensors), _EMBEDDING[0])
    _check(tensors, folder, embedding, (cfg.vocab_size, cfg.d_model))
    expected = {n for names in sources for n in names} | set(_EMBEDDING)
    for name in tensors:
        if name not in expected:
            raise WanInputError(f"{folder}: unexpected tensor {name!r} (shape {tuple(tensors.shape(name))}) is not a "
                                "parameter of the UMT5 encoder that config.json describes; check that config.json "
                                "belongs to these weights")
    return sources, embedding


def load_umt5(path, dtype=jnp.bfloat16, mesh=None) -> tuple[UMT5Encoder, UMT5Embedding]:
    """Load a diffusers `text_encoder/` folder into a `UMT5Encoder` with weights in `dtype`, and its
    token embedding (on the host, memory-mapped).

    With a `mesh`, each parameter is placed sharded as it is read (`wan_tpu.parallel.sharding.place_param`,
    rule table "umt5").
    """
    path = os.fspath(path)
    config, tensors = open_checkpoint(path, "text_encoder")
    cfg = UMT5Config.from_json(config, os.path.join(path, "config.json"))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: UMT5Encoder(cfg, dtype)))
    flat = nnx.to_flat_state(state)
    sources, embedding = _sources(tensors, path, flat, cfg)
    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        paths = [".".join(str(k) for k in key) for key, _ in flat]
        place = lambda i, host: place_param(mesh, "umt5", paths[i], host)  # noqa: E731
    stored = [StoredParam(tensors, names, Layout(), np.dtype(var.get_value().dtype), str(key[0]) == "blocks")
              for names, (key, var) in zip(sources, flat)]
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), UMT5Embedding(tensors[embedding], dtype)
