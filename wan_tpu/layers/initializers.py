"""Initial parameter values, and `SHAPES_ONLY`: a build that needs only the parameters' shapes and dtypes.

An abstract module (`nnx.eval_shape`: loaders, sharding plans, compile-ahead) is built by tracing its
constructor, and drawing random initial values was over a third of that trace: UnifoLM-WMA-0 (UNet, heads,
projections) built in 0.88–1.10 s instead of 1.57–1.69 on a 2-core CPU, and in 2.1–2.6 s instead of 3.2–4.2
beside the loads of a cold start on an H200 host, where it comes before every stage program. A builder's `rngs`
whose `params()` gives `SHAPES_ONLY` (`wan_tpu.unifolm.model.KeyCounter`) makes these initialisers trace
one op per parameter (zeros): the same shapes and dtypes, no values anyone reads. Given a real key they
draw as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class _ShapesOnly:
    def __repr__(self):
        return "SHAPES_ONLY"


SHAPES_ONLY = _ShapesOnly()


def normal(key, shape, dtype):
    """N(0, 1) of `shape` and `dtype`; zeros for `SHAPES_ONLY`."""
    if key is SHAPES_ONLY:
        return jnp.zeros(shape, dtype)
    return jax.random.normal(key, shape, dtype)


def lecun_normal(key, shape, dtype=jnp.float32):
    """flax's default kernel initialiser (`nnx.Linear`, `nnx.Conv`); zeros for `SHAPES_ONLY`."""
    if key is SHAPES_ONLY:
        return jnp.zeros(shape, dtype)
    return jax.nn.initializers.lecun_normal()(key, shape, dtype)
