"""DiT forward benchmark on one NVIDIA GPU: our jitted `WanTransformer` against diffusers'
`WanTransformer3DModel` (eager, and torch.compile of its repeated blocks), same GPU, same run.

    python scripts/bench_dit.py --configs 1.3b,14b --attention cudnn,pallas_gpu --iters 5 --compile 1.3b --check 1.3b
    (options: --profile DIR writes a jax.profiler trace of ours; --no-diffusers times ours only)

Random weights at real sizes, bf16 (diffusers' float32 modules kept float32 on both sides), one
batch element, 512 text tokens: 1.3b at latent 21×60×104 (480×832, 81 frames), 14b at 21×90×160
(720×1280, 81 frames). Ours is timed as the jitted pure `forward(graphdef, state, ...)` a sampling
loop runs, and as the module call `dit(...)` (which adds the per-call module traversal on the host).
Prints ms per forward (median of `--iters` after warm-up), our time relative
to each diffusers entry, and MFU = model FLOPs ÷ time ÷ the bf16 8192³ matmul rate measured here.
`--check` configs run ours on the diffusers model's own weights (save_pretrained → load_transformer)
and print the relative error of our output against diffusers eager.
Model FLOPs: `wan_tpu.profiling.dit_forward_flops` (per layer 8·S·dim² + 4·S²·D·H + 4·S·dim² + 4·L·dim²
+ 4·S·L·D·H + 4·S·dim·ffn, plus the patch embedding, output projection and text embedder).
Torch runs first and frees its memory before the JAX part of each config.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from wan_tpu.configs.models import VARIANTS, config_to_json  # noqa: E402
from wan_tpu.profiling import dit_forward_flops, measured_peak_flops  # noqa: E402

CONFIGS = {  # name: (variant, latent (F, H, W))
    "1.3b": ("wan2.1-t2v-1.3b", (21, 60, 104)),
    "14b": ("wan2.1-t2v-14b", (21, 90, 160)),
    "5b": ("wan2.2-ti2v-5b", (31, 44, 80)),
    "tiny": ("tiny", (3, 8, 8)),  # a smoke run of the script itself (runs on CPU too)
}
TEXT_LEN = 512


def model_flops(cfg, latent) -> float:
    f, h, w = latent
    return dit_forward_flops(cfg, (f // cfg.patch_size[0]) * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2]),
                             TEXT_LEN)


def median_ms(call, sync, iters, warmup):
    for _ in range(warmup):
        sync(call())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def inputs(cfg, latent, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, cfg.in_channels, *latent), np.float32)
    t = np.array([900.0], np.float32)
    c = rng.standard_normal((1, TEXT_LEN, cfg.text_dim), np.float32)
    return x, t, c


def diffusers_model(cfg):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(_torch_device()):
        model = WanTransformer3DModel(**config_to_json(cfg)).eval()
    torch.set_default_dtype(torch.float32)
    # As from_pretrained(torch_dtype=bfloat16) does: _keep_in_fp32_modules stay float32.
    keep = model._keep_in_fp32_modules
    for name, p in model.named_parameters():
        if any(k in name.split(".") for k in keep):
            p.data = p.data.float()
    return model


def _torch_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_torch(cfg, latent, args, name, results):
    import torch

    model = diffusers_model(cfg)
    x, t, c = (torch.from_numpy(a).to(_torch_device()) for a in inputs(cfg, latent))
    x, c = x.bfloat16(), c.bfloat16()
    sync = (lambda _: torch.cuda.synchronize()) if torch.cuda.is_available() else (lambda _: None)
    ref = None
    with torch.inference_mode():
        call = lambda: model(x, t, c, return_dict=False)[0]  # noqa: E731
        results["diffusers eager"] = median_ms(call, sync, args.iters, 1)
        folder = None
        if name in args.check:
            ref = call().float().cpu().numpy()
            folder = tempfile.mkdtemp(prefix=f"bench_dit_{name}_")
            model.save_pretrained(folder)
        if name in args.compile:
            model.compile_repeated_blocks(fullgraph=True)
            results["diffusers torch.compile"] = median_ms(call, sync, args.iters, 2)
    del model, x, c
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ref, folder


def run_jax(cfg, latent, args, name, folder, results):
    from flax import nnx

    from wan_tpu.layers.attention import attention
    from wan_tpu.models.transformer import WanTransformer, forward
    from wan_tpu.models.transformer_loading import load_transformer

    if folder is None:
        dit = nnx.jit(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))()
    else:
        dit = load_transformer(folder, dtype=jnp.bfloat16)
    x, t, c = inputs(cfg, latent)
    x, c = jnp.asarray(x, jnp.bfloat16), jnp.asarray(c, jnp.bfloat16)
    t = jnp.asarray(t)
    seq = x.shape[2] * x.shape[3] * x.shape[4] // cfg.patch_volume
    q, k, v = (jax.random.normal(jax.random.key(i), (1, seq, cfg.num_attention_heads, cfg.attention_head_dim),
                                 jnp.bfloat16) for i in range(3))
    out = None
    for impl in args.attention:
        label = impl or "default"
        dit.self_attention = dit.cross_attention = functools.partial(attention, impl=impl)
        call = lambda: dit(x, t, c)  # noqa: E731
        if impl == args.attention[0]:  # the module call's host overhead does not depend on the kernel
            results[f"ours ({label}): dit(...)"] = median_ms(call, jax.block_until_ready, args.iters, 1)
        # What a compiled sampling loop runs: the jitted pure forward, no per-call module traversal.
        graphdef, state = nnx.split(dit)
        pure = jax.jit(forward, static_argnums=0)
        results[f"ours ({label}): jitted forward"] = median_ms(lambda: pure(graphdef, state, x, t, c),
                                                               jax.block_until_ready, args.iters, 1)
        del state
        if out is None and folder is not None:
            out = np.asarray(call().astype(jnp.float32))
        if args.profile:
            with jax.profiler.trace(os.path.join(args.profile, f"{name}_{label}"), create_perfetto_trace=True):
                jax.block_until_ready(call())
        # The self-attention alone, at this shape, times the layer count: how much of ours is attention.
        attn = jax.jit(functools.partial(attention, impl=impl))
        results[f"self-attention only ({label}) ×layers"] = cfg.num_layers * median_ms(
            lambda: attn(q, k, v), jax.block_until_ready, args.iters, 1)
    del dit
    gc.collect()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="1.3b,14b")
    p.add_argument("--attention", default="cudnn,pallas_gpu",
                   help="comma list of wan_tpu.attention impls to time ours with (None = the library's choice)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--compile", default="1.3b", help="configs that also time diffusers + torch.compile")
    p.add_argument("--check", default="1.3b", help="configs where ours runs on diffusers' weights and is compared")
    p.add_argument("--no-diffusers", dest="diffusers", action="store_false", help="time ours only")
    p.add_argument("--profile", default="", help="folder for a jax.profiler trace of one forward of ours per config")
    args = p.parse_args()
    args.attention = [None if a == "None" else a for a in args.attention.split(",")]
    args.compile, args.check = args.compile.split(","), args.check.split(",")

    import torch

    # Off GPU only the script itself is being tried: a small product keeps that quick.
    n = 8192 if jax.default_backend() == "gpu" else 512
    peak = measured_peak_flops(n) / 1e12
    dev = jax.devices()[0].device_kind
    print(f"device {dev}; jax {jax.__version__}; torch {torch.__version__}; bf16 {n}^3 matmul {peak:.0f} TFLOP/s")
    rows = []
    for name in args.configs.split(","):
        variant, latent = CONFIGS[name]
        cfg = VARIANTS[variant].transformer
        flops = model_flops(cfg, latent)
        results = {}
        ref, folder = run_torch(cfg, latent, args, name, results) if args.diffusers else (None, None)
        out = run_jax(cfg, latent, args, name, folder, results)
        err = "" if ref is None else f"{np.linalg.norm(out - ref) / np.linalg.norm(ref):.2e}"
        rows.append((name, latent, flops, results, err))
        print(f"{name}: {results} check {err or '-'}", flush=True)

    print()
    print("| config | latent F×H×W | model FLOPs | entry | ms/forward | ours (best) ÷ entry | MFU | rel err vs diffusers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, latent, flops, results, err in rows:
        ours = min(ms for entry, ms in results.items() if entry.endswith("jitted forward"))
        for entry, ms in results.items():
            mfu = "" if "only" in entry else f"{flops / (ms * 1e-3) / (peak * 1e12):.1%}"
            latent_s = "×".join(map(str, latent))
            print(f"| {name} | {latent_s} | {flops:.3g} | {entry} | {ms:.1f} | {ours / ms:.3f} | {mfu} | "
                  f"{err if entry.startswith('ours') else ''} |")


if __name__ == "__main__":
    main()
