"""XLA flags (and JAX settings) a command line sets for its own process, before JAX starts its backends.

    from wan_tpu.runtime.xla_defaults import apply_jax_defaults, apply_xla_defaults
    apply_xla_defaults()   # first thing in a notebook or script, before any JAX array exists
    apply_jax_defaults()   # before the first program is traced

`--xla_gpu_enable_triton_gemm=false`: XLA's GPU compiler otherwise autotunes Triton tilings for every
matrix product against cuBLAS, and keeps Triton where it looked faster in isolation. In our models
that search costs compile time and the whole programs come out slower. Measured on one H200 (jax
0.11.2, 2026-11-26, docs/PERFORMANCE.md): the 1.3B DiT forward 477.5 → 466.8 ms, FP8 456.1 → 450.5 ms
and the FP8 compile 56 → 4 s (`benchmarks/bench_dit.py`); UnifoLM-WMA 0.084 → 0.061 s/step, its first
sampling 68.2 → 42.2 s (`benchmarks/bench_unifolm.py`); the 14B DiT and Matrix-Game-2 unchanged. It names
GPU options only: CPU and TPU runs parse it and do not change.

`--xla_backend_optimization_level=1`, in a process without an accelerator only (`accelerator_present`):
on a CPU, LLVM's optimisation of the generated code is most of a program's compile, and XLA's default
(level 3) buys these programs nothing. Measured on a 2-core CPU (2026-11-29, same hour, median of 3,
`XLA_FLAGS=--xla_backend_optimization_level=N python benchmarks/profile_compile.py unifolm|matrix-game|wan
--runs 3`), cold at levels 3 / 2 / 1: Matrix-Game-2 tiny 18.0 / 11.1 / 10.9 s, UnifoLM-WMA tiny
`--mode decision` 23.8 / 23.6 / 20.5 s (its sampling program's compile 12.1 → 8.4 s, the sampling 1.08 →
1.09 s), Wan tiny 8.0 / - / 7.0 s; warm runs unchanged. Level 0 halves the compile again but runs the
sampling 2.3× slower. On a GPU the flag sets the level of the kernels' own LLVM pass: on an H200 the
backend's seconds moved within run-to-run noise (UnifoLM's sampling 9.1 → 8.0 s, Matrix-Game-2's decode
1.7 → 2.1 s), so a GPU or TPU process keeps XLA's default.

A flag the user already put in `XLA_FLAGS` is left as they set it, and a caller from Python keeps its
environment unless it calls this (after the backends started, the flags would have no effect).
"""

from __future__ import annotations

import glob
import os
import shutil

XLA_DEFAULTS = {"xla_gpu_enable_triton_gemm": "false"}
CPU_XLA_DEFAULTS = {"xla_backend_optimization_level": "1"}  # a process without an accelerator


# XLA options (`jax.jit(..., compiler_options=PER_RUN)`) of a program a stream calls once (Matrix-Game-2's condition
# encodes, the DiT cache's first pass): XLA's fusion autotuner times each fusion's candidate emitters on the device,
# seconds of a cold start that a single call never repays. The autotuning of convolutions and matrix products stays
# (their untuned algorithms run for minutes). Matrix-Game-2 universal on an H200, cold, in turns (2026-11-29,
# `benchmarks/profile_compile.py matrix-game --device`): XLA compile 38.1-38.4 vs 41.0-54.8 s in all, first chunk
# 16.00-17.25 vs 18.42-21.47 s (with the decode's caches from one frame's trace); warm 3.38-3.96 vs 3.55-3.99 s. An
# option of XLA's GPU compiler, which a CPU compile ignores. Set on the jitted function itself, so that a call compiles
# the very program `prepare` compiles ahead (bit-identical results with and without it); only a top-level jit may
# take it, not one nested in another program.
PER_RUN = {"xla_gpu_experimental_enable_fusion_autotuner": False}


