"""Loading CLIP towers from transformers folders (config.json + model.safetensors), file → device.

    vision = load_clip_vision("image_encoder", dtype=jnp.float32, mesh=None, num_layers=None)
    text = load_clip_text("text_encoder")

The folders are what `CLIPVisionModel` / `CLIPTextModel.save_pretrained` write (tensors
`vision_model.encoder.layers.{i}.self_attn.q_proj.weight`, `text_model.embeddings.token_embedding.weight`,
…; transformers 5 writes them without the `vision_model.` / `text_model.` prefix, which is then
optional). Every tensor the config implies is checked by name and shape before any data is read (a missing,
unexpected or mis-shaped one is a `WanInputError` naming it); only the first `num_layers` blocks (None:
all; negative: all but the last -num_layers) are then read, as stored (torch layout), per-layer tensors stacked on
the leading layer axis. With
a mesh each parameter is placed by the `clip` rules of `wan_tpu.configs.sharding` as it is read.
The vision `post_layernorm` is checked but not read (it feeds only the pooled output); `position_ids`
buffers, which older transformers saved, are ignored.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.encoders.clip import CLIPTextConfig, CLIPTextTransformer, CLIPVisionConfig, CLIPVisionTransformer
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import open_checkpoint, read_config
from wan_tpu.loading.params import Layout, StoredParam, load_params

_LAYERS = ("encoder", "layers")


def checkpoint_names(prefix: str, path: tuple[str, ...], num_layers: int) -> list[str]:
    """Our parameter path → its transformers tensor name(s): one per layer for the stacked blocks."""
    if path[:2] == _LAYERS:
        rest = ".".join(path[2:])
        return [f"{prefix}encoder.layers.{i}.{rest}" for i in range(num_layers)]
    return [prefix + ".".join(path)]


def load_clip_vision(path, dtype=jnp.float32, mesh=None, num_layers: int | None = None,
                     attention_impl: str | None = None) -> CLIPVisionTransformer:
    """A `CLIPVisionModel` folder → `CLIPVisionTransformer` keeping its first `num_layers` blocks (None: all;
    negative: all but the last -num_layers, so -1 gives `hidden_states[-2]`)."""
    return _load(path, "image_encoder", "vision_model.", CLIPVisionConfig, num_layers, mesh, _vision(dtype, attention_impl),
                 unread=("post_layernorm.weight", "post_layernorm.bias"))


def load_clip_text(path, dtype=jnp.float32, mesh=None, num_layers: int | None = None) -> CLIPTextTransformer:
    """A `CLIPTextModel` folder → `CLIPTextTransformer` keeping its first `num_layers` blocks (as `load_clip_vision`)."""
    return _load(path, "text_encoder", "text_model.", CLIPTextConfig, num_layers, mesh,
                 lambda cfg: CLIPTextTransformer(cfg, dtype))


def clip_vision_config(path, num_layers: int | None = None) -> CLIPVisionConfig:
    """The config of the tower `load_clip_vision(path, num_layers=...)` gives (its kept blocks), from
    config.json alone (no tensor read)."""
    path = os.fspath(path)
    return _kept(path, CLIPVisionConfig.from_json(read_config(path, "image_encoder"), os.path.join(path, "config.json")),
                 num_layers)


def abstract_clip_vision(config: CLIPVisionConfig, dtype=jnp.float32, attention_impl: str | None = None):
    """The tower `load_clip_vision` fills for `config` (from `clip_vision_config`), without weights
    (`nnx.eval_shape`): its graphdef is the loaded one's, so programs compiled for it serve the loaded tower."""
    return nnx.eval_shape(lambda: _vision(dtype, attention_impl)(config))


def _vision(dtype, attention_impl):
    return lambda cfg: CLIPVisionTransformer(cfg, dtype, attention_impl)


def _kept(path: str, cfg, num_layers: int | None):
    total = cfg.num_hidden_layers
    keep = total if num_layers is None else num_layers + total if num_layers < 0 else num_layers
    if not 0 <= keep <= total:
        raise WanInputError(f"{path}: cannot keep {keep} of the {total} CLIP blocks config.json describes; "
                            "check config.json")
    return dataclasses.replace(cfg, num_hidden_layers=keep)


def _load(path, what, prefix, config_class, num_layers, mesh, build, unread=()):
    path = os.fspath(path)
    config, tensors = open_checkpoint(path, what)
    if not any(n.startswith(prefix) for n in tensors):
        prefix = ""  # transformers 5 saves the towers' tensors without it
    cfg = config_class.from_json(config, os.path.join(path, "config.json"))
    total = cfg.num_hidden_layers
    kept = _kept(path, cfg, num_layers)
    keep = kept.num_hidden_layers
    # Every tensor of the whole checkpoint is checked (the full model), the kept blocks are read.
    full = nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: build(cfg))))
    expected = {}
    for key, var in full:
        p = tuple(str(k) for k in key)
        shape = tuple(var.get_value().shape)
        for n in checkpoint_names(prefix, p, total):
            expected[n] = shape[1:] if p[:2] == _LAYERS else shape
    expected.update({prefix + n: (cfg.hidden_size,) for n in unread})
    for n, shape in expected.items():
        if n not in tensors:
            raise WanInputError(f"{path}: missing tensor {n!r} (shape {shape}); the weights do not match config.json — "
                                f"re-download or re-save the {what}")
        if tuple(tensors.shape(n)) != shape:
            raise WanInputError(f"{path}: tensor {n!r} has shape {tuple(tensors.shape(n))}, but config.json implies "
                                f"{shape}; the weights do not match config.json")
    for n in tensors:
        if n not in expected and not n.endswith("position_ids"):
            raise WanInputError(f"{path}: unexpected tensor {n!r} (shape {tuple(tensors.shape(n))}) is not a parameter "
                                f"of the CLIP model config.json describes; check that config.json belongs to these weights")

    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(kept)))
    flat = nnx.to_flat_state(state)
    paths = [tuple(str(k) for k in key) for key, _ in flat]
    # Stored as used (torch layout): every parameter is a plain copy. With no block kept (the penultimate
    # hidden state of a one-block tower is the embeddings' output) the block stack is empty: nothing to read.
    read = [i for i, p in enumerate(paths) if keep or p[:2] != _LAYERS]
    stored = [StoredParam(tensors, checkpoint_names(prefix, paths[i], keep), Layout(),
                          np.dtype(flat[i][1].get_value().dtype), paths[i][:2] == _LAYERS) for i in read]
    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        place = lambda j, host: place_param(mesh, "clip", ".".join(paths[read[j]]), host)  # noqa: E731
    for i, value in zip(read, load_params(stored, place)):
        flat[i][1].set_value(value)
    for i in sorted(set(range(len(paths))) - set(read)):
        target = flat[i][1].get_value()
        flat[i][1].set_value(jnp.zeros(target.shape, target.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
