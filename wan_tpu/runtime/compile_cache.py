"""The persistent compilation cache: compiled programs and GPU autotuning results kept on disk, on by default.

    import wan_tpu.runtime.compile_cache as compile_cache
    with compile_cache.selected(True):   # what a pipeline made with compile_cache=True runs its work in
        ...                               # (False: `generate --no-compile-cache`); restored after
    compile_cache.enable()        # on for this process: for code outside any pipeline (its default)
    compile_cache.disable()       # off for this process
    compile_cache.cache_dir()     # where this thread reads and writes now: see below
    compile_cache.stats()         # programs loaded from / written to the cache so far in this process
    compile_cache.summary()       # the same with the folder, or "off": the CLIs' timing-table line

Each pipeline (`WanPipeline`, `MatrixGamePipeline`, `UnifolmPipeline`) holds its own choice
(`pipe.compile_cache`, from `from_pretrained(..., compile_cache=...)`) and applies it only around its
own work, compiles and executable-cache reads and writes (`selected`): two pipelines in one process,
one with the cache off, do not change each other's behaviour. JAX keeps one cache switch per process,
so `selected` sets it for the duration and restores it after; while work with one choice runs (in any
thread: `prepare`'s background compiles), work with the other waits for it to end (a process-wide
count under a lock; work with the same choice runs alongside).

The cache lives in `$WAN_TPU_CACHE_DIR`, else `$XDG_CACHE_HOME/wan_tpu`, else `~/.cache/wan_tpu`, in a
folder per jax version, jaxlib version, backend and device kind (e.g.
`jax-0.11.2_jaxlib-0.11.2_gpu_NVIDIA-H200/`): JAX's own keys already hash the versions and devices,
but XLA's per-fusion GPU autotuning cache (a sub-folder, `xla_gpu_per_fusion_autotune_cache_dir/`) is
not validated by XLA, so results measured on another device kind or XLA version must never be found.
A cache written by another version or device is thus ignored (and left alone), never an error. A version
folder's autotuning sub-folder starts with the results the package ships for its name, where it ships some
(`wan_tpu.runtime.autotune_packs`: measured on that GPU, so a first run there tunes nothing they hold).

Every program is cached, however small or quick to compile (`jax_persistent_cache_min_compile_time_secs
= 0`, no entry-size floor): a cache hit costs a file read, and the tiny preset's programs, each
compiling in well under a second, add up to most of its run time. An entry that cannot be read (a
process killed while writing it, a full disk) is deleted and the program recompiled and rewritten;
JAX alone would warn on every run and never rewrite it.

A cache directory already set for JAX (`JAX_COMPILATION_CACHE_DIR` or `jax.config`) is used as is.
Caching never changes results: a program loaded from the cache is the one compiled from the same HLO
with the same options (tests compare latents bit for bit).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import warnings
from dataclasses import dataclass

import jax

_HIT = "/jax/compilation_cache/cache_hits"
_WRITE = "/jax/compilation_cache/cache_misses"  # JAX records it when it writes an entry
# Recorded (`jax.monitoring.record_event`) by `wan_tpu.runtime.executable_cache`, for whole programs it loads / stores.
PROGRAM_LOADED = "/wan_tpu/executable_cache/loaded"
PROGRAM_STORED = "/wan_tpu/executable_cache/stored"
_lock = threading.Lock()
_counts = {_HIT: 0, _WRITE: 0, PROGRAM_LOADED: 0, PROGRAM_STORED: 0}
_state = {"listening": False, "repairing": False, "used": None}  # used: the folder a selection last turned on
# `selected`: the choice that runs now (None: none), how many holders, and the process's state to restore.
_select = threading.Condition()
_selection = {"mode": None, "count": 0, "restore": None}
_SETTINGS = ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes",
             "jax_persistent_cache_enable_xla_caches")


def base_dir() -> str:
    """`$WAN_TPU_CACHE_DIR`, else `$XDG_CACHE_HOME/wan_tpu`, else `~/.cache/wan_tpu`."""
    if os.environ.get("WAN_TPU_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["WAN_TPU_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(xdg), "wan_tpu")


def version_key(device=None) -> str:
    """The folder name for this jax/jaxlib and device kind, e.g. `jax-0.10.2_jaxlib-0.10.2_cpu_cpu`."""
    import jaxlib

    device = device or jax.devices()[0]
    parts = (f"jax-{jax.__version__}", f"jaxlib-{jaxlib.__version__}", device.platform, device.device_kind)
    return "_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", p).strip("-") for p in parts)


def cache_dir() -> str | None:
    """The folder read and written now (a pipeline's selection while its work runs, else the process's
    default), None when the cache is off."""
    return jax.config.jax_compilation_cache_dir or None


def is_enabled() -> bool:
    return cache_dir() is not None


def enable(path: str | None = None) -> str:
    """Turn the cache on for this process (idempotent): the default of code outside any pipeline; returns
    its folder.

    `path` replaces `base_dir()` (the version folder is still added). Without `path`, a folder already
    in use is kept as is: the user's own JAX cache folder, or one an earlier `enable(path)` chose (a
    pipeline with the cache on uses it too: it does not move a script's cache). Call it before the first
    compilation you want cached: programs compiled earlier in the process are not written back. Waits
    for pipelines' work that runs in `selected` to end.
    """
    with _select:
        while _selection["count"]:
            _select.wait()
        return _enable(path)


def _enable(path: str | None = None) -> str:
    from jax.experimental.compilation_cache import compilation_cache as cc

    current = cache_dir()
    if path is None and current is not None:
        target = current
    else:
        target = _version_folder(os.path.abspath(os.path.expanduser(path or base_dir())))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # The per-fusion autotuning cache only: XLA's kernel cache ("all") clashes with JAX's cache (kernel
    # naming, jax-ml/jax#22899).
    jax.config.update("jax_persistent_cache_enable_xla_caches", "xla_gpu_per_fusion_autotune_cache_dir")
    if target != current:
        cc.set_cache_dir(target)
        cc.reset_cache()  # JAX decides once per process whether the cache is used; let it decide again
    _state["used"] = target
    _listen()
    _repair_unreadable_entries()
    return target


@functools.lru_cache(maxsize=16)
def _version_folder(base: str) -> str:
    """`base`'s folder for this process's versions and devices, made once (a pipeline's selection asks at
    every call)."""
    target = os.path.join(base, version_key())
    os.makedirs(target, exist_ok=True)
    from wan_tpu.runtime import autotune_packs

    try:  # the GPU autotuning results shipped for these versions and this device, if any
        autotune_packs.seed(target)
    except (OSError, ValueError) as e:  # an optimisation only: the compiles then tune as without it
        warnings.warn(f"the shipped autotuning results were not used ({e})", stacklevel=2)
    return target


def disable() -> None:
    """Turn the cache off for this process: code outside any pipeline reads and writes nothing from now on
    (a pipeline with the cache on still uses it for its own work). Waits as `enable` does."""
    with _select:
        while _selection["count"]:
            _select.wait()
        _set_dir(None)


def _set_dir(path: str | None) -> None:
    from jax.experimental.compilation_cache import compilation_cache as cc

    if cache_dir() != path:
        cc.set_cache_dir(path)
        cc.reset_cache()  # JAX decides once per process whether the cache is used; let it decide again


@contextlib.contextmanager
def selected(enabled: bool | None):
    """The cache on (in the folder `enable()` would use: the one in use, else `base_dir()`'s version
    folder) or off for the duration, then the process's state restored: what a pipeline runs its own work
    in (its loads, compiles and executable-cache reads and writes; `wan_tpu.runtime.executable_cache`
    follows `cache_dir()`). JAX has one switch per process: work with the other choice, in any thread,
    waits until every holder of this one has left (holders with the same choice share it; nesting is
    fine). Never wait inside it for work that needs the other choice. `None`: no choice, the state as it
    is (a pipeline built directly, not by `from_pretrained`, as code outside any pipeline)."""
    if enabled is None:
        yield
        return
    enabled = bool(enabled)
    with _select:
        while _selection["count"] and _selection["mode"] is not enabled:
            _select.wait()
        if not _selection["count"]:
            _selection["restore"] = _apply(enabled)
            _selection["mode"] = enabled
        _selection["count"] += 1
    try:
        yield
    finally:
        with _select:
            _selection["count"] -= 1
            if not _selection["count"]:
                _restore(_selection["restore"])
                _selection["mode"] = _selection["restore"] = None
                _select.notify_all()


def in_pipeline_choice(method):
    """A pipeline method decorator: the method runs in `selected(self.compile_cache)`, its pipeline's choice."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with selected(self.compile_cache):
            return method(self, *args, **kwargs)

    return run


