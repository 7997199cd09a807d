"""Compiled programs kept on disk whole and found by a key computed without tracing: a warm start loads
its programs instead of tracing and lowering them.

    compiled = executable_cache.load("chunk-1", key)            # None on a miss (or with the cache off)
    if compiled is None:
        compiled = executable_cache.store("chunk-1", key, jitted.lower(*abstract_args))   # compiles, writes
    programs.put("chunk-1", compiled)
    out = programs.call("chunk-1", dynamic_args, lambda: jitted(*args, **kwargs))

    # or, at a call site whose arguments are at hand (the loaders' layout programs):
    out = executable_cache.cached_call("param-layout", key, jitted, args, kwargs, static_argnames=(...))
    with executable_cache.ahead():   # the same calls, ahead of time: load or compile, run nothing (zeros out)
        out = executable_cache.cached_call("unifolm-sample", key, jitted, abstract_args, ...)

    # and a module without weights (`nnx.eval_shape`), its structure and parameter shapes pickled:
    vae = executable_cache.cached_abstract("wan-vae", (config, "bfloat16"), lambda: WanVAE(config, ...))

JAX's persistent compile cache (`wan_tpu.runtime.compile_cache`) is keyed by the lowered program, so even a hit
first traces and lowers it: seconds of Python for a 30-block DiT, under the GIL that the weights' loads
need too. Here the caller names what determines the program — the components' configs, dtypes, sizes,
the attention settings — and the file key adds what the caller cannot see: jax, jaxlib, flax and numpy
versions, the devices (platform, kind, count), `XLA_FLAGS`, every `WAN_TPU_*` setting but the cache
folder and the interrupt test hook, the `jax.config` values that change programs, and a hash of this package's source files. So an
entry is never found by another version, device, setting or code; a key whose text holds an object
address (not stable across processes) is never written.

Entries live in `executables/` of the compile cache's folder and follow its switch
(`compile_cache.is_enabled()`: a pipeline's own choice while its work runs, `compile_cache.selected`); off,
`load` misses and `store` only compiles. An entry that cannot be
read (a killed writer, another jaxlib's format) is deleted with a warning and the program recompiled and
written again; a backend that cannot serialise its executables just keeps them in memory. Writes go to
a temporary file renamed into place, so a reader never sees half an entry.

`prefetch(group, key)` (a pipeline's `prepare`, through `Warmup.prefetch`) starts reading, in the background, every
entry the last process with the same `group` and `key` loaded or stored (its manifest, `manifest-GROUP-*.bin`,
which this process then keeps up to date): a warm start's programs deserialise from its first second,
beside the weights' loads, instead of once each program's caller has traced its way to it.

`Programs` holds a pipeline's loaded programs by name. A call made with arguments the program was not
compiled for (a `TypeError` from JAX's argument check, raised before anything runs or is donated) drops
it with a warning and takes the jitted path, so an entry can cost a compile, never a wrong result.
`jax.stages.Compiled` is called without the jitted function's static arguments.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import importlib
import os
import pickle
import threading
import time
import warnings

import jax

from wan_tpu.runtime import compile_cache

FOLDER = "executables"
# Time spans (`jax.monitoring.record_event_time_span`, `fun_name` = what) of the work around compiling that JAX
# does not report itself: loads and stores here, `Warmup`'s background tasks and the waits for them, seeded
# random weights. `benchmarks/profile_compile.py` draws its cold-start timeline from them and JAX's own spans.
TIMELINE = "/wan_tpu/timeline/"


@contextlib.contextmanager
def span(kind: str, name: str):
    """Record the time the body takes as a `TIMELINE + kind` span named `name` (nothing listens by default)."""
    start = time.time()
    try:
        yield
    finally:
        jax.monitoring.record_event_time_span(TIMELINE + kind, start, time.time(), fun_name=name)


def load(name: str, key) -> jax.stages.Compiled | None:
    """The program stored under (`name`, `key`), deserialised and loaded on this process's devices, or None."""
    path = _path(name, key)
    if path is None:
        return None
    prefetched = _take_prefetched(path)
    if prefetched is not None:
        with span("executable load", name):
            return prefetched.compiled.result()
    if not os.path.isfile(path):
        return None
    with span("executable load", name):
        return _load(name, path)


