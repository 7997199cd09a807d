"""3D rotary position embedding of the Wan DiT (diffusers' WanRotaryPosEmbed).

head_dim D is split into (t, h, w) parts: h = w = 2·(D // 6), t = D − h − w (44/42/42 at D=128). Each
part rotates consecutive channel pairs (2i, 2i+1) by position·θ^(−2i/part) along its own axis. The
per-axis tables are tiny and computed in float64 on the host (as diffusers does) so the angles are
exact; the (S, D/2) table is only formed by broadcasting inside the compiled graph.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def rope_split(head_dim: int) -> tuple[int, int, int]:
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def _axis_angles(part: int, length: int, theta: float) -> np.ndarray:
    inv_freq = 1.0 / theta ** (np.arange(0, part, 2, dtype=np.float64) / part)
    return np.outer(np.arange(length, dtype=np.float64), inv_freq)  # (length, part/2)


def rope_tables(head_dim: int, grid: tuple[int, int, int], theta: float = 10000.0):
    """(cos, sin) of shape (F·H·W, head_dim), float32, tokens in (f, h, w) row-major order.

    Laid out for `apply_rope`: each pair's angle is repeated over its two channels, and sin carries
    the rotation's sign (−sin on even channels, +sin on odd), so rotating is two multiplies and a
    pair swap — elementwise work the compiler fuses with the q/k norm, with no concatenation per layer.
    """
    f, h, w = grid
    parts = rope_split(head_dim)
    angles = [_axis_angles(p, n, theta) for p, n in zip(parts, grid)]
    tables = []
    for fn, signs in ((np.cos, (1.0, 1.0)), (np.sin, (-1.0, 1.0))):
        at, ah, aw = (jnp.asarray(fn(a), jnp.float32) for a in angles)
        full = jnp.concatenate(
            [
                jnp.broadcast_to(at[:, None, None, :], (f, h, w, at.shape[-1])),
                jnp.broadcast_to(ah[None, :, None, :], (f, h, w, ah.shape[-1])),
                jnp.broadcast_to(aw[None, None, :, :], (f, h, w, aw.shape[-1])),
            ],
            axis=-1,
        ).reshape(f * h * w, head_dim // 2, 1)
        tables.append((full * jnp.asarray(signs, jnp.float32)).reshape(f * h * w, head_dim))
    return tables[0], tables[1]


def rotate(x, cos, sin):
    """Rotate channel pairs (2i, 2i+1) of x (B, S, H, D) by the `rope_tables` angles, in x's dtype.

    out[2i] = x[2i]·cos − x[2i+1]·sin and out[2i+1] = x[2i+1]·cos + x[2i]·sin (diffusers' convention).
    """
    b, s, nh, d = x.shape
    swapped = x.reshape(b, s, nh, d // 2, 2)[..., ::-1].reshape(b, s, nh, d)
    return x * cos[None, :, None, :] + swapped * sin[None, :, None, :]


def apply_rope(x, cos, sin):
    """`rotate` with the math in float32, returned in x's dtype."""
    return rotate(x.astype(jnp.float32), cos, sin).astype(x.dtype)
