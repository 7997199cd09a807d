"""Quantised linear layers: per-output-channel weight scales, per-token activation scales, in FP8
(float8_e4m3fn) or int8.

    wq, w_scale = quantize_weight(kernel, "fp8")   # kernel (…, in, out) → (…, in, out), f32 (…, out)
    layer = QuantizedLinear(wq, w_scale, bias, fmt="fp8", dtype=jnp.bfloat16)
    y = layer(x)                                   # x (…, in) → (…, out) in `dtype`

The arithmetic, exactly (what `tests/test_quantized.py` checks against float64), with M the format's
largest value (448 for e4m3fn, 127 for int8):
    s_x[t] = max(max_i |x[t, i]|, tiny) / M                (one scale per token, computed in-graph)
    x_q = q(clip(x / s_x, ±M)),  w_q = q(clip(w / s_w, ±M)),  s_w[o] = max(max_i |w[i, o]|, tiny) / M
    y[t, o] = (Σ_i x_q[t, i] · w_q[i, o]) · s_x[t] · s_w[o] + b[o]
where q() casts to f8 (round to nearest) or rounds to an integer. Both scales factor out of the sum,
so the product itself is a plain low-precision matrix product with no scaling inside:
`lax.dot_general` on two f8 (or int8) operands, 2-D (tokens flattened) with one contracting
dimension — the shape XLA's GPU gemm rewriter turns into a cuBLASLt FP8 GEMM (it takes only scalar
scales, hence scales applied outside, where they fuse into the elementwise consumer), and that TPUs
run on their int8 / FP8 matrix units. FP8 products come back in the activation dtype (bf16 for bf16
models: half the bytes of f32); int8 products accumulate exactly in int32. e4m3fn has no infinity
and a cast past 464 gives NaN, hence the clip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.layers.fusion import own_pass_on_gpu


@dataclasses.dataclass(frozen=True)
class Format:
    dtype: object
    max: float
    integer: bool


FORMATS = {"fp8": Format(jnp.float8_e4m3fn, 448.0, False), "int8": Format(jnp.int8, 127.0, True)}
# Smallest amax a scale is computed from: an all-zero row or column gets a finite scale, and its
# quantised values are exactly 0.
_TINY = 1e-12


def _scale(amax, fmt: Format):
    return jnp.maximum(amax, _TINY) / fmt.max


def _quantize(x, scale, fmt: Format):
    y = jnp.clip(x / scale, -fmt.max, fmt.max)
    return (jnp.round(y) if fmt.integer else y).astype(fmt.dtype)


def quantize_weight(kernel, fmt: str):
    """(…, in, out) → (quantised (…, in, out), float32 scales (…, out)): one scale per output channel."""
    f = FORMATS[fmt]
    w = kernel.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(w), axis=-2), f)
    return _quantize(w, scale[..., None, :], f), scale


def quantize_rows(x, fmt: str):
    """(N, in) → (quantised (N, in), float32 scales (N, 1)): one scale per token (row)."""
    f = FORMATS[fmt]
    xf = x.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), f)
    return _quantize(xf, scale, f), scale


def quantized_matmul(x, wq, w_scale, bias=None, fmt: str = "fp8", out_dtype=jnp.bfloat16):
    """x (…, in) against a quantised kernel: the arithmetic of the module docstring, in `out_dtype`."""
    lead = x.shape[:-1]
    if FORMATS[fmt].integer:
        # x written once in its dtype before the amax and the casting pass. Its producer starts
        # from a product's 4-byte int32 output, which XLA, fusing it, presumably reads once per
        # pass. On an H200: 1.3B int8 forward 380.4 / 381.7 → 376.2 / 376.3 ms; 14B 7,152.8 →
        # 7,098.8 ms and 7,202.6 → 7,199.9. FP8 products come back in bf16, and there the extra
        # write costs more than it saves (1.3B 359.7 → 367.6 ms, 14B 6,875.0 → 6,907.4 ms), hence
        # integer formats only.
        x = own_pass_on_gpu(x)
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]), fmt)
    tokens = xq.shape[0]
    # cuBLASLt FP8 wants every dimension a multiple of 16; XLA would otherwise pad (copy) the
    # operand and slice (copy) the result around each GEMM. Padded here, the zero rows come out of
    # the quantising fusion and the slice folds into the scaling below (32,760 tokens → 32,768).
    xq = jnp.pad(xq, ((0, -tokens % 16), (0, 0)))
    acc_dtype = jnp.int32 if FORMATS[fmt].integer else out_dtype
    # 2-D operands, contracting x's minor dimension with w's major one: the shape the FP8 GEMM
    # rewrite accepts (it transposes w to the column-major layout cuBLASLt wants itself). Default
    # precision, so cuBLASLt may use FP8 fast accumulation: HIGHEST (float32 sums) is no more
    # accurate (FFN-only 1.3B forward 5.71e-2 from bf16 against 5.73e-2; the CPU's exact sums give
    # 5.80e-2 on those weights) and keeps the 14B FP8 forward from finishing within 350 s on an H200.
    y = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=acc_dtype)[:tokens]
    y = y.astype(jnp.float32) * x_scale * w_scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype).reshape(*lead, wq.shape[-1])


class QuantizedLinear(nnx.Module):
    """A biased linear layer with a quantised kernel (in, out) and float32 per-output scales.

    Parameter names: `kernel`, `kernel_scale`, `bias` — `kernel` keeps nnx.Linear's name so that
    sharding rules and checkpoint paths still find it.
    """

    def __init__(self, kernel, kernel_scale, bias, *, fmt: str, dtype):
        self.kernel = nnx.Param(kernel)
        self.kernel_scale = nnx.Param(kernel_scale)
        self.bias = None if bias is None else nnx.Param(bias)
        self.fmt = fmt
        self.dtype = dtype

    def __call__(self, x):
        bias = None if self.bias is None else self.bias[...]
        return quantized_matmul(x, self.kernel[...], self.kernel_scale[...], bias, self.fmt, self.dtype)