def _load(name: str, path: str, entry: tuple | None = None) -> jax.stages.Compiled | None:
    """The entry at `path` (read already: `entry`) deserialised, or None (then deleted, with a warning)."""
    try:
        from jax.experimental.serialize_executable import deserialize_and_load

        _load_kernel_runtimes()
        if entry is None:
            with open(path, "rb") as f:
                entry = pickle.load(f)
        payload, in_tree, out_tree, device_ids, _ = entry
        by_id = {d.id: d for d in jax.devices()}
        compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
    except Exception as e:  # noqa: BLE001 - an unreadable entry is a miss, repaired by the next store
        _remove(path)
        warnings.warn(f"executable cache: dropped an unreadable entry for {name} ({type(e).__name__}); it is "
                      "recompiled", stacklevel=2)
        return None
    jax.monitoring.record_event(compile_cache.PROGRAM_LOADED)  # counted in `compile_cache.stats()`
    _touched(path)
    return compiled


# ---- prefetching a start's programs --------------------------------------------------------------------

_PREFETCH_LOCK = threading.Lock()
_PREFETCHED: dict = {}  # entry path → its `_Prefetched` read, until a caller takes it
_MANIFESTS: dict[str, list[str]] = {}  # manifest path → the entry file names it lists (kept up to date)
_TOUCHED: dict[str, None] = {}  # entry paths this process loaded or stored, in order
# Threads deserialising at once: the largest program (listed first) starts at once, the small ones beside it.
PREFETCH_THREADS = 4


class _Prefetched:
    """One entry read (`entry`: its pickled tuple, None when unreadable) and deserialised (`compiled`: None
    when it cannot be) in the background."""

    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        self.entry: concurrent.futures.Future = concurrent.futures.Future()
        self.compiled: concurrent.futures.Future = concurrent.futures.Future()

    def run(self) -> None:
        entry = compiled = None
        try:
            try:
                with open(self.path, "rb") as f:
                    entry = pickle.load(f)
            except Exception as e:  # noqa: BLE001 - unreadable: its caller compiles it and the store repairs the entry
                _remove(self.path)
                warnings.warn(f"executable cache: dropped an unreadable entry for {self.name} ({type(e).__name__}); "
                              "it is recompiled", stacklevel=2)
            self.entry.set_result(entry)
            if entry is not None:
                with span("executable prefetch", self.name):
                    compiled = _load(self.name, self.path, entry)
        finally:
            if not self.entry.done():
                self.entry.set_result(None)
            self.compiled.set_result(compiled)


def prefetch(group: str, key) -> concurrent.futures.Future | None:
    """Start loading, in background threads, every entry listed in the manifest of (`group`, `key`) — what the
    last process with them (the same command: family, configs, mode, sizes) loaded or stored — largest first;
    from now on this process's own loads and stores are added to that manifest. A caller that meets a listed
    program (`load`, `cached_call`, `ahead`) takes the loaded one, waiting for it if its read is under way.
    → a future done when every listed entry is loaded (its result: their count), or None when there is
    nothing to read (no manifest yet, the cache off, no key)."""
    manifest = _path(f"manifest-{group}", key)
    if manifest is None:
        return None
    try:
        with open(manifest, "rb") as f:
            listed = [name for name in pickle.load(f) if isinstance(name, str)]
    except FileNotFoundError:
        listed = []
    except Exception:  # noqa: BLE001 - a torn or foreign manifest: started afresh
        listed = []
    folder = os.path.dirname(manifest)
    todo = []
    with _PREFETCH_LOCK:
        listed = _MANIFESTS.setdefault(manifest, listed)
        for path in _TOUCHED:  # what this process used before it asked belongs to the group too
            _list(manifest, listed, path)
        for file in listed:
            path = os.path.join(folder, file)
            if path in _PREFETCHED or path in _TOUCHED or not os.path.isfile(path):
                continue
            _PREFETCHED[path] = _Prefetched(file.rsplit("-", 1)[0], path)  # NAME-DIGEST.bin
            todo.append(_PREFETCHED[path])
    if not todo:
        return None
    todo.sort(key=lambda p: -_size(p.path))
    done: concurrent.futures.Future = concurrent.futures.Future()

    def load_all():
        try:
            with concurrent.futures.ThreadPoolExecutor(min(PREFETCH_THREADS, len(todo)),
                                                       thread_name_prefix="wan_tpu-prefetch") as pool:
                list(pool.map(_Prefetched.run, todo))
        finally:  # whoever waits is never left waiting
            done.set_result(len(todo))

    # Not a daemon: a thread killed inside XLA at exit aborts the process.
    threading.Thread(target=load_all, name="wan_tpu-prefetch").start()
    return done


