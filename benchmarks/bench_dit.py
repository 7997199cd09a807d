"""DiT forward on one NVIDIA GPU: our jitted `WanTransformer` (fused and unfused elementwise work,
bf16 and FP8) against diffusers' `WanTransformer3DModel` (eager and torch.compile), same GPU, same run.

    python benchmarks/bench_dit.py --configs 1.3b,5b,14b --compile 1.3b --profile /tmp/prof --psnr 1.3b
    python benchmarks/bench_dit.py --configs tiny --compile "" --profile /tmp/prof --psnr tiny    # CPU dry run

Per config, ours runs as the jitted pure `forward(graphdef, state, ...)` a sampling loop runs, in
each of `--variants`: `fused` (the default model: `WanTransformerBlock.fused_elementwise`),
`unfused` (the same weights with diffusers' op order around the matmuls), `fp8` (the same weights,
every block linear quantised, `wan_tpu.wan.quantize`), `fp8-ffn` (only the FFN's linears quantised),
`fp8-attn` (bf16 linears, self-attention on the FP8 kernel, `attention(impl="pallas_gpu_fp8")`),
`fp8+attn` (both: every block linear and self-attention in FP8), `int8` and `int8+attn` (the
block linears in int8 instead). Attention is the library's choice
(`--attention IMPL` to force one). Prints ms per forward (median of `--iters` after a warm-up),
each entry's time relative to ours fused (bf16), and MFU = model FLOPs ÷ time ÷ the bf16 8192³
matmul rate measured first in this run. Quantised rows give their relative error (Frobenius) against
ours bf16 on the same inputs. The last column is the SM clock and board power while each entry was
timed (medians of `nvidia-smi` samples every 50 ms, `wan_tpu.runtime.profiling.GpuMonitor`): under dense
work an H100 or H200 sits at its 700 W limit, and its clock is whatever that power allows.

Options:
- `--profile DIR --profile-configs 1.3b`: one traced forward per variant; prints the GPU time
  per op class (matmuls, attention, fusions, …) and the largest ops, from `wan_tpu.runtime.profiling.op_times`.
- `--psnr 1.3b --psnr-steps 8`: a short sampling run (flow UniPC, CFG 5, 512 random text tokens)
  with the bf16 and then the FP8 DiT from the same noise, both decoded by a Wan 2.1 VAE, and the
  PSNR of the FP8 video against the bf16 one. Random weights (DiT and VAE): the figure measures how
  far FP8 moves the pipeline's output, not picture quality. Costly: 1.3B with `fused,fp8-ffn,fp8`
  and `--psnr` ran past 300 s on an H100 (`fused,fp8-ffn` fit in a 208 s call with an attention
  sweep). Each variant's time and error print as they come, so a run cut short keeps what it measured.
- `--xla-variants "lt=--xla_gpu_enable_cublaslt=true;..." --xla-configs 1.3b`: ours fused again in a
  fresh process per XLA_FLAGS setting, same table. (That flag changes nothing on jax 0.11.2: its
  cuBLASLt epilogues already fuse the biases and the FFN's GELU, as each variant's printed
  "compiled ... forward" line shows.)
- `--check 1.3b`: ours also on diffusers' own weights (save_pretrained → load_transformer), with
  the relative error against diffusers eager. `--no-diffusers`: ours only.

Random weights at real sizes, bf16 (diffusers' float32 modules kept float32 on both sides), one
batch element, 512 text tokens: 1.3b at latent 21×60×104 (480×832, 81 frames), 14b at 21×90×160
(720×1280, 81 frames), 5b (TI2V) at 31×44×80 (704×1280, 121 frames). Torch runs first and frees
its memory before the JAX part of each config. Model FLOPs: `wan_tpu.runtime.profiling.dit_forward_flops`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# ours as a command line runs it (wan_tpu.runtime.xla_defaults); a flag set in XLA_FLAGS wins
from wan_tpu.runtime.xla_defaults import apply_xla_defaults  # noqa: E402

apply_xla_defaults()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from wan_tpu.configs.models import VARIANTS, config_to_json  # noqa: E402
from wan_tpu.runtime.profiling import GpuMonitor, clock_summary, dit_forward_flops, measured_peak_flops, op_class_table, trace  # noqa: E402
from wan_tpu.wan.quantize import BLOCK_LINEARS  # noqa: E402

CONFIGS = {  # name: (variant, latent (F, H, W))
    "1.3b": ("wan2.1-t2v-1.3b", (21, 60, 104)),
    "14b": ("wan2.1-t2v-14b", (21, 90, 160)),
    "5b": ("wan2.2-ti2v-5b", (31, 44, 80)),
    "tiny": ("tiny", (3, 8, 8)),  # a smoke run of the script itself (runs on CPU too)
}
TEXT_LEN = 512
OURS = "ours fused"  # the reference row of each config
START = time.perf_counter()  # progress lines say when they came: a 14B variant takes minutes
# variant: (quantize mode, which block linears); the "attn" variants also run self-attention on the
# FP8 kernel (impl "pallas_gpu_fp8")
QUANT_RECIPES = {"fp8-ffn": ("fp8", tuple(p for p in BLOCK_LINEARS if p[0] == "ffn")), "fp8": ("fp8", BLOCK_LINEARS),
                 "fp8-attn": ("fp8", ()), "fp8+attn": ("fp8", BLOCK_LINEARS),
                 "int8": ("int8", BLOCK_LINEARS), "int8+attn": ("int8", BLOCK_LINEARS)}


def model_flops(cfg, latent) -> float:
    f, h, w = latent
    return dit_forward_flops(cfg, (f // cfg.patch_size[0]) * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2]),
                             TEXT_LEN)


# (config, entry) → the time.time() span of its timed calls: main's `GpuMonitor` gives the clock and
# power there (a forward at the GPU's 700 W limit runs at whatever SM clock that power allows).
TIMED = {}


def record(results, name, label, timing, scale=1):
    """`results[label]`: the timing's median ms (× `scale`); `TIMED` keeps when its calls ran."""
    TIMED[name, label] = timing.span
    results[label] = scale * timing.ms


