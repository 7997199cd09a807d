"""The persistent compilation cache: compiled programs and GPU autotuning results kept on disk, on by default.

    import wan_tpu.runtime.compile_cache as compile_cache
    compile_cache.enable()        # what WanPipeline.from_pretrained(..., compile_cache=True) does
    compile_cache.disable()       # what `generate --no-compile-cache` / compile_cache=False do
    compile_cache.cache_dir()     # where this process reads and writes: see below
    compile_cache.stats()         # programs loaded from / written to the cache so far in this process
    compile_cache.summary()       # the same with the folder, or "off": the CLIs' timing-table line

The cache lives in `$WAN_TPU_CACHE_DIR`, else `$XDG_CACHE_HOME/wan_tpu`, else `~/.cache/wan_tpu`, in a
folder per jax version, jaxlib version, backend and device kind (e.g.
`jax-0.11.2_jaxlib-0.11.2_gpu_NVIDIA-H200/`): JAX's own keys already hash the versions and devices,
but XLA's per-fusion GPU autotuning cache (a sub-folder, `xla_gpu_per_fusion_autotune_cache_dir/`) is
not validated by XLA, so results measured on another device kind or XLA version must never be found.
A cache written by another version or device is thus ignored (and left alone), never an error.

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
_state = {"listening": False, "repairing": False}


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
    """The folder this process reads and writes, None when the cache is off."""
    return jax.config.jax_compilation_cache_dir or None


def is_enabled() -> bool:
    return cache_dir() is not None


def enable(path: str | None = None) -> str:
    """Turn the cache on for this process (idempotent); returns its folder.

    `path` replaces `base_dir()` (the version folder is still added). Without `path`, a folder already
    in use is kept as is: the user's own JAX cache folder, or one an earlier `enable(path)` chose (a
    pipeline's `from_pretrained` does not move a script's cache). Call it before the first compilation
    you want cached: programs compiled earlier in the process are not written back.
    """
    from jax.experimental.compilation_cache import compilation_cache as cc

    current = cache_dir()
    if path is None and current is not None:
        target = current
    else:
        target = os.path.join(os.path.abspath(os.path.expanduser(path or base_dir())), version_key())
        os.makedirs(target, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # The per-fusion autotuning cache only: XLA's kernel cache ("all") clashes with JAX's cache (kernel
    # naming, jax-ml/jax#22899).
    jax.config.update("jax_persistent_cache_enable_xla_caches", "xla_gpu_per_fusion_autotune_cache_dir")
    if target != current:
        cc.set_cache_dir(target)
        cc.reset_cache()  # JAX decides once per process whether the cache is used; let it decide again
    _listen()
    _repair_unreadable_entries()
    return target


def disable() -> None:
    """Turn the cache off for this process: nothing is read or written from now on."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    if cache_dir() is not None:
        cc.set_cache_dir(None)
        cc.reset_cache()


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
    """Cache traffic of this process since the first `enable()`."""
    with _lock:
        return CacheStats(_counts[_HIT], _counts[_WRITE], _counts[PROGRAM_LOADED], _counts[PROGRAM_STORED])


def summary() -> str:
    """`stats()` and the folder, or "off": the line the CLIs' timing tables print."""
    return f"{stats()}  ({cache_dir()})" if is_enabled() else "off"


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
