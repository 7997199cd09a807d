"""XLA flags a command line sets for its own process, before JAX starts its backends.

    from wan_tpu.runtime.xla_defaults import apply_xla_defaults
    apply_xla_defaults()   # first thing in a notebook or script, before any JAX array exists

`--xla_gpu_enable_triton_gemm=false`: XLA's GPU compiler otherwise autotunes Triton tilings for every
matrix product against cuBLAS, and keeps Triton where it looked faster in isolation. In our models
that search costs compile time and the whole programs come out slower. Measured on one H200 (jax
0.11.2, 2026-11-26, docs/PERFORMANCE.md): the 1.3B DiT forward 477.5 → 466.8 ms, FP8 456.1 → 450.5 ms
and the FP8 compile 56 → 4 s (`benchmarks/bench_dit.py`); UnifoLM-WMA 0.084 → 0.061 s/step, its first
sampling 68.2 → 42.2 s (`benchmarks/bench_unifolm.py`); the 14B DiT and Matrix-Game-2 unchanged. It names
GPU options only: CPU and TPU runs parse it and do not change. A flag the user already put in
`XLA_FLAGS` is left as they set it, and a caller from Python keeps its environment unless it calls
this (after the backends started, the flags would have no effect).
"""

from __future__ import annotations

import os

XLA_DEFAULTS = {"xla_gpu_enable_triton_gemm": "false"}


def apply_xla_defaults() -> list[str]:
    """Append each of `XLA_DEFAULTS` to `XLA_FLAGS` unless the user named that flag; returns those added."""
    flags = os.environ.get("XLA_FLAGS", "")
    named = {flag.lstrip("-").split("=")[0] for flag in flags.split()}
    added = [f"--{name}={value}" for name, value in XLA_DEFAULTS.items() if name not in named]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added