def _take_prefetched(path: str):
    """The background read of the entry at `path` (taken: a later caller reads the file itself), or None."""
    with _PREFETCH_LOCK:
        return _PREFETCHED.pop(path, None)


def _touched(path: str) -> None:
    """Record that this process loaded or stored the entry at `path`; a manifest of its folder that lacks it
    gains it (rewritten whole: a few hundred bytes, and only while a process meets programs it did not list)."""
    with _PREFETCH_LOCK:
        _TOUCHED[path] = None
        for manifest, listed in _MANIFESTS.items():
            _list(manifest, listed, path)


def _list(manifest: str, listed: list[str], path: str) -> None:
    file = os.path.basename(path)
    if os.path.dirname(path) == os.path.dirname(manifest) and file not in listed:
        listed.append(file)
        _write("manifest", manifest, pickle.dumps(list(listed), protocol=pickle.HIGHEST_PROTOCOL))


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def exists(name: str, key) -> bool:
    """Whether an entry for (`name`, `key`) is on disk (it may still prove unreadable when loaded)."""
    path = _path(name, key)
    return path is not None and os.path.isfile(path)


def store(name: str, key, lowered: jax.stages.Lowered, compiler_options: dict | None = None) -> jax.stages.Compiled:
    """Compile `lowered` (with XLA's `compiler_options`, which the key must name) and write it under (`name`,
    `key`) when the cache is on; → the compiled program."""
    with span("compile and store", name):
        return _store(name, key, lowered, compiler_options)


def _store(name: str, key, lowered: jax.stages.Lowered, compiler_options: dict | None) -> jax.stages.Compiled:
    hits = compile_cache.thread_hits()
    compiled = lowered.compile(compiler_options)
    path = _path(name, key)
    if path is None:
        return compiled
    if compile_cache.thread_hits() > hits and jax.devices()[0].platform == "cpu":
        # XLA:CPU (jax 0.10.2) serialises an executable that JAX's persistent cache served without all of
        # its functions: a later process fails to run it ("Function bitcast_concatenate_fusion not found";
        # seen after a change of this package's sources, whose programs JAX's cache still held). Compiled
        # afresh for the store: with an option that changes nothing on a CPU but JAX's cache key (a GPU
        # graph size), unique to this entry.
        hits = compile_cache.thread_hits()
        unique = 10**6 + int(os.path.basename(path)[-12:-4], 16) % 10**6  # from the entry's digest
        compiled = lowered.compile({**(compiler_options or {}), "xla_gpu_graph_min_graph_size": unique})
        if compile_cache.thread_hits() > hits:  # served again: kept in memory only
            return compiled
    try:
        from jax.experimental.serialize_executable import serialize

        # The devices it runs on, in its assignment's order: loading would otherwise spread it over all.
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
        # Its outputs' shapes too: `ahead` hands them on while the program deserialises in the background.
        data = pickle.dumps((*serialize(compiled), device_ids, _shapes(compiled.out_info)),
                            protocol=pickle.HIGHEST_PROTOCOL)
    except (ValueError, NotImplementedError, TypeError, pickle.PicklingError):
        return compiled  # this backend or program cannot be serialised: kept in memory only
    if _write(name, path, data):
        jax.monitoring.record_event(compile_cache.PROGRAM_STORED)
        _touched(path)
    return compiled