def inputs(cfg, latent, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, cfg.in_channels, *latent), np.float32)
    t = np.array([900.0], np.float32)
    c = rng.standard_normal((1, TEXT_LEN, cfg.text_dim), np.float32)
    return x, t, c


def gemm_summary(hlo: str) -> str:
    """The compiled program's cuBLAS calls by fused epilogue (bias, GELU: what cuBLASLt folds into the GEMM
    so that no separate pass reads its output again) and its pads (`quantized_matmul` pads the quantised
    rows to a multiple of 16, as cuBLASLt's FP8 GEMMs want, inside the quantising fusion)."""
    calls = [line for line in hlo.splitlines() if 'custom_call_target="__cublas' in line]
    kinds = {}
    for line in calls:
        epilogue = re.search(r'"epilogue":"(\w+)"', line)
        kind = epilogue.group(1) if epilogue else "none"
        kinds[kind] = kinds.get(kind, 0) + 1
    pads = sum(1 for line in hlo.splitlines() if re.search(r"= \S+ pad\(", line))
    by_kind = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    return f"{len(calls)} cuBLAS GEMM calls (epilogue: {by_kind or '-'}), {pads} pad ops"


# ---- diffusers ------------------------------------------------------------------------------------

def diffusers_model(cfg):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(harness.torch_device()):
        model = WanTransformer3DModel(**config_to_json(cfg)).eval()
    torch.set_default_dtype(torch.float32)
    # As from_pretrained(torch_dtype=bfloat16) does: _keep_in_fp32_modules stay float32.
    keep = model._keep_in_fp32_modules
    for name, p in model.named_parameters():
        if any(k in name.split(".") for k in keep):
            p.data = p.data.float()
    return model


