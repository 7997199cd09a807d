"""Normalisation layers: what the DiT's parity tests do not show on their own."""

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu.layers.norms import RMSNorm


def test_rms_statistic_in_its_own_pass_on_gpu():
    """`RMSNorm.normalize` (the q/k norm RoPE continues from): the same values on every platform, and
    lowered for CUDA its row statistic sits behind an optimization barrier (`fusion.own_pass_on_gpu`, so XLA
    does not write the float32 result for RoPE to read again); lowered for the CPU it does not."""
    norm = RMSNorm(256, 1e-6)
    norm.weight[...] = jax.random.normal(jax.random.key(1), (256,), jnp.float32)
    x = jax.random.normal(jax.random.key(0), (2, 8, 256), jnp.bfloat16)
    f = jax.jit(lambda x: norm.normalize(x))
    x64, w64 = np.asarray(x, np.float64), np.asarray(norm.weight[...], np.float64)
    want = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6) * w64
    got = np.asarray(f(x), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert "optimization_barrier" in f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "optimization_barrier" not in f.lower(x).as_text()
