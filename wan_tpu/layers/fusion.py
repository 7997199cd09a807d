"""Steering XLA's GPU fusion where its choice costs memory passes (docs/PERFORMANCE.md, fourteenth session)."""

from __future__ import annotations

import jax


def own_pass_on_gpu(x):
    """`x` written to memory by the pass that makes it, on GPUs (an optimization barrier); unchanged
    elsewhere. Its consumers then read `x` instead of each fusing (and repeating) the work that makes
    it, or one of them writing a wider copy for the others."""
    return jax.lax.platform_dependent(x, cuda=jax.lax.optimization_barrier, default=lambda v: v)
