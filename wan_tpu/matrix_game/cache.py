"""Static ring caches of the causal Matrix-Game DiT: fixed shapes, updated in place, donated.

Every cache holds the last `window` latent frames (`config.window_frames`: the authors'
`local_attn_size`, which counts the current chunk). Latent frame f lives in slot f mod window, so
the frames 0 … n−1 of a stream that has not filled the window yet occupy the slots 0 … n−1: the
valid entries are always a prefix, and attention reads `cache[:, :valid]` with `valid` a static
size (`valid_window_frames`). Order inside the window does not matter to attention, and keys are
stored already rotated by their absolute-position RoPE, so no slot is ever moved: where the
authors roll their caches left on overflow, a ring overwrites the oldest frame.

One program serves every chunk of a stream: a chunk's valid size is one of a few static sizes
(`Window`: min(window, (k+1)·C) for chunk k), chosen by the traced chunk index at each attention
call (`windowed`), so the first chunk, whose window holds only its own frames, is no program of its
own and every size computes exactly what a program for that size alone computes.

Layouts (one run of blocks; every array has a leading layer axis L, batch B):
- `self_attn`  (L, B, window·S, H, D): S tokens per latent frame;
- `cross_attn` (L, B, N, H, D): K/V of the N embedded CLIP tokens, computed once per stream;
- `keyboard`   (L, B, window, Ha, Da): one key per latent frame (shared by all its tokens);
- `mouse`      (L, B, S, window, Ha, Da): a temporal key sequence per spatial token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class KVCache(NamedTuple):
    k: jax.Array
    v: jax.Array


class BlockCache(NamedTuple):
    """The caches of one run of blocks (stacked on the leading layer axis); None where a branch is absent."""

    self_attn: KVCache
    cross_attn: KVCache
    keyboard: KVCache | None = None
    mouse: KVCache | None = None


class MatrixGameCache(NamedTuple):
    """All caches of the model: one `BlockCache` per run of blocks (`MatrixGameTransformer.block_runs`)."""

    blocks: tuple[BlockCache, ...]


def valid_window_frames(window: int, end_frame: int) -> int:
    """Frames of the window that hold data once frames 0 … end_frame−1 are written."""
    return min(window, end_frame)


def num_window_branches(window: int, frames_per_chunk: int) -> int:
    """Distinct `valid_window_frames` a chunked stream meets: chunk k sees min(window, (k+1)·C) frames."""
    return math.ceil(window / frames_per_chunk)


@dataclasses.dataclass(frozen=True)
class Window:
    """The valid window frames of a chunk whose index is traced: one of `sizes` (static), `index`
    (a traced int32 scalar) saying which. Where a chunk index is a Python int, a plain int serves."""

    sizes: tuple[int, ...]
    index: jax.Array

    @classmethod
    def of(cls, window: int, frames_per_chunk: int, chunk_index):
        """The sizes chunks meet (`num_window_branches` of them) and chunk `chunk_index`'s among them; an
        int where there is one size or `chunk_index` is concrete."""
        count = num_window_branches(window, frames_per_chunk)
        if count == 1:
            return window
        if isinstance(chunk_index, (int, np.integer)):
            return valid_window_frames(window, (int(chunk_index) + 1) * frames_per_chunk)
        sizes = tuple(valid_window_frames(window, (k + 1) * frames_per_chunk) for k in range(count))
        return cls(sizes, jnp.clip(chunk_index, 0, count - 1))


def windowed(fn, valid, select: bool = False):
    """`fn(valid)` for a static `valid`; for a `Window`, `fn(size)` of its chosen size: a `lax.switch`
    with one branch per size (only the chosen one runs), or with `select`, every size computed and the
    chosen one kept (no conditional: for calls of a few keys, cheaper than one, which costs a GPU a
    round trip to the host). Each size's branch is the very call a program for that size alone makes,
    so the result is bitwise that program's."""
    if not isinstance(valid, Window):
        return fn(valid)
    if not select:
        return jax.lax.switch(valid.index, [lambda n=n: fn(n) for n in valid.sizes])
    outs = [fn(n) for n in valid.sizes]
    out = outs[0]
    for i, other in enumerate(outs[1:], 1):
        out = jax.tree.map(lambda a, b, i=i: jnp.where(valid.index == i, b, a), out, other)
    return out


def ring_write(cache: jax.Array, new: jax.Array, first_frame, axis: int, frame_len: int) -> jax.Array:
    """Write the frames of `new` (consecutive along `axis`, `frame_len` entries each) into their ring
    slots (frame mod window) of `cache`; `first_frame` may be traced. One slice update per frame, so a
    chunk that wraps around the ring end needs no gather."""
    window = cache.shape[axis] // frame_len
    for j in range(new.shape[axis] // frame_len):
        frame = jax.lax.slice_in_dim(new, j * frame_len, (j + 1) * frame_len, axis=axis)
        slot = (first_frame + j) % window
        cache = jax.lax.dynamic_update_slice_in_dim(cache, frame.astype(cache.dtype), slot * frame_len, axis)
    return cache