def run_torch(cfg, latent, args, name, results):
    import torch

    model = diffusers_model(cfg)
    x, t, c = (torch.from_numpy(a).to(harness.torch_device()) for a in inputs(cfg, latent))
    x, c = x.bfloat16(), c.bfloat16()
    ref = folder = None
    with torch.inference_mode():
        call = lambda m=model, x=x, c=c: m(x, t, c, return_dict=False)[0]  # noqa: E731
        record(results, name, "diffusers eager", harness.measure(call, harness.torch_sync, iters=args.iters))
        if name in args.check:
            ref = call().float().cpu().numpy()
            folder = tempfile.mkdtemp(prefix=f"bench_dit_{name}_")
            model.save_pretrained(folder)
        if name in args.compile:
            model.compile_repeated_blocks(fullgraph=True)
            record(results, name, "diffusers torch.compile",
                   harness.measure(call, harness.torch_sync, iters=args.iters, warmup=2))
    del model, x, c, call
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ref, folder


# ---- ours -----------------------------------------------------------------------------------------

def sample_latents(dit, cfg, latent, steps, seed=0):
    """A short CFG sampling run from fixed noise and random text embeddings (the PSNR probe)."""
    from wan_tpu.wan.denoise import Conditioning, denoise
    from wan_tpu.wan.schedulers import make_scheduler

    _, _, c = inputs(cfg, latent, seed)
    _, _, neg = inputs(cfg, latent, seed + 1)
    noise = jax.random.normal(jax.random.key(seed), (1, cfg.in_channels, *latent), jnp.float32)
    cond = Conditioning(jnp.asarray(c), jnp.asarray(neg))
    return denoise([dit], noise, cond, make_scheduler("unipc", steps, 3.0), [5.0], progress=False)


