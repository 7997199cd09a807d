"""Attention forward benchmark on one NVIDIA GPU: our Pallas kernel against cuDNN and the peers.

    python scripts/bench_attention.py [--configs 64x128x2] [--shapes self480,self720,cross480]
        [--peers cudnn,mha,torch]

Entries: ours (`wan_tpu.attention(impl="pallas_gpu")`; `--configs` adds Hopper kernel variants as
block_q x block_kv x stages), jax cuDNN (`jax.nn.dot_product_attention`), JAX's bundled Pallas
Triton `mha` (lengths padded to 128, padded keys masked with segment ids), torch SDPA with the
flash and cuDNN backends. bf16, D=128, B=1, random inputs. Prints, per entry, the median time per
call (calls queued back to back, one sync per batch), TFLOP/s with FLOPs = 4·Sq·Skv·D·H, the ratio
to jax cuDNN, and the relative error of a 256-query, 2-head output slice against a float32 XLA
reference (must be ≤ 1e-2).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from wan_tpu.layers.attention import attention, reference_attention  # noqa: E402

SHAPES = {  # name: (heads, Sq, Skv)
    "self480": (12, 32760, 32760),
    "self720": (40, 75600, 75600),
    "cross480": (12, 32760, 512),
}
D = 128
SLICE_Q, SLICE_H = 256, 2


def time_calls(call, sync, seconds_per_call_hint):
    """Median ms per call over 5 batches of back-to-back calls (≥ ~0.2 s each)."""
    sync(call())
    sync(call())
    n = max(2, min(50, int(0.2 / max(seconds_per_call_hint, 1e-5))))
    per_call = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n - 1):
            call()
        sync(call())
        per_call.append((time.perf_counter() - start) / n)
    return statistics.median(per_call) * 1e3


def rel_error(out_slice, ref_slice):
    out_slice = np.asarray(out_slice, np.float32)
    return float(np.linalg.norm(out_slice - ref_slice) / np.linalg.norm(ref_slice))


def jax_entries(configs, peers):
    from jax.experimental.pallas.ops.gpu import attention as bundled
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    def bundled_mha(q, k, v):
        sq, skv = q.shape[1], k.shape[1]
        scale = 1.0 / np.sqrt(q.shape[-1])
        pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))  # noqa: E731
        if sq == skv:
            n = -(-sq // 128) * 128
            seg = jnp.broadcast_to((jnp.arange(n) < sq).astype(jnp.int32)[None], (q.shape[0], n))
            return bundled.mha(pad(q, n), pad(k, n), pad(v, n), seg, sm_scale=scale)[:, :sq]
        n = -(-sq // 128) * 128
        return bundled.mha(pad(q, n), k, v, None, sm_scale=scale)[:, :sq]

    entries = {"ours (pallas_gpu)": lambda q, k, v: attention(q, k, v, impl="pallas_gpu")}
    for cfg in configs:
        bq, bkv, st = (int(x) for x in cfg.split("x"))
        entries[f"ours mgpu {cfg}"] = functools.partial(mgpu_attention, block_q=bq, block_kv=bkv, stages=st)
    entries["jax cuDNN"] = lambda q, k, v: attention(q, k, v, impl="cudnn")
    if "mha" in peers:
        entries["jax Pallas Triton mha"] = bundled_mha
    return {name: jax.jit(fn) for name, fn in entries.items()}


def torch_entries():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        return run

    return {"torch SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "torch SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}


def bench_shape(name, configs, peers):
    import torch

    heads, sq, skv = SHAPES[name]
    flops = 4 * sq * skv * D * heads
    kq, kk, kv = jax.random.split(jax.random.key(int(time.time())), 3)
    q = jax.random.normal(kq, (1, sq, heads, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, skv, heads, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, skv, heads, D), jnp.bfloat16)
    ref = np.asarray(reference_attention(*(x[:, :, :SLICE_H].astype(jnp.float32) for x in (q[:, :SLICE_Q], k, v))))
    hint = flops / 500e12
    rows = []
    results = []
    for label, fn in jax_entries(configs, peers).items():
        try:
            ms = time_calls(lambda: fn(q, k, v), lambda o: o.block_until_ready(), hint)
            err = rel_error(fn(q, k, v)[:, :SLICE_Q, :SLICE_H], ref)
            results.append((label, ms, err))
        except Exception as e:  # one failing peer must not hide the others
            results.append((label, None, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
    tq, tk, tv = (torch.from_dlpack(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
    for label, fn in (torch_entries() if "torch" in peers else {}).items():
        try:
            ms = time_calls(lambda: fn(tq, tk, tv), lambda o: torch.cuda.synchronize(), hint)
            out = fn(tq, tk, tv)[:, :SLICE_H, :SLICE_Q].permute(0, 2, 1, 3).float().cpu().numpy()
            results.append((label, ms, rel_error(out, ref)))
        except Exception as e:
            results.append((label, None, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
        torch.cuda.synchronize()
    cudnn_ms = dict((r[0], r[1]) for r in results).get("jax cuDNN")
    for label, ms, err in results:
        if ms is None:
            rows.append(f"| {name} {heads}h {sq}x{skv} | {label} | failed | | | {err} |")
            continue
        ratio = f"{cudnn_ms / ms:.3f}" if cudnn_ms else "-"
        ok = "ok" if err <= 1e-2 else "FAIL"
        rows.append(f"| {name} {heads}h {sq}x{skv} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ratio} | {err:.1e} {ok} |")
    print("\n".join(rows), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="", help="extra Hopper kernel variants: block_q x block_kv x stages, comma separated")
    parser.add_argument("--peers", default="cudnn,mha,torch", help="peers besides jax cuDNN: mha, torch")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma separated, from {list(SHAPES)}")
    args = parser.parse_args()
    import torch

    device = jax.devices()[0]
    print(f"device: {device.device_kind}; jax {jax.__version__}; torch {torch.__version__}; "
          f"cuDNN (torch) {torch.backends.cudnn.version()}")
    rows = ["| shape | impl | ms | TFLOP/s | ×cuDNN (jax) | rel. err (≤1e-2) |", "|---|---|---|---|---|---|"]
    print("\n".join(rows))
    configs = [c for c in args.configs.split(",") if c]
    for name in args.shapes.split(","):
        bench_shape(name, configs, args.peers.split(","))


if __name__ == "__main__":
    main()
