"""Wan 2.1 VAE decode/encode: wan_tpu (JAX) vs diffusers' AutoencoderKLWan (torch), same random weights, bf16.

    python benchmarks/bench_vae.py --strips 3   # 480x832 and 720x1280, 81 frames, on the GPU; adds 3-strip rows
    python benchmarks/bench_vae.py --tiled 384x704:336x576   # adds a tiled decode at the last size
    python benchmarks/bench_vae.py --impls wan_tpu --sizes 480x832 --reps 3
    python benchmarks/bench_vae.py --memory-analysis --strips 3   # compile only: XLA's temp bytes per step
    python benchmarks/bench_vae.py --impls wan_tpu --kinds decode --sizes 480x832 --profile   # + the top XLA ops
    python benchmarks/bench_vae.py --memory-analysis --variants "s1=1;s2=2;s2-at0=2 --xla_gpu_autotune_level=0"
        # decode only, one row per variant (strip count, extra XLA_FLAGS), plus XLA's accounting per flag set

Rows "wan_tpu" are `decode(z)`'s default path (at these sizes: 2 exact strips, see WanVAE.decode).
Every side runs in subprocesses so peak-memory counters do not mix. JAX's peak counter cannot be
reset and would also count the conv autotuner's scratch, so a "prime" process compiles everything
into a persistent compilation cache first; the measuring processes load the executables and run
their work in increasing expected peak (a row marked "peak ≤" was hidden by an earlier, larger one).
Time is the median of `--reps` runs after one warm-up; peak is `torch.cuda.max_memory_allocated` /
JAX `memory_stats()['peak_bytes_in_use']`. The last lines compare outputs (first frames at the first
size) between the two implementations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

GIB = 1024**3


def _sizes(text):
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def make_checkpoint(path):
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    model = AutoencoderKLWan()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gamma" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(1, p[0].numel()) ** 0.5 if p.dim() > 1 else 0.05))
    model.to(torch.bfloat16).save_pretrained(path)


def _inputs(kind, h, w, frames, seed=1):
    rng = np.random.default_rng(seed)
    if kind == "decode":
        return rng.standard_normal((1, 16, (frames - 1) // 4 + 1, h // 8, w // 8), dtype=np.float32)
    return rng.uniform(-1, 1, (1, 3, frames, h, w)).astype(np.float32)


def worker_torch(args):
    import torch
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(args.ckpt, torch_dtype=torch.bfloat16).cuda().eval()
    for kind in args.kinds.split(","):
        for i, (h, w) in enumerate(_sizes(args.sizes if kind == "decode" else args.encode_sizes or args.sizes)):
            x = torch.from_numpy(_inputs(kind, h, w, args.frames)).cuda().to(torch.bfloat16)
            fn = (lambda: vae.decode(x).sample) if kind == "decode" else (lambda: vae.encode(x).latent_dist.mode())
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                timing = harness.measure(fn, harness.torch_sync, iters=args.reps, hold=True)
            out, times = timing.out, timing.times
            peak = torch.cuda.max_memory_allocated()
            if i == 0:
                sl = out[:, :, :5].float().cpu().numpy() if kind == "decode" else out.float().cpu().numpy()
                np.save(os.path.join(args.ckpt, f"torch_{kind}.npy"), sl)
            del out, timing
            torch.cuda.empty_cache()
            _emit("diffusers", kind, h, w, times, peak)


def worker_jax(args):
    import jax
    import jax.numpy as jnp

    # A persistent compilation cache filled by the "prime" process: the measuring processes load the
    # executables instead of compiling, so their peak memory is the decode's, not the conv autotuner's.
    jax.config.update("jax_compilation_cache_dir", os.path.join(args.ckpt, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from wan_tpu.vae.loading import load_vae

    vae = load_vae(args.ckpt, dtype=jnp.bfloat16)
    dev = jax.devices()[0]
    kind = args.worker.split(":")[1]
    sizes = _sizes(args.sizes)
    tiled = [("decode", *sizes[-1], tuple(_sizes(t)[0] for t in args.tiled.split(":")))] if args.tiled else []
    strips = [int(n) for n in args.strips.split(",") if n]
    jobs = {  # smallest expected peak first: more strips, then the default, size by size
        "decode": tiled + [("decode", h, w, n) for h, w in sizes for n in sorted(strips, reverse=True) + [None]],
        "encode": [("encode", h, w, None) for h, w in _sizes(args.encode_sizes or args.sizes)],
    }
    if args.label:  # a --variants sweep: only this variant's strip count
        jobs["decode"] = [("decode", h, w, strips[0]) for h, w in sizes]
    jobs["prime"] = jobs["decode"] + (jobs["encode"] if "encode" in args.kinds.split(",") else [])
    last_peak = 0
    for job, h, w, variant in jobs[kind]:
        x = jnp.asarray(_inputs(job, h, w, args.frames), jnp.bfloat16)
        if job == "encode":
            fn = lambda: vae.encode(x)  # noqa: E731
        elif isinstance(variant, int):
            fn = lambda: vae.decode(x, tiling=False, strips=variant)  # noqa: E731
        elif variant:
            fn = lambda: vae.decode(x, tiling=True, tile_sample_size=variant[0], tile_sample_stride=variant[1])  # noqa: E731
        else:
            fn = lambda: vae.decode(x, tiling=False)  # noqa: E731
        timing = harness.measure(fn, lambda out: out.block_until_ready(), iters=0 if kind == "prime" else args.reps,
                                 hold=True)
        out, first, times = timing.out, timing.first, timing.times
        del timing
        if kind == "prime":
            print(f"primed {job} {h}x{w} {variant or ''}: first call {first:.1f}s", flush=True)
            continue
        peak = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0)
        if args.profile and job == "decode":
            _profile(fn, f"{args.label or 'wan_tpu'} decode {h}x{w} strips {variant}")
        masked = peak == last_peak  # JAX's peak counter cannot be reset: an earlier, larger peak hides this one
        last_peak = peak
        if h * w == sizes[0][0] * sizes[0][1] and not variant:
            sl = np.asarray(out[:, :, :5] if job == "decode" else out, np.float32)
            np.save(os.path.join(args.ckpt, f"jax_{job}.npy"), sl)
        del out
        if args.label:
            label = args.label
        elif isinstance(variant, int):
            label = f"wan_tpu strips {variant}"
        else:
            label = "wan_tpu" + (f" tiled {variant[0][0]}x{variant[0][1]}" if variant else "")
        label += " (peak ≤)" if masked else ""
        _emit(label, job, h, w, times, peak)


def _profile(fn, title, top=14):
    """One more run under the profiler: the XLA ops that took the most time on the device."""
    import tempfile

    from wan_tpu.runtime.profiling import op_times, trace

    with tempfile.TemporaryDirectory() as log_dir:
        with trace(log_dir):
            fn().block_until_ready()
        rows = op_times(log_dir)
    total = sum(t for _, t, _ in rows)
    print(f"PROFILE {title}: {1000 * total:.0f} ms of device ops", flush=True)
    for op, t, n in rows[:top]:
        print(f"PROFILE   {op:40} {1000 * t:8.1f} ms {100 * t / total:5.1f}%  {n:6d} runs", flush=True)


def memory_analysis(args):
    """Compile (without running, abstract weights) decode's steps at each size and print XLA's accounting:
    temporaries, and the largest cuDNN conv workspace among them (the u8[...] output of a conv custom
    call; XLA lets its autotuner pick algorithms needing up to 4 GiB). On the CPU the second is 0."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.configs.vae import VAE_PRESETS
    from wan_tpu.vae import model as V

    model = nnx.eval_shape(lambda: V.WanVAE(VAE_PRESETS["wan2.1"], dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    g, state = nnx.split(model)
    for h, w in _sizes(args.sizes):
        z = jax.ShapeDtypeStruct((1, 16, 1, h // 8, w // 8), jnp.bfloat16)
        caches, mid = jax.eval_shape(lambda st, x: V._decode_stem(g, st, x, None, None), state, z)
        steps = {"stem": V._decode_stem.lower(g, state, z, caches, None)}
        for strips in sorted({1, 2, *(int(n) for n in args.strips.split(",") if n)}):
            cols, widths, offsets = model.decoder.strip_plan(w // 8, 0, -(-(w // 8) // strips))
            mid = jax.ShapeDtypeStruct((1, 1, h // 8, cols[1] - cols[0], mid.shape[-1]), jnp.bfloat16)
            caches, _ = jax.eval_shape(lambda st, m: V._decode_strip(g, st, m, None, None, False, widths, offsets), state, mid)
            steps[f"strip 1/{strips}"] = V._decode_strip.lower(g, state, mid, caches, None, False, widths, offsets)
        for name, lowered in steps.items():
            compiled = lowered.compile()
            m = compiled.memory_analysis()
            scratch = [int(n) for line in compiled.as_text().splitlines() if "cudnn$conv" in line
                       for n in re.findall(r"u8\[(\d+)\]", line.split("custom-call(")[0])]
            print(f"{h}x{w} {name:12} args {m.argument_size_in_bytes / GIB:6.2f} GiB  temp {m.temp_size_in_bytes / GIB:6.2f} GiB  "
                  f"largest conv workspace {max(scratch, default=0) / GIB:5.2f} GiB ({len(scratch)} convs)", flush=True)


def _emit(impl, kind, h, w, times, peak):
    harness.emit_result(dict(impl=impl, kind=kind, size=f"{h}x{w}", ms=1000 * statistics.median(times), peak_gib=peak / GIB))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="480x832,720x1280")
    ap.add_argument("--encode-sizes", default="", help="sizes to encode (default: --sizes)")
    ap.add_argument("--kinds", default="decode,encode", help="what to time")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tiled", default="", help="SIZE:STRIDE in pixels, e.g. 384x704:336x576; adds a tiled JAX decode at the last size")
    ap.add_argument("--strips", default="", help="comma-separated strip counts to time besides decode's default")
    ap.add_argument("--variants", default="", help="LABEL=STRIPS[ XLA_FLAGS];... : time only these decodes, each under its own XLA_FLAGS")
    ap.add_argument("--ckpt", default="/tmp/bench_vae_ckpt")
    ap.add_argument("--timeout", type=int, default=200, help="seconds per subprocess")
    ap.add_argument("--worker", default="")
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    ap.add_argument("--impls", default="diffusers,wan_tpu", help="which sides to run")
    ap.add_argument("--profile", action="store_true", help="after timing each JAX decode, run it once more under the "
                    "profiler and print the XLA ops that took the most time on the device")
    ap.add_argument("--memory-analysis", action="store_true", help="only compile decode's steps and print XLA's memory accounting "
                    "(with --variants: besides the timings, once per distinct XLA_FLAGS)")
    args = ap.parse_args()
    if not args.worker:  # the workers' parent leaves the device to them
        harness.print_env()
    if args.worker == "torch":
        return worker_torch(args)
    if args.worker.startswith("jax:"):
        return worker_jax(args)
    if args.variants:
        return sweep(args)
    if args.memory_analysis:
        return memory_analysis(args)

    if not os.path.isdir(args.ckpt):
        make_checkpoint(args.ckpt)
    rows = []
    impls = args.impls.split(",")
    ours = ["jax:prime"] + [f"jax:{k}" for k in args.kinds.split(",")]
    workers = (["torch"] if "diffusers" in impls else []) + (ours if "wan_tpu" in impls else [])
    for worker in workers:
        rows += _run(_cmd(args, worker=worker), worker, args.timeout)
    print_table(rows, args)


def _cmd(args, **flags):
    """This script with the shared arguments, `flags` overriding them."""
    keys = ("sizes", "frames", "reps", "ckpt", "tiled", "strips", "encode_sizes", "kinds")
    values = {k: getattr(args, k) for k in keys} | flags
    cmd = [sys.executable, __file__] + [a for k, v in values.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    return cmd + (["--profile"] if args.profile and flags.get("worker", "") not in ("jax:prime", "torch") else [])


def _run(cmd, name, timeout, env=None):
    """One measuring subprocess → its RESULT rows; prints its errors if it produced none."""
    t0 = time.time()
    try:
        proc = harness.run_fresh(cmd, env=env, timeout=timeout)
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        out, err = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    got = harness.read_results(out)
    print(f"[{name}] {time.time() - t0:.0f}s, {len(got)} results", flush=True)
    print("".join(line + "\n" for line in out.splitlines() if line.startswith(("primed", "RESULT", "PROFILE"))), end="", flush=True)
    if (not got and "prime" not in name) or "Error" in err[-2000:]:
        print(err[-3000:], flush=True)
    return got


def sweep(args):
    """--variants: every variant's compilations run first, in parallel (one process per variant and size,
    plus XLA's memory accounting per distinct XLA_FLAGS), filling the compilation cache; then diffusers
    and each variant time their decodes alone, one process each, loading the executables."""
    variants = []
    for spec in args.variants.split(";"):
        label, _, rest = spec.strip().partition("=")
        strips, _, flags = rest.strip().partition(" ")
        variants.append((label, int(strips), flags.strip()))
    if not os.path.isdir(args.ckpt):
        make_checkpoint(args.ckpt)
    grow = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the compiling processes share the GPU
    t0, procs = time.time(), []
    for label, strips, flags in variants:
        for size in args.sizes.split(","):
            cmd = _cmd(args, sizes=size, strips=strips, kinds="decode", worker="jax:prime", label=label)
            procs.append((f"prime {label} {size}", subprocess.Popen(cmd, env=harness.xla_flags_env(flags, **grow),
                                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    analyses = list(dict.fromkeys(f for _, _, f in variants)) if args.memory_analysis else []
    for flags in analyses:
        cmd = [sys.executable, __file__, "--memory-analysis", "--sizes", args.sizes]
        procs.append((f"memory analysis, XLA_FLAGS='{flags}'", subprocess.Popen(cmd, env=harness.xla_flags_env(flags, **grow),
                                                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                                                text=True)))
    notes = []
    for name, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1, t0 + args.timeout - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\ntimeout"
        lines = [line for line in out.splitlines() if line.startswith(("primed", "480", "720")) or " GiB " in line]
        if name.startswith("memory"):
            notes += [name] + lines
        print(f"[{name}] done at {time.time() - t0:.0f}s, rc {proc.returncode}", flush=True)
        if proc.returncode:
            print(err[-1500:], flush=True)
    rows = _run(_cmd(args, kinds="decode", worker="torch"), "diffusers", args.timeout)
    for label, strips, flags in variants:
        rows += _run(_cmd(args, strips=strips, kinds="decode", worker="jax:decode", label=label), label, args.timeout,
                     harness.xla_flags_env(flags))
    print_table(rows, args)
    print("\n".join(notes))
    print("variants (XLA_FLAGS): " + "; ".join(f"{label} = {strips} strip(s) [{flags or 'default'}]" for label, strips, flags in variants))


def print_table(rows, args):
    ref = {(r["kind"], r["size"]): r for r in rows if r["impl"] == "diffusers"}
    print(f"\nWan 2.1 VAE, bf16, {args.frames} frames, median of {args.reps} after warm-up")
    print(harness.header("work", "size", "impl", "time ms", "peak GiB", "time ×", "mem ×"))
    order = [f"{h}x{w}" for h, w in _sizes(args.sizes)]
    for r in sorted(rows, key=lambda r: (r["kind"], order.index(r["size"]), r["impl"] != "diffusers", r["impl"])):
        base = ref.get((r["kind"], r["size"]))
        tr = f"{r['ms'] / base['ms']:.2f}" if base else "-"
        mr = f"{r['peak_gib'] / base['peak_gib']:.2f}" if base and base["peak_gib"] else "-"
        print(harness.row(r["kind"], r["size"], r["impl"], f"{r['ms']:.0f}", f"{r['peak_gib']:.2f}", tr, mr))
    for kind in ("decode", "encode"):
        a, b = (os.path.join(args.ckpt, f"{impl}_{kind}.npy") for impl in ("torch", "jax"))
        if os.path.exists(a) and os.path.exists(b):
            x, y = np.load(a), np.load(b)
            if x.shape == y.shape:
                print(f"{kind} output vs diffusers (bf16, first size): max |Δ| {np.abs(x - y).max():.3g}, "
                      f"mean |Δ| {np.abs(x - y).mean():.3g}, mean |ref| {np.abs(x).mean():.3g}")


if __name__ == "__main__":
    main()
