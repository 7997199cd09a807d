"""The DiT step's memory estimate (`wan_tpu.wan.memory.dit_step_bytes`) against XLA's own buffer assignment
on this device: one CFG forward (batch 2, 512 text tokens) compiled for real sizes, nothing allocated.

    python benchmarks/bench_memory.py --configs 1.3b,14b            # on the GPU/TPU whose runs the check guards
    python benchmarks/bench_memory.py --configs tiny                 # smoke run (CPU)

For each config and attention kernel (default: what `impl=None` picks here) it prints XLA's temporary
buffers (`compiled.memory_analysis().temp_size_in_bytes`: the activations) beside the estimate and
their ratio; weights (arguments) are listed too. The estimate should be at or a little above XLA's
figure: below it, `generate` could start a run that then fails to allocate; far above, it refuses
runs that fit. bf16 as `generate` runs by default.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from wan_tpu.configs.models import VARIANTS  # noqa: E402
from wan_tpu.wan import memory  # noqa: E402
from wan_tpu.wan.transformer import (  # noqa: E402
    WanTransformer,
    forward,
    set_attention,  # noqa: E402
)

CONFIGS = {  # name: (variant, latent (F, H, W))
    "1.3b": ("wan2.1-t2v-1.3b", (21, 60, 104)),
    "14b": ("wan2.1-t2v-14b", (21, 90, 160)),
    "5b": ("wan2.2-ti2v-5b", (31, 44, 80)),
    "tiny": ("tiny", (3, 8, 8)),
}
GiB = 2**30


def measure(name: str, impl: str | None, dtype) -> dict:
    variant, (f, h, w) = CONFIGS[name]
    cfg = VARIANTS[variant].transformer
    dit = set_attention(nnx.eval_shape(lambda: WanTransformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))), impl, None)
    graphdef, state = nnx.split(dit)
    x = jax.ShapeDtypeStruct((2, cfg.in_channels, f, h, w), dtype)
    t = jax.ShapeDtypeStruct((2,), jnp.float32)
    context = jax.ShapeDtypeStruct((2, 512, cfg.text_dim), dtype)
    analysis = jax.jit(functools.partial(forward, graphdef)).lower(state, x, t, context).compile().memory_analysis()
    tokens = (f // cfg.patch_size[0]) * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2])
    platform = jax.devices()[0].platform
    chosen = memory.attention_impl(impl, platform, cfg, tokens, dtype)
    estimate = memory.dit_step_bytes(cfg, tokens, 2, chosen, memory.Layout(platform=platform))
    return {"config": name, "impl": chosen, "tokens": tokens, "temp": analysis.temp_size_in_bytes,
            "weights": analysis.argument_size_in_bytes, "estimate": estimate}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1.3b,14b", help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--attention", default=None, help="kernel(s), comma-separated (default: the backend's choice)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args(argv)
    harness.print_env(jax.devices())
    print(f"{args.dtype}, CFG batch 2, 512 text tokens")
    print(harness.header("config", "tokens", "attention", "XLA temporaries GiB", "estimate GiB", "estimate ÷ XLA",
                         "weights GiB"))
    for name in args.configs.split(","):
        for impl in (args.attention or "").split(",") if args.attention else [None]:
            r = measure(name, impl, jnp.dtype(args.dtype))
            print(harness.row(r["config"], f"{r['tokens']:,}", r["impl"], f"{r['temp'] / GiB:.2f}", f"{r['estimate'] / GiB:.2f}",
                              f"{r['estimate'] / max(r['temp'], 1):.2f}", f"{r['weights'] / GiB:.2f}"), flush=True)


if __name__ == "__main__":
    main()
