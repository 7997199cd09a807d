"""`wan_tpu.layers.fp8`: the FP8 linear's arithmetic against a float64 reference of the same scaled
arithmetic (quantise → f8 × f8 product → per-token × per-channel dequantisation + bias).

Tolerances: the product of the exact f8 operands, accumulated in float32 and returned in float32,
within 1e-6 (relative Frobenius) of the float64 reference; returned in bfloat16, within 2^-8 (one
bf16 rounding). Quantisation itself: every element within half an e4m3fn step (2^-4 relative, or
the subnormal step 2^-9 · scale near zero) of its input, and each row's / column's largest |value|
lands on 448 exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wan_tpu.layers.fp8 import F8, F8_MAX, fp8_matmul, quantize_rows, quantize_weight


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


@pytest.mark.parametrize("out_dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2.0**-8)])
def test_matmul_matches_float64_scaled_arithmetic(out_dtype, tol):
    x, w, b = _inputs(0)
    wq, w_scale = quantize_weight(w)
    out = np.asarray(jax.jit(fp8_matmul, static_argnames="out_dtype")(x, wq, w_scale, b, out_dtype=out_dtype),
                     np.float64)
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731 (f8 → f32 is exact)
    ref = (f64(xq) @ f64(wq)) * f64(x_scale) * f64(w_scale) + f64(b)
    assert out.shape == (3, 5, 48)
    assert _rel(out.reshape(ref.shape), ref) <= tol


def test_quantisation_is_within_half_a_step():
    x, w, _ = _inputs(1)
    for q, scale, orig, axis in ((*quantize_rows(x.reshape(-1, 64)), x.reshape(-1, 64), -1),
                                 (*quantize_weight(w), w, -2)):
        assert q.dtype == F8
        qf = np.asarray(q.astype(jnp.float32), np.float64)
        scale = np.asarray(scale, np.float64)
        scale = scale if axis == -1 else scale[None, :]
        orig = np.asarray(orig, np.float64)
        assert np.isfinite(qf).all()
        bound = 2.0**-4 * np.abs(orig) + 2.0**-10 * scale
        assert (np.abs(qf * scale - orig) <= bound + 1e-12).all()
        amax = np.abs(qf).max(axis=axis)
        nonzero = np.abs(orig).max(axis=axis) > 0
        assert (amax[nonzero] == F8_MAX).all() and (amax[~nonzero] == 0).all()


def test_close_to_the_unquantised_product():
    """Sanity of the whole scheme on random data: FP8's relative error, a few percent."""
    x, w, b = _inputs(2)
    out = np.asarray(fp8_matmul(x, *quantize_weight(w), b, out_dtype=jnp.float32))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    assert _rel(out, ref) <= 5e-2


def test_product_is_a_2d_f8_dot_for_the_gpu_gemm_rewriter():
    """What XLA's FP8 GEMM rewrite matches: a dot_general of two f8e4m3fn operands, each with one
    contracting and one free dimension (tokens flattened), no scaling between the f8 values and the dot."""
    x, w, b = _inputs(3)
    wq, w_scale = quantize_weight(w)
    text = jax.jit(fp8_matmul).lower(x, wq, w_scale, b).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1
    assert "(tensor<15x64xf8E4M3FN>, tensor<64x48xf8E4M3FN>) -> tensor<15x48xbf16>" in dots[0]