def _write(name: str, path: str, data: bytes) -> bool:
    """`data` into `path` through a temporary file renamed into place → whether it was written."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:  # a full or read-only disk: the run goes on, uncached
        _remove(tmp)
        warnings.warn(f"executable cache: could not write {name} ({e.strerror or e})", stacklevel=3)
        return False
    return True


_ABSTRACTS_LOCK = threading.Lock()
_ABSTRACTS: dict = {}  # (name, key text) → [a lock, (graphdef, pickled state) once built]


def cached_abstract(name: str, key, build, *, split: bool = False):
    """`nnx.eval_shape(build)`, the module without weights (its structure and each parameter's shape,
    dtype and metadata), read back from this cache when a process with the same code and `key` (what
    `build` depends on: config, dtype, settings) built it before. Building one traces every layer's
    constructor: 1.6 s for UnifoLM's UNet on a 2-core CPU, 0.2 s to read back. Without a key or with
    the cache off: built. Once per process and key: a second caller meanwhile (a loader's thread and
    `prepare`'s compile thread both need UnifoLM's) waits for the first instead of building it again
    beside it, and gets its own copy.

    `split`: its `nnx.split` (graphdef, state) instead, what the entry holds, for a loader that fills the
    state: splitting UnifoLM's UNet again took 0.25–0.34 s of the interpreter on a 2-core CPU (merging 0.04),
    twice per warm load, beside the other components' loads."""
    from flax import nnx

    from wan_tpu.layers.conv import default_out_first

    # The convolutions' kernel layout of a module built now (the backend's, or a loader's `kernel_layout`).
    key = None if key is None else (key, "out-first" if default_out_first() else "spatial-first")
    text = None if key is None else repr(key)
    if text is None or " at 0x" in text:
        graphdef, state = _cached_abstract(name, key, build)
    else:
        with _ABSTRACTS_LOCK:
            entry = _ABSTRACTS.setdefault((name, text), [threading.Lock(), None])
        with entry[0]:
            if entry[1] is None:
                graphdef, state = _cached_abstract(name, key, build)
                try:
                    entry[1] = graphdef, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
                except (pickle.PicklingError, TypeError, AttributeError):
                    pass
            else:
                # The first one's graphdef itself: equal graphdefs (the same hook objects in them) are the same
                # static argument to `jax.jit`, so a program compiled for one module serves the other.
                graphdef, state = entry[1][0], pickle.loads(entry[1][1])
    return (graphdef, state) if split else nnx.merge(graphdef, state)


