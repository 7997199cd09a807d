"""Clocks and power while each kernel runs back to back on one NVIDIA GPU, beside its speed.

    python benchmarks/bench_power.py                    # matmul, our attention and its ceilings, cuDNN, FP8 (~2 min)
    python benchmarks/bench_power.py --shapes self480 --seconds 2
    python benchmarks/bench_power.py --only FP8 --seconds 2   # the 8-bit kernel and its ceilings (and the matmul)

H100 and H200 cards run under a 700 W limit, and under load they reach it: the SM clock then falls
from 1980 MHz to whatever keeps the power there, so a kernel's speed is its work per clock times
the clock its energy allows. This script shows both. Each entry is compiled, run twice, left idle
for 2 s (clocks back at their maximum), timed once ("first call"), then run back to back for
`--seconds` while `nvidia-smi` samples every 50 ms: the SM clock's median and minimum, the power's
median, the temperature and the throttle reasons (`clocks_event_reasons.active`: 0x4 = the software
power cap, 0x0 = none). "per clock" = TFLOP/s ÷ (median clock × the chip's dense bf16 rate per
clock: 132 SMs × 4,096 FLOP; FP8 counts twice that).

Entries (bf16, B=1, D=128; shapes as `bench_attention.py`'s self480 / self720): the bf16 16,384³
matmul; `attention(impl="pallas_gpu")` (the tuned kernel); the same tiles without `half_p`; the
kernel's ceilings (`mgpu_attention(ceiling=...)`, wrong results on purpose): no exp2, and no
softmax at all (scores straight into P·V); jax cuDNN; `attention(impl="pallas_gpu_fp8")` and the
8-bit kernel's same two ceilings (`mgpu_attention_fp8(ceiling=...)`, `tuning.GPU_FP8_BLOCKS`' tiles).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from wan_tpu.layers.attention import attention  # noqa: E402
from wan_tpu.runtime.profiling import GpuMonitor  # noqa: E402

SHAPES = {"self480": (12, 32760), "self720": (40, 75600)}
FLOPS_PER_CLOCK = 132 * 4096  # H100 / H200 SXM dense bf16, per clock


def run_entry(fn, args, seconds):
    """(steady seconds per call, first call's seconds after 2 s idle, steady window's wall-clock span)."""
    f = jax.jit(fn)
    harness.measure(lambda: f(*args), jax.block_until_ready, warmup=2, iters=0)
    time.sleep(2.0)
    first = harness.timed(lambda: jax.block_until_ready(f(*args)))[1]
    t0, n, start = time.time(), 0, time.perf_counter()
    while time.time() - t0 < seconds:
        out = f(*args)
        n += 1
        if n % 4 == 0:  # keep the queue short, so that the window is the work
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n, first, (t0 + min(1.0, seconds / 4), time.time())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="self480,self720", help=f"comma separated, from {list(SHAPES)}")
    parser.add_argument("--seconds", type=float, default=4.0, help="back-to-back run per entry")
    parser.add_argument("--only", default="", help="run only the entries whose name holds this text (e.g. FP8)")
    args = parser.parse_args()
    harness.print_env(jax.devices())
    if jax.default_backend() != "gpu" or not shutil.which("nvidia-smi"):
        sys.exit("bench_power.py needs an NVIDIA GPU and nvidia-smi; run it on the device")
    from wan_tpu.kernels.flash_mgpu import mgpu_attention, mgpu_attention_fp8
    from wan_tpu.kernels.tuning import GPU_BLOCKS, GPU_FP8_BLOCKS

    tuned = GPU_BLOCKS["self"]
    tiles = {k: v for k, v in tuned.items() if k not in ("half_p", "stale_max")}
    results = []
    with GpuMonitor() as monitor:
        a = jax.random.normal(jax.random.PRNGKey(0), (16384, 16384), jnp.bfloat16)
        results.append(("matmul 16384³", 2 * 16384**3, 1, *run_entry(lambda x, y: x @ y, (a, a), args.seconds)))
        del a
        for shape in filter(None, args.shapes.split(",")):
            heads, s = SHAPES[shape]
            qkv = tuple(jax.random.normal(jax.random.PRNGKey(i), (1, s, heads, 128), jnp.bfloat16) for i in range(3))
            flops = 4 * s * s * 128 * heads
            entries = {
                "ours (pallas_gpu, tuned)": functools.partial(attention, impl="pallas_gpu"),
                "ours without stale_max": functools.partial(mgpu_attention, **tiles, half_p=tuned.get("half_p", False)),
                "ours without half_p": functools.partial(mgpu_attention, **tiles),
                "ceiling: no exp2": functools.partial(mgpu_attention, **tiles, ceiling="no_exp2"),
                "ceiling: no softmax": functools.partial(mgpu_attention, **tiles, ceiling="no_softmax"),
                "jax cuDNN": functools.partial(attention, impl="cudnn"),
                "ours FP8 (pallas_gpu_fp8)": functools.partial(attention, impl="pallas_gpu_fp8"),
                "ours FP8 without pv_row_sums": functools.partial(mgpu_attention_fp8, **{**GPU_FP8_BLOCKS, "pv_row_sums": False}),
                "FP8 ceiling: no exp2": functools.partial(mgpu_attention_fp8, **GPU_FP8_BLOCKS, ceiling="no_exp2"),
                "FP8 ceiling: no softmax": functools.partial(mgpu_attention_fp8, **GPU_FP8_BLOCKS, ceiling="no_softmax"),
            }
            entries = {k: v for k, v in entries.items() if args.only in k}
            for name, fn in entries.items():
                print(f"{shape}: {name}", flush=True)
                results.append((f"{shape} {name}", flops, 2 if "FP8" in name else 1, *run_entry(fn, qkv, args.seconds)))
            del qkv
    samples = monitor.samples()
    print(f"\n{len(samples)} nvidia-smi samples")
    print(harness.header("entry", "TFLOP/s", "first call after 2 s idle", "SM MHz median (min)", "per clock", "W median", "°C",
                         "throttle"))
    for name, flops, rate, per_call, first, (t0, t1) in results:
        window = monitor.window(t0, t1)
        tflops = flops / per_call / 1e12
        if not window:
            print(harness.row(name, f"{tflops:.1f}", f"{flops / first / 1e12:.1f}", "no samples", "", "", "", ""))
            continue
        clock = statistics.median(r[1] for r in window)
        reasons = ",".join(sorted({r[4][-2:] for r in window}))
        print(harness.row(name, f"{tflops:.1f}", f"{flops / first / 1e12:.1f}", f"{clock:.0f} ({min(r[1] for r in window):.0f})",
                          f"{tflops * 1e12 / (clock * 1e6 * FLOPS_PER_CLOCK * rate):.1%}",
                          f"{statistics.median(r[2] for r in window):.0f}", f"{window[-1][3]:.0f}", f"0x{reasons}"))


if __name__ == "__main__":
    main()
