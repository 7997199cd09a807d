"""`load_transformer`: a diffusers-format `transformer/` folder → `WanTransformer`.

Every parameter of the (abstractly built) module is filled from the checkpoint: diffusers names are
mapped to ours (`to_out.0` → `to_out`, `ffn.net.0.proj` → `ffn.proj_in`, `ffn.net.2` → `ffn.proj_out`),
linear weights are transposed to (in, out), the patch-embedding Conv3d becomes a matmul kernel, and
per-layer tensors `blocks.{i}.…` are stacked on the leading layer axis. All names and shapes are
checked against config.json before any data is read. Tensors stream one parameter at a time from
memory-mapped files, so the host holds at most one (stacked) parameter besides the mapping.
`checkpoint_origin(dit)` re-reads one parameter exactly as it was loaded (how `wan_tpu.wan.lora` restores
the weights a LoRA changed), and `param_sources(dit)` maps each parameter to its diffusers tensor names.
"""

from __future__ import annotations

import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.loading import stacking
from wan_tpu.loading.checkpoint import TensorSource, open_checkpoint
from wan_tpu.configs.models import WanTransformerConfig, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.loading.params import TRANSPOSE, Layout, StoredParam, load_params
from wan_tpu.wan.transformer import WanTransformer

# Checkpoint tensors diffusers itself ignores (`_keys_to_ignore_on_load_unexpected`).
_IGNORED_SEGMENTS = ("norm_added_q",)


def diffusers_name(our_path: tuple[str, ...]) -> str:
    """Our parameter path (without the leaf) → diffusers module path."""
    out = []
    for i, seg in enumerate(our_path):
        parent = our_path[i - 1] if i else ""
        if seg == "to_out":
            out.append("to_out.0")
        elif parent in ("ffn", "ff") and seg == "proj_in":
            out.append("net.0.proj")
        elif parent in ("ffn", "ff") and seg == "proj_out":
            out.append("net.2")
        else:
            out.append(seg)
    return ".".join(out)


# Original Wan (Wan-Video/Wan2.1 `WanModel`) module names ↔ diffusers', as (original, diffusers)
# dotted prefixes matched segment by segment: top-level modules, then the modules of one block.
_ORIGINAL_TOP = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("head.head", "proj_out"),
    ("head.modulation", "scale_shift_table"),
)
_ORIGINAL_BLOCK = tuple(
    (f"{orig_attn}.{orig}", f"{attn}.{new}")
    for orig_attn, attn in (("self_attn", "attn1"), ("cross_attn", "attn2"))
    for orig, new in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"),
                      ("norm_k", "norm_k"), ("k_img", "add_k_proj"), ("v_img", "add_v_proj"),
                      ("norm_k_img", "norm_added_k"))
) + (
    # The original block applies norm1 (self-attention), norm3 (cross-attention), norm2 (FFN);
    # diffusers numbers them in that order.
    ("norm3", "norm2"), ("norm2", "norm3"), ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
    ("modulation", "scale_shift_table"),
)


def _rename(name: str, pairs, reverse: bool) -> str | None:
    parts = name.split(".")
    for original, diffusers in pairs:
        src, dst = (diffusers, original) if reverse else (original, diffusers)
        src = src.split(".")
        if parts[: len(src)] == src:
            return ".".join([dst, *parts[len(src):]])
    return None


def _convert_wan_name(name: str, reverse: bool) -> str:
    top = _rename(name, _ORIGINAL_TOP, reverse)
    if top is not None:
        return top
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blocks":
        rest = _rename(".".join(parts[2:]), _ORIGINAL_BLOCK, reverse)
        if rest is not None:
            return ".".join([*parts[:2], rest])
    return name


def original_wan_to_diffusers(name: str) -> str:
    """An original-format Wan parameter name (`blocks.0.self_attn.q.weight`, `head.head.bias`, …) → its
    diffusers name (`blocks.0.attn1.to_q.weight`, `proj_out.bias`); names it does not know (a
    model's own additions, e.g. Matrix-Game's `blocks.0.action_model.…`) come back unchanged."""
    return _convert_wan_name(name, reverse=False)


def diffusers_to_original_wan(name: str) -> str:
    """The inverse of `original_wan_to_diffusers` (for messages that name what a file should hold)."""
    return _convert_wan_name(name, reverse=True)


