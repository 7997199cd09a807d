"""How far an FP8 (or int8) forward lands from float32, by which block linears are quantised: one random
DiT of a named config (full width and depth), one small latent, on a device with FP8 units or the CPU
(which emulates them: the arithmetic is `wan_tpu.layers.quantized`'s exactly).

    python benchmarks/fp8_error.py --config 1.3b --latent 3,16,16 --text 64
    python benchmarks/fp8_error.py --config 1.3b --latent 5,30,52 --text 512 --dtype bfloat16   # as the device compares
    python benchmarks/fp8_error.py --config 1.3b --text 512 --dtype bfloat16 --init nnx --seed 1  # bench_dit.py's weights
    python benchmarks/fp8_error.py --config 1.3b --text 512 --dtype bfloat16 --init nnx --format int8  # int8 linears
    python benchmarks/fp8_error.py --config 1.3b --text 512 --dtype bfloat16 --init nnx --attention  # + 8-bit attention
    ... --attention --acc-bits 13,0   # + the kernel's loop step by step, P·V sums cut to 13 bits / float32

Prints, per recipe, the relative L2 error of the DiT output against the float32 forward of the same
weights, and the share of the forward's linear FLOPs the recipe runs in FP8; first the bf16 model's. Also one linear alone
(Gaussian 512×dim activations through a dim×dim N(0, 1/dim) kernel) against float64: the per-product
floor of each format. Reference for the FP8 quality target (≤ 3e-2 relative error of one forward).

Random weights decide which recipe looks best: with `--init presets` (`presets.random_module`: biases
N(0, 0.02²)) the attention projections carry the error and the FFN alone stays near 2e-2; with
`--init nnx` (the modules' own initialisers, zero biases: what `bench_dit.py` draws on the device)
the FFN's proj_out does and FFN-only lands near 5e-2. The device matches the CPU for the same
weights (docs/PERFORMANCE.md), so neither figure says how trained weights fare.
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
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from wan_tpu.configs.models import VARIANTS  # noqa: E402
from wan_tpu.layers.quantized import quantize_weight, quantized_matmul  # noqa: E402
from wan_tpu.loading.random_init import random_module  # noqa: E402
from wan_tpu.wan import quantize  # noqa: E402
from wan_tpu.wan.transformer import WanTransformer, forward  # noqa: E402

ATTENTION = tuple(p for p in quantize.BLOCK_LINEARS if p[0] != "ffn")
FFN = tuple(p for p in quantize.BLOCK_LINEARS if p[0] == "ffn")
RECIPES = {
    "all block linears": quantize.BLOCK_LINEARS,
    "FFN only": FFN,
    "attention only": ATTENTION,
    "FFN in only (proj_in)": (("ffn", "proj_in"),),
    "all but FFN out": tuple(p for p in quantize.BLOCK_LINEARS if p != ("ffn", "proj_out")),
}


# Self-attention in 8 bits, emulated (the FP8 kernel's scaled arithmetic, `flash_mgpu.fp8_operands`;
# P rounded against the row's final max): name → (Q·Kᵀ format or None for bf16, P·V in e4m3?).
ATTENTION_RECIPES = {
    "attn int8 QK + e4m3 PV (shipped)": ("int8", True),
    "attn e4m3 QK + e4m3 PV": ("e4m3", True),
    "attn int8 QK, bf16 PV": ("int8", False),
    "attn bf16 QK, e4m3 PV": (None, True),
}


def emulated_8bit_attention(q, k, v, qk, pv):
    """(B, S, H, D) → (B, Sq, H, D): `pallas_gpu_fp8`'s arithmetic in float32 on any backend, with Q·Kᵀ in
    `qk` ("int8", "e4m3" or None: the inputs as given) and P·V in e4m3 (`pv`) or float32."""
    from wan_tpu.kernels.flash_mgpu import LOG2E, P_SHIFT, fp8_operands

    sq, skv = q.shape[1], k.shape[1]
    q8, k8, vt8, scales = fp8_operands(q, k, v, qk_int8=qk == "int8")
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    if qk:
        s = jnp.einsum("bqhd,bkhd->bhqk", f32(q8[:, :sq]), f32(k8[:, :skv])) * scales[:, :, 0, :sq, None]
    else:
        s = jnp.einsum("bqhd,bkhd->bhqk", f32(q), f32(k)) * (LOG2E / np.sqrt(q.shape[-1]))
    p = jnp.exp2(s - s.max(-1, keepdims=True) + P_SHIFT)
    l = p.sum(-1, keepdims=True)
    if pv:
        o = jnp.einsum("bhqk,bhdk->bhqd", f32(p.astype(jnp.float8_e4m3fn)), f32(vt8[..., :skv])) / l
        o = o * scales[:, :, 1, :sq, None]
    else:
        o = jnp.einsum("bhqk,bkhd->bhqd", p, f32(v)) / l
    return o.transpose(0, 2, 1, 3).astype(q.dtype)


def _truncate_mantissa(x, bits):
    """float32 → float32 with only `bits` mantissa bits kept (rounded toward zero)."""
    drop = 23 - bits
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(u & jnp.uint32((0xFFFFFFFF >> drop) << drop), jnp.float32)


def emulated_kernel_attention(q, k, v, acc_bits, block_kv=256, chunk=32):
    """The shipped kernel's loop (int8 Q·Kᵀ, e4m3 P·V), emulated step by step: online softmax over
    `block_kv`-key steps, P rounded against the running max, and each `chunk` keys' e4m3 products added
    into the running accumulator that is then cut to `acc_bits` mantissa bits. A mild model of Hopper's
    FP8 accumulation: the hardware reportedly cuts each product before it adds it (`aligned_sum`, per
    call in `accumulation_study`), which loses far more once the sum is large."""
    from wan_tpu.kernels.flash_mgpu import P_SHIFT, fp8_operands

    sq, skv = q.shape[1], k.shape[1]
    q8, k8, vt8, scales = fp8_operands(q, k, v, qk_int8=True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    steps = -(-skv // block_kv)
    pad = steps * block_kv - skv
    kk = jnp.pad(f32(k8[:, :skv]), ((0, 0), (0, pad), (0, 0), (0, 0)))
    vt = jnp.pad(f32(vt8[..., :skv]), ((0, 0), (0, 0), (0, 0), (0, pad)))
    qq, cs = f32(q8[:, :sq]), scales[:, :, 0, :sq, None]
    b, h, d = q.shape[0], q.shape[2], q.shape[3]

    def step(j, carry):
        acc, m, l = carry
        kj = jax.lax.dynamic_slice_in_dim(kk, j * block_kv, block_kv, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(vt, j * block_kv, block_kv, axis=3)
        sj = jnp.einsum("bqhd,bkhd->bhqk", qq, kj) * cs
        valid = (j * block_kv + jnp.arange(block_kv)) < skv
        sj = jnp.where(valid, sj, -jnp.inf)
        m_new = jnp.maximum(m, sj.max(-1, keepdims=True))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sj - m_new + P_SHIFT)
        l = l * alpha + p.sum(-1, keepdims=True)
        p8 = f32(p.astype(jnp.float8_e4m3fn))
        acc = acc * alpha
        for c in range(0, block_kv, chunk):
            part = jnp.einsum("bhqk,bhdk->bhqd", p8[..., c:c + chunk], vj[..., c:c + chunk])
            acc = acc + part if acc_bits is None else _truncate_mantissa(acc + part, acc_bits)
        return acc, m_new, l

    init = (jnp.zeros((b, h, sq, d), jnp.float32), jnp.full((b, h, sq, 1), -jnp.inf), jnp.zeros((b, h, sq, 1)))
    acc, _, l = jax.lax.fori_loop(0, steps, step, init)
    o = acc / l * scales[:, :, 1, :sq, None]
    return o.transpose(0, 2, 1, 3).astype(q.dtype)


def aligned_sum(acc, prods, bits):
    """acc + Σ prods (over axis 1), each product first cut (toward zero) to the grid of `bits` bits below
    acc's leading bit: the rule by which Hopper's FP8 MMA adds products into its accumulator, as far as
    DeepSeek-V3's report describes it (about 14 bits kept). acc (n, d), prods (n, m, d)."""
    grid = jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(jnp.abs(acc), 1e-30))) - bits)[:, None, :]
    cut = jnp.where(acc[:, None, :] == 0, prods, jnp.trunc(prods / grid) * grid)
    return acc + cut.sum(1)


