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
buffers, which older transformers saved, and the projection of `CLIPVisionModelWithProjection` /
`CLIPTextModelWithProjection` (`visual_projection`, `text_projection`) are ignored.

`load_clip_vision` also takes one file (told apart by its tensor names, the config inferred from the shapes;
the head count, which weights do not tell, from `CLIP_HEADS` by width or `num_heads`):
  * Wan's own `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (XLM-R text tower + ViT-H/14,
    read weights-only and memory-mapped): its visual tower under transformers' names
    (`clip_vision_from_original`; the fused q/k/v are split as views of the file), the rest unread;
  * ComfyUI's `clip_vision/clip_vision_h.safetensors`: transformers' `CLIPVisionModelWithProjection`
    names (with or without `vision_model.`); `visual_projection` and any text tower are not read.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.encoders.clip import CLIPTextConfig, CLIPTextTransformer, CLIPVisionConfig, CLIPVisionTransformer
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import MappedSource, open_checkpoint, read_config
from wan_tpu.loading.component_files import is_weights_file, open_weights_file, strip_prefix, weights_in_dtype, wrong_component
from wan_tpu.loading.params import Layout, StoredParam, load_params

_LAYERS = ("encoder", "layers")
_UNREAD = ("position_ids", "visual_projection.weight", "text_projection.weight")


def checkpoint_names(prefix: str, path: tuple[str, ...], num_layers: int) -> list[str]:
    """Our parameter path → its transformers tensor name(s): one per layer for the stacked blocks."""
    if path[:2] == _LAYERS:
        rest = ".".join(path[2:])
        return [f"{prefix}encoder.layers.{i}.{rest}" for i in range(num_layers)]
    return [prefix + ".".join(path)]


def load_clip_vision(path, dtype=jnp.float32, mesh=None, num_layers: int | None = None,
                     attention_impl: str | None = None, num_heads: int | None = None) -> CLIPVisionTransformer:
    """A `CLIPVisionModel` folder or a CLIP file (the module docstring) → `CLIPVisionTransformer` keeping its
    first `num_layers` blocks (None: all; negative: all but the last -num_layers, so -1 gives
    `hidden_states[-2]`). `num_heads`: a file's head count where `CLIP_HEADS` does not know its width."""
    return _load(path, "image_encoder", "vision_model.", CLIPVisionConfig, num_layers, mesh, _vision(dtype, attention_impl),
                 unread=("post_layernorm.weight", "post_layernorm.bias"),
                 opener=lambda p: open_clip_vision(p, dtype, num_heads))


def load_clip_text(path, dtype=jnp.float32, mesh=None, num_layers: int | None = None) -> CLIPTextTransformer:
    """A `CLIPTextModel` folder → `CLIPTextTransformer` keeping its first `num_layers` blocks (as `load_clip_vision`)."""
    return _load(path, "text_encoder", "text_model.", CLIPTextConfig, num_layers, mesh,
                 lambda cfg: CLIPTextTransformer(cfg, dtype))


def clip_vision_config(path, num_layers: int | None = None, num_heads: int | None = None) -> CLIPVisionConfig:
    """The config of the tower `load_clip_vision(path, num_layers=...)` gives (its kept blocks), from
    config.json or a file's header alone (no tensor read)."""
    path = os.fspath(path)
    config = open_clip_vision(path, num_heads=num_heads)[0] if is_weights_file(path) else read_config(path, "image_encoder")
    return _kept(path, CLIPVisionConfig.from_json(config, _config_where(path)), num_layers)


def clip_text_config(path, num_layers: int | None = None) -> CLIPTextConfig:
    """The config of the tower `load_clip_text(path, num_layers=...)` gives, from config.json alone."""
    path = os.fspath(path)
    return _kept(path, CLIPTextConfig.from_json(read_config(path, "text_encoder"), _config_where(path)), num_layers)


def abstract_clip_text(config: CLIPTextConfig, dtype=jnp.float32):
    """The tower `load_clip_text` fills for `config` (from `clip_text_config`), without weights: its graphdef
    is the loaded one's."""
    return nnx.eval_shape(lambda: CLIPTextTransformer(config, dtype))


