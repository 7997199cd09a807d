"""DiT step-time scaling over 1, 2 and 4 GPUs of one host, for the (dp, sp, tp) mesh shapes that fit.

    python benchmarks/bench_scaling.py [--models 14b,1.3b] [--gpus 1,2,4] [--attention cudnn] [--iters 2] [--budget 420]

One denoise step's transformer work with classifier-free guidance: the DiT on the (cond, uncond)
pair, batch 2, bf16, random weights, 512 text tokens; 14b at latent 21×90×160 (720×1280, 81
frames, 75,600 tokens), 1.3b at 21×60×104 (480×832, 81 frames, 32,760 tokens). The 1-GPU baseline
is the plain DiT (no mesh); n GPUs are the first n devices under `wan_tpu.make_mesh` +
`wan_tpu.parallel.sharding.shard_transformer` (weights FSDP-sharded, CFG pair on dp, context-parallel
attention on sp, heads on tp). Each row: median ms of `--iters` after one warm-up (the warm-up
includes compilation, reported separately), speedup t1/tn, efficiency t1/(n·tn) against linear,
and the memory the busiest GPU holds after the step (weights + inputs + output: the FSDP saving). Rows print as they
finish, then a table; configs that no
longer fit in `--budget` seconds are reported as skipped. Runs on CPU too with `--models tiny`
(XLA_FLAGS=--xla_force_host_platform_device_count=4 gives it 4 devices).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# ours as a command line runs it (wan_tpu.runtime.xla_defaults); a flag set in XLA_FLAGS wins
from wan_tpu.runtime.xla_defaults import apply_xla_defaults  # noqa: E402

apply_xla_defaults()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import wan_tpu  # noqa: E402
from wan_tpu.configs.models import VARIANTS  # noqa: E402
from wan_tpu.parallel.sharding import shard_transformer  # noqa: E402
from wan_tpu.wan.transformer import WanTransformer, forward  # noqa: E402

MODELS = {  # name: (variant, latent (F, H, W))
    "14b": ("wan2.1-t2v-14b", (21, 90, 160)),
    "1.3b": ("wan2.1-t2v-1.3b", (21, 60, 104)),
    "tiny": ("tiny", (3, 16, 16)),
}
# Mesh shapes (dp, sp, tp) per GPU count, most interesting first (the budget may cut the tail).
SHAPES = {
    1: [(1, 1, 1)],
    2: [(2, 1, 1), (1, 2, 1)],
    4: [(2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)],
}
TEXT_LEN = 512
BATCH = 2  # the CFG pair


def random_dit(cfg, mesh, attention):
    """A DiT with random bf16 weights made on the devices, already in their mesh layout."""
    dit = nnx.eval_shape(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention_impl=attention))
    if mesh is not None:
        shard_transformer(dit, mesh)
    graphdef, abstract = nnx.split(dit)
    leaves, treedef = jax.tree.flatten(abstract)
    shardings = [getattr(leaf, "sharding", None) for leaf in leaves]

    def make(key):
        keys = jax.random.split(key, len(leaves))
        # Drawn in the parameter's own dtype (no float32 copy of 14B weights); small values keep
        # every activation finite through 40 layers (timing does not depend on them).
        return [jax.random.normal(k, leaf.shape, leaf.dtype) * jnp.asarray(0.02, leaf.dtype) for k, leaf in zip(keys, leaves)]

    values = jax.jit(make, out_shardings=shardings if mesh is not None else None)(jax.random.key(0))
    return graphdef, jax.tree.unflatten(treedef, values)


def inputs(cfg, latent, mesh):
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (BATCH, cfg.in_channels, *latent), jnp.bfloat16)
    c = jax.random.normal(keys[1], (BATCH, TEXT_LEN, cfg.text_dim), jnp.bfloat16)
    t = jnp.array([900.0, 900.0], jnp.float32)
    if mesh is not None:
        x, t, c = (jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in (x, t, c))
    return x, t, c


def resident_gib(devices) -> float:
    """GiB held by the busiest device now (weights + inputs + output). The allocator's peak counter
    cannot be reset between configs, so it would only ever show the 1-GPU baseline's peak."""
    stats = [d.memory_stats() or {} for d in devices]
    return max(s.get("bytes_in_use", 0) for s in stats) / 2**30


