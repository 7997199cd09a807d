"""`load_umt5`: a diffusers `text_encoder/` folder (transformers' `UMT5EncoderModel`), or one text
encoder file, → `UMT5Encoder` and its host-side `UMT5Embedding`.

    model, embed_tokens = load_umt5("Wan2.1-T2V-1.3B-Diffusers/text_encoder", dtype=jnp.bfloat16, mesh=None)

config.json gives the `UMT5Config`; the safetensors (one file, or shards listed by an index) are read
through `wan_tpu.loading.checkpoint`. Every parameter's checkpoint names and shapes are checked against
config.json before any data is read. Tensors keep their torch layout, so each parameter goes to the
device as stored through the loaders' one placement path (`wan_tpu.loading.params`; per-layer
tensors `encoder.block.{i}.…` stacked on the leading layer axis); with a mesh each is placed by the
`umt5` rules of `wan_tpu.configs.sharding`, each device receiving its slice.
The embedding is tied: `shared.weight` or `encoder.embed_tokens.weight`, whichever the file holds; it
stays in the checkpoint's memory map (see `wan_tpu.encoders.umt5.UMT5Embedding`).

Files, told apart by their tensor names, their config inferred from the shapes (`umt5_config_from_shapes`):
  * Wan's own `models_t5_umt5-xxl-enc-bf16.pth` (`wan/modules/t5.py`: `token_embedding`,
    `blocks.N.attn.q/k/v/o`, `blocks.N.norm1/norm2`, `blocks.N.ffn.gate.0/fc1/fc2`,
    `blocks.N.pos_embedding.embedding`, `norm`), read weights-only and memory-mapped. Its feed-forward is
    `fc2(fc1(x) · gelu_tanh(gate(x)))`, transformers' `wo(gelu_tanh(wi_0(x)) · wi_1(x))`: gate → `wi_0`,
    fc1 → `wi_1`, fc2 → `wo` (`wan_t5_name`);
  * ComfyUI's `text_encoders/umt5_xxl_*.safetensors`: transformers' names (any prefix ComfyUI adds is
    dropped, so are a full model's decoder tensors and the `spiece_model` tokenizer bytes), fp16 / bf16 /
    fp8_e4m3fn, or fp8_scaled (`wan_tpu.loading.component_files.weights_in_dtype`).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.encoders.umt5 import UMT5Config, UMT5Embedding, UMT5Encoder
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import MappedSource, TensorSource, open_checkpoint
from wan_tpu.loading.component_files import is_weights_file, open_weights_file, strip_prefix, weights_in_dtype, wrong_component
from wan_tpu.loading.params import Layout, StoredParam, load_params

# Our block submodules → transformers' (`encoder.block.{i}.` + this).
_BLOCK_MODULES = {
    "attention_norm": "layer.0.layer_norm",
    "attention": "layer.0.SelfAttention",
    "ffn_norm": "layer.1.layer_norm",
    "ffn": "layer.1.DenseReluDense",
}
_EMBEDDING = ("shared.weight", "encoder.embed_tokens.weight")


# Wan's T5 (`wan/modules/t5.py`) block tensors → transformers' (both under the block's prefix).
_WAN_T5_BLOCK = {
    "norm1.weight": "layer.0.layer_norm.weight",
    **{f"attn.{p}.weight": f"layer.0.SelfAttention.{p}.weight" for p in "qkvo"},
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_WAN_T5_TOP = {"token_embedding.weight": "shared.weight", "norm.weight": "encoder.final_layer_norm.weight"}
_WAN_T5_MARKER = "blocks.0.attn.q.weight"
_HF_MARKER = "encoder.block.0.layer.0.SelfAttention.q.weight"


def wan_t5_name(name: str) -> str:
    """The transformers `UMT5EncoderModel` name of a tensor of Wan's T5 encoder (the module docstring)."""
    if name in _WAN_T5_TOP:
        return _WAN_T5_TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in _WAN_T5_BLOCK:
        return f"encoder.block.{parts[1]}.{_WAN_T5_BLOCK[parts[2]]}"
    raise WanInputError(f"tensor {name!r} is not part of Wan's T5 encoder; is this models_t5_umt5-xxl-enc-bf16.pth?")


