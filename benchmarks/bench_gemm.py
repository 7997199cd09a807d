"""One matrix product in bf16, FP8 (e4m3 × e4m3 → bf16) and int8 (int8 × int8 → int32) on one GPU, as XLA
compiles them: TFLOP/s (TOPS for int8) and the library call each became.

    python benchmarks/bench_gemm.py                       # the Wan DiT's FFN shapes at 480p and 720p, and 8192³
    python benchmarks/bench_gemm.py --shapes 64x64x64     # a CPU dry run of the script itself

What `--quantize fp8` and `--quantize int8` hand to cuBLASLt (`wan_tpu.layers.quantized`), without the
scaling around the product. The operands are all ones (as in the H200 figures of docs/PERFORMANCE.md);
with random data the tensor cores draw more power and may clock lower. Median of 5 batches of 20 calls.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from wan_tpu.runtime.xla_defaults import apply_xla_defaults

apply_xla_defaults()  # as the command lines compile: XLA's Triton GEMM search off

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# M×K×N: the 1.3B FFN in and out at 480p (32,768 tokens), a square product, the 14B FFN in at 720p
SHAPES = "32768x1536x8960,32768x8960x1536,8192x8192x8192,32768x5120x13824"
FORMATS = {"bf16": (jnp.bfloat16, jnp.bfloat16), "fp8": (jnp.float8_e4m3fn, jnp.bfloat16), "int8": (jnp.int8, jnp.int32)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN")
    args = p.parse_args()
    harness.print_env(jax.devices())
    print(harness.header("M×K×N", "format", "TFLOP/s", "library call"))
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        for name, (dtype, acc) in FORMATS.items():
            a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
            product = jax.jit(lambda a, b, acc=acc: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                                        preferred_element_type=acc))
            hlo = product.lower(a, b).compile().as_text()
            calls = [line.split('custom_call_target="')[1].split('"')[0] for line in hlo.splitlines()
                     if "custom_call_target" in line] or ["XLA's own emitter"]
            seconds = harness.measure(functools.partial(product, a, b), jax.block_until_ready, iters=5, batch=20).median
            rate = 2 * m * k * n / seconds / 1e12
            print(harness.row(f"{m}×{k}×{n}", name, f"{rate:.0f}", ", ".join(calls)), flush=True)


if __name__ == "__main__":
    main()