def _cached_abstract(name: str, key, build):
    """`cached_abstract`'s (graphdef, state), read from disk or built (and written)."""
    from flax import nnx

    path = _path(f"abstract-{name}", key)
    if path is not None and os.path.isfile(path):
        try:
            with span("abstract load", name), open(path, "rb") as f:
                graphdef, state = pickle.load(f)
            return graphdef, state
        except Exception as e:  # noqa: BLE001 - an unreadable entry is a miss, repaired below
            _remove(path)
            warnings.warn(f"executable cache: dropped an unreadable entry for {name} ({type(e).__name__}); it is "
                          "built again", stacklevel=2)
    with span("abstract build", name):
        graphdef, state = nnx.split(nnx.eval_shape(build))
    if path is not None:
        try:
            data = pickle.dumps((graphdef, state), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            return graphdef, state  # something in it does not pickle: built every time
        _write(name, path, data)
    return graphdef, state


def cached_arrays(name: str, key, make) -> list:
    """`make()` (host numpy arrays, e.g. a preset's seeded random weights), read back from this cache when a
    process with the same code and `key` (what `make` depends on) made them before: the tiny UnifoLM
    preset's 42 M random parameters take seconds to draw on a 2-core CPU and a tenth of that to read.
    Without a key or with the cache off: made."""
    path = _path(f"arrays-{name}", key)
    if path is not None and os.path.isfile(path):
        try:
            with span("arrays load", name), open(path, "rb") as f:
                return pickle.load(f)
        except Exception as e:  # noqa: BLE001 - an unreadable entry is a miss, repaired below
            _remove(path)
            warnings.warn(f"executable cache: dropped an unreadable entry for {name} ({type(e).__name__}); it is "
                          "made again", stacklevel=2)
    arrays = make()
    if path is not None:
        _write(name, path, pickle.dumps(arrays, protocol=pickle.HIGHEST_PROTOCOL))
    return arrays


class Programs:
    """Compiled programs by name; `call` runs one, or the jitted fallback when there is none (or it refuses
    the arguments: dropped, warned once)."""

    def __init__(self):
        self._compiled: dict[str, jax.stages.Compiled] = {}

    def put(self, name: str, compiled: jax.stages.Compiled) -> None:
        self._compiled[name] = compiled

    def __contains__(self, name: str) -> bool:
        return name in self._compiled

    def call(self, name: str, dynamic: tuple, fallback):
        """`compiled(*dynamic)` (the jitted function's arguments less its static ones), else `fallback()`."""
        compiled = self._compiled.get(name)
        if compiled is not None:
            try:
                return compiled(*dynamic)
            except TypeError as e:  # JAX checks the arguments before running or donating anything
                self._compiled.pop(name, None)
                warnings.warn(f"the stored program {name} does not take these arguments ({str(e).splitlines()[0]}); "
                              "it is compiled again", stacklevel=2)
        return fallback()


# XLA's compiler option for a program without command buffers (no CUDA graphs), on NVIDIA GPUs. XLA
# records a program's first run there as a CUDA graph, which CUDA work from another thread meanwhile can
# break (`cudaErrorStreamCaptureUnjoined`); a program run once or a few times per load (the loaders'
# layout programs, which several loads run at once in their threads) gains nothing from a graph.
GRAPHLESS = {"xla_gpu_enable_command_buffer": ""}


# A program that runs once per load (a parameter's layout and cast: transposes, no product) gains nothing
# from XLA's autotuning, which on a GPU times every fusion's emitters on the device: on an H200, a cold
# Matrix-Game-2 start spent 20.0 of its layout programs' 23.1 s of XLA compile on it, beside the stream's
# own programs' compiles and autotuning.
RUN_ONCE = {**GRAPHLESS, "xla_gpu_autotune_level": 0}


def run_once() -> dict | None:
    """`RUN_ONCE` on NVIDIA GPUs (no CUDA graph, no autotuning), else None."""
    return RUN_ONCE if jax.devices()[0].platform == "gpu" else None


_CALLED: dict = {}  # (name, full key, cache folder or None) → compiled program, for `cached_call`, once per process
_CALLED_LOCK = threading.Lock()
_AHEAD = threading.local()


@contextlib.contextmanager
def ahead():
    """In this thread, for the duration: `cached_call` loads or compiles (and stores) its program as a call
    would, but runs nothing and returns zeros of the program's outputs (shapes and dtypes), so the code
    around it carries on to the next program. A later call with arguments of the same shapes and dtypes
    (and the same cache choice) runs that very program: how `UnifolmPipeline.prepare` compiles its stage
    programs ahead. Dynamic arguments may be `jax.ShapeDtypeStruct`s (a module's abstract state) or
    tracers: run under `jax.eval_shape`, the code around the calls computes nothing either.

    Each program is traced and lowered in this thread, then compiled (or, when stored, deserialised) in a
    thread of its own (`wan_tpu-compile-NAME`), its output shapes known from the lowering (or the stored
    entry): the programs compile side by side, not one after the other (UnifoLM's sampling, its largest,
    beside the prepare and decode programs). Leaving the block waits for them all and raises the first
    failure."""
    before = getattr(_AHEAD, "on", False), getattr(_AHEAD, "pending", None)
    pending = []
    _AHEAD.on, _AHEAD.pending = True, pending
    try:
        yield
    finally:
        _AHEAD.on, _AHEAD.pending = before
        for thread in pending:  # also after an error: no thread outlives the block
            thread.join()
    failed = [thread.error for thread in pending if thread.error is not None]
    if failed:
        raise failed[0]


def ahead_active() -> bool:
    """Whether this thread is within `ahead()`: calls load or compile their programs and run nothing."""
    return getattr(_AHEAD, "on", False)


class _Background(threading.Thread):
    """A program loaded or compiled for `ahead` (output `shapes`), kept in `_CALLED` when done; its failure in
    `error`."""

    def __init__(self, name: str, memo: tuple, work, shapes):
        super().__init__(name=f"wan_tpu-compile-{name}")
        self.memo, self.work, self.shapes, self.error = memo, work, shapes, None

    def run(self):
        try:
            compiled = self.work()
        except BaseException as e:  # noqa: BLE001 - raised by `ahead` in the thread that waits for it
            self.error = e
            return
        with _CALLED_LOCK:
            _CALLED[self.memo] = compiled


def _ahead_in_background(name, full, memo, jitted, args, kwargs, static_argnums, static_argnames, compiler_options):
    """`cached_call`'s miss within `ahead`: the program's output shapes now, its load or compile in a thread
    (once: the same program met again meanwhile, e.g. UnifoLM's sampling for both halves of `interact`,
    gets the shapes of the one under way)."""
    under_way = {thread.memo: thread.shapes for thread in _AHEAD.pending}
    if memo in under_way:
        return under_way[memo]
    path = _path(name, full)
    entry = None
    prefetched = None if path is None else _take_prefetched(path)
    if prefetched is not None:
        entry = prefetched.entry.result()
    elif path is not None and os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
        except Exception:  # noqa: BLE001 - unreadable: `_load` below drops it and the program is compiled
            entry = None
    if entry is not None and len(entry) == 5 and entry[4] is not None:
        abstract_args = _abstract((args, kwargs), static_argnums, static_argnames)

        def work():
            with span("executable load", name):
                compiled = prefetched.compiled.result() if prefetched is not None else _load(name, path, entry)
            if compiled is not None:
                return compiled
            return store(name, full, jitted.lower(*abstract_args[0], **abstract_args[1]), compiler_options)

        shapes = entry[4]
    else:
        lowered = _lower(jitted, args, kwargs, static_argnums, static_argnames)
        shapes = _shapes(lowered.out_info)
        work = functools.partial(store, name, full, lowered, compiler_options)
    thread = _Background(name, memo, work, shapes)
    _AHEAD.pending.append(thread)
    thread.start()
    return shapes


def cached_call(name: str, key, jitted, args: tuple, kwargs: dict | None = None, *, static_argnums: tuple = (),
                static_argnames: tuple = (), compiler_options: dict | None = None, key_names_statics: bool = False):
    """`jitted(*args, **kwargs)` (a `jax.jit` function and its static arguments' positions and names) run by
    a program loaded whole from this cache, or compiled (with XLA's `compiler_options`) and stored on a
    miss: a later process traces and lowers nothing for it. `key` names what the arguments do not (configs,
    dtypes, settings); the static values' text, every dynamic leaf's shape and dtype and the options complete
    it. With the cache off the program is compiled once per process (and once more by a caller with it on,
    which then stores it). Without a key, or with arguments spread over several devices (another program):
    the jitted path. Within `ahead()`: loaded or compiled only, zeros of its outputs returned.
    `key_names_statics`: `key` determines the static arguments, whose text is then left out (a module's
    graphdef: megabytes of text holding function addresses, which no stored key may contain)."""
    return cached_program(name, key, jitted, args, kwargs, static_argnums=static_argnums,
                          static_argnames=static_argnames, compiler_options=compiler_options,
                          key_names_statics=key_names_statics)(*args, **(kwargs or {}))


def cached_program(name: str, key, jitted, args: tuple, kwargs: dict | None = None, *, static_argnums: tuple = (),
                   static_argnames: tuple = (), compiler_options: dict | None = None, key_names_statics: bool = False):
    """`cached_call`'s program for `args` and `kwargs` as a function `run(*args, **kwargs)` of arguments like them
    (the same statics; dynamic ones of the same shapes, dtypes and placements), which runs it as `cached_call`
    would: the key is built once (its text, for a model's weights, takes milliseconds), not at every call of a
    loop that runs the program again and again (UnifoLM's sampling step programs)."""
    kwargs = kwargs or {}

    def dynamic_of(call_args, call_kwargs):
        return (tuple(a for i, a in enumerate(call_args) if i not in static_argnums),
                {k: v for k, v in call_kwargs.items() if k not in static_argnames})

    if key is None:
        if getattr(_AHEAD, "on", False):  # nothing to load or compile ahead: its call compiles it
            shapes = jitted.eval_shape(*args, **kwargs)
            return lambda *a, **kw: _zeros(shapes)
        return jitted
    dynamic, dynamic_kw = dynamic_of(args, kwargs)
    statics = [] if key_names_statics else (
        [a for i, a in enumerate(args) if i in static_argnums] + [kwargs[k] for k in static_argnames if k in kwargs])
    leaves, tree = jax.tree.flatten((dynamic, dynamic_kw))
    signature = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and len(leaf.sharding.device_set) > 1:
            if getattr(_AHEAD, "on", False):
                shapes = jitted.eval_shape(*args, **kwargs)
                return lambda *a, **kw: _zeros(shapes)
            return jitted
        signature.append((tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", type(leaf).__name__)),
                          bool(getattr(leaf, "weak_type", False))))
    full = (key, tuple(repr(s) for s in statics), repr(tree), tuple(signature),
            tuple(sorted((compiler_options or {}).items())))
    # Per cache folder: a program compiled with the cache off (nothing stored) is compiled again, and
    # stored, by a caller with it on, as it would be in a process of its own.
    memo = (name, full, compile_cache.cache_dir())
    with _CALLED_LOCK:
        compiled = _CALLED.get(memo)
    if compiled is None and getattr(_AHEAD, "pending", None) is not None:
        shapes = _ahead_in_background(name, full, memo, jitted, args, kwargs, static_argnums, static_argnames,
                                      compiler_options)
        return lambda *a, **kw: _zeros(shapes)
    if compiled is None:
        compiled = load(name, full) or store(name, full, _lower(jitted, args, kwargs, static_argnums, static_argnames),
                                             compiler_options)
        with _CALLED_LOCK:
            _CALLED[memo] = compiled
    if getattr(_AHEAD, "on", False):
        return lambda *a, **kw: _zeros(compiled.out_info)
    refused = []

    def run(*call_args, **call_kwargs):
        if refused:
            return jitted(*call_args, **call_kwargs)
        call_dynamic, call_dynamic_kw = dynamic_of(call_args, call_kwargs)
        try:
            return compiled(*call_dynamic, **call_dynamic_kw)
        except TypeError as e:  # JAX checks the arguments before running anything
            refused.append(e)
            with _CALLED_LOCK:
                _CALLED.pop(memo, None)
            warnings.warn(f"the stored program {name} does not take these arguments ({str(e).splitlines()[0]}); "
                          "it is compiled again", stacklevel=3)
            return jitted(*call_args, **call_kwargs)

    return run


def _lower(jitted, args, kwargs, static_argnums, static_argnames):
    """`jitted.lower(*args, **kwargs)`, tracers among the dynamic arguments (`ahead` under `jax.eval_shape`)
    given as their shapes and dtypes."""
    args, kwargs = _abstract((args, kwargs), static_argnums, static_argnames)
    return jitted.lower(*args, **kwargs)


def _abstract(call, static_argnums, static_argnames):
    """(args, kwargs) with every tracer among the dynamic arguments replaced by its shape and dtype."""

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
                            if isinstance(x, jax.core.Tracer) else x, tree)

    args, kwargs = call
    return (tuple(a if i in static_argnums else abstract(a) for i, a in enumerate(args)),
            {k: v if k in static_argnames else abstract(v) for k, v in kwargs.items()})


