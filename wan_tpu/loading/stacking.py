"""Blocks stacked on a leading layer axis (one block body scanned over the layers), and the cheap way to
build a model that has them without weights.

    self.blocks = stack_layers(lambda r: Block(cfg, rngs=r), cfg.num_layers, rngs)
    abstract = eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0)))     # shapes only, as loaders need

`stack_layers` builds `n` blocks as one module whose every parameter has a leading axis of `n`, each
layer initialised from its own split of `rngs` (`nnx.vmap`). Under `eval_shape` only shapes are made, so
it builds one block and broadcasts its shapes instead: the same graphdef and state shapes (tested)
without tracing every initialiser through `vmap` — the larger part of the ~0.5 s that building
Matrix-Game's abstract DiT took on an H100 host, paid on every start before its weights can load.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

_SHAPES_ONLY = contextvars.ContextVar("wan_tpu_shapes_only", default=False)


def stack_layers(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """`n` blocks `make(rngs)` stacked on a leading axis (module docstring)."""
    if _SHAPES_ONLY.get():
        graphdef, state = nnx.split(make(rngs))
        return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), state))

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)

    return build(rngs)


@contextlib.contextmanager
def shapes_only():
    """Within: `stack_layers` builds one block per stack (for a caller's own `nnx.eval_shape`)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def eval_shape(build: Callable[[], nnx.Module]) -> nnx.Module:
    """`nnx.eval_shape(build)`, with `stack_layers` building one block per stack."""
    with shapes_only():
        return nnx.eval_shape(build)