def umt5_config_from_shapes(tensors) -> dict:
    """The transformers `config.json` fields of UMT5 encoder weights (transformers' names), from their shapes:
    the heads from the relative-position tables (buckets, heads), gated when `wi_0` is present."""
    def shape(name):
        if name not in tensors:
            raise WanInputError(f"the text encoder weights have no {name!r}; is this a UMT5 (umt5-xxl) encoder?")
        return tuple(tensors.shape(name))

    vocab, d_model = shape(next((n for n in _EMBEDDING if n in tensors), _EMBEDDING[0]))
    layers = 1 + max(int(n.split(".")[2]) for n in tensors if n.startswith("encoder.block."))
    buckets, heads = shape("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in tensors
    d_ff = shape(f"encoder.block.0.layer.1.DenseReluDense.{'wi_0' if gated else 'wi'}.weight")[0]
    inner = shape(_HF_MARKER)[0]
    if inner % heads:
        raise WanInputError(f"the text encoder's attention width {inner} is not a multiple of its {heads} heads; "
                            "is this a UMT5 encoder?")
    return {"model_type": "umt5", "vocab_size": vocab, "d_model": d_model, "d_kv": inner // heads, "d_ff": d_ff,
            "num_layers": layers, "num_heads": heads, "relative_attention_num_buckets": buckets,
            "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
            "feed_forward_proj": "gated-gelu" if gated else "relu"}


def open_umt5(path, dtype=jnp.bfloat16) -> tuple[dict, object]:
    """(config dict, tensors under transformers' names) of a text encoder folder or file (the module
    docstring); a file's layout and config come from its header alone."""
    path = os.fspath(path)
    if not is_weights_file(path):
        return open_checkpoint(path, "text_encoder")
    raw = open_weights_file(path, "text encoder")
    if any(n.endswith(_WAN_T5_MARKER) for n in raw):
        raw = weights_in_dtype(strip_prefix(raw, _WAN_T5_MARKER), dtype)
        tensors = MappedSource(raw, {wan_t5_name(n): n for n in raw})
    elif any(n.endswith(_HF_MARKER) for n in raw):
        raw = weights_in_dtype(strip_prefix(raw, _HF_MARKER), dtype)
        # A whole T5 (ComfyUI also stores the tokenizer's bytes as `spiece_model`): the encoder's tensors only.
        tensors = MappedSource(raw, {n: n for n in raw if n.startswith("encoder.") or n in _EMBEDDING})
    else:
        raise wrong_component(path, "text_encoder", raw)
    return umt5_config_from_shapes(tensors), tensors


def umt5_config(path) -> UMT5Config:
    """The `UMT5Config` of a text encoder folder (its config.json) or file (its header), reading no tensor."""
    if is_weights_file(path):
        return UMT5Config.from_json(open_umt5(path)[0], os.fspath(path))
    return UMT5Config.from_folder(path)


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


def load_umt5(path, dtype=jnp.bfloat16, mesh=None, offload: bool = False) -> tuple[UMT5Encoder, UMT5Embedding]:
    """Load a diffusers `text_encoder/` folder or a text encoder file (the module docstring) into a
    `UMT5Encoder` with weights in `dtype`, and its token embedding (on the host, memory-mapped).

    With a `mesh`, each parameter is placed sharded as it is read (`wan_tpu.parallel.sharding.place_param`,
    rule table "umt5"). `offload=True`: the block stack is read straight into host memory, every block
    streamed (`UMT5Encoder.offload_blocks`), so an encoder larger than the device (UMT5-XXL's 11 GB in
    bf16 beside an 8 GiB card) loads without its blocks ever occupying device memory.
    """
    path = os.fspath(path)
    config, tensors = open_umt5(path, dtype)
    cfg = UMT5Config.from_json(config, path if is_weights_file(path) else os.path.join(path, "config.json"))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: UMT5Encoder(cfg, dtype)))
    flat = nnx.to_flat_state(state)
    sources, embedding = _sources(tensors, path, flat, cfg)
    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        paths = [".".join(str(k) for k in key) for key, _ in flat]
        place = lambda i, host, **where: place_param(mesh, "umt5", paths[i], host, **where)  # noqa: E731
    stored = [StoredParam(tensors, names, Layout(), np.dtype(var.get_value().dtype), str(key[0]) == "blocks")
              for names, (key, var) in zip(sources, flat)]
    for (_, var), value in zip(flat, load_params(stored, place, streamed=[offload and p.stacked for p in stored])):
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), UMT5Embedding(tensors[embedding], dtype)
