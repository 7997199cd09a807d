"""Checkpoint tensors → device parameters, at the host's copy speed: the one placement path of every loader.

    params = [StoredParam(tensors, ["blocks.0.attn1.to_q.weight", ...], Layout(perm=(1, 0)), jnp.bfloat16), ...]
    arrays = load_params(params)                 # one jax.Array per StoredParam, in order

Measured on an H100 host (`scripts/profile_load.py`), what a loader spends beyond the bytes is per-tensor
overhead and host-side layout work: `jax.device_put` of a 2.7 GB DiT tensor by tensor ran at 1.7 GB/s
against 5.2 GB/s for reading the same files, a VAE of small tensors at 0.4 GB/s, and transposing (and
casting) bf16 weights in numpy took our DiT loader down to 0.43 GB/s. So here:
  * each parameter is read **as stored** (dtype and layout) straight from the file into one host buffer,
    per-layer tensors of a stacked parameter side by side (`TensorSource.read_into`: plain reads, no
    page-by-page faults of a memory map, the GIL released);
  * parameters go to the device in batches (one `jax.device_put` of a list per ~256 MB), read ahead by
    a few threads while the previous batch transfers;
  * the layout change (`Layout`: a reshape and a transpose, e.g. torch's (out, in) → (in, out)) and the
    cast to the model's dtype of a large parameter run on the device, where they cost microseconds, in
    one small program per distinct (shape, layout, dtype) that the compilation cache keeps; a small one
    (under `DEVICE_LAYOUT_BYTES`, e.g. the VAE's many convolutions) is converted on the host, where it
    is cheap, rather than compiling a program for each of its shapes.
Results are bit-identical to converting on the host: a transpose moves bits and both sides round
float32 → bfloat16 to nearest even.

With a mesh, the host builds each parameter in its final layout and dtype and `place` puts it on the
devices slice by slice (`wan_tpu.sharding.place_param`), so a device never holds more than its shard.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from wan_tpu.checkpoint import TensorSource

BATCH_BYTES = 256 << 20  # host bytes per device_put batch: large enough to amortise, small enough to pipeline
READ_THREADS = 4
DEVICE_LAYOUT_BYTES = 16 << 20  # at least this many stored bytes: layout and cast on the device


@dataclasses.dataclass(frozen=True)
class Layout:
    """Stored layout → ours: `reshape` (None: keep) then `perm` (None: keep), per layer of a stacked parameter."""

    reshape: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None

    def apply(self, a, stacked: bool = False):
        """`a` (numpy or jax; with a leading layer axis when `stacked`) in our layout."""
        lead = a.shape[:1] if stacked else ()
        if self.reshape is not None:
            a = a.reshape(*lead, *self.reshape)
        if self.perm is not None:
            a = a.transpose(*range(len(lead)), *(p + len(lead) for p in self.perm))
        return a

    @property
    def identity(self) -> bool:
        return self.reshape is None and self.perm is None


TRANSPOSE = Layout(perm=(1, 0))  # torch Linear (out, in) → (in, out)


@dataclasses.dataclass(frozen=True)
class StoredParam:
    """One parameter as the checkpoint stores it: `names` (one per layer, stacked on a new leading axis,
    when `stacked`), its `layout` change and the `dtype` it is placed in."""

    tensors: TensorSource
    names: Sequence[str]
    layout: Layout
    dtype: np.dtype
    stacked: bool = False

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = tuple(self.tensors.shape(self.names[0]))
        return (len(self.names), *shape) if self.stacked else shape

    @property
    def stored_dtype(self) -> np.dtype:
        return self.tensors.dtype(self.names[0])

    def read_stored(self) -> np.ndarray:
        """The stored bytes in one contiguous host array (stored dtype and layout)."""
        out = np.empty(self.stored_shape, self.stored_dtype)
        if self.stacked:
            for i, name in enumerate(self.names):
                self.tensors.read_into(name, out[i])
        else:
            self.tensors.read_into(self.names[0], out)
        return out

    @property
    def stored_bytes(self) -> int:
        return int(np.prod(self.stored_shape, dtype=np.int64)) * self.stored_dtype.itemsize

    @property
    def as_stored(self) -> bool:
        """Placed exactly as stored (no layout change, no cast)."""
        return self.layout.identity and np.dtype(self.dtype) == self.stored_dtype

    def read_host(self) -> np.ndarray:
        """The parameter as placed (our layout and dtype), built on the host."""
        return np.ascontiguousarray(self.layout.apply(self.read_stored(), self.stacked).astype(self.dtype, copy=False))


@functools.partial(jax.jit, static_argnames=("layout", "stacked", "dtype"))
def _to_ours(stored, layout: Layout, stacked: bool, dtype):
    return layout.apply(stored, stacked).astype(dtype)


def load_params(params: Sequence[StoredParam], place: Callable[[int, np.ndarray], jax.Array] | None = None,
                threads: int = READ_THREADS) -> list[jax.Array]:
    """Every parameter on the device, in order: the default device, or where `place(i, host)` puts
    `params[i]` given in our layout and dtype (e.g. sharded over a mesh)."""
    if place is not None:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            # map() reads ahead of the placing loop, at most `threads` parameters held beyond it.
            return [place(i, host) for i, host in enumerate(pool.map(StoredParam.read_host, params))]
    batches, size = [[]], 0
    for i, p in enumerate(params):
        if batches[-1] and size >= BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += p.stored_bytes
    on_device = [not p.as_stored and p.stored_bytes >= DEVICE_LAYOUT_BYTES for p in params]
    out: list[jax.Array | None] = [None] * len(params)

    def read(batch):
        return [params[i].read_stored() if on_device[i] else params[i].read_host() for i in batch]

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        ahead = collections.deque(pool.submit(read, b) for b in batches[:threads])
        for n, batch in enumerate(batches):
            hosts = ahead.popleft().result()
            if n + threads < len(batches):
                ahead.append(pool.submit(read, batches[n + threads]))
            for i, placed in zip(batch, jax.device_put(hosts)):
                p = params[i]
                out[i] = _to_ours(placed, p.layout, p.stacked, np.dtype(p.dtype)) if on_device[i] else placed
    return out