def _config_where(path: str) -> str:
    return path if is_weights_file(path) else os.path.join(path, "config.json")


# Heads by width of the CLIP vision towers in use (ViT-B/L: OpenAI; H, bigG: open_clip, Wan's ViT-H/14), and
# their activation: the weights tell neither.
CLIP_HEADS = {768: 12, 1024: 16, 1280: 16, 1664: 16}
CLIP_ACTIVATION = {768: "quick_gelu", 1024: "quick_gelu"}
_HF_MARKER = "encoder.layers.0.self_attn.q_proj.weight"
_WAN_MARKER = "visual.transformer.0.attn.to_qkv.weight"


def clip_vision_config_from_shapes(tensors, prefix: str, num_heads: int | None = None) -> dict:
    """transformers' `CLIPVisionModel` config.json of vision tower weights (names under `prefix`), from their
    shapes; the head count from `num_heads` or `CLIP_HEADS`."""
    def shape(name):
        if prefix + name not in tensors:
            raise WanInputError(f"the CLIP weights have no {prefix + name!r}; is this a CLIP vision tower?")
        return tuple(tensors.shape(prefix + name))

    (dim,) = shape("embeddings.class_embedding")
    patch = shape("embeddings.patch_embedding.weight")[-1]
    positions = shape("embeddings.position_embedding.weight")[0]
    layers = 1 + max(int(n[len(prefix):].split(".")[2]) for n in tensors if n.startswith(f"{prefix}encoder.layers."))
    heads = num_heads or CLIP_HEADS.get(dim)
    if heads is None or dim % heads:
        raise WanInputError(f"cannot tell the head count of a {dim}-wide CLIP tower; pass num_heads")
    return {"architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model", "hidden_size": dim,
            "intermediate_size": shape("encoder.layers.0.mlp.fc1.weight")[0], "num_hidden_layers": layers,
            "num_attention_heads": heads, "image_size": math.isqrt(positions - 1) * patch, "patch_size": patch,
            "num_channels": shape("embeddings.patch_embedding.weight")[1],
            "hidden_act": CLIP_ACTIVATION.get(dim, "gelu"), "layer_norm_eps": 1e-5}


def open_clip_vision(path, dtype=jnp.float32, num_heads: int | None = None) -> tuple[dict, object]:
    """(config dict, tensors under transformers' names) of an image encoder folder or file (the module
    docstring); a file's layout and config come from its header alone."""
    path = os.fspath(path)
    if not is_weights_file(path):
        return open_checkpoint(path, "image_encoder")
    raw = open_weights_file(path, "image encoder")
    if any(n.endswith(_WAN_MARKER) for n in raw):
        raw = weights_in_dtype(strip_prefix(raw, _WAN_MARKER), dtype)
        config, arrays = clip_vision_from_original(raw, num_heads)
        made = {n: (tuple(a.shape), a.dtype, lambda a=a: a) for n, a in arrays.items()}
        return config, MappedSource(raw, {}, made)
    if not any(n.endswith(_HF_MARKER) for n in raw):
        raise wrong_component(path, "image_encoder", raw)
    marker = "vision_model." + _HF_MARKER if any(n.endswith("vision_model." + _HF_MARKER) for n in raw) else _HF_MARKER
    raw = weights_in_dtype(strip_prefix(raw, marker), dtype)
    prefix = "vision_model." if any(n.startswith("vision_model.") for n in raw) else ""
    # A `CLIPVisionModelWithProjection` or a whole `CLIPModel`: the vision tower's tensors only.
    tensors = MappedSource(raw, {n: n for n in raw if n.startswith(prefix) and not n.startswith("text_model.")})
    return clip_vision_config_from_shapes(tensors, prefix, num_heads), tensors


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


def _load(path, what, prefix, config_class, num_layers, mesh, build, unread=(), opener=None):
    path = os.fspath(path)
    config, tensors = (opener or (lambda p: open_checkpoint(p, what)))(path)
    if not any(n.startswith(prefix) for n in tensors):
        prefix = ""  # transformers 5 saves the towers' tensors without it
    cfg = config_class.from_json(config, _config_where(path))
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
        if n not in expected and not n.endswith(_UNREAD):
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