def _shapes(tree):
    """Shapes and dtypes (and weak types) only, as they pickle: a program's `out_info` also pins shardings."""
    try:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type), tree)
    except (AttributeError, TypeError):
        return None


def _zeros(shapes):
    """Zeros of each output's shape and dtype (and weak type, for float32 and int32): on the host (no
    program compiled for them), except the weak-typed ones; a read-only view of one zero each, which holds
    no memory (UnifoLM-WMA-0's stage programs with the step in 8 pieces return 2.4 GB of activations, which
    written out took 0.63 s of `prepare`'s tracing on a 2-core CPU)."""
    import jax.numpy as jnp
    import numpy as np

    def zeros(s):
        if getattr(s, "weak_type", False) and s.dtype in (jnp.float32, jnp.int32):
            return jnp.full(s.shape, 0.0 if s.dtype == jnp.float32 else 0)
        return np.broadcast_to(np.zeros((), s.dtype), s.shape)

    return jax.tree.map(zeros, shapes)


@functools.cache
def _load_kernel_runtimes() -> None:
    """What a program's custom calls need at run time, which tracing would have set up. On NVIDIA GPUs, a
    Mosaic GPU kernel (our attention) stored in a program links its host code against Mosaic GPU's runtime
    library when the program loads: the library must be in the process, with its symbols global, and named
    by `MOSAIC_GPU_RUNTIME_LIB_PATH` (tracing a kernel imports `jax.experimental.mosaic.gpu`, which does
    both; loading a stored program does not). Without it the kernel is rebuilt on its first run, inside
    XLA's CUDA-graph capture, which fails (`cudaErrorStreamCaptureUnjoined`) or takes seconds. The library
    sits beside the GPU plugin's Mosaic GPU extension, found as that package finds it, without importing
    the package: 0.17 s alone, but 1 s while the loads' threads held the GIL (an H100 host's warm start)."""
    if jax.devices()[0].platform != "gpu":
        return
    runtime = os.environ.get("MOSAIC_GPU_RUNTIME_LIB_PATH")
    if not runtime:
        try:
            from jax._src.lib import mosaic_gpu

            runtime = os.path.join(os.path.dirname(mosaic_gpu._mosaic_gpu_ext.__file__), "libmosaic_gpu_runtime.so")
        except (ImportError, AttributeError):  # another layout: ask the package itself
            try:
                importlib.import_module("jax.experimental.mosaic.gpu")  # sets MOSAIC_GPU_RUNTIME_LIB_PATH
            except ImportError:  # a jaxlib without Mosaic GPU: its programs hold no such kernel
                return
            runtime = os.environ.get("MOSAIC_GPU_RUNTIME_LIB_PATH")
    if runtime and os.path.isfile(runtime):
        os.environ.setdefault("MOSAIC_GPU_RUNTIME_LIB_PATH", runtime)
        ctypes.CDLL(runtime, mode=ctypes.RTLD_GLOBAL)


