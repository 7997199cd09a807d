"""Attention forward on one NVIDIA GPU: a sweep of our Hopper kernel's variants against jax cuDNN
and torch SDPA, each variant checked against a float32 reference before it is timed.

    python benchmarks/bench_attention.py                      # the default sweep, all four shapes (~4 min on H200)
    python benchmarks/bench_attention.py --shapes self480,cross512 --variants 64x192x2,64x192x2xp
    python benchmarks/bench_attention.py --tiny               # the script's own CPU dry run (interpret mode)

Shapes (B=1, D=128, bf16): self480 12 h × 32,760 (Wan 1.3B 480p), self720 40 h × 75,600 (14B 720p),
self5b 24 h × 27,280 (TI2V 5B 704×1280), cross512 12 h × 32,760 q × 512 text keys, cross769 × 769 keys
(257 image + 512 text). Short on both sides (`tuning.gpu_shape_class` "short", not in the default run):
mg2640 12 h × 2,640 (Matrix-Game-2's first chunk over its own frames), wma_spatial B=16 × 5 h × 2,560, D=64 (UnifoLM-WMA at 320×512),
wma_temporal B=2,560 × 5 h × 16 frames, D=64.
Variants of `wan_tpu/kernels/flash_mgpu.py`, written `BQxBKVxSTAGES[xp[N]][xq]`: block_q rows per compute
warpgroup × block_kv keys per step × K/V ring depth; `p` = persistent (one CTA per SM, or N CTAs,
each walking (head, q tile) tiles with one continuous K/V ring), `q` = q tiles fastest in the grid
(CTAs running together share a head's K/V in L2), `f` = the FP8 kernel (`mgpu_attention_fp8`: checked
at ≤ 6e-2 instead of 1e-2), `i` = the same with int8 Q·Kᵀ (`qk_int8=True`), `t` = each step's P·V summed
from zero, then added in float32 (`pv_two_level=True`, either kernel: `64x256x2xixt`, `64x192x2xt`), `o` = FA3's intra-warpgroup
overlap (`overlap=True`, bf16 kernel: `64x128x2xo`), `e` = P in f16, its row sums as packed f16 adds
(one a pair of keys), P·V in f16 (`half_p=True`, bf16 kernel), `s` = with `e`, the row max kept from step to
step unless the row sums pass a limit (`stale_max=True`), `r` = the FP8 kernel's row sums taken by P·V
(`pv_row_sums=True`: transposed V gets a row of ones). `--variants` replaces the default list of every
shape class (`SELF_VARIANTS`, `CROSS_VARIANTS`).

Every entry runs in its own try/except (a variant that fails to compile prints its error and the
sweep goes on). Before timing, 256 query rows spread over the sequence, first and last head, of
each output are compared with a float32
XLA reference (relative Frobenius error ≤ 1e-2, else FAIL and not timed). Timing: median of 5
batches of back-to-back calls. TFLOP/s = 4·Sq·Skv·D·H ÷ time; "× cuDNN" = jax cuDNN's time ÷
this entry's. The bf16 8192³ matmul is measured first, in the same process. Peers: `--peers
cudnn,torch[,mha]` (mha: JAX's Pallas Triton kernel, lengths padded to 128; slow, off by default).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from wan_tpu.layers.attention import attention, reference_attention  # noqa: E402

SHAPES = {  # name: (heads, Sq, Skv)
    "self480": (12, 32760, 32760),
    "self720": (40, 75600, 75600),
    "self5b": (24, 27280, 27280),
    "cross512": (12, 32760, 512),
    "cross769": (12, 32760, 769),
    # (heads, Sq, Skv, batch, head dim) where they differ from B=1, D=128
    "mg2640": (12, 2640, 2640),
    "wma_spatial": (5, 2560, 2560, 16, 64),
    "wma_temporal": (5, 16, 16, 2560, 64),
}
DEFAULT_SHAPES = ("self480", "self720", "cross512", "cross769")
TINY_SHAPES = {"self480": (2, 300, 300), "cross512": (2, 300, 40)}
# What one sweep tries; the shared-memory limit (227 KiB) allows block_kv 192 only with 2 stages
# and 128 with 3. Cross-attention has 4-7 kv steps per tile, so the persistent walk (no pipeline
# fill or drain between tiles) with FA3's intra-warpgroup overlap (`o`) is its main candidate (the
# shipped choice); `64x256x2xixtxhxcxr` is the shipped 8-bit kernel. The tuned row is the shipped
# self-attention kernel (`tuning.GPU_BLOCKS["self"]`: 64x128x2xexsxhxc); 64x192x2 is the pre-`half_p` tiles.
# Persistent variants come last: if one ever hung on a device, the rows before it are already printed.
SELF_VARIANTS = ("64x192x2", "64x128x3", "64x192x2xq", "64x128x2xo", "64x256x2xixtxhxcxr", "64x192x2xp", "64x128x3xp")
CROSS_VARIANTS = ("64x128x2", "64x64x4", "64x128x2xq", "64x128x2xo", "64x128x3xp", "64x128x3xpxo", "64x64x4xp")
D = 128
SLICE_Q = 256
TOL = 1e-2
TOL_FP8 = 6e-2  # e4m3 Q, K, V and P: three mantissa bits (per-element rounding up to 6%)
VARIANT = re.compile(r"^(\d+)x(\d+)x(\d+)((?:x(?:p\d*|q|f|i|t|o|h|e|s|r|c\d*))*)$")


def parse_variant(spec: str, sms: int) -> dict:
    """`64x192x2xp` → mgpu_attention kwargs (p without a number: one CTA per SM; f, i, t: the FP8
    kernel, `fp8=True` here, popped by the caller)."""
    m = VARIANT.match(spec)
    if not m:
        raise SystemExit(f"bad variant {spec!r}: write BQxBKVxSTAGES[xp[N]][xq][xf|xi][xt][xo][xh][xe][xs][xr][xc[N]], e.g. 64x192x2xp")
    kw = dict(block_q=int(m[1]), block_kv=int(m[2]), stages=int(m[3]))
    for flag in filter(None, m[4].split("x")):
        if flag == "q":
            kw["q_major"] = True
        elif flag in ("f", "i"):  # the FP8 kernel; i: with int8 Q·Kᵀ
            kw["fp8"] = True
            kw["qk_int8"] = kw.get("qk_int8", False) or flag == "i"
            kw.setdefault("pv_two_level", False)
            kw.setdefault("pv_row_sums", False)  # only with r
        elif flag == "t":  # two-level P·V sums (either kernel)
            kw["pv_two_level"] = True
        elif flag == "o":  # FA3's intra-warpgroup overlap (bf16 kernel; implies h)
            kw["overlap"] = True
        elif flag == "h":  # FA3's turn hand-over between the compute warpgroups (either kernel)
            kw["fa3_turns"] = True
        elif flag == "e":  # P in f16, row sums by packed f16 adds, P·V in f16 (bf16 kernel)
            kw["half_p"] = True
        elif flag == "s":  # the running max kept unless the row sums pass a limit (with e)
            kw["stale_max"] = True
        elif flag == "r":  # the row sums taken by P·V (V's row of ones; FP8 kernel)
            kw["pv_row_sums"] = True
        elif flag[0] == "c":  # FA3's CTA pairs (c: 2, c4: 4 CTAs): each K/V tile loaded once for them all
            kw["cluster"] = int(flag[1:] or 2)
        else:
            kw["persistent"] = int(flag[1:] or sms)
    return kw


def _short(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:150]}"


def jax_entries(variants, peers, sms, interpret):
    from wan_tpu.kernels.flash_mgpu import mgpu_attention, mgpu_attention_fp8

    entries = {"ours (pallas_gpu, tuned)": functools.partial(attention, impl="pallas_gpu", interpret=interpret)}
    for spec in variants:
        kw = parse_variant(spec, sms)
        kernel = mgpu_attention_fp8 if kw.pop("fp8", False) else mgpu_attention
        entries[f"ours mgpu {spec}"] = functools.partial(kernel, **kw)
    if not interpret:
        entries["jax cuDNN"] = functools.partial(attention, impl="cudnn")
    if "mha" in peers and not interpret:
        entries["jax Pallas Triton mha"] = _bundled_mha
    return {name: jax.jit(fn) for name, fn in entries.items()}


def _bundled_mha(q, k, v):
    """JAX's bundled Pallas Triton kernel; its segment ids mask the padding to 128 (self-attention only)."""
    from jax.experimental.pallas.ops.gpu import attention as bundled

    sq = q.shape[1]
    if k.shape[1] != sq:
        raise NotImplementedError("the bundled mha pads q and k with one segment-id array: self-attention only")
    n = -(-sq // 128) * 128
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n - sq), (0, 0), (0, 0)))  # noqa: E731
    seg = jnp.broadcast_to((jnp.arange(n) < sq).astype(jnp.int32)[None], (q.shape[0], n))
    return bundled.mha(pad(q), pad(k), pad(v), seg, sm_scale=1 / np.sqrt(q.shape[-1]))[:, :sq]