# ---- Wan's own CLIP (`wan/modules/clip.py`) ---------------------------------------------------------

_ORIGINAL_LAYER = {"norm1.": "layer_norm1.", "norm2.": "layer_norm2.", "attn.proj.": "self_attn.out_proj.",
                   "mlp.0.": "mlp.fc1.", "mlp.2.": "mlp.fc2."}
_ORIGINAL_TOP = {"visual.pre_norm.": "vision_model.pre_layrnorm.", "visual.post_norm.": "vision_model.post_layernorm.",
                 "visual.patch_embedding.": "vision_model.embeddings.patch_embedding."}


def clip_vision_from_original(state_dict, num_heads: int | None = None) -> tuple[dict, dict]:
    """Wan's original CLIP state dict (`visual.*`, `textual.*`, `log_scale`) → (a transformers
    `CLIPVisionModel` config.json dict, its tensors in transformers' names). Tensors keep their type
    and dtype (torch tensors or numpy arrays: only reshapes and slices).

    The visual tower is transformers' CLIP vision transformer: pre-norm blocks with a fused `to_qkv`
    (q, k, v in that order), exact GELU, LayerNorm eps 1e-5, a patch conv without bias, a class token.
    The text tower, the projection head and `log_scale` are not part of it and are left out."""
    visual = {k: v for k, v in state_dict.items() if k.startswith("visual.")}
    if "visual.pos_embedding" not in visual or "visual.patch_embedding.weight" not in visual:
        raise WanInputError("the CLIP state dict has no visual.pos_embedding / visual.patch_embedding; "
                            "is this models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth?")
    dim, patch = visual["visual.pos_embedding"].shape[-1], visual["visual.patch_embedding.weight"].shape[-1]
    grid = math.isqrt(visual["visual.pos_embedding"].shape[1] - 1)
    layers = 1 + max(int(k.split(".")[2]) for k in visual if k.startswith("visual.transformer."))
    heads = num_heads or CLIP_HEADS.get(dim)
    if heads is None or dim % heads:
        raise WanInputError(f"cannot tell the head count of a {dim}-wide CLIP tower; pass num_heads")
    config = {
        "architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model", "hidden_size": dim,
        "intermediate_size": int(visual["visual.transformer.0.mlp.0.weight"].shape[0]), "num_hidden_layers": layers,
        "num_attention_heads": heads, "image_size": grid * patch, "patch_size": patch, "num_channels": 3,
        "hidden_act": "gelu", "layer_norm_eps": 1e-5,
        "projection_dim": int(visual["visual.head"].shape[1]) if "visual.head" in visual else dim,
    }
    out = {"vision_model.embeddings.class_embedding": visual.pop("visual.cls_embedding").reshape(dim),
           "vision_model.embeddings.position_embedding.weight": visual.pop("visual.pos_embedding")[0]}
    visual.pop("visual.head", None)
    for name, value in visual.items():
        top = next((k for k in _ORIGINAL_TOP if name.startswith(k)), None)
        if top is not None:
            out[_ORIGINAL_TOP[top] + name[len(top):]] = value
            continue
        if not name.startswith("visual.transformer."):
            raise WanInputError(f"unexpected CLIP tensor {name!r}; is this Wan's CLIP checkpoint?")
        index, rest = name[len("visual.transformer."):].split(".", 1)
        layer = f"vision_model.encoder.layers.{index}."
        if rest.startswith("attn.to_qkv."):
            kind = rest[len("attn.to_qkv."):]
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{layer}self_attn.{proj}.{kind}"] = value[i * dim : (i + 1) * dim]
            continue
        old = next((k for k in _ORIGINAL_LAYER if rest.startswith(k)), None)
        if old is None:
            raise WanInputError(f"unexpected CLIP tensor {name!r}; is this Wan's CLIP checkpoint?")
        out[layer + _ORIGINAL_LAYER[old] + rest[len(old):]] = value
    return config, out
