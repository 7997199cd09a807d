"""FP8 (float8_e4m3fn) linear layers: per-output-channel weight scales, per-token activation scales.

    wq, w_scale = quantize_weight(kernel)          # kernel (…, in, out) → f8 (…, in, out), f32 (…, out)
    layer = Fp8Linear(wq, w_scale, bias, dtype=jnp.bfloat16)
    y = layer(x)                                   # x (…, in) → (…, out) in `dtype`

The arithmetic, exactly (what `tests/test_fp8.py` checks against float64):
    s_x[t] = max(max_i |x[t, i]|, tiny) / 448            (one scale per token, computed in-graph)
    x_q = f8(clip(x / s_x, ±448)),  w_q = f8(clip(w / s_w, ±448)),  s_w[o] = max(max_i |w[i, o]|, tiny) / 448
    y[t, o] = (Σ_i x_q[t, i] · w_q[i, o]) · s_x[t] · s_w[o] + b[o]
Both scales factor out of the sum, so the product itself is a plain f8 × f8 matrix product with
no scaling inside: `lax.dot_general` on float8_e4m3fn operands, 2-D (tokens flattened) with one
contracting dimension, which XLA's GPU gemm rewriter turns into a cuBLASLt FP8 GEMM on compute
capability ≥ 8.9 (it takes only scalar scales, hence scales applied outside, where they fuse into
the elementwise consumer). The product is returned in the activation dtype (bf16 for bf16 models:
half the bytes of an f32 result). 448 is the largest finite e4m3fn value; e4m3fn has no infinity
and a cast past 464 gives NaN, hence the clip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

F8 = jnp.float8_e4m3fn
F8_MAX = 448.0
# Smallest amax a scale is computed from: an all-zero row or column gets a finite scale, and its
# quantised values are exactly 0.
_TINY = 1e-12


def _scale(amax):
    return jnp.maximum(amax, _TINY) / F8_MAX


def _to_f8(x, scale):
    return jnp.clip(x / scale, -F8_MAX, F8_MAX).astype(F8)


def quantize_weight(kernel):
    """(…, in, out) → (f8 (…, in, out), float32 scales (…, out)): one scale per output channel."""
    w = kernel.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(w), axis=-2))
    return _to_f8(w, scale[..., None, :]), scale


def quantize_rows(x):
    """(N, in) → (f8 (N, in), float32 scales (N, 1)): one scale per token (row)."""
    xf = x.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(xf), axis=-1, keepdims=True))
    return _to_f8(xf, scale), scale


def fp8_matmul(x, wq, w_scale, bias=None, out_dtype=jnp.bfloat16, precision=None):
    """x (…, in) against a quantised kernel: the arithmetic of the module docstring, in `out_dtype`."""
    lead = x.shape[:-1]
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    # 2-D operands, contracting x's minor dimension with w's major one: the shape the FP8 GEMM
    # rewrite accepts (it transposes w to the column-major layout cuBLASLt wants itself).
    y = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=out_dtype)
    y = y.astype(jnp.float32) * x_scale * w_scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype).reshape(*lead, wq.shape[-1])


class Fp8Linear(nnx.Module):
    """A biased linear layer with a float8_e4m3fn kernel (in, out) and float32 per-output scales.

    Parameter names: `kernel` (f8), `kernel_scale`, `bias` — `kernel` keeps nnx.Linear's name so
    that sharding rules and checkpoint paths still find it.
    """

    def __init__(self, kernel, kernel_scale, bias, *, dtype):
        self.kernel = nnx.Param(kernel)
        self.kernel_scale = nnx.Param(kernel_scale)
        self.bias = None if bias is None else nnx.Param(bias)
        self.dtype = dtype

    def __call__(self, x):
        bias = None if self.bias is None else self.bias[...]
        return fp8_matmul(x, self.kernel[...], self.kernel_scale[...], bias, out_dtype=self.dtype)
