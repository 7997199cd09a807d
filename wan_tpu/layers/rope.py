"""3D rotary position embedding of the Wan DiT (diffusers' WanRotaryPosEmbed), and its variants.

head_dim D is split into (t, h, w) parts: h = w = 2·(D // 6), t = D − h − w (44/42/42 at D=128). Each
part rotates consecutive channel pairs (2i, 2i+1) by position·θ^(−2i/part) along its own axis. The
per-axis tables are tiny and computed in float64 on the host (as diffusers does) so the angles are
exact; the (S, D/2) table is only formed by broadcasting inside the compiled graph.

Variants use the same tables: a frame offset (the causal Matrix-Game DiT places each chunk at its
absolute frame index; the offset may be a traced integer, then the temporal table is precomputed
for `max_frames` positions and sliced on the device, so the angles stay exact), and another split
or θ (Matrix-Game's action RoPE: θ 256, split (8, 28, 28) over a (frames, 1, 1) grid, so only the
first 8 channels rotate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rope_split(head_dim: int) -> tuple[int, int, int]:
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def _axis_angles(part: int, positions: np.ndarray, theta: float) -> np.ndarray:
    inv_freq = 1.0 / theta ** (np.arange(0, part, 2, dtype=np.float64) / part)
    return np.outer(positions.astype(np.float64), inv_freq)  # (positions, part/2)


def _temporal_tables(part, f, theta, frame_offset, max_frames):
    """(cos, sin) float32 (f, part/2) of frames frame_offset … frame_offset+f−1."""
    if isinstance(frame_offset, (int, np.integer)):
        a = _axis_angles(part, np.arange(frame_offset, frame_offset + f), theta)
        return jnp.asarray(np.cos(a), jnp.float32), jnp.asarray(np.sin(a), jnp.float32)
    a = _axis_angles(part, np.arange(max_frames), theta)
    return tuple(
        jax.lax.dynamic_slice_in_dim(jnp.asarray(fn(a), jnp.float32), frame_offset, f) for fn in (np.cos, np.sin)
    )


def rope_tables(head_dim: int, grid: tuple[int, int, int], theta: float = 10000.0, *, frame_offset=0,
                split: tuple[int, int, int] | None = None, max_frames: int = 1024):
    """(cos, sin) of shape (F·H·W, head_dim), float32, tokens in (f, h, w) row-major order.

    Laid out for `apply_rope`: each pair's angle is repeated over its two channels, and sin carries
    the rotation's sign (−sin on even channels, +sin on odd), so rotating is two multiplies and a
    pair swap — elementwise work the compiler fuses with the q/k norm, with no concatenation per layer.

    `frame_offset` (int or traced int32 scalar) shifts the temporal positions; a traced offset
    indexes a table of `max_frames` positions (an offset past it is clamped: callers check it).
    `split` overrides the (t, h, w) channel split (it must sum to head_dim).
    """
    f, h, w = grid
    parts = split or rope_split(head_dim)
    if sum(parts) != head_dim:
        raise ValueError(f"rope split {parts} does not sum to head_dim {head_dim}")
    ct, st = _temporal_tables(parts[0], f, theta, frame_offset, max_frames)
    spatial = [_axis_angles(p, np.arange(n), theta) for p, n in zip(parts[1:], (h, w))]
    tables = []
    for t_table, fn, signs in ((ct, np.cos, (1.0, 1.0)), (st, np.sin, (-1.0, 1.0))):
        ah, aw = (jnp.asarray(fn(a), jnp.float32) for a in spatial)
        full = jnp.concatenate(
            [
                jnp.broadcast_to(t_table[:, None, None, :], (f, h, w, t_table.shape[-1])),
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
