"""Checkpoint tensors → device parameters, at the host's copy speed: the one placement path of every loader.

    params = [StoredParam(tensors, ["blocks.0.attn1.to_q.weight", ...], Layout(perm=(1, 0)), jnp.bfloat16), ...]
    arrays = load_params(params)                 # one jax.Array per StoredParam, in order

Measured on an H100 host (`benchmarks/profile_load.py`, 2026-11-23): the page cache reads at 5–6 GB/s;
`jax.device_put` straight from a memory map reaches 3.8 GB/s for UMT5's large tensors with one thread
and 5.8 GB/s with four, while copying into fresh host buffers first (1.7 GB/s: the kernel zeroes every
new page) or one batched `device_put` of them all (1.3 GB/s) is slower; and transposing and casting
bf16 weights in numpy took the DiT loader down to 0.43 GB/s. So here:
  * a few threads put parameters on the device at once, each large one as stored (dtype and layout),
    layer by layer straight from the checkpoint's memory map: no host copy at all;
  * the layout change (`Layout`: a reshape and a transpose, e.g. torch's (out, in) → (in, out)), the
    stacking of per-layer tensors on a leading axis and the cast to the model's dtype run on the device,
    where they cost microseconds, in one small program per distinct (layers, shape, layout, dtype) that
    a GPU's or TPU's executable cache keeps whole (a warm start loads it without tracing or lowering);
  * a small parameter (under `DEVICE_LAYOUT_BYTES`, e.g. the VAE's many convolutions, a layer norm's
    stacked gains) is built on the host, where that is cheap, rather than compiling a program for each
    of its shapes.
Results are bit-identical to converting on the host: a transpose moves bits and both sides round
float32 → bfloat16 to nearest even.

With a mesh, the host builds each parameter in its final layout and dtype and `place` puts it on the
devices slice by slice (`wan_tpu.parallel.sharding.place_param`), so a device never holds more than its shard.
In a job of several processes (`wan_tpu.runtime.distributed`) `place` is given a `ParamSlices` instead:
each process reads from the checkpoint only the slices its own devices hold (`ParamSlices[index]`), so no
host reads, or holds, a whole sharded parameter.

A loader whose parameter list waits on something slow (UnifoLM's comes from its abstract build, seconds of the
interpreter on a cold start) starts `EarlyPuts` first: the checkpoint's large tensors go to the device as stored
while the list is made, and `load_params(..., early=)` takes them from there. The layout programs those
parameters need then compile in a thread of their own, in the order the parameters come, beside the small
parameters' host conversions, rather than one at a time in the loading thread as each large parameter arrives.
Within `host_work_after(event)` the host conversions wait for `event` (the puts and compiles do not).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu.loading.checkpoint import TensorSource

READ_THREADS = 4
DEVICE_LAYOUT_BYTES = 16 << 20  # at least this many stored bytes: layout and cast on the device
HOST_TILED_BYTES = 1 << 20  # a transpose on the host of at least this many bytes goes in bands
HOST_TILE_ROWS = 256
HOST_TILE_THREADS = 8  # a stack's layers, at most this many at once
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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
        if self.layout == TRANSPOSE and len(self.stored_shape) == 2 + self.stacked and self.stored_bytes >= HOST_TILED_BYTES:
            return self._read_transposed()
        return np.ascontiguousarray(self.layout.apply(self.read_stored(), self.stacked).astype(self.dtype, copy=False))

    def _read_transposed(self) -> np.ndarray:
        """`read_host` of a (stacked) 2-D transpose, the torch Linear's: each layer read and then transposed
        a band of rows at a time, a stack's layers in threads of their own (the callers already run in the
        read threads; they end with the call). numpy's plain transpose of a large bf16 matrix walks the
        source a column at a time and ran at 0.1–0.5 GB/s (a streamed 14B DiT's load took 49 s on an H200
        host); bands that fit the cache move it several times faster, and the copies release the GIL."""
        rows, cols = self.stored_shape[-2:]
        out = np.empty((len(self.names), cols, rows) if self.stacked else (cols, rows), self.dtype)
        layers = out if self.stacked else out[None]
        same = np.dtype(self.dtype) == self.stored_dtype

        def layer(i: int) -> None:
            src = np.empty((rows, cols), self.stored_dtype)
            self.tensors.read_into(self.names[i], src)
            dst = layers[i]
            if same and src.dtype.itemsize in _UINT:  # as unsigned ints: numpy's copy loop, GIL released
                src, dst = src.view(_UINT[src.dtype.itemsize]), dst.view(_UINT[src.dtype.itemsize])
            for r in range(0, rows, HOST_TILE_ROWS):
                dst[:, r:r + HOST_TILE_ROWS] = src[r:r + HOST_TILE_ROWS].T if same else \
                    src[r:r + HOST_TILE_ROWS].T.astype(self.dtype)

        if len(layers) == 1:
            layer(0)
            return out
        threads = min(HOST_TILE_THREADS, len(layers), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="wan_tpu-transpose") as pool:
            list(pool.map(layer, range(len(layers))))
        return out


def _span(index, shape) -> list[tuple[int, int]]:
    spans = []
    for i, n in enumerate(shape):
        sl = index[i] if i < len(index) else slice(None)
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"only contiguous slices are read, got step {step}")
        spans.append((start, max(start, stop)))
    return spans


def _groups(stored: tuple[int, ...], ours: tuple[int, ...]) -> list[tuple[range, range]]:
    """The dimensions of `stored` and of its reshape `ours` that cover each other (equal products)."""
    groups, i, j = [], 0, 0
    while i < len(stored) or j < len(ours):
        a, b, p, q = i, j, 1, 1
        if i < len(stored):
            p, i = stored[i], i + 1
        if j < len(ours):
            q, j = ours[j], j + 1
        while p != q:
            if p < q:
                p, i = p * stored[i], i + 1
            else:
                q, j = q * ours[j], j + 1
        groups.append((range(a, i), range(b, j)))
    return groups


class ParamSlices:
    """A `StoredParam` in our layout and dtype, read a slice at a time: `shape`, `dtype`, `[index]` (a tuple
    of contiguous slices, as `jax.make_array_from_callback` gives) reads only the stored bytes that slice
    needs; `np.asarray(...)` reads it whole."""

    def __init__(self, param: StoredParam):
        self.param = param
        stored = param.stored_shape
        self.lead = stored[:1] if param.stacked else ()
        layer = stored[len(self.lead):]
        layout = param.layout
        self.reshaped = tuple(layout.reshape) if layout.reshape is not None else layer
        self.perm = tuple(layout.perm) if layout.perm is not None else tuple(range(len(self.reshaped)))
        self.groups = _groups(layer, self.reshaped)
        self.shape = self.lead + tuple(self.reshaped[p] for p in self.perm)
        self.dtype = np.dtype(param.dtype)
        self.ndim = len(self.shape)

    def __array__(self, dtype=None, copy=None):
        out = self.param.read_host()
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        spans = _span(index, self.shape)
        lead_span, ours = spans[:len(self.lead)], spans[len(self.lead):]
        # Our dimension k is the reshaped dimension perm[k].
        reshaped = [None] * len(self.reshaped)
        for k, p in enumerate(self.perm):
            reshaped[p] = ours[k]
        stored_index, region, after = [], [], []
        for s_dims, r_dims in self.groups:
            whole = all(reshaped[r] == (0, self.reshaped[r]) for r in r_dims)
            if len(s_dims) == 1 and len(r_dims) == 1:
                a, b = reshaped[r_dims[0]]
                stored_index.append(slice(a, b))
                region.append(b - a)
                after.append(slice(None))
            else:
                # A slice across merged dimensions is not one box of the stored tensor: read the group whole.
                stored_index += [slice(None)] * len(s_dims)
                region += [self.reshaped[r] for r in r_dims]
                after += [slice(None) if whole else slice(*reshaped[r]) for r in r_dims]
        p = self.param
        names = p.names[slice(*lead_span[0])] if p.stacked else p.names[:1]
        read = getattr(p.tensors, "read_slice", None)
        layers = [read(n, tuple(stored_index)) if read is not None else np.asarray(p.tensors[n][tuple(stored_index)])
                  for n in names]
        a = np.stack(layers) if p.stacked else layers[0]
        a = a.reshape(*a.shape[:len(self.lead)], *region)[(slice(None),) * len(self.lead) + tuple(after)]
        a = a.transpose(*range(len(self.lead)), *(q + len(self.lead) for q in self.perm))
        return np.ascontiguousarray(a.astype(self.dtype, copy=False))


@functools.partial(jax.jit, static_argnames=("layout", "stacked", "dtype"))
def _to_ours(layers, layout: Layout, stacked: bool, dtype):
    stored = jnp.stack(layers) if stacked else layers[0]
    return layout.apply(stored, stacked).astype(dtype)


def _layout_program(layers: tuple, layout: Layout, stacked: bool, dtype):
    """`_to_ours(layers, ...)` through a program loaded whole from the executable cache when the compile
    cache holds it (`executable_cache.cached_call`): a warm start then traces and lowers
    nothing. Lowering the Matrix-Game DiT's 10 layout programs took 1.3 s of its 1.7 s warm load on an
    H100 (its transfers 0.25 s). Without CUDA graphs, since the loads of several components run theirs at
    once, each in its thread, beside the others' transfers; and without autotuning, which a program run once
    per load never repays (`executable_cache.RUN_ONCE`)."""
    from wan_tpu.runtime import executable_cache

    return executable_cache.cached_call("param-layout", "param-layout", _to_ours, (layers,),
                                        dict(layout=layout, stacked=stacked, dtype=np.dtype(dtype)),
                                        static_argnames=("layout", "stacked", "dtype"),
                                        compiler_options=executable_cache.run_once())


_HOST_WORK_AFTER: contextvars.ContextVar = contextvars.ContextVar("wan_tpu_host_work_after", default=None)


@contextlib.contextmanager
def host_work_after(event: threading.Event):
    """Within it, in this thread, `load_params` converts no parameter on the host (and lays none out on the device)
    before `event` is set; the large tensors' puts (`EarlyPuts`) and the layout programs' compiles go on meanwhile.
    A loader whose conversions would only take turns with more urgent interpreter work (UnifoLM's `prepare`
    tracing its stage programs, whose compiles then start sooner) runs in it."""
    token = _HOST_WORK_AFTER.set(event)
    try:
        yield
    finally:
        _HOST_WORK_AFTER.reset(token)


class EarlyPuts:
    """The large tensors (`DEVICE_LAYOUT_BYTES` or more) of `tensors` put on the default device as stored, in
    `threads` background threads, from before the model's parameter list exists; `load_params(..., early=self)`
    takes each from here instead of putting it. The puts are what the loader would do (`_put`: a large tensor goes
    as stored, its layout and cast on the device), only sooner: UnifoLM-WMA-0's 168 large tensors are 7.5 of its
    UNet's 10 GB, and its parameter list, from the abstract build, came 1.9–2.8 s into a cold start's load on an
    H200 host. `close()` drops what was not taken (a load that failed its checks: nothing stays on the device)."""

    def __init__(self, tensors: TensorSource, threads: int = READ_THREADS):
        self.tensors = tensors
        names = [n for n in tensors if _stored_bytes(tensors, n) >= DEVICE_LAYOUT_BYTES]
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="wan_tpu-early-put")
        self._futures = {n: self._pool.submit(_put_stored, tensors, n) for n in names}
        self._pool.shutdown(wait=False)

    def take(self, tensors, name: str) -> jax.Array | None:
        """The tensor `name` of `tensors` on the device (waiting for its put), or None where it is not put here."""
        if tensors is not self.tensors:
            return None
        with self._lock:
            future = self._futures.pop(name, None)
        return None if future is None else future.result()

    def close(self) -> None:
        """Drop what was not taken, and wait for the puts under way: no thread outlives the load."""
        with self._lock:
            futures, self._futures = self._futures, {}
        for future in futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)


def _stored_bytes(tensors, name: str) -> int:
    return int(np.prod(tensors.shape(name), dtype=np.int64)) * np.dtype(tensors.dtype(name)).itemsize


def _put_stored(tensors, name: str) -> jax.Array:
    return jax.device_put(np.asarray(tensors[name]))


def _on_device(p: StoredParam) -> bool:
    """Whether `_put` puts `p` as stored and leaves its layout and cast to a program on the device."""
    return p.stored_bytes >= DEVICE_LAYOUT_BYTES and not (p.as_stored and not p.stacked)


def _layout_key(p: StoredParam) -> tuple:
    shape = tuple(p.tensors.shape(p.names[0]))
    return (len(p.names) if p.stacked else 0, shape, np.dtype(p.stored_dtype), p.layout, np.dtype(p.dtype))


class _LayoutCompiles:
    """The layout programs of `params`' device layouts, compiled (or read back from the executable cache) one after
    another in a thread of their own, in the order the parameters come: `wait(p)` waits for `p`'s own program only;
    `close()` stops the thread after the program under way (a load that failed) and joins it, so that no thread
    outlives its load."""

    def __init__(self, params: Sequence[StoredParam]):
        self._todo: dict = {}
        for p in params:
            if _on_device(p):
                self._todo.setdefault(_layout_key(p), p)
        self._ready = {key: threading.Event() for key in self._todo}
        self._stop = threading.Event()
        self._thread = None
        if self._todo:
            # Not a daemon: a thread killed inside XLA at exit aborts the process.
            self._thread = threading.Thread(target=self._compile_all, name="wan_tpu-layout-compile")
            self._thread.start()

    def _compile_all(self) -> None:
        from wan_tpu.runtime import executable_cache

        try:
            for key, p in self._todo.items():
                if self._stop.is_set():
                    return
                try:
                    stored = jax.ShapeDtypeStruct(key[1], key[2])
                    with executable_cache.ahead():  # compiled and kept (`_CALLED`), nothing run
                        _layout_program((stored,) * max(key[0], 1), p.layout, p.stacked, p.dtype)
                except Exception:  # noqa: BLE001 - the parameter's own call compiles it, and raises what it raises
                    pass
                self._ready[key].set()
        finally:
            for event in self._ready.values():
                event.set()

    def wait(self, p: StoredParam) -> None:
        event = self._ready.get(_layout_key(p))  # None: not compiled here, its call compiles it
        if event is not None:
            event.wait()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _ordered(pool, fn, items, ahead: int):
    """`fn` over `items` in `pool`, results in order, at most `ahead` of them pending beyond the consumer."""
    pending = collections.deque()
    items = iter(items)
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def load_params(params: Sequence[StoredParam], place: Callable[..., jax.Array] | None = None,
                threads: int = READ_THREADS, streamed: Sequence[bool] = (),
                early: EarlyPuts | None = None) -> list[jax.Array]:
    """Every parameter on the device, in order: the default device, or where `place(i, host)` puts
    `params[i]` given in our layout and dtype (e.g. sharded over a mesh). `early`: the checkpoint's large tensors
    already on their way to the default device (`EarlyPuts`, without `place`), taken from there.

    `streamed[i]`: parameter `i` (a stack whose layers stream from host memory, `wan_tpu.parallel.offload`)
    goes straight into its devices' host memory instead, converted on the host, never occupying device
    memory: `place(i, host, memory_kind=...)` puts it with its mesh placement
    (`wan_tpu.parallel.sharding.place_param`)."""
    kind = None
    if any(streamed):
        from wan_tpu.parallel.offload import host_kind

        kind = host_kind()
    where = lambda i: {"memory_kind": kind} if i < len(streamed) and streamed[i] else {}  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        if place is not None and jax.process_count() > 1:
            return list(_ordered(pool, lambda i: _place_slices(place, i, params[i], where(i)), range(len(params)),
                                 threads))
        if place is not None:
            hosts = _ordered(pool, StoredParam.read_host, params, threads)
            return [place(i, host, **where(i)) for i, host in enumerate(hosts)]
        # With early puts the large parameters' arrays are ready before their turn: their layout programs compile
        # ahead of it; otherwise each compiles as its parameter comes.
        layouts = _LayoutCompiles([p for i, p in enumerate(params) if not where(i)] if early is not None else [])
        try:
            after = _HOST_WORK_AFTER.get()
            if after is not None:
                after.wait()
            out = []
            for p, on_device, arrays in _ordered(pool, lambda i: _put(params[i], where(i).get("memory_kind"), early),
                                                 range(len(params)), 2 * threads):
                if on_device:
                    layouts.wait(p)
                out.append(_layout_program(tuple(arrays), p.layout, p.stacked, p.dtype) if on_device else arrays[0])
            return out
        finally:
            layouts.close()


def _place_slices(place, i: int, p: StoredParam, where: dict) -> jax.Array:
    """`place(i, ...)` given the parameter's slices to read; a `place` that takes only arrays gets it whole."""
    try:
        return place(i, ParamSlices(p), **where)
    except TypeError:
        return place(i, p.read_host(), **where)


def _put(p: StoredParam, host_kind: str | None = None, early: EarlyPuts | None = None):
    """`p` host → device: (p, whether its layout and cast are still to do on the device, the arrays put).

    Large parameters go as stored, each layer straight from its memory map (no host copy), or are taken from
    `early`; small ones are converted on the host first, so that they compile no program of their own. With
    `host_kind` the parameter goes to that host memory of the default device, converted on the host (a layout
    program would run on the device)."""
    if early is not None and host_kind is None:
        arrays = [early.take(p.tensors, n) for n in p.names]
        if any(a is not None for a in arrays):
            arrays = [a if a is not None else _put_stored(p.tensors, n) for a, n in zip(arrays, p.names)]
            return p, not (p.as_stored and not p.stacked), arrays
    if host_kind is not None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=host_kind)
        return p, False, [jax.device_put(p.read_host(), sharding)]
    if p.as_stored and not p.stacked:
        return p, False, [jax.device_put(np.asarray(p.tensors[p.names[0]]))]
    if p.stored_bytes < DEVICE_LAYOUT_BYTES:
        return p, False, [jax.device_put(p.read_host())]
    return p, True, [jax.device_put(np.asarray(p.tensors[n])) for n in p.names]
