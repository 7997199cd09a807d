"""Steering XLA's GPU fusion where its choice costs memory passes.

On GPUs XLA fuses a cheap producer into each of its consumers, or one consumer writes a wider copy
for the others. Where the producer reads a wide input (a product's int32 output, in
`quantized.quantized_matmul`) or the fusion writes a float32 copy of bf16 rows (an RMS norm's
statistic, in `norms`), writing the intermediate once in a pass of its own saves memory passes."""

from __future__ import annotations

import jax


def own_pass_on_gpu(x):
    """`x` written to memory by the pass that makes it, on GPUs (an optimization barrier); unchanged
    elsewhere. Its consumers then read `x` instead of each fusing (and repeating) the work that makes
    it, or one of them writing a wider copy for the others."""
    return jax.lax.platform_dependent(x, cuda=jax.lax.optimization_barrier, default=lambda v: v)
