"""`wan_tpu.layers.rope`: a traced frame offset gives the static offset's tables bit for bit, and a
custom split over a (frames, 1, 1) grid (Matrix-Game's action RoPE: θ 256, (8, 28, 28)) rotates only
the first part, at float64-exact angles."""

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu.layers.rope import apply_rope, rope_tables


def test_traced_frame_offset_equals_static():
    static = rope_tables(128, (3, 4, 5), frame_offset=37)
    traced = jax.jit(lambda off: rope_tables(128, (3, 4, 5), frame_offset=off, max_frames=64))(jnp.int32(37))
    for a, b in zip(static, traced):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Frame 37 of the shifted table is frame 0 of a table whose grid starts 37 frames earlier.
    longer = rope_tables(128, (40, 4, 5))
    np.testing.assert_array_equal(np.asarray(static[0][:20]), np.asarray(longer[0][37 * 20:38 * 20]))


def test_action_split_rotates_only_the_temporal_part():
    cos, sin = rope_tables(64, (3, 1, 1), 256.0, frame_offset=5, split=(8, 28, 28))
    cos, sin = np.asarray(cos), np.asarray(sin)
    np.testing.assert_array_equal(cos[:, 8:], 1.0)
    np.testing.assert_array_equal(sin[:, 8:], 0.0)
    angles = np.outer(np.arange(5, 8), 256.0 ** (-np.arange(0, 8, 2) / 8)).repeat(2, axis=1)
    np.testing.assert_array_equal(cos[:, :8], np.cos(angles).astype(np.float32))
    np.testing.assert_array_equal(sin[:, :8], (np.sin(angles) * np.tile([-1, 1], 4)).astype(np.float32))
    x = jax.random.normal(jax.random.key(0), (1, 3, 2, 64))
    out = apply_rope(x, jnp.asarray(cos), jnp.asarray(sin))
    np.testing.assert_array_equal(np.asarray(out[..., 8:]), np.asarray(x[..., 8:]))