def time_step(cfg, latent, shape, n, args):
    """(median ms, warm-up s, resident GiB) of one CFG step on the first n devices with mesh `shape`."""
    devices = jax.devices()[:n]
    mesh = None if n == 1 else wan_tpu.make_mesh(*shape, devices=devices)
    graphdef, state = random_dit(cfg, mesh, args.attention)
    x, t, c = inputs(cfg, latent, mesh)
    step = jax.jit(forward, static_argnums=0)
    timing = harness.measure(functools.partial(step, graphdef, state, x, t, c), jax.block_until_ready, iters=args.iters)
    resident = resident_gib(devices)  # the last step's output still held
    ms, warmup = timing.ms, timing.first
    del state, x, t, c, step, timing
    gc.collect()
    return ms, warmup, resident


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="14b,1.3b")
    p.add_argument("--gpus", default="1,2,4", help="device counts to measure (subsets of the visible devices)")
    p.add_argument("--attention", default="cudnn", help="wan_tpu.attention impl (None = library default)")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--budget", type=float, default=420.0, help="seconds; configs that would overrun are skipped")
    args = p.parse_args()
    args.attention = None if args.attention == "None" else args.attention
    counts = [int(g) for g in args.gpus.split(",") if int(g) <= jax.device_count()]
    began = time.perf_counter()
    harness.print_env(jax.devices())
    print(f"attention {args.attention}; NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}", flush=True)

    # Order: every model's baseline, then every model's widest CFG-on-dp mesh, then the other
    # shapes, interleaving models, so that a budget cut drops the least telling rows.
    combos = [(n, s) for n in counts for s in SHAPES.get(n, [])]
    head = [combos[0]] + [c for c in combos if c[0] == max(counts)][:1]
    ordered = head + [c for c in combos if c not in head]
    plan = [(name, n, s) for n, s in ordered for name in args.models.split(",")]

    rows, baseline, warm = [], {}, {}
    for name, n, shape in plan:
        variant, latent = MODELS[name]
        cfg = VARIANTS[variant].transformer
        # A step on n devices takes about t1/n; the warm-up adds a compile like the last one seen.
        expected = (baseline.get(name, 0) / 1e3 / n) * (args.iters + 1) + warm.get(name, 60.0)
        if time.perf_counter() - began + expected > args.budget:
            row = (name, latent, n, shape, None, None, None, "skipped (budget)")
        else:
            try:
                ms, warmup, resident = time_step(cfg, latent, shape, n, args)
            except Exception as e:  # noqa: BLE001  (one failing shape, e.g. out of memory, must not hide the others)
                row = (name, latent, n, shape, None, None, None, f"failed: {type(e).__name__}: {str(e)[:120]}")
            else:
                if n == 1:
                    baseline[name] = ms
                warm[name] = max(warmup - ms / 1e3, 1.0)
                row = (name, latent, n, shape, ms, warmup, resident, "")
        rows.append(row)
        print(f"{name} n={n} mesh={shape}: {row[4:]}", flush=True)

    print()
    print(harness.header("model", "latent F×H×W", "GPUs", "mesh dp×sp×tp", "ms/step (CFG batch 2)", "speedup",
                         "efficiency t1/(n·tn)", "warm-up s", "resident GiB/GPU", "note"))
    for name, latent, n, shape, ms, warmup, resident, note in rows:
        lat = "×".join(map(str, latent))
        mesh = "plain (no mesh)" if n == 1 else "×".join(map(str, shape))
        if ms is None:
            print(harness.row(name, lat, n, mesh, "", "", "", "", "", note))
            continue
        t1 = baseline.get(name)
        speedup, efficiency = ("", "") if t1 is None else (f"{t1 / ms:.2f}", f"{t1 / (n * ms):.1%}")
        print(harness.row(name, lat, n, mesh, f"{ms:.0f}", speedup, efficiency, f"{warmup:.0f}", f"{resident:.1f}", note))


if __name__ == "__main__":
    main()
