"""Putting models on a `(dp, sp, tp)` mesh: weight rules, placement, and the DiT's sharded hooks.

Weights follow the first-match `regex → PartitionSpec` tables in `wan_tpu.configs.sharding`.
`place_param` applies them while a loader reads: each device receives only its slice of the host
(memory-mapped) array. `describe_sharding` lists every parameter with its spec and flags those no
rule matched.

Activations (`shard_transformer` installs these as the DiT's hooks):
- the token stream `(B, S, dim)`: batch over `dp`, sequence over `sp`;
- self-attention runs inside `shard_map`: batch over `dp`, heads over `tp`, query sequence over
  `sp`, K/V all-gathered over `sp` inside (context parallel);
- cross-attention (K/V are ≤ 769 text/image tokens): K/V replicated over the sequence axes, query
  sequence over `sp`; heads stay over `tp` (q, k, v come out of column-parallel projections
  split by heads, so this needs no collective at all).
Fallbacks, chosen per traced shape:
- heads not divisible by `tp` (the 1.3B model has 12 heads; 8 devices): `tp` joins the sequence
  axes, so the whole block, attention included, runs sequence-parallel over `sp·tp` with its
  weights gathered per layer (FSDP) instead of split by heads;
- batch not divisible by `dp` (one video without CFG on dp=2): `dp` joins the sequence axes.
- a sequence not divisible by its shard count: the token stream is sharded unevenly (XLA pads);
  attention pads q/k/v to a multiple and slices the padding off the gathered K/V before the
  kernel, so padded keys never enter a softmax; padded query rows are dropped after.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from wan_tpu.configs.sharding import FSDP, RULES
from wan_tpu.errors import WanInputError
from wan_tpu.layers import attention as attention_lib
from wan_tpu.parallel.mesh import AXES, mesh_size


@functools.cache
def _compiled_rules(family: str):
    if family not in RULES:
        raise ValueError(f"unknown model family {family!r} for sharding rules; choose one of {sorted(RULES)}")
    return tuple((pattern, re.compile(pattern), spec) for pattern, spec in RULES[family])


def match_rule(family: str, path: str) -> tuple[str | None, P]:
    """(pattern, spec) of the first rule matching `path`; (None, P()) when none does."""
    for pattern, regex, spec in _compiled_rules(family):
        if regex.search(path):
            return pattern, spec
    return None, P()


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def fit_spec(spec: P, shape: tuple[int, ...], mesh) -> tuple[P, list[str]]:
    """`spec` made valid for an array of `shape` on `mesh`, and notes on what had to change.

    Size-1 and absent mesh axes are dropped silently; a dimension the remaining axes do not divide
    keeps the longest prefix of its axes that does (possibly none: replicated on that dimension).
    """
    if len(spec) > len(shape):
        return P(), [f"rule has {len(spec)} dims for a rank-{len(shape)} array: replicated"]
    notes, dims = [], []
    for i, (entry, size) in enumerate(zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape)):
        axes = tuple(a for a in _axes(entry) if mesh.shape.get(a, 1) > 1)
        kept = axes
        while kept and size % mesh_size(mesh, kept):
            kept = kept[:-1]
        if kept != axes:
            notes.append(f"dim {i} ({size}) not divisible by {'×'.join(axes)}: sharded over {'×'.join(kept) or 'nothing'}")
        dims.append(_entry(kept))
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims), notes


def tp_as_fsdp(spec: P) -> P:
    """The spec for a DiT whose heads `tp` does not divide: `tp` leaves the head split and joins FSDP.

    Splitting q/k/v by `tp` would cut heads in pieces; the projections' outputs would then reach
    attention split across the hidden dimension and XLA would gather them whole. Storing `tp` as
    one more FSDP axis keeps the same bytes per device and lets the sequence-parallel block gather
    one layer's weights instead.
    """
    dims = []
    for entry in spec:
        axes = tuple(a for a in _axes(entry) if a != "tp")
        dims.append(_entry(axes + ("tp",) if axes == FSDP else axes))
    return P(*dims)


def heads_split_by_tp(mesh, num_heads: int | None) -> bool:
    return num_heads is None or num_heads % mesh.shape.get("tp", 1) == 0


def param_spec(mesh, family: str, path: str, shape: tuple[int, ...], num_heads: int | None = None) -> P:
    """The fitted spec of one parameter; `num_heads` (DiT) switches to `tp_as_fsdp` when `tp` does not divide it."""
    return _resolve(mesh, family, path, shape, num_heads)[1]


def _resolve(mesh, family, path, shape, num_heads=None):
    rule, spec = match_rule(family, path)
    if not heads_split_by_tp(mesh, num_heads):
        spec = tp_as_fsdp(spec)
    return rule, *fit_spec(spec, shape, mesh)


def place_param(mesh, family: str, param_path: str, host_array, dtype=None, num_heads: int | None = None,
                memory_kind: str | None = None) -> jax.Array:
    """Put one parameter on `mesh` as its rule says; each device reads only its own slice.

    `host_array` may be a read-only memory map, or anything that reads a slice when indexed
    (`wan_tpu.loading.params.ParamSlices`: on a mesh spanning several processes each process then reads
    only its own devices' slices, each once however many of its devices hold it); `dtype` (optional)
    converts each slice as it is read; `num_heads` (DiT, optional) lets a model whose heads `tp` does not
    divide land in its final layout (`shard_transformer` re-places it otherwise); `memory_kind`: the
    devices' memory to place it in (None: their own; a host kind for a stack streamed from host memory,
    `wan_tpu.parallel.offload`: each device's slice goes straight into its host's memory).
    """
    shape = tuple(host_array.shape)
    spec = param_spec(mesh, family, param_path, shape, num_heads)
    return put(host_array, NamedSharding(mesh, spec, memory_kind=memory_kind), dtype)


def put(host_array, sharding, dtype=None) -> jax.Array:
    """`host_array` (numpy, a memory map, a `ParamSlices`, or a jax.Array) on `sharding`: each device gets its
    slice, read once per process however many of its devices hold it. On a mesh spanning processes each
    process fills only its own devices, with no collective (`jax.device_put` of a host array would compare the
    processes' copies first: a collective, which a loader in a background thread must not issue, since every
    process has to issue its collectives in the same order); every process passes the same values."""
    if isinstance(host_array, jax.Array):
        arr = host_array if dtype is None else host_array.astype(dtype)
        return jax.device_put(arr, sharding)
    pieces = {}

    def read(index):
        key = tuple((sl.start, sl.stop) for sl in index)
        if key not in pieces:
            piece = np.asarray(host_array[index])
            pieces[key] = piece if dtype is None else piece.astype(dtype)
        return pieces[key]

    return jax.make_array_from_callback(tuple(host_array.shape), sharding, read)


@dataclasses.dataclass(frozen=True)
class ParamSharding:
    path: str
    shape: tuple[int, ...]
    spec: P
    rule: str | None  # the matching pattern; None: no rule matched, replicated
    notes: tuple[str, ...] = ()

    @property
    def replicated(self) -> bool:
        return all(d is None for d in self.spec)

    def __str__(self):
        flag = "  [no rule: replicated]" if self.rule is None else ""
        notes = f"  ({'; '.join(self.notes)})" if self.notes else ""
        return f"{self.path:<60} {str(self.shape):<22} {str(self.spec)}{flag}{notes}"


def _flat_arrays(module_or_state) -> list[tuple[str, object]]:
    """(dotted path, array or ShapeDtypeStruct) of every parameter."""
    if isinstance(module_or_state, nnx.Module):
        module_or_state = nnx.state(module_or_state, nnx.Param)
    if isinstance(module_or_state, nnx.State):
        return [(".".join(str(k) for k in path), var.get_value()) for path, var in nnx.to_flat_state(module_or_state)]
    if isinstance(module_or_state, Mapping):
        return list(module_or_state.items())
    raise TypeError(f"describe_sharding takes an nnx.Module, nnx.State or a path → array mapping, not {type(module_or_state)}")


def _num_heads(module_or_state, num_heads):
    if num_heads is None:
        num_heads = getattr(getattr(module_or_state, "config", None), "num_attention_heads", None)
    return num_heads


def describe_sharding(module_or_state, mesh, family: str, num_heads: int | None = None) -> list[ParamSharding]:
    """Every parameter with the spec it gets on `mesh`; `rule is None` marks those no rule matched.

    Works on abstract modules (`nnx.eval_shape`) and abstract meshes. `print(*rows, sep="\\n")`.
    `num_heads` defaults to a DiT's `config.num_attention_heads`.
    """
    num_heads = _num_heads(module_or_state, num_heads)
    rows = []
    for path, value in _flat_arrays(module_or_state):
        shape = tuple(value.shape)
        rule, spec, notes = _resolve(mesh, family, path, shape, num_heads)
        rows.append(ParamSharding(path, shape, spec, rule, tuple(notes)))
    return rows


def shard_module(module: nnx.Module, mesh, family: str, num_heads: int | None = None) -> nnx.Module:
    """Move every array of an already built module onto `mesh` per the rules (in place).

    An abstract module (`nnx.eval_shape`) gets `ShapeDtypeStruct`s that carry the shardings, ready
    for `jax.jit(...).lower` or `jax.export`.
    """
    num_heads = _num_heads(module, num_heads)
    state = nnx.state(module)
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if not isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
            continue
        spec = param_spec(mesh, family, ".".join(str(k) for k in path), value.shape, num_heads)
        # Memory kind kept: a stack offloaded to host memory (`wan_tpu.parallel.offload`) stays there.
        target = NamedSharding(mesh, spec, memory_kind=getattr(value.sharding, "memory_kind", None))
        if isinstance(value, jax.ShapeDtypeStruct):
            var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=target))
        elif not value.sharding.is_equivalent_to(target, value.ndim):
            var.set_value(reshard(value, target))
    nnx.update(module, state)
    return module


def reshard(value: jax.Array, target: NamedSharding) -> jax.Array:
    """`value` on `target`; onto a mesh spanning processes from this process's own copy (the same in every
    process) without a collective, as `put` does."""
    if target.is_fully_addressable or not value.is_fully_addressable:
        return jax.device_put(value, target)
    return put(np.asarray(value), target)


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Where the token stream's batch, sequence and attention heads live for one traced shape."""

    batch: str | None
    seq: tuple[str, ...]
    heads: str | None


