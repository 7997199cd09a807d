"""`timestep_embedding`: host (numpy) timesteps are embedded in float64 and rounded once, as the
original Wan code does; device arrays in float32, as diffusers does (within ~1e-4 at t ≈ 1000)."""

import jax.numpy as jnp
import numpy as np

from wan_tpu.layers.embeddings import timestep_embedding


def test_host_timesteps_are_embedded_in_float64():
    t = np.array([[1000.0, 908.8427124023438, 0.0]])
    ours = np.asarray(timestep_embedding(t, 256))
    half = 128
    args = t[..., None] * np.power(10000.0, -np.arange(half) / half)
    np.testing.assert_array_equal(ours, np.concatenate([np.cos(args), np.sin(args)], -1).astype(np.float32))
    device = np.asarray(timestep_embedding(jnp.asarray(t, jnp.float32), 256))
    assert 0 < np.abs(device - ours).max() < 2e-4