def decode_psnr(latents_a, latents_b, tiny: bool) -> float:
    """PSNR (dB, uint8 frames) of two latents decoded by one random-weight Wan 2.1 VAE."""
    from flax import nnx

    from wan_tpu.configs.vae import VAE_PRESETS, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD
    from wan_tpu.vae.model import WanVAE, frames_to_uint8

    config = VAE_PRESETS["wan2.1"]
    if tiny:
        config = dataclasses.replace(VAE_PRESETS["tiny"], z_dim=16, latents_mean=WAN21_LATENTS_MEAN,
                                     latents_std=WAN21_LATENTS_STD)
    vae = nnx.jit(lambda: WanVAE(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))()
    frames = [np.asarray(frames_to_uint8(vae.decode(vae.denormalize_latents(z.astype(jnp.float32)))), np.float64)
              for z in (latents_a, latents_b)]
    mse = float(np.mean((frames[0] - frames[1]) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def run_jax(cfg, latent, args, name, folder, results, notes):
    import functools

    from flax import nnx

    from wan_tpu.layers.attention import attention
    from wan_tpu.wan.quantize import quantize_transformer
    from wan_tpu.wan.transformer import WanTransformer, forward
    from wan_tpu.wan.transformer_loading import load_transformer

    if folder is None:
        dit = nnx.jit(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))()
    else:
        dit = load_transformer(folder, dtype=jnp.bfloat16)
    if args.attention != "None":
        dit.self_attention = dit.cross_attention = functools.partial(attention, impl=args.attention)
    x, t, c = inputs(cfg, latent)
    x, c, t = jnp.asarray(x, jnp.bfloat16), jnp.asarray(c, jnp.bfloat16), jnp.asarray(t)
    outs, psnr_latents = {}, {}
    for variant in args.variants:
        dit.blocks.fused_elementwise = variant != "unfused"
        model = dit
        if variant in QUANT_RECIPES:  # the last variant quantises `dit` in place (memory), another a copy
            target = dit if variant == args.variants[-1] else nnx.merge(*nnx.split(dit))  # sharing the bf16 arrays
            mode, linears = QUANT_RECIPES[variant]
            model = quantize_transformer(target, mode, linears=linears) if linears else target
            if variant.endswith("attn"):
                model.self_attention = functools.partial(attention, impl="pallas_gpu_fp8")
        graphdef, state = nnx.split(model)
        compiled = jax.jit(forward, static_argnums=0).lower(graphdef, state, x, t, c).compile()
        if not args.json:
            print(f"{name}: ours {variant} compiled (at {time.perf_counter() - START:.0f} s)", flush=True)
        call = functools.partial(compiled, state, x, t, c)
        label = f"ours {variant}"
        record(results, name, label, harness.measure(call, jax.block_until_ready, iters=args.iters))
        if not args.json:  # as it comes: a run killed at a time limit still leaves its rows
            print(f"{name}: {label} {results[label]:.1f} ms (at {time.perf_counter() - START:.0f} s)", flush=True)
        outs[variant] = np.asarray(call().astype(jnp.float32))
        if variant in QUANT_RECIPES and "fused" in outs:
            notes.append(f"{name}: {variant} forward vs bf16 (ours fused), relative error "
                         f"{harness.rel_error(outs[variant], outs['fused']):.2e}")
            if not args.json:
                print(notes[-1], flush=True)
        hlo = compiled.as_text()
        notes.append(f"{name}: compiled {variant} forward: {gemm_summary(hlo)}")
        if variant in QUANT_RECIPES and QUANT_RECIPES[variant][0] == "fp8":
            # What XLA made of the f8 × f8 dots: cuBLASLt FP8 GEMMs, or something slower.
            f8_dots = sum(1 for line in hlo.splitlines() if " dot(" in line and "f8e4m3fn" in line)
            lt_f8 = hlo.count("__cublas$lt$matmul$f8")
            other = hlo.count('"__cublas$gemm"') + hlo.count('"__cublas$lt$matmul"')
            notes.append(f"{name}: compiled {variant} forward: {lt_f8} cuBLASLt FP8 GEMM calls, {other} other cuBLAS GEMMs, "
                         f"{f8_dots} dots on f8 operands left to XLA's own emitters (fused or not)")
        if name in args.profile_configs and args.profile:
            log_dir = os.path.join(args.profile, f"{name}_{variant}")
            # Two forwards first: after the pause above (read-back, HLO text) the GPU is cool and clocks
            # high, and a forward traced then ran 4% faster than the timed ones at the power limit.
            for _ in range(2):
                jax.block_until_ready(call())
            with trace(log_dir):
                jax.block_until_ready(call())
            notes += op_class_table(log_dir, f"{name} {label}")
        if name in args.psnr and (variant == "fused" or variant in QUANT_RECIPES):
            psnr_latents[variant] = sample_latents(model, cfg, latent, args.psnr_steps)
        del state, model, call
    for variant in QUANT_RECIPES:
        if variant in psnr_latents and "fused" in psnr_latents:
            psnr = decode_psnr(psnr_latents["fused"], psnr_latents[variant], tiny=name == "tiny")
            notes.append(f"{name}: PSNR of the decoded {variant} video vs bf16, {args.psnr_steps} UniPC steps, CFG 5, "
                         f"same seed, random DiT and VAE weights: {psnr:.2f} dB")
    # The self-attention alone, at this shape, times the layer count: how much of ours is attention.
    seq = x.shape[2] * x.shape[3] * x.shape[4] // cfg.patch_volume
    q, k, v = (jax.random.normal(jax.random.key(i), (1, seq, cfg.num_attention_heads, cfg.attention_head_dim),
                                 jnp.bfloat16) for i in range(3))
    attn = jax.jit(functools.partial(attention, impl=None if args.attention == "None" else args.attention))
    only = "self-attention only ×layers"
    record(results, name, only, harness.measure(lambda: attn(q, k, v), jax.block_until_ready, iters=args.iters),
           scale=cfg.num_layers)
    del dit
    gc.collect()
    return outs.get("fused")


def run_xla_variants(args, rows):
    """Ours fused in a fresh process per XLA_FLAGS setting (XLA reads its flags once per process)."""
    for spec in filter(None, args.xla_variants.split(";")):
        label, _, flags = spec.partition("=")
        cmd = [sys.executable, os.path.abspath(__file__), "--configs", ",".join(args.xla_configs), "--no-diffusers",
               "--variants", "fused", "--iters", str(args.iters), "--attention", args.attention, "--json"]
        try:
            done = harness.run_fresh(cmd, env=harness.xla_flags_env(flags), timeout=args.xla_timeout)
            found = done.results()
            if not found:
                raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1][:200])
            for name, ms in found[0].items():
                rows[name][f"ours fused, XLA_FLAGS {label} ({flags})"] = ms
        except Exception as e:  # one failing flag set must not hide the rest
            print(f"xla variant {label}: {type(e).__name__}: {e}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="1.3b,5b,14b")
    p.add_argument("--variants", default="fused,unfused,fp8",
                   help="ours: fused, unfused, fp8, fp8-ffn, fp8-attn, fp8+attn, int8, int8+attn")
    p.add_argument("--attention", default="None", help="wan_tpu.attention impl for ours (None = the library's choice)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--compile", default="1.3b", help="configs that also time diffusers + torch.compile")
    p.add_argument("--check", default="", help="configs where ours runs on diffusers' weights and is compared")
    p.add_argument("--no-diffusers", dest="diffusers", action="store_false", help="time ours only")
    p.add_argument("--profile", default="", help="folder for jax.profiler traces (op-class breakdown)")
    p.add_argument("--profile-configs", default="1.3b", help="configs to profile when --profile is given")
    p.add_argument("--psnr", default="", help="configs whose FP8 video PSNR vs bf16 is measured")
    p.add_argument("--psnr-steps", type=int, default=8)
    p.add_argument("--xla-variants", default="", help='"label=XLA_FLAGS;..." runs of ours fused in fresh processes')
    p.add_argument("--xla-configs", default="1.3b")
    p.add_argument("--xla-timeout", type=int, default=240)
    p.add_argument("--json", action="store_true", help="print one RESULT line of JSON (for --xla-variants)")
    args = p.parse_args()
    known = ("fused", "unfused", *QUANT_RECIPES)  # in this order: the last one may quantise the DiT in place
    unknown = set(args.variants.split(",")) - set(known)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; choose from {', '.join(known)}")
    args.variants = [v for v in known if v in args.variants.split(",")]
    for key in ("compile", "check", "profile_configs", "psnr", "xla_configs"):
        setattr(args, key, [c for c in getattr(args, key).split(",") if c])
    if args.psnr and not ("fused" in args.variants and set(QUANT_RECIPES) & set(args.variants)):
        raise SystemExit("--psnr needs the fused variant and a quantised one")

    if not args.json:
        harness.print_env(jax.devices())
    # Off GPU only the script itself is being tried: a small product keeps that quick.
    n = 8192 if jax.default_backend() == "gpu" else 512
    peak = measured_peak_flops(n) / 1e12
    if not args.json:
        print(f"bf16 {n}^3 matmul {peak:.0f} TFLOP/s; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    rows, notes, errs = {}, [], {}
    with GpuMonitor() as monitor:
        for name in args.configs.split(","):
            variant, latent = CONFIGS[name]
            cfg = VARIANTS[variant].transformer
            results = rows[name] = {}
            ref, folder = run_torch(cfg, latent, args, name, results) if args.diffusers else (None, None)
            out = run_jax(cfg, latent, args, name, folder, results, notes)
            if ref is not None:
                errs[name] = f"{harness.rel_error(out, ref):.2e}"
            if not args.json:
                print(f"{name}: {results}", flush=True)
    if args.json:
        harness.emit_result({name: r["ours fused"] for name, r in rows.items()})
        return
    if args.xla_variants:
        run_xla_variants(args, rows)

    print()
    print("\n".join(notes))
    print(f"\nbf16 {n}^3 matmul in this run: {peak:.0f} TFLOP/s")
    print(harness.header("config", "latent F×H×W", "model FLOPs", "entry", "ms/forward", "entry ÷ ours fused", "MFU",
                         "rel err vs diffusers", "while timed (medians)"))
    for name, results in rows.items():
        variant, latent = CONFIGS[name]
        flops = model_flops(VARIANTS[variant].transformer, latent)
        ours = results.get(OURS)
        for entry, ms in results.items():
            mfu = "" if "only" in entry else f"{flops / (ms * 1e-3) / (peak * 1e12):.1%}"
            ratio = f"{ms / ours:.3f}" if ours else ""
            err = errs.get(name, "") if entry == OURS else ""
            clocks = clock_summary(monitor.window(*TIMED[name, entry])) if (name, entry) in TIMED else ""
            print(harness.row(name, "×".join(map(str, latent)), f"{flops:.3g}", entry, f"{ms:.1f}", ratio, mfu, err, clocks))


if __name__ == "__main__":
    main()