def token_layout(mesh, batch: int, num_heads: int) -> TokenLayout:
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    batch_axis = "dp" if dp > 1 and batch % dp == 0 else None
    heads_axis = "tp" if tp > 1 and num_heads % tp == 0 else None
    seq = ("dp",) if batch_axis is None else ()
    seq += ("sp",) + (("tp",) if heads_axis is None else ())
    return TokenLayout(batch_axis, tuple(a for a in seq if mesh.shape[a] > 1), heads_axis)


def _pad_seq(x, multiple: int):
    pad = (-x.shape[1]) % multiple
    if pad == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))


class ShardedAttention:
    """A DiT attention hook: `wan_tpu.layers.attention.attention` inside `shard_map` on `mesh`.

    `kind="self"` gathers K/V over the query sequence axes (context parallel); `kind="cross"`
    keeps K/V whole on every sequence shard.
    """

    def __init__(self, mesh, kind: str, **attention_kwargs):
        if kind not in ("self", "cross"):
            raise ValueError(f"kind must be 'self' or 'cross', got {kind!r}")
        self.mesh, self.kind = mesh, kind
        self.attention_kwargs = attention_kwargs

    def __call__(self, q, k, v):
        b, s, h, _ = q.shape
        layout = token_layout(self.mesh, b, h)
        seq = layout.seq
        n = mesh_size(self.mesh, seq)
        q_spec = P(layout.batch, _entry(seq), layout.heads)
        kv_spec = q_spec if self.kind == "self" else P(layout.batch, None, layout.heads)
        if self.kind == "self":
            q, k, v = (_pad_seq(x, n) for x in (q, k, v))
        else:
            q = _pad_seq(q, n)
        kv_len = k.shape[1] if self.kind == "cross" else s
        kwargs = self.attention_kwargs

        def local(q, k, v):
            if self.kind == "self" and seq:
                # Tiled gather in mesh-axis order rebuilds the padded sequence; drop its padding so
                # no padded key reaches the softmax.
                k = jax.lax.all_gather(k, seq, axis=1, tiled=True)[:, :kv_len]
                v = jax.lax.all_gather(v, seq, axis=1, tiled=True)[:, :kv_len]
            return attention_lib.attention(q, k, v, **kwargs)

        out = jax.shard_map(local, mesh=self.mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                            check_vma=False)(q, k, v)
        return out[:, :s] if out.shape[1] != s else out