class ParamSource:
    """How one of our parameters is read: checkpoint names (one per layer if stacked) and a layout fix.

    `names`: the diffusers tensor names (`blocks.{i}.…` per layer when `stacked`); `source_shape`: one
    of them as stored (diffusers layout); `transform`: that layout → ours (None: the same).
    """

    def __init__(self, path: tuple[str, ...], target: jax.ShapeDtypeStruct, cfg: WanTransformerConfig):
        *module, leaf = path
        self.path = ".".join(path)
        self.stacked = bool(module) and module[0] == "blocks"
        layer_shape = target.shape[1:] if self.stacked else target.shape
        base = diffusers_name(tuple(module))
        self.layout = Layout()
        if leaf == "kernel" and base == "patch_embedding":
            # Conv3d (out, in, pt, ph, pw) with stride == kernel is a matmul over flattened (in, pt, ph, pw).
            self.source_shape = (cfg.inner_dim, cfg.in_channels, *cfg.patch_size)
            self.layout = Layout(reshape=layer_shape[::-1], perm=(1, 0))
        elif leaf == "kernel":
            self.source_shape = layer_shape[::-1]
            self.layout = TRANSPOSE
        else:
            self.source_shape = layer_shape
        name = f"{base}.weight" if leaf == "kernel" else f"{base}.{leaf}" if base else leaf
        if self.stacked:
            rest = name[len("blocks."):]
            self.names = [f"blocks.{i}.{rest}" for i in range(cfg.num_layers)]
        else:
            self.names = [name]

    def check(self, tensors: TensorSource, folder: str):
        for n in self.names:
            if n not in tensors:
                raise WanInputError(
                    f"{folder}: tensor {n!r} (shape {self.source_shape}) is missing; the weights do not match "
                    f"config.json — re-download or re-save the transformer"
                )
            if tuple(tensors.shape(n)) != tuple(self.source_shape):
                raise WanInputError(
                    f"{folder}: tensor {n!r} has shape {tuple(tensors.shape(n))}, but config.json implies "
                    f"{self.source_shape}; the weights do not match config.json"
                )

    @property
    def transform(self):
        """The layout change as a function of one layer's array (None: none), for deltas in stored layout (LoRA)."""
        return None if self.layout.identity else self.layout.apply

    def stored(self, tensors: TensorSource, dtype) -> StoredParam:
        return StoredParam(tensors, self.names, self.layout, np.dtype(dtype), self.stacked)

    def read(self, tensors: TensorSource, dtype) -> np.ndarray:
        return self.stored(tensors, dtype).read_host()


def load_transformer(path: str, dtype=jnp.float32, mesh=None, quantize: str | None = None) -> WanTransformer:
    """Load a diffusers-format Wan transformer folder (config.json + safetensors) into a WanTransformer.

    Parameters that diffusers keeps in float32 stay float32; the rest are cast to `dtype`. With a
    `mesh`, each parameter is placed sharded as it is read (`wan_tpu.parallel.sharding.place_param`) and the
    model's hooks are set for the mesh (`wan_tpu.parallel.sharding.shard_transformer`). `quantize="fp8"`
    (or "int8") then quantises the block linears on device (`wan_tpu.wan.quantize`).
    """
    from wan_tpu.wan.quantize import check_device, check_mode, quantize_transformer

    if check_mode(quantize):
        # Refuse before reading gigabytes of weights.
        check_device(quantize, None if mesh is None else list(mesh.devices.flat))
    config, tensors = open_checkpoint(path, "transformer")
    cfg = config_from_json(config)
    abstract = stacking.eval_shape(lambda: WanTransformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)

    sources = [ParamSource(tuple(str(p) for p in key), var.get_value(), cfg) for key, var in flat]
    for s in sources:
        s.check(tensors, path)
    expected = {n for s in sources for n in s.names}
    for name in tensors:
        if name not in expected and not any(seg in name.split(".") for seg in _IGNORED_SEGMENTS):
            raise WanInputError(
                f"{path}: unexpected tensor {name!r} (shape {tuple(tensors.shape(name))}) is not a parameter of the "
                f"transformer that config.json describes; check that config.json belongs to these weights"
            )

    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        place = lambda i, host: place_param(mesh, "dit", sources[i].path, host, num_heads=cfg.num_attention_heads)  # noqa: E731
    stored = [s.stored(tensors, var.get_value().dtype) for s, (_, var) in zip(sources, flat)]
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    dit = nnx.merge(graphdef, nnx.from_flat_state(flat))
    _ORIGINS[dit] = CheckpointOrigin(path, tensors, {s.path: s for s in sources},
                                     {s.path: np.dtype(var.get_value().dtype) for s, (_, var) in zip(sources, flat)})

    if mesh is not None:
        from wan_tpu.parallel.sharding import shard_transformer

        shard_transformer(dit, mesh)
    return quantize_transformer(dit, quantize, mesh)


def param_sources(module: WanTransformer) -> list[ParamSource]:
    """How every parameter of a (possibly abstract, `nnx.eval_shape`) DiT maps to diffusers tensor names."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return [ParamSource(tuple(str(p) for p in key), var.get_value(), module.config) for key, var in flat]


class CheckpointOrigin:
    """Where a loaded DiT's weights came from, so that one parameter can be read again exactly as loaded.

    The files' sizes and modification times are noted at load time: a file replaced since then
    cannot give back the loaded values, and `read` says so instead of returning other weights.
    """

    def __init__(self, path: str, tensors: TensorSource, sources: dict[str, ParamSource], dtypes: dict[str, np.dtype]):
        self.path, self._tensors, self._sources, self._dtypes = path, tensors, sources, dtypes
        self._stamps = {f: _stamp(f) for f in tensors.files}

    def read(self, param_path: str) -> np.ndarray:
        """The host array that `load_transformer` placed for `param_path` (same dtype, same bits)."""
        for f, stamp in self._stamps.items():
            if _stamp(f) != stamp:
                raise WanInputError(f"{f} changed on disk since the transformer was loaded, so its weights cannot be "
                                    "restored exactly; load the transformer again")
        return self._sources[param_path].read(self._tensors, self._dtypes[param_path])


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


# DiT → CheckpointOrigin; weak, so that a dropped model frees its entry. A side table rather than an
# attribute: attributes of an nnx module are part of its graphdef, which keys compiled code.
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_origin(dit: WanTransformer) -> CheckpointOrigin | None:
    """The checkpoint `dit` was loaded from by `load_transformer` (None for models built otherwise)."""
    return _ORIGINS.get(dit)