def _path(name: str, key) -> str | None:
    folder = compile_cache.cache_dir()
    if folder is None or key is None:  # no key: the caller cannot say what determines the program
        return None
    text = repr(key)
    if " at 0x" in text:  # an object's address: a different key in every process, and no equality check
        return None
    digest = hashlib.sha256("\n".join((name, text, *_environment())).encode()).hexdigest()[:40]
    return os.path.join(folder, FOLDER, f"{_safe(name)}-{digest}.bin")


def _environment() -> tuple[str, ...]:
    """What changes a program that its caller's key does not name (the module docstring)."""
    import flax
    import jaxlib
    import numpy

    devices = jax.devices()
    # Where the cache lives, where programs compile and the interrupt test hook change no program.
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("WAN_TPU_")
                      and k not in ("WAN_TPU_CACHE_DIR", "WAN_TPU_PAUSE_AT", "WAN_TPU_COMPILE_WORKERS"))
    config = {name: getattr(jax.config, name, None) for name in (
        "jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable", "jax_default_prng_impl",
        "jax_numpy_rank_promotion", "jax_use_shardy_partitioner", "jax_include_full_tracebacks_in_locations",
        "jax_traceback_in_locations_limit")}
    return (f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__} numpy {numpy.__version__}",
            f"devices {devices[0].platform} {devices[0].device_kind} x{len(devices)}",
            f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}", repr(settings), repr(sorted(config.items())), source_hash())


_HASH_LOCK = threading.Lock()


# Every source file of the package keys the cached programs, wherever this module sits in it.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_hash() -> str:
    """sha256 of this package's Python sources (paths and contents), once per process: the first caller
    computes it while the others wait. `Warmup` asks before its threads start: alone it takes 2 ms, but
    read by six program threads at once beside the loads it took 0.4 s (every file read gives the GIL up,
    and each taking it back waits for the other threads' turns)."""
    with _HASH_LOCK:
        return _hash_sources()


@functools.cache
def _hash_sources() -> str:
    root = PACKAGE_ROOT
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
