"""A LoRA on an FP8 / int8 DiT: kept as a separate low-rank term beside the quantised product (what
`wan_tpu.wan.lora` does: `LowRankQuantizedLinear`), against merging it into the dequantised weight and
quantising that again (done here with `quantize_weight`, as `load_lora` does for full `diff` deltas).
Errors of both against the unquantised model with the LoRA merged exactly, and the quantisation error
without a LoRA for scale.

    python benchmarks/lora_quantized_error.py                                  # tiny DiT, CPU, seconds
    python benchmarks/lora_quantized_error.py --config 1.3b --latent 3,16,16 --format int8
    python benchmarks/lora_quantized_error.py --config 1.3b --strength 0.3 --rank 64   # lightx2v-like
    python benchmarks/lora_quantized_error.py --config 1.3b --latent 21,60,104 --text 512 --dtype bfloat16 \
        --rank 64 --time 10                  # on a GPU: also the forward's time with the low-rank terms

A random rank-`--rank` LoRA on every block linear, its update `--strength` × the weight's norm, written in
the kohya layout and loaded through `load_lora`. `--time N`: also the median of N compiled forwards of the
quantised DiT without and with the LoRA's low-rank terms (their cost). First one linear alone
(512 Gaussian tokens through a dim×dim N(0, 1/dim) kernel) against float64, then the whole DiT forward.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

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

_forward = jax.jit(forward, static_argnums=0)


def random_lora(rng, shape_out_in, rank: int, strength: float, weight_norm: float):
    """(down (rank, in), up (out, rank)) whose product has Frobenius norm `strength` × `weight_norm`."""
    out, inp = shape_out_in
    down = rng.standard_normal((rank, inp)).astype(np.float32)
    up = rng.standard_normal((out, rank)).astype(np.float32)
    delta = np.linalg.norm(up @ down)
    up *= np.float32(strength * weight_norm / delta)
    return down, up


def one_linear(dim: int, rank: int, strength: float, fmt: str) -> dict:
    """Relative errors of one linear's output against float64 x·(W + ΔW)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, dim)).astype(np.float32)
    w = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)  # (in, out)
    down, up = random_lora(rng, (dim, dim), rank, strength, np.linalg.norm(w))
    delta = (up @ down).T  # (in, out)
    exact = x.astype(np.float64) @ (w.astype(np.float64) + delta)
    wq, s = quantize_weight(jnp.asarray(w), fmt)
    merged_q, merged_s = quantize_weight(wq.astype(jnp.float32) * s[None] + jnp.asarray(delta), fmt)
    base = quantized_matmul(jnp.asarray(x), wq, s, fmt=fmt, out_dtype=jnp.float32)
    return {
        "no LoRA (quantised W against W)": harness.rel_error(base, x.astype(np.float64) @ w),
        "merged and quantised again": harness.rel_error(
            quantized_matmul(jnp.asarray(x), merged_q, merged_s, fmt=fmt, out_dtype=jnp.float32), exact),
        "separate low-rank term": harness.rel_error(np.asarray(base) + (x @ down.T) @ up.T, exact),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", choices=("tiny", "1.3b", "14b"))
    p.add_argument("--latent", default="2,8,8", help="F,H,W of the latent")
    p.add_argument("--text", type=int, default=16, help="text tokens")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--strength", type=float, default=0.1, help="‖ΔW‖ / ‖W‖ of each layer's update")
    p.add_argument("--format", default="fp8", choices=quantize.MODES)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the quantised DiTs' dtype (the reference stays float32)")
    p.add_argument("--time", type=int, default=0, metavar="N", help="time N forwards without / with the LoRA")
    args = p.parse_args(argv)
    harness.print_env(jax.devices())
    variant = {"tiny": "tiny", "1.3b": "wan2.1-t2v-1.3b", "14b": "wan2.1-t2v-14b"}[args.config]
    cfg = VARIANTS[variant].transformer
    d = cfg.num_attention_heads * cfg.attention_head_dim
    print(f"one linear, 512 × {d} through {d} × {d} with a rank-{args.rank} update of {args.strength:g}×‖W‖, "
          f"{args.format}, relative error against float64:")
    print(harness.table(("LoRA on the quantised linear", "rel. error"),
                        ((n, f"{e:.2e}") for n, e in one_linear(d, args.rank, args.strength, args.format).items())))

    from safetensors.numpy import save_file

    dtype = jnp.dtype(args.dtype)
    build = lambda dt=dtype: random_module(lambda: WanTransformer(cfg, dtype=dt, rngs=nnx.Rngs(0)), seed=0)  # noqa: E731
    rng = np.random.default_rng(1)
    entries, factors = {}, {}
    reference = build(jnp.float32)
    for parent, name in quantize.BLOCK_LINEARS:
        linear = getattr(getattr(reference.blocks, parent), name, None)
        if linear is None:
            continue
        kernel = np.asarray(linear.kernel[...])  # (layers, in, out)
        downs, ups = [], []
        for layer in range(cfg.num_layers):
            down, up = random_lora(rng, kernel.shape[:0:-1], args.rank, args.strength, np.linalg.norm(kernel[layer]))
            wan = {"to_out": "o", "to_q": "q", "to_k": "k", "to_v": "v", "proj_in": "0", "proj_out": "2"}[name]
            group = {"attn1": "self_attn", "attn2": "cross_attn", "ffn": "ffn"}[parent]
            module = f"diffusion_model.blocks.{layer}.{group}.{wan}"
            entries |= {f"{module}.lora_down.weight": down, f"{module}.lora_up.weight": up}
            downs.append(down.T)
            ups.append(up.T)
        factors[(parent, name)] = (np.stack(downs), np.stack(ups))
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "lora.safetensors")
    save_file(entries, path)

    rng = np.random.default_rng(0)
    latent = tuple(int(v) for v in args.latent.split(","))
    x = jnp.asarray(rng.standard_normal((1, cfg.in_channels, *latent)), jnp.float32)
    t = jnp.asarray([900.0], jnp.float32)
    c = jnp.asarray(rng.standard_normal((1, args.text, cfg.text_dim)), jnp.float32)
    def run(m):
        dt = jnp.dtype(m.dtype)
        return np.asarray(_forward(*nnx.split(m), x.astype(dt), t, c.astype(dt)).astype(jnp.float32))

    plain = run(reference)
    reference.load_lora(path)
    exact = run(reference)

    base = quantize.quantize_transformer(build(), args.format)
    rows = [("no LoRA (quantised DiT against float32)", harness.rel_error(run(base), plain))]
    separate = quantize.quantize_transformer(build(), args.format)
    separate.load_lora(path)
    rows.append(("separate low-rank term (wan_tpu.wan.lora)", harness.rel_error(run(separate), exact)))
    merged = quantize.quantize_transformer(build(), args.format)
    for (parent, name), (down, up) in factors.items():
        layer = getattr(getattr(merged.blocks, parent), name)
        w = layer.kernel[...].astype(jnp.float32) * layer.kernel_scale[...][:, None, :] + jnp.einsum("lir,lro->lio", down, up)
        kernel, scale = quantize_weight(w, args.format)
        layer.kernel.set_value(kernel)
        layer.kernel_scale.set_value(scale)
    rows.append(("merged and quantised again", harness.rel_error(run(merged), exact)))
    print(f"\n{variant}, {cfg.num_layers} blocks, latent {latent}, {args.format} block linears, rank {args.rank}, "
          f"update {args.strength:g}×‖W‖ on each: DiT output against float32 with the LoRA merged exactly")
    print(harness.table(("LoRA on the quantised DiT", "rel. error"), ((n, f"{e:.2e}") for n, e in rows)))
    if args.time:
        times = {}
        for name, model in (("without the LoRA", base), ("with its low-rank terms", separate)):
            graphdef, state = nnx.split(model)
            inputs = (x.astype(dtype), t, c.astype(dtype))
            times[name] = harness.measure(lambda g=graphdef, st=state: _forward(g, st, *inputs), jax.block_until_ready,
                                          iters=args.time).ms
        extra = times["with its low-rank terms"] / times["without the LoRA"] - 1
        print(f"\n{args.dtype} {args.format} DiT forward, median of {args.time} (ms); rank {args.rank}: "
              f"{extra:+.1%} with the LoRA")
        print(harness.table(("forward", "ms"), ((n, f"{v:.1f}") for n, v in times.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
