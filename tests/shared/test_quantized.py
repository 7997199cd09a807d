"""`wan_tpu.layers.quantized`: the FP8 and int8 linear's arithmetic against a float64 reference of the
same scaled arithmetic (quantise → low-precision product → per-token × per-channel dequantisation + bias).

Tolerances: the product of the exact quantised operands, accumulated in float32 (fp8) or int32
(int8) and returned in float32, within 1e-6 (relative Frobenius) of the float64 reference; returned
in bfloat16, within 2^-8 (one bf16 rounding). Quantisation itself: every element within half a step
of its input (fp8: 2^-4 relative, or the subnormal step 2^-9 · scale near zero; int8: scale / 2),
and each row's / column's largest |value| lands on the format's largest value exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wan_tpu.layers.quantized import FORMATS, quantize_rows, quantize_weight, quantized_matmul


def _inputs(seed, tokens=(3, 5), din=64, dout=48):
    rng = np.random.default_rng(seed)
    # Rows and columns of very different magnitudes, and one all-zero token row: per-token and
    # per-channel scales must each handle their own range.
    x = rng.standard_normal((*tokens, din)) * np.exp(rng.uniform(-4, 4, (*tokens, 1)))
    x[0, 0] = 0.0
    w = rng.standard_normal((din, dout)) * np.exp(rng.uniform(-3, 3, (1, dout))) / np.sqrt(din)
    b = rng.standard_normal(dout)
    return (jnp.asarray(a, jnp.float32) for a in (x, w, b))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _f64(a):
    return np.asarray(a.astype(jnp.float32), np.float64)  # f8 and int8 → f32 are exact


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("out_dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2.0**-8)])
def test_matmul_matches_float64_scaled_arithmetic(fmt, out_dtype, tol):
    x, w, b = _inputs(0)
    wq, w_scale = quantize_weight(w, fmt)
    fn = jax.jit(quantized_matmul, static_argnames=("fmt", "out_dtype"))
    out = np.asarray(fn(x, wq, w_scale, b, fmt=fmt, out_dtype=out_dtype), np.float64)
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]), fmt)
    ref = (_f64(xq) @ _f64(wq)) * _f64(x_scale) * _f64(w_scale) + _f64(b)
    assert out.shape == (3, 5, 48)
    assert _rel(out.reshape(ref.shape), ref) <= tol


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantisation_is_within_half_a_step(fmt):
    f = FORMATS[fmt]
    x, w, _ = _inputs(1)
    for q, scale, orig, axis in ((*quantize_rows(x.reshape(-1, 64), fmt), x.reshape(-1, 64), -1),
                                 (*quantize_weight(w, fmt), w, -2)):
        assert q.dtype == f.dtype
        qf, scale, orig = _f64(q), np.asarray(scale, np.float64), np.asarray(orig, np.float64)
        scale = scale if axis == -1 else scale[None, :]
        bound = 0.5 * scale if f.integer else 2.0**-4 * np.abs(orig) + 2.0**-10 * scale
        assert np.isfinite(qf).all()
        assert (np.abs(qf * scale - orig) <= bound * (1 + 1e-6) + 1e-12).all()
        amax = np.abs(qf).max(axis=axis)
        nonzero = np.abs(orig).max(axis=axis) > 0
        assert (amax[nonzero] == f.max).all() and (amax[~nonzero] == 0).all()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_close_to_the_unquantised_product(fmt):
    """Sanity of the whole scheme on random data: a few percent (fp8), under one percent (int8)."""
    x, w, b = _inputs(2)
    out = np.asarray(quantized_matmul(x, *quantize_weight(w, fmt), b, fmt=fmt, out_dtype=jnp.float32))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    assert _rel(out, ref) <= 5e-2


@pytest.mark.parametrize("fmt, operand, result", [("fp8", "f8E4M3FN", "bf16"), ("int8", "i8", "i32")])
def test_product_is_one_2d_low_precision_dot(fmt, operand, result):
    """What XLA's FP8 GEMM rewrite (and the TPU's int8/FP8 units) want: one dot_general of two
    quantised operands, each with one contracting and one free dimension (tokens flattened, padded
    from 15 to a multiple of 16), no scaling between the quantised values and the dot."""
    x, w, b = _inputs(3)
    wq, w_scale = quantize_weight(w, fmt)
    text = jax.jit(quantized_matmul, static_argnames="fmt").lower(x, wq, w_scale, b, fmt=fmt).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1
    assert f"(tensor<16x64x{operand}>, tensor<64x48x{operand}>) -> tensor<16x48x{result}>" in dots[0]


@pytest.mark.parametrize("fmt, barrier", [("fp8", False), ("int8", True)])
def test_int8_input_made_in_its_own_pass_on_gpu(fmt, barrier):
    """int8 only, CUDA only: the quantised linear's input behind an optimization barrier (written once, so
    XLA does not fuse the previous product's 4-byte int32 output into both the amax and the casting pass);
    the values are the same with and without it, since the barrier is the identity."""
    x, w, b = _inputs(4)
    wq, w_scale = quantize_weight(w, fmt)
    f = jax.jit(quantized_matmul, static_argnames="fmt")
    cuda = f.trace(x, wq, w_scale, b, fmt=fmt).lower(lowering_platforms=("cuda",)).as_text()
    assert ("optimization_barrier" in cuda) == barrier
    assert "optimization_barrier" not in f.lower(x, wq, w_scale, b, fmt=fmt).as_text()
