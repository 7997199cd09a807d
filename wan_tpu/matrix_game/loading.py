"""Loading the Matrix-Game-2 DiT from the released safetensors, and putting it on a mesh.

    model = load_matrix_game_transformer("Matrix-Game-2.0/base_distilled_model/base_distill.safetensors",
                                         variant="universal", dtype=jnp.bfloat16, mesh=None)

The released files (`Skywork/Matrix-Game-2.0`) hold the authors' `WanDiffusionWrapper` state: original
Wan names under `model.` (`model.blocks.0.self_attn.q.weight`, `model.blocks.0.action_model.t_qkv.weight`,
`model.head.head.bias`, …). Names go original → diffusers (`wan_tpu.loading.wan_names.original_wan_to_diffusers`,
shared with the Wan loader) → ours; the action module keeps the authors' names (`keyboard_embed.0` →
`keyboard_embed.linear_1`, `mouse_mlp.0/2/3` → `mouse_mlp.proj_in/proj_out`, `mouse_mlp_norm`). The
action modules' q/k RMSNorm weights are in the files but unused by the authors' forward (and ours).
Every name and shape is checked before any data is read; what is missing, unexpected or mis-shaped
is reported in one line. Tensors stream one parameter at a time from memory-mapped files (per-block
tensors stacked into their run), cast to the parameter's dtype and, with a mesh, placed sharded as
read (rules family "matrix_game" in `wan_tpu.configs.sharding`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from wan_tpu.configs.matrix_game import MatrixGameTransformerConfig, config_from_json, get_variant
from wan_tpu.errors import WanInputError
from wan_tpu.loading import stacking
from wan_tpu.loading.checkpoint import TensorSource
from wan_tpu.loading.params import TRANSPOSE, Layout, StoredParam, load_params
from wan_tpu.loading.wan_names import diffusers_name, diffusers_to_original_wan, original_wan_to_diffusers
from wan_tpu.matrix_game.cache import MatrixGameCache
from wan_tpu.matrix_game.model import MatrixGameTransformer, block_runs

PREFIX = "model."
# Our action-module submodules → the authors' (`nn.Sequential` indices).
_ACTION_NAMES = {("keyboard_embed", "linear_1"): "keyboard_embed.0", ("keyboard_embed", "linear_2"): "keyboard_embed.2",
                 ("mouse_mlp", "proj_in"): "mouse_mlp.0", ("mouse_mlp", "proj_out"): "mouse_mlp.2",
                 ("mouse_mlp_norm",): "mouse_mlp.3"}
# In the checkpoint, never read by the authors' forward (their action-module RMSNorm drops its weight).
_UNUSED = ("img_attn_q_norm", "img_attn_k_norm", "key_attn_q_norm", "key_attn_k_norm")


def _checkpoint_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if files:
            return files
        raise WanInputError(f"{path}: no *.safetensors file; pass the Matrix-Game DiT file or its folder")
    raise WanInputError(f"Matrix-Game checkpoint {path!r} does not exist; pass the DiT .safetensors file or its folder")


def transformer_config(path: str, variant=None) -> MatrixGameTransformerConfig:
    """The config `load_matrix_game_transformer(path, variant)` builds, reading no tensor: `variant`'s
    (a name or a config) or, without one, the authors' config.json beside the weights."""
    if isinstance(variant, MatrixGameTransformerConfig):
        return variant
    if variant is not None:
        return get_variant(variant).transformer
    cfg_path = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")
    if not os.path.isfile(cfg_path):
        raise WanInputError(f"{path}: no config.json beside the weights; pass variant= (universal, gta_drive, "
                            "templerun, foundation)")
    with open(cfg_path) as f:
        return config_from_json(json.load(f))


class _Param:
    """One of our parameters: the checkpoint names it reads (one per layer if stacked) and its layout."""

    def __init__(self, path: tuple, shape: tuple[int, ...], cfg: MatrixGameTransformerConfig, runs):
        *module, leaf = path
        self.path = ".".join(str(p) for p in path)
        layers = None
        if module and module[0] == "blocks":
            start, stop, _ = runs[module[1]]
            layers, module = range(start, stop), module[2:]
            shape = shape[1:]
        if module and module[0] == "action_model":
            sub = tuple(module[1:])
            base = "action_model." + _ACTION_NAMES.get(sub, ".".join(sub))
        else:
            base = diffusers_name(tuple(module))
        self.layout = Layout()
        if leaf == "kernel" and base == "patch_embedding":
            # Conv3d (out, in, pt, ph, pw) with stride == kernel is a matmul over flattened (in, pt, ph, pw).
            self.source_shape = (cfg.dim, cfg.in_dim, *cfg.patch_size)
            self.layout = Layout(reshape=tuple(shape[::-1]), perm=(1, 0))
        elif leaf == "kernel":
            self.source_shape = tuple(shape[::-1])
            self.layout = TRANSPOSE
        else:
            self.source_shape = tuple(shape)
        name = f"{base}.weight" if leaf == "kernel" else f"{base}.{leaf}" if base else leaf
        self.names = [name] if layers is None else [f"blocks.{i}.{name}" for i in layers]
        self.stacked = layers is not None

    def stored(self, tensors, names: dict[str, str], dtype) -> StoredParam:
        return StoredParam(tensors, [names[n] for n in self.names], self.layout, np.dtype(dtype), self.stacked)


