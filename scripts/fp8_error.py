"""How far an FP8 forward lands from float32, by which block linears are quantised: one random DiT of
a named config (full width and depth), one small latent, on a device with FP8 units or the CPU (which
emulates them: the arithmetic is `wan_tpu.layers.quantized`'s exactly).

    python scripts/fp8_error.py --config 1.3b --latent 3,16,16 --text 64
    python scripts/fp8_error.py --config 1.3b --latent 5,30,52 --text 512 --dtype bfloat16   # as the device compares
    python scripts/fp8_error.py --config 1.3b --text 512 --dtype bfloat16 --init nnx --seed 1  # bench_dit.py's weights

Prints, per recipe, the relative L2 error of the DiT output against the float32 forward of the same
weights, and the share of the forward's linear FLOPs the recipe runs in FP8; first the bf16 model's. Also one linear alone
(Gaussian 512×dim activations through a dim×dim N(0, 1/dim) kernel) against float64: the per-product
floor of each format. Reference for the issue-16 quality target (≤ 3e-2 of one forward).

Random weights decide which recipe looks best: with `--init presets` (`presets.random_module`: biases
N(0, 0.02²)) the attention projections carry the error and the FFN alone stays near 2e-2; with
`--init nnx` (the modules' own initialisers, zero biases: what `bench_dit.py` draws on the device)
the FFN's proj_out does and FFN-only lands near 5e-2. The device matches the CPU for the same
weights (docs/PERFORMANCE.md, ninth session), so neither figure says how trained weights fare.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu import quantize
from wan_tpu.configs.models import VARIANTS
from wan_tpu.layers.quantized import quantize_weight, quantized_matmul
from wan_tpu.models.transformer import WanTransformer, forward
from wan_tpu.presets import random_module

ATTENTION = tuple(p for p in quantize.BLOCK_LINEARS if p[0] != "ffn")
FFN = tuple(p for p in quantize.BLOCK_LINEARS if p[0] == "ffn")
RECIPES = {
    "all block linears": quantize.BLOCK_LINEARS,
    "FFN only": FFN,
    "attention only": ATTENTION,
    "FFN in only (proj_in)": (("ffn", "proj_in"),),
    "all but FFN out": tuple(p for p in quantize.BLOCK_LINEARS if p != ("ffn", "proj_out")),
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def linear_floor(dim: int) -> dict:
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (512, dim), jnp.float32)
    w = jax.random.normal(k[1], (dim, dim), jnp.float32) / np.sqrt(dim)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    wq, s = quantize_weight(w, "fp8")
    return {"bf16 × bf16": rel((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32), ref),
            "e4m3 × e4m3 (per-token, per-channel scales)": rel(quantized_matmul(x, wq, s, out_dtype=jnp.float32), ref),
            "e4m3 weights, f32 activations": rel(x @ (wq.astype(jnp.float32) * s[None]), ref)}


def linear_flops(cfg, tokens: int, text: int) -> dict:
    """Multiply-adds per block linear for `tokens` video and `text` text tokens (the text is projected to
    the model width before the blocks; a text-to-video DiT has no image-context projections)."""
    d, f = cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim
    macs = {("attn1", n): tokens * d * d for n in ("to_q", "to_k", "to_v", "to_out")}
    macs |= {("attn2", "to_q"): tokens * d * d, ("attn2", "to_out"): tokens * d * d,
             ("attn2", "to_k"): text * d * d, ("attn2", "to_v"): text * d * d,
             ("ffn", "proj_in"): tokens * d * f, ("ffn", "proj_out"): tokens * f * d}
    return macs


_forward = jax.jit(forward, static_argnums=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="1.3b", choices=("1.3b", "14b", "5b", "tiny"))
    p.add_argument("--latent", default="3,16,16", help="F,H,W of the latent")
    p.add_argument("--text", type=int, default=64, help="text tokens")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model's and activations' dtype; the reference is that model unquantised "
                        "(bfloat16: what scripts/bench_dit.py compares on the device)")
    p.add_argument("--init", default="presets", choices=("presets", "nnx"),
                   help="random weights: presets.random_module's (the usual fan-in scales), or the modules' "
                        "own initialisers (what scripts/bench_dit.py draws on the device)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (inputs keep seed 0)")
    args = p.parse_args(argv)
    variant = {"1.3b": "wan2.1-t2v-1.3b", "14b": "wan2.1-t2v-14b", "5b": "wan2.2-ti2v-5b", "tiny": "tiny"}[args.config]
    cfg = VARIANTS[variant].transformer
    latent = tuple(int(v) for v in args.latent.split(","))
    d = cfg.num_attention_heads * cfg.attention_head_dim
    print(f"one linear, 512 × {d} through {d} × {d}, relative error against float64:")
    for name, err in linear_floor(d).items():
        print(f"  {name:48s} {err:.2e}")

    # The same seed draws the same weights in either dtype (rounded to bf16; float32 modules stay float32).
    def build(dtype):
        make = lambda: WanTransformer(cfg, dtype=dtype, rngs=nnx.Rngs(args.seed))  # noqa: E731
        return random_module(make, seed=args.seed) if args.init == "presets" else nnx.jit(make)()
    dtype = jnp.dtype(args.dtype)
    graphdef, state = nnx.split(build(dtype))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, cfg.in_channels, *latent)), dtype)
    t = jnp.asarray([900.0], jnp.float32)
    c = jnp.asarray(rng.standard_normal((1, args.text, cfg.text_dim)), dtype)
    run = lambda g, s, x, c: np.asarray(_forward(g, s, x, t, c).astype(jnp.float32))  # noqa: E731
    ref = run(graphdef, state, x, c)
    tokens = (latent[0] // cfg.patch_size[0]) * (latent[1] // cfg.patch_size[1]) * (latent[2] // cfg.patch_size[2])
    flops = linear_flops(cfg, tokens, args.text)
    print(f"\n{variant}, {cfg.num_layers} blocks, latent {latent} ({tokens} tokens), {args.text} text tokens: "
          f"FP8 forward against {args.dtype}")
    print(f"  {'recipe (block linears in e4m3)':34s} {'rel. error':>10s} {'share of linear FLOPs':>22s}")
    if args.dtype == "float32":
        # The bf16 model against float32: where bench_dit.py's FP8 rows (against bf16) start from.
        gb, sb = nnx.split(build(jnp.bfloat16))
        out = run(gb, sb, x.astype(jnp.bfloat16), c.astype(jnp.bfloat16))
        print(f"  {'bf16 weights and activations':34s} {rel(out, ref):10.2e} {'':>22s}")
    for name, linears in RECIPES.items():
        model = nnx.merge(graphdef, state)  # shares the unquantised arrays; quantising replaces its linears only
        quantize.quantize_transformer(model, "fp8", linears=linears)
        g, s = nnx.split(model)
        out = run(g, s, x, c)
        share = sum(flops.get(p, 0) for p in linears) / sum(flops.values())
        print(f"  {name:34s} {rel(out, ref):10.2e} {share:22.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