def _apply(enabled: bool):
    """Switch to `enabled` → what `_restore` needs to switch back (None: nothing changed)."""
    current = cache_dir()
    if not enabled:
        if current is None:
            return None
        _set_dir(None)
        return current, None
    settings = {name: getattr(jax.config, name) for name in _SETTINGS}
    _state["used"] = _enable()
    return current, settings


def _restore(saved) -> None:
    if saved is None:
        return
    folder, settings = saved
    for name, value in (settings or {}).items():
        jax.config.update(name, value)
    _set_dir(folder)


@dataclass(frozen=True)
class CacheStats:
    hits: int  # programs loaded from the cache
    writes: int  # programs compiled and written to it
    programs_loaded: int = 0  # whole programs loaded by `wan_tpu.runtime.executable_cache` (nothing traced)
    programs_stored: int = 0  # and written by it

    def __str__(self) -> str:
        text = f"{self.hits} loaded, {self.writes} compiled and stored"
        if self.programs_loaded or self.programs_stored:
            text += f"; whole programs: {self.programs_loaded} loaded, {self.programs_stored} stored"
        return text


def stats() -> CacheStats:
    """Cache traffic of this process since the cache was first turned on (`enable`, `selected`)."""
    with _lock:
        return CacheStats(_counts[_HIT], _counts[_WRITE], _counts[PROGRAM_LOADED], _counts[PROGRAM_STORED])