def _check(params: list[_Param], tensors: TensorSource, names: dict[str, str], path: str):
    """Every expected tensor present with its shape, nothing else but the known-unused ones; one line."""
    shapes = {n: p.source_shape for p in params for n in p.names}
    missing = [n for n in shapes if n not in names]
    wrong = [f"{names[n]} {tuple(tensors.shape(names[n]))} (expected {shapes[n]})"
             for n in shapes if n in names and tuple(tensors.shape(names[n])) != shapes[n]]
    extra = [raw for ours, raw in names.items() if ours not in shapes and ours.split(".")[-2] not in _UNUSED]
    if missing or wrong or extra:
        def few(xs):
            return ", ".join(xs[:6]) + (f" (+{len(xs) - 6} more)" if len(xs) > 6 else "")

        listed = (("missing", [PREFIX + diffusers_to_original_wan(n) for n in missing]), ("unexpected", extra),
                  ("wrong shape", wrong))
        problems = [f"{label}: {few(xs)}" for label, xs in listed if xs]
        raise WanInputError(f"{path}: the weights do not match the Matrix-Game config — " + "; ".join(problems)
                            + "; pass the variant these weights belong to")


def load_matrix_game_transformer(path: str, variant=None, dtype=jnp.float32, mesh=None,
                                 attention_impl=None) -> MatrixGameTransformer:
    """Load a Matrix-Game-2 DiT: `path` is the released `.safetensors` (or its folder), `variant` a
    name of `wan_tpu.configs.matrix_game.MATRIX_GAME_VARIANTS` or a `MatrixGameTransformerConfig`
    (default: the authors' config.json beside the weights). Float32 modules (time embedder,
    modulation tables, norms) stay float32; the rest is cast to `dtype`. With a `mesh`, weights land
    sharded and the model's hooks are set for it (`shard_matrix_game`)."""
    cfg = transformer_config(path, variant)
    tensors = TensorSource(_checkpoint_files(path))
    graphdef, state = abstract_transformer(cfg, dtype, attention_impl, split=True)
    flat = nnx.to_flat_state(state)
    runs = block_runs(cfg)
    params = [_Param(tuple(key), var.get_value().shape, cfg, runs) for key, var in flat]
    # Checkpoint names in diffusers form (the `model.` prefix of the authors' wrapper dropped).
    names = {original_wan_to_diffusers(n[len(PREFIX):] if n.startswith(PREFIX) else n): n for n in tensors}
    _check(params, tensors, names, path)

    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        place = lambda i, host: place_param(mesh, "matrix_game", params[i].path, host, num_heads=cfg.num_heads)  # noqa: E731
    stored = [p.stored(tensors, names, var.get_value().dtype) for p, (_, var) in zip(params, flat)]
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model if mesh is None else shard_matrix_game(model, mesh)


def abstract_transformer(cfg: MatrixGameTransformerConfig, dtype=jnp.float32, attention_impl=None, *, split: bool = False):
    """The DiT `load_matrix_game_transformer` fills (without a mesh), without weights (`nnx.eval_shape`):
    its graphdef is the loaded one's, so programs compiled for it serve the loaded model. Read back from the
    executable cache (`cached_abstract`) after the first build: building it took 0.4–0.5 s of a warm start's
    first seconds, holding the interpreter while the weights' loads were under way."""
    from wan_tpu.runtime import executable_cache

    with stacking.shapes_only():
        return executable_cache.cached_abstract(
            "matrix-game-dit", (cfg, jnp.dtype(dtype).name, attention_impl),
            lambda: MatrixGameTransformer(cfg, dtype=dtype, rngs=nnx.Rngs(0), attention_impl=attention_impl), split=split)


def shard_matrix_game(model: MatrixGameTransformer, mesh, **attention_kwargs) -> MatrixGameTransformer:
    """Put a `MatrixGameTransformer` on `mesh`: weights per the "matrix_game" rules, mesh-aware hooks.

    Tokens: batch over `dp`, sequence over `sp` (and `tp` when it does not divide the heads). The
    self-attention's keys come from the cache (a window longer than the chunk's queries), so both
    attentions use the cross-attention layout: queries split over the sequence axes, K/V whole.
    `attention_kwargs` (`impl`, `interpret`, `block_sizes`) override the current hooks' settings.
    """
    from wan_tpu.parallel.sharding import ShardActivation, ShardedAttention, attention_kwargs_of, shard_module

    shard_module(model, mesh, "matrix_game", model.config.num_heads)
    kwargs = {**attention_kwargs_of(model.self_attention), **attention_kwargs}
    model.self_attention = ShardedAttention(mesh, "cross", **kwargs)
    model.cross_attention = ShardedAttention(mesh, "cross", **kwargs)
    model.shard_activation = ShardActivation(mesh, model.config.num_heads)
    return model


def cache_sharding(mesh, cache: MatrixGameCache, num_heads: int):
    """NamedShardings for a cache (same pytree): batch over `dp`, attention heads over `tp` where it
    divides them; `jax.device_put(cache, cache_sharding(...))`, or a jit's in/out shardings."""
    from wan_tpu.parallel.sharding import fit_spec, heads_split_by_tp

    tp = "tp" if heads_split_by_tp(mesh, num_heads) else None

    def spec(x, heads_axis):
        dims = [None] * x.ndim
        dims[1] = "dp"
        if heads_axis is not None and tp is not None:
            dims[heads_axis] = tp
        return NamedSharding(mesh, fit_spec(P(*dims), x.shape, mesh)[0])

    blocks = []
    for b in cache.blocks:
        attn = [jax.tree.map(lambda x: spec(x, 3), kv) for kv in (b.self_attn, b.cross_attn)]
        action = [None if kv is None else jax.tree.map(lambda x: spec(x, None), kv) for kv in (b.keyboard, b.mouse)]
        blocks.append(type(b)(*attn, *action))
    return MatrixGameCache(tuple(blocks))