def accumulation_study(keys: int, v_mean: float, bits: int, two_level: bool, queries=64, d=128, step=256, chunk=32):
    """One head's e4m3 P·V over `keys` keys (q, k ~ N(0, 1); v ~ v_mean + N(0, 0.3²)), P against the
    final max: relative error of the `aligned_sum` rule against exact float32 sums. `two_level`: each
    `step` keys summed from zero, then added in float32 (what `mgpu_attention_fp8(pv_two_level=True)` does)."""
    from wan_tpu.kernels.flash_mgpu import F8_MAX, LOG2E, P_SHIFT

    ks = jax.random.split(jax.random.key(0), 3)
    q, k = jax.random.normal(ks[0], (queries, d)), jax.random.normal(ks[1], (keys, d))
    v = v_mean + 0.3 * jax.random.normal(ks[2], (keys, d))
    s = q @ k.T * (LOG2E / np.sqrt(d))
    p = jnp.exp2(s - s.max(-1, keepdims=True) + P_SHIFT).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    v8 = (v * (F8_MAX / jnp.abs(v).max())).astype(jnp.float8_e4m3fn).astype(jnp.float32)  # one scale: it cancels
    exact = p @ v8

    def one_step(i, acc):
        pi = jax.lax.dynamic_slice_in_dim(p, i * step, step, 1)
        vi = jax.lax.dynamic_slice_in_dim(v8, i * step, step, 0)
        part = jnp.zeros_like(acc) if two_level else acc
        for c in range(0, step, chunk):
            part = aligned_sum(part, pi[:, c:c + chunk, None] * vi[None, c:c + chunk], bits)
        return acc + part if two_level else part

    out = jax.lax.fori_loop(0, keys // step, one_step, jnp.zeros((queries, d)))
    return harness.rel_error(out, exact)


def linear_floor(dim: int) -> dict:
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (512, dim), jnp.float32)
    w = jax.random.normal(k[1], (dim, dim), jnp.float32) / np.sqrt(dim)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    wq, s = quantize_weight(w, "fp8")
    w8, s8 = quantize_weight(w, "int8")
    return {"bf16 × bf16": harness.rel_error((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32), ref),
            "e4m3 × e4m3 (per-token, per-channel scales)": harness.rel_error(quantized_matmul(x, wq, s, out_dtype=jnp.float32), ref),
            "e4m3 weights, f32 activations": harness.rel_error(x @ (wq.astype(jnp.float32) * s[None]), ref),
            "int8 × int8 (per-token, per-channel scales)": harness.rel_error(
                quantized_matmul(x, w8, s8, fmt="int8", out_dtype=jnp.float32), ref)}


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
                        "(bfloat16: what benchmarks/bench_dit.py compares on the device)")
    p.add_argument("--init", default="presets", choices=("presets", "nnx"),
                   help="random weights: presets.random_module's (the usual fan-in scales), or the modules' "
                        "own initialisers (what benchmarks/bench_dit.py draws on the device)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (inputs keep seed 0)")
    p.add_argument("--format", default="fp8", choices=quantize.MODES, help="the quantised linears' format")
    p.add_argument("--attention", action="store_true",
                   help="also self-attention in 8 bits (emulated `pallas_gpu_fp8` recipes), linears unquantised")
    p.add_argument("--acc-bits", default="", type=lambda t: [int(b) or None for b in t.split(",") if b],
                   help="with --attention: also the kernel's loop with P·V sums cut to these mantissa bits "
                        "(e.g. 13,0; 0 = float32's 23)")
    p.add_argument("--accumulation", action="store_true",
                   help="only the per-call study of FP8 MMA accumulation (`accumulation_study`), then exit")
    args = p.parse_args(argv)
    harness.print_env(jax.devices())
    if args.accumulation:
        print("e4m3 P·V, one head, 64 queries; relative error of 14-bit-aligned accumulation vs exact sums")
        print(harness.header("keys", "V mean", "running accumulator", "fresh per 256 keys"))
        for keys in (2048, 8192, 32768):
            for v_mean in (0.0, 1.0):
                print(harness.row(keys, f"{v_mean:.1f}", f"{accumulation_study(keys, v_mean, 13, False):.2e}",
                                  f"{accumulation_study(keys, v_mean, 13, True):.2e}"), flush=True)
        return 0
    variant = {"1.3b": "wan2.1-t2v-1.3b", "14b": "wan2.1-t2v-14b", "5b": "wan2.2-ti2v-5b", "tiny": "tiny"}[args.config]
    cfg = VARIANTS[variant].transformer
    latent = tuple(int(v) for v in args.latent.split(","))
    d = cfg.num_attention_heads * cfg.attention_head_dim
    print(f"one linear, 512 × {d} through {d} × {d}, relative error against float64:")
    print(harness.table(("product", "rel. error"), ((name, f"{err:.2e}") for name, err in linear_floor(d).items())))

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
          f"{args.format} forward against {args.dtype}")
    print(harness.header(f"recipe (block linears in {args.format})", "rel. error", "share of linear FLOPs"))
    if args.dtype == "float32":
        # The bf16 model against float32: where bench_dit.py's FP8 rows (against bf16) start from.
        gb, sb = nnx.split(build(jnp.bfloat16))
        out = run(gb, sb, x.astype(jnp.bfloat16), c.astype(jnp.bfloat16))
        print(harness.row("bf16 weights and activations", f"{harness.rel_error(out, ref):.2e}", ""))
    for name, linears in RECIPES.items():
        model = nnx.merge(graphdef, state)  # shares the unquantised arrays; quantising replaces its linears only
        quantize.quantize_transformer(model, args.format, linears=linears)
        g, s = nnx.split(model)
        out = run(g, s, x, c)
        share = sum(flops.get(p, 0) for p in linears) / sum(flops.values())
        print(harness.row(name, f"{harness.rel_error(out, ref):.2e}", f"{share:.0%}"), flush=True)
    if args.attention:
        print()
        print(harness.header("self-attention emulated in 8 bits (block linears unquantised)", "rel. error"))
        kernel_loop = {f"kernel loop, {bits or 23}-bit accumulation": functools.partial(emulated_kernel_attention, acc_bits=bits)
                       for bits in args.acc_bits}
        for name, fn in {**{n: functools.partial(emulated_8bit_attention, qk=qk, pv=pv)
                            for n, (qk, pv) in ATTENTION_RECIPES.items()}, **kernel_loop}.items():
            model = nnx.merge(graphdef, state)
            model.self_attention = fn
            g, s = nnx.split(model)
            print(harness.row(name, f"{harness.rel_error(run(g, s, x, c), ref):.2e}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