def _without_passes(*names: str) -> dict:
    """XLA options that turn off the HLO passes `names` besides those the user's `XLA_FLAGS` turn off (a program's
    option replaces the flag's list, which would otherwise come back on for it)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    users = [flag.split("=", 1)[1] for flag in flags if flag.lstrip("-").startswith("xla_disable_hlo_passes=")]
    passes = [p for value in users for p in value.split(",") if p] + list(names)
    return {"xla_disable_hlo_passes": ",".join(dict.fromkeys(passes))}


# XLA options of Matrix-Game-2's programs: no Triton softmax rewriter, which turns normalisations and softmaxes into
# Triton fusions whose tiling and emitting were most of their compiles, for no faster a chunk. Matrix-Game-2 universal
# on an H200 (jax 0.11.2, with the shipped tuning, cold, in turns, 2026-11-29, `benchmarks/profile_compile.py
# matrix-game --device`): first chunk 13.82 / 14.35 vs 17.12 / 17.42 s; the decode's compile 4.6 vs 9.2 s, the
# first frame's encode 0.9 vs 2.9 s, XLA compile 18.1 vs 26.9 s in all; each later chunk 0.28-0.29 s either way.
# UnifoLM-WMA's one-program sampling, the same day, ran 2.64 s without it against 2.23 s with it, so it keeps it; its
# step as pieces does not (`wan_tpu.unifolm.sampling.PIECES`). A CPU or TPU compile has no such pass and ignores the
# option.
NO_SOFTMAX_REWRITER = _without_passes("triton-softmax-rewriter")


def _platforms() -> list[str]:
    return [p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]


def accelerator_present() -> bool:
    """Whether JAX will find a GPU or TPU here, decided without starting JAX's backends (XLA reads its flags
    when the first one starts): `JAX_PLATFORMS` when set, else an NVIDIA or AMD driver or a TPU's device
    files on the machine."""
    if _platforms():
        return any(p != "cpu" for p in _platforms())
    return bool(nvidia_gpu_allowed() and (shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl"))
                or os.path.exists("/dev/kfd") or glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def nvidia_gpu_allowed() -> bool:
    """Whether `JAX_PLATFORMS` (when set) lets JAX use an NVIDIA GPU; asked without starting JAX."""
    return not _platforms() or any(name in p for p in _platforms() for name in ("cuda", "gpu"))


def nvidia_gpu_present() -> bool:
    """Whether JAX may run on an NVIDIA GPU here: allowed, and the driver's device file is on the machine."""
    return nvidia_gpu_allowed() and os.path.exists("/dev/nvidiactl")


# JAX settings a command line sets for its own process. `jax_traceback_in_locations_limit` 1: each operation of a
# lowered program carries its own source line and its named scopes (`jax.named_scope`, what a profile shows), not
# the Python traceback that made it (up to 100 frames). XLA keeps those frames in every executable and, each time
# one is loaded, formats them into the profiler annotations of each kernel (`ModuleAnnotations`): two thirds of the
# time a warm Matrix-Game-2 start spent deserialising its programs (`py-spy --native`, an H200, jax 0.11.2).
# Without the tracebacks, warm, in turns, one call (`benchmarks/profile_compile.py matrix-game --device`): its
# decode program loaded in 0.63-0.72 s instead of 1.34-1.42 s, all its programs in 1.56-1.61 s of prefetch threads
# instead of 2.53-2.68 s; with one frame (this setting; another call) 0.80 s. No frames at all
# (`jax_include_full_tracebacks_in_locations` off) would also drop the named scopes from the operations' names.
# Locations are debug information only: the results are the same.
JAX_DEFAULTS = {"jax_traceback_in_locations_limit": 1}


def apply_jax_defaults() -> list[str]:
    """Set each of `JAX_DEFAULTS` unless the user's environment names it (the name in capitals, which JAX
    reads itself); returns those set. From Python: call it before the first program is traced."""
    import jax

    added = [name for name in JAX_DEFAULTS if name.upper() not in os.environ]
    for name in added:
        jax.config.update(name, JAX_DEFAULTS[name])
    return added


def apply_xla_defaults() -> list[str]:
    """Append each of `XLA_DEFAULTS` (and `CPU_XLA_DEFAULTS` without an accelerator) to `XLA_FLAGS` unless the
    user named that flag; returns those added."""
    flags = os.environ.get("XLA_FLAGS", "")
    named = {flag.lstrip("-").split("=")[0] for flag in flags.split()}
    defaults = XLA_DEFAULTS if accelerator_present() else {**XLA_DEFAULTS, **CPU_XLA_DEFAULTS}
    added = [f"--{name}={value}" for name, value in defaults.items() if name not in named]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added