class ShardActivation:
    """The DiT's `shard_activation(x, name)` hook: a sharding constraint per activation name."""

    def __init__(self, mesh, num_heads: int):
        self.mesh, self.num_heads = mesh, num_heads

    def spec(self, shape: tuple[int, ...], name: str) -> P:
        layout = token_layout(self.mesh, shape[0], self.num_heads)
        if name == "tokens":
            return P(layout.batch, _entry(layout.seq))
        # "context" and anything else: batch-sharded, replicated otherwise.
        return P(layout.batch)

    def __call__(self, x, name: str):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(x.shape, name)))


def attention_kwargs_of(hook) -> dict:
    if isinstance(hook, ShardedAttention):
        return dict(hook.attention_kwargs)
    if isinstance(hook, functools.partial) and hook.func is attention_lib.attention:
        return dict(hook.keywords)
    return {}


def shard_transformer(dit, mesh, **attention_kwargs):
    """Put a `WanTransformer` on `mesh`: weights per the "dit" rules, mesh-aware hooks installed.

    Weights already placed by the loader stay where they are. `attention_kwargs` (`impl`,
    `interpret`, `block_sizes`) override what the DiT's current attention hooks use.
    """
    if not set(AXES) <= set(mesh.axis_names):
        raise WanInputError(
            f"the DiT needs a mesh with axes {AXES}, got {tuple(mesh.axis_names)}; build it with wan_tpu.make_mesh(dp, sp, tp)"
        )
    shard_module(dit, mesh, "dit")
    heads = dit.config.num_attention_heads
    self_kwargs = {**attention_kwargs_of(dit.self_attention), **attention_kwargs}
    cross_kwargs = {**attention_kwargs_of(dit.cross_attention), **attention_kwargs}
    dit.self_attention = ShardedAttention(mesh, "self", **self_kwargs)
    dit.cross_attention = ShardedAttention(mesh, "cross", **cross_kwargs)
    dit.shard_activation = ShardActivation(mesh, heads)
    return dit


def param_bytes_per_device(module: nnx.Module) -> dict:
    """{device: bytes of parameters it holds}: the memory effect of the rules, for tests and logs."""
    out: dict = {}
    for _, value in _flat_arrays(module):
        for shard in value.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


__all__ = [
    "ParamSharding",
    "ShardActivation",
    "ShardedAttention",
    "TokenLayout",
    "describe_sharding",
    "fit_spec",
    "heads_split_by_tp",
    "match_rule",
    "param_bytes_per_device",
    "param_spec",
    "place_param",
    "put",
    "reshard",
    "shard_module",
    "shard_transformer",
    "token_layout",
    "tp_as_fsdp",
]

