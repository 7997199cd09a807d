"""XLA flags a command line sets for its own process, before JAX starts its backends.

    from wan_tpu.xla_defaults import apply_xla_defaults
    apply_xla_defaults()   # first thing in a notebook or script, before any JAX array exists

`--xla_gpu_enable_triton_gemm=false`: XLA's GPU compiler otherwise autotunes Triton tilings for every
matrix product against cuBLAS. For Wan's DiT cuBLAS wins anyway, so the search buys nothing and
costs compile time; the FP8 linears' search alone took 56 s of a cold 1.3B run. Measured on one H200
(jax 0.11.2, `scripts/bench_dit.py --configs 1.3b --variants fused,fp8`, 2026-11-26): bf16 forward
477.5 → 466.8 ms, FP8 456.1 → 450.5 ms, FP8 compile 56 → 4 s. It names GPU options only: CPU and TPU
runs parse it and do not change. A flag the user already put in `XLA_FLAGS` is left as they set it,
and a caller from Python keeps its environment unless it calls this (after the backends started, the
flags would have no effect).
"""

from __future__ import annotations

import os

XLA_DEFAULTS = {"xla_gpu_enable_triton_gemm": "false"}


def apply_xla_defaults() -> list[str]:
    """Append each of `XLA_DEFAULTS` to `XLA_FLAGS` unless the user named that flag; returns those added."""
    flags = os.environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in XLA_DEFAULTS.items() if f"--{name}" not in flags]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added