def summary() -> str:
    """`stats()` and the folder (the one in use, else the one this process last used: a pipeline's with
    the cache on), or "off" if none was: the line the CLIs' timing tables print."""
    folder = cache_dir() or _state["used"]
    return f"{stats()}  ({folder})" if folder else "off"


def size_bytes(path: str | None = None) -> int:
    """Bytes on disk under `path` (default: the whole cache, every version folder)."""
    total = 0
    for root, _, files in os.walk(path or base_dir()):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # removed meanwhile by another process
                pass
    return total


_thread = threading.local()


def thread_hits() -> int:
    """Compiles this thread has had served by JAX's persistent cache (a compile runs in its caller's thread)."""
    return getattr(_thread, "hits", 0)


def _listen() -> None:
    if _state["listening"]:
        return

    def count(event: str, **_):
        if event in _counts:
            with _lock:
                _counts[event] += 1
        if event == _HIT:
            _thread.hits = getattr(_thread, "hits", 0) + 1

    jax.monitoring.register_event_listener(count)
    _state["listening"] = True


def _repair_unreadable_entries() -> None:
    """An entry that fails to load is deleted, so the fresh compile is written in its place.

    JAX itself (0.10/0.11) warns on every run and never rewrites: its writer skips existing keys. This
    wraps JAX's reader; if the internals it needs are missing (another JAX version), JAX's own
    behaviour stays: a warning and a recompile.
    """
    if _state["repairing"]:
        return
    try:
        from jax._src import compilation_cache as jcc
        from jax._src import lru_cache
    except ImportError:
        return
    read = getattr(jcc, "get_executable_and_time", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if read is None or suffix is None:
        return

    def get_executable_and_time(cache_key, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any unreadable entry is a cache miss
            folder = getattr(getattr(jcc, "_cache", None), "path", None)
            if folder is None:
                raise
            try:
                os.remove(os.path.join(os.fspath(folder), f"{cache_key}{suffix}"))
            except OSError:
                pass
            warnings.warn(f"compile cache: dropped an unreadable entry ({type(e).__name__}); it is recompiled",
                          stacklevel=2)
            return None, None

    jcc.get_executable_and_time = get_executable_and_time
    _state["repairing"] = True
