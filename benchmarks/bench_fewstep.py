"""Few-step sampling with a merged LoRA, and step caches: wan_tpu beside diffusers in the same call.

    # 14B, 720p, 81 frames, 4 Euler steps (sigmas 1, .75, .5, .25, shift 5), guidance 1, a random rank-64
    # LoRA in the kohya format merged into the DiT; diffusers: the same file via load_lora_weights + fuse_lora
    python benchmarks/bench_fewstep.py lora --config 14b --workdir outputs/bench_e2e
    # 1.3B, 480p, 81 frames, 50 UniPC steps with CFG: no cache and each cache at its default threshold;
    # diffusers: no cache, FirstBlockCacheConfig(), MagCacheConfig(mag_ratios=Wan 2.1 1.3B's) via enable_cache
    python benchmarks/bench_fewstep.py cache --config 1.3b --workdir outputs/bench_e2e
    # smoke runs on CPU
    python benchmarks/bench_fewstep.py lora --config tiny --size 32*32 --frames 5 --lora-rank 4
    python benchmarks/bench_fewstep.py cache --config tiny --size 32*32 --frames 5 --steps 8

Random weights: the checkpoint is bench_e2e's (`ensure_checkpoint`, written once under --workdir and
reused; `--prepare-only` writes it and the LoRA and stops). Each side runs in its own process, one
after the other (clean device memory; JAX and torch never share the device): load, text encode,
denoise, VAE decode (bf16 DiT and UMT5, float32 VAE on both sides). Columns: seconds per stage;
`denoise` is the wall time of the loop (ours: compilation included, and also shown without it: the
first step, which compiles, is counted at the median of the computed steps); `s/step` = denoise
without compilation / steps; `skipped`: steps on which the DiT blocks ran for no CFG branch (diffusers:
counted from the calls in which its last block ran); `total` = load + LoRA + text encode + denoise +
decode. Needs diffusers (and peft for `lora`) on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py and bench_e2e.py, beside this script
import harness  # noqa: E402
from bench_e2e import (  # noqa: E402
    CONFIGS,
    FEW_STEP_SHIFT,
    FEW_STEP_SIGMAS,
    PROMPT,
    SEED,
    diffusers_cache_config,
    diffusers_decode,
    diffusers_pipeline,
    ensure_checkpoint,
    few_step_scheduler,
    merge_lora,
    write_lora,
)

from wan_tpu.errors import WanInputError  # noqa: E402


def _excl_compile(steps: list[float], computed: list[bool]) -> float:
    """The loop's time without compilation: the first step (compile + a computed step) counted at the
    median of the other computed steps."""
    rest = [s for s, c in zip(steps[1:], computed[1:]) if c] or steps[1:] or steps
    return sum(steps[1:]) + statistics.median(rest)


# ---- wan_tpu side -------------------------------------------------------------------------------------


def ours(args, ckpt: str, lora: str | None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.runtime.profiling import StageTimer
    from wan_tpu.wan.cli import parse_size
    from wan_tpu.wan.pipeline import WanPipeline

    timer = StageTimer()
    width, height = parse_size(args.size)
    pipe = WanPipeline.from_pretrained(ckpt, dtype=jnp.bfloat16)
    few = args.mode == "lora"
    s = pipe.settings(height=height, width=width, num_frames=args.frames, guidance_scale=1.0 if few else None,
                      flow_shift=FEW_STEP_SHIFT if few else None,
                      num_inference_steps=len(FEW_STEP_SIGMAS) if few else args.steps)
    with timer.stage("load"):
        pipe.text_encoder
    with timer.stage("text encode"):
        embeds = jax.block_until_ready(pipe.encode_prompt(PROMPT, None, s.guidance_scale))
    pipe.release("text_encoder")
    with timer.stage("load"):
        pipe.transformer
    if lora:
        with timer.stage("lora"):
            pipe.load_lora_weights(lora)
            jax.block_until_ready(jax.tree.leaves(nnx.state(pipe.transformer)))
    variants = [None] if few else [None, "teacache", "magcache", "fbcache"]
    kwargs = dict(scheduler="euler", sigmas=FEW_STEP_SIGMAS) if few else {}
    rows, latents = [], None
    for cache in variants:
        steps: list[float] = []
        start = time.perf_counter()
        out = jax.block_until_ready(pipe.denoise(
            embeds, seed=SEED, height=s.height, width=s.width, num_frames=s.num_frames,
            num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale, flow_shift=s.flow_shift,
            progress=True, step_seconds=steps, cache=cache, **kwargs))
        denoise = time.perf_counter() - start
        stats = pipe.cache_stats
        computed = [True] * len(steps) if stats is None else list(~stats.skip_mask.all(axis=1))
        latents = out if latents is None else latents
        rows.append({"run": f"wan_tpu {cache or 'no cache'}" + (f" ({stats.threshold:g})" if stats else ""),
                     "denoise": denoise, "excl_compile": _excl_compile(steps, computed), "steps": len(steps),
                     "skipped": 0 if stats is None else stats.skipped})
    pipe.release("transformer")
    with timer.stage("load"):
        pipe.vae
    with timer.stage("decode"):
        pipe.decode(latents)
    sec = timer.seconds
    peak = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.devices()[:1]][0]
    for r in rows:
        r.update(load=sec["load"], lora=sec.get("lora", 0.0), text=sec["text encode"], decode=sec["decode"],
                 peak_bytes=peak, device=jax.devices()[0].device_kind)
    return rows


# ---- diffusers side -----------------------------------------------------------------------------------


def peer(args, ckpt: str, lora: str | None) -> list[dict]:
    import diffusers
    import numpy as np
    import torch

    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.encoders.umt5_text import WAN_NEGATIVE_PROMPT
    from wan_tpu.wan.cli import parse_size

    dev = harness.torch_device()
    sync = harness.torch_sync
    width, height = parse_size(args.size)
    few = args.mode == "lora"
    sec = {"load": 0.0, "lora": 0.0}
    t0 = time.perf_counter()
    pipe = diffusers_pipeline(ckpt, dev)
    sync()
    sec["load"] = time.perf_counter() - t0
    if lora:
        t0 = time.perf_counter()
        merge_lora(pipe, lora)
        sync()
        sec["lora"] = time.perf_counter() - t0
    variant = VARIANTS[CONFIGS[args.config].variant]
    width, height = width or variant.sample_size[0], height or variant.sample_size[1]
    frames = args.frames or variant.sample_frames
    guidance = 1.0 if few else variant.guidance_scale
    t0 = time.perf_counter()
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(PROMPT, negative_prompt=WAN_NEGATIVE_PROMPT,
                                              do_classifier_free_guidance=guidance > 1, max_sequence_length=512,
                                              device=dev)
    sync()
    sec["text"] = time.perf_counter() - t0
    if few:
        pipe.scheduler = few_step_scheduler()
        steps, variants = len(FEW_STEP_SIGMAS), [("no cache", None)]
    else:
        from wan_tpu.wan.settings import default_shift

        shift = default_shift(variant, width, height)
        pipe.scheduler = diffusers.UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=shift)
        steps = args.steps or 50
        variants = [("no cache", None), ("fbcache (0.05)", diffusers_cache_config("fbcache", steps)),
                    ("magcache (0.06, K=3, R=0.2)", diffusers_cache_config("magcache", steps))]
    # Which DiT calls ran the last block (a skipped call never reaches its FFN).
    calls, tail_ran = [0], []
    last_ffn = pipe.transformer.blocks[-1].ffn
    ffn_forward = last_ffn.forward

    def counted(*a, **k):
        tail_ran[-1] = True
        return ffn_forward(*a, **k)

    last_ffn.forward = counted
    dit_forward = pipe.transformer.forward

    def dit_call(*a, **k):
        tail_ran.append(False)
        calls[0] += 1
        return dit_forward(*a, **k)

    pipe.transformer.forward = dit_call
    rows, latents = [], None
    for name, config in variants:
        if config is not None:
            pipe.transformer.enable_cache(config)
        tail_ran.clear()
        generator = torch.Generator(dev).manual_seed(SEED)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, height=height, width=width,
                       num_frames=frames, num_inference_steps=steps, guidance_scale=guidance, generator=generator,
                       output_type="latent", return_dict=False)[0]
        sync()
        denoise = time.perf_counter() - t0
        if config is not None:
            pipe.transformer.disable_cache()
        per_step = np.asarray(tail_ran).reshape(steps, -1)
        latents = out if latents is None else latents
        rows.append({"run": f"diffusers {name}", "denoise": denoise, "excl_compile": denoise, "steps": steps,
                     "skipped": int((~per_step).all(axis=1).sum())})
    t0 = time.perf_counter()
    with torch.no_grad():
        diffusers_decode(pipe.vae, latents)
    sync()
    sec["decode"] = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    kind = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    for r in rows:
        r.update(load=sec["load"], lora=sec["lora"], text=sec["text"], decode=sec["decode"], peak_bytes=peak,
                 device=kind)
    return rows


# ---- driver -------------------------------------------------------------------------------------------


def format_table(rows: list[dict]) -> str:
    head = ("run", "load", "lora", "text", "denoise", "excl.compile", "s/step", "skipped", "decode", "total",
            "wall", "peak GiB")
    body = []
    for r in rows:
        if "status" in r:
            body.append((r["run"], r["status"]))
            continue
        total = r["load"] + r["lora"] + r["text"] + r["excl_compile"] + r["decode"]
        wall = total - r["excl_compile"] + r["denoise"]
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
        body.append((r["run"], f"{r['load']:.1f}", f"{r['lora']:.1f}", f"{r['text']:.1f}", f"{r['denoise']:.1f}",
                     f"{r['excl_compile']:.1f}", f"{r['excl_compile'] / r['steps']:.3f}",
                     f"{r['skipped']}/{r['steps']}", f"{r['decode']:.1f}", f"{total:.1f}",
                     f"{wall:.1f}", peak))
    return harness.table(head, body) + ("\n(seconds; total = load + lora + text + denoise excl. compile + decode; wall = the same with the "
                                 "denoise's compilation: what the user waits for)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_fewstep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("lora", "cache"), help="lora: 4 steps with a merged LoRA; cache: step caches")
    p.add_argument("--config", choices=sorted(CONFIGS), default=None, help="model (default: 14b for lora, 1.3b for cache)")
    p.add_argument("--size", default=None, help="W*H (default: the model's)")
    p.add_argument("--frames", type=int, default=None, help="frames, 4n+1 (default: 81)")
    p.add_argument("--steps", type=int, default=None, help="cache mode: steps (default: 50)")
    p.add_argument("--lora-rank", type=int, default=64, help="rank of the random LoRA (default 64)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "wan_tpu_bench_e2e"),
                   help="where the random checkpoint and LoRA are written (reused when present)")
    p.add_argument("--sides", nargs="+", choices=("ours", "diffusers"), default=["ours", "diffusers"])
    p.add_argument("--prepare-only", action="store_true", help="write the random checkpoint and LoRA, and stop")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop a side still running this long after the start, so the table still prints")
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # run one side in this process
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    return p


def _run_side(args, side: str, deadline: float | None) -> list[dict]:
    rows, why = harness.run_part([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--side", side], deadline,
                                 args.time_limit)
    return rows if why is None else [{"run": side, "status": why}]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.config = args.config or ("14b" if args.mode == "lora" else "1.3b")
    if not args.side:  # this process leaves the device to the sides' processes
        harness.print_env()
    start = time.perf_counter()
    try:
        ckpt = ensure_checkpoint(args.workdir, args.config)
        lora = None
        if args.mode == "lora":
            lora = write_lora(os.path.join(os.path.abspath(args.workdir),
                                           f"{CONFIGS[args.config].variant}-lora-r{args.lora_rank}.safetensors"),
                              args.config, args.lora_rank)
        if args.prepare_only:
            return 0
        if args.side:
            rows = (ours if args.side == "ours" else peer)(args, ckpt, lora)
            with open(args.result_json, "w") as f:
                json.dump(rows, f)
            return 0
    except WanInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    deadline = None if args.time_limit is None else start + args.time_limit
    rows = [r for side in args.sides for r in _run_side(args, side, deadline)]
    what = (f"{len(FEW_STEP_SIGMAS)} Euler steps (sigmas {FEW_STEP_SIGMAS}, shift {FEW_STEP_SHIFT:g}), guidance 1, "
            f"random rank-{args.lora_rank} kohya LoRA merged" if args.mode == "lora" else
            f"{args.steps or 50} UniPC steps, CFG 5, step caches at their default thresholds")
    device = next((r["device"] for r in rows if "device" in r), "?")
    print(f"\nWan 2.1 T2V {args.config} ({device}), random weights, {args.size or 'default size'}, "
          f"{args.frames or 81} frames; {what}:")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