def torch_entries():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        return run

    return {"torch SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "torch SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}


def bench_shape(name, shape, variants, peers, sms, interpret):
    heads, sq, skv, batch, d = (*shape, 1, D) if len(shape) == 3 else shape
    flops = 4 * batch * sq * skv * d * heads
    kq, kk, kv = jax.random.split(jax.random.key(int(time.time())), 3)
    # Drawn in float32, then rounded: jax's bf16 sampler has only 128 distinct values and a biased
    # mean, whose e4m3 rounding errors add up instead of averaging out (FP8 entries: 0.19 vs 0.05).
    q, k, v = (jax.random.normal(key, (batch, n, heads, d), jnp.float32).astype(jnp.bfloat16)
               for key, n in ((kq, sq), (kk, skv), (kv, skv)))
    # The checked slice: 256 query rows spread over the whole sequence (every q tile region, so
    # every CTA schedule is exercised), the first and the last head.
    rows = slice(None, None, max(1, sq // SLICE_Q))
    heads_checked = jnp.array([0, heads - 1])
    pick = lambda o: o[:, rows][:, :, heads_checked]  # noqa: E731
    ref = np.asarray(reference_attention(*(x[:, :, heads_checked].astype(jnp.float32) for x in (q[:, rows], k, v))))
    # Median of 5 batches of back-to-back calls, each batch ≥ ~0.2 s (a guess at 500 TFLOP/s).
    calls = max(2, min(50, int(0.2 / max(flops / 500e12, 1e-5))))
    results = []

    def run(label, fn, out_slice, sync):
        try:
            err = harness.rel_error(out_slice(), ref)  # correctness first: a wrong variant is never timed
            if not err <= (TOL_FP8 if {"f", "i"} & set(label.split()[-1].split("x")) else TOL):
                results.append((label, None, f"FAIL rel. err {err:.1e}"))
            else:
                results.append((label, harness.measure(fn, sync, iters=5, batch=calls).ms, err))
        except Exception as e:  # one failing entry must not hide the others
            results.append((label, None, _short(e)))
        print(f"  {name}: {results[-1]}", flush=True)

    for label, fn in jax_entries(variants, peers, sms, interpret).items():
        if interpret and label.startswith("ours mgpu"):
            # No Hopper here: check that the variant lowers to a Mosaic GPU kernel for CUDA.
            try:
                fn.trace(q, k, v).lower(lowering_platforms=("cuda",))
                results.append((label, None, "lowers for CUDA (not run: no Hopper GPU)"))
            except Exception as e:
                results.append((label, None, _short(e)))
            continue
        run(label, lambda fn=fn: fn(q, k, v), lambda fn=fn: pick(fn(q, k, v)), lambda o: o.block_until_ready())
    if "torch" in peers and not interpret:
        import torch

        tq, tk, tv = (torch.from_dlpack(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
        for label, fn in torch_entries().items():
            run(label, lambda fn=fn: fn(tq, tk, tv),
                lambda fn=fn: fn(tq, tk, tv)[:, [0, heads - 1], rows].permute(0, 2, 1, 3).float().cpu().numpy(),
                lambda o: torch.cuda.synchronize())
        del tq, tk, tv
    cudnn_ms = dict((r[0], r[1]) for r in results).get("jax cuDNN")
    rows = []
    for label, ms, err in results:
        where = f"{name} {heads}h {sq}×{skv}" + (f" B{batch} D{d}" if (batch, d) != (1, D) else "")
        if ms is None:
            rows.append(harness.row(where, label, "–", "–", "–", err))
        else:
            ratio = f"{cudnn_ms / ms:.3f}" if cudnn_ms else "–"
            rows.append(harness.row(where, label, f"{ms:.3f}", f"{flops / ms / 1e9:.0f}", ratio, f"{err:.1e}"))
    print("\n".join(rows), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma separated, from {list(SHAPES)}")
    parser.add_argument("--variants", default="", help="Hopper kernel variants for every shape (default: per shape class)")
    parser.add_argument("--peers", default="cudnn,torch", help="peers besides jax cuDNN: torch, mha")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny shapes, our kernel in interpret mode")
    args = parser.parse_args()
    from wan_tpu.runtime.profiling import measured_peak_flops

    harness.print_env(jax.devices())
    device = jax.devices()[0]
    interpret = args.tiny or device.platform != "gpu"
    sms = getattr(device, "core_count", 0) or 132
    peak = measured_peak_flops(8192 if not interpret else 256) / 1e12
    import torch

    print(f"{sms} SMs; cuDNN (torch) {torch.backends.cudnn.version()}; "
          f"bf16 matmul {'8192' if not interpret else '256'}^3 {peak:.0f} TFLOP/s", flush=True)
    shapes = TINY_SHAPES if interpret else SHAPES
    rows = []
    for name in args.shapes.split(","):
        if name not in shapes:
            continue
        given = [v for v in args.variants.split(",") if v]
        variants = given or (SELF_VARIANTS if name.startswith("self") else CROSS_VARIANTS)
        rows += bench_shape(name, shapes[name], variants, args.peers.split(","), sms, interpret)
    print(f"\nbf16 8192^3 matmul in this run: {peak:.0f} TFLOP/s")
    print(harness.header("shape", "impl", "ms", "TFLOP/s", "× jax cuDNN", "rel. err (≤1e-2)"))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
