"""Loading a Wan DiT from each checkpoint layout users have: time, peak host RSS and device memory.

    python benchmarks/bench_load_formats.py --workdir /scratch/blf                 # 14B T2V, every layout
    python benchmarks/bench_load_formats.py --workdir /scratch/blf --layouts fp8_scaled,gguf_q8_0
    python benchmarks/bench_load_formats.py --workdir /tmp/blf --tiny              # smoke run (CPU)

Random weights of Wan 2.1 T2V 14B (`--tiny`: the tiny preset's DiT) are written in each layout, each by
its format's own library: the official folder (the authors' names, their config.json, 5 GB bf16
safetensors shards + index, as `WanModel.save_pretrained` shards), a ComfyUI fp8_scaled single file
(`model.diffusion_model.` prefix, float8_e4m3fn weights with float32 `scale_weight`s and the
`scaled_fp8` marker, `safetensors.torch.save_file`), a city96-style Q8_0 GGUF (`gguf.GGUFWriter`,
streamed tensor by tensor) and a diffusers folder (bf16 shards + index + config.json). One layout is
written, loaded and deleted at a time (`--keep` keeps them), so the scratch folder holds at most one
(28 GB for 14B bf16).

Each load runs in a fresh process (`load_transformer`, every parameter waited for): wall time of the
load, the process's peak host RSS, and the device's memory in use after the load and at its peak
(`memory_stats`; n/a on the CPU). fp8_scaled loads with `quantize="fp8"` and the Q8_0 GGUF with
`quantize="int8"` where the device runs them natively (their weights then stay 8-bit), else
dequantised in `--dtype`. The fp8_scaled DiT must be resident in at most `--max-resident-gb` (16) GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

LAYOUTS = ("official", "fp8_scaled", "gguf_q8_0", "diffusers")
SHARD_BYTES = 5 << 30
PREFIX = "model.diffusion_model."
POOL = 1 << 24  # random values drawn once and repeated: the weights' values do not matter here


def _config(tiny: bool):
    from wan_tpu.configs.models import VARIANTS

    return VARIANTS["tiny" if tiny else "wan2.1-t2v-14b"].transformer


def _tensors(cfg):
    """(diffusers name, stored shape) of every tensor of the DiT, in the loader's order."""
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.wan.transformer import WanTransformer
    from wan_tpu.wan.weights import param_sources

    abstract = nnx.eval_shape(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    return [(n, tuple(s.source_shape)) for s in param_sources(abstract) for n in s.names]


def _filler(dtype):
    import numpy as np

    pool = (np.random.default_rng(0).standard_normal(POOL) * 0.02).astype(dtype)
    return lambda shape: np.resize(pool, shape)


def _shards(items, itemsize):
    shard, size = [], 0
    for name, shape in items:
        n = itemsize * int(__import__("math").prod(shape))
        if shard and size + n > SHARD_BYTES:
            yield shard
            shard, size = [], 0
        shard.append((name, shape))
        size += n
    if shard:
        yield shard


def _write_sharded(folder, items, rename, config):
    import ml_dtypes
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder)
    fill = _filler(ml_dtypes.bfloat16)
    shards = list(_shards(items, 2))
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {rename(n): torch.from_numpy(fill(s).view("uint16")).view(torch.bfloat16) for n, s in shard}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        total += sum(t.nbytes for t in tensors.values())
    with open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write(layout: str, path: str, cfg) -> None:
    """Random weights of `cfg` in `layout` at `path`."""
    import ml_dtypes
    import numpy as np

    from wan_tpu.configs.models import config_to_json
    from wan_tpu.loading.wan_names import diffusers_to_original_wan

    items = _tensors(cfg)
    if layout == "diffusers":
        _write_sharded(path, items, lambda n: n, {"_class_name": "WanTransformer3DModel", **config_to_json(cfg)})
    elif layout == "official":
        official = {"_class_name": "WanModel", "dim": cfg.inner_dim, "eps": cfg.eps, "ffn_dim": cfg.ffn_dim,
                    "freq_dim": cfg.freq_dim, "in_dim": cfg.in_channels, "model_type": "t2v",
                    "num_heads": cfg.num_attention_heads, "num_layers": cfg.num_layers, "out_dim": cfg.out_channels,
                    "text_len": 512}
        _write_sharded(path, items, diffusers_to_original_wan, official)
    elif layout == "fp8_scaled":
        import torch
        from safetensors.torch import save_file

        fp8, bf16 = _filler(ml_dtypes.float8_e4m3fn), _filler(ml_dtypes.bfloat16)
        tensors = {}
        for name, shape in items:
            key = PREFIX + diffusers_to_original_wan(name)
            if len(shape) == 2:
                tensors[key] = torch.from_numpy(fp8(shape).view("uint8")).view(torch.float8_e4m3fn)
                tensors[key[: -len("weight")] + "scale_weight"] = torch.tensor(0.01, dtype=torch.float32)
            else:
                tensors[key] = torch.from_numpy(bf16(shape).view("uint16")).view(torch.bfloat16)
        tensors[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
        save_file(tensors, path)
    elif layout == "gguf_q8_0":
        import gguf

        T = gguf.GGMLQuantizationType
        f32 = _filler(np.float32)
        q8 = _filler(np.int8)
        plan = []
        writer = gguf.GGUFWriter(path, arch="wan")
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, shape in items:
            key = diffusers_to_original_wan(name)
            quantized = len(shape) == 2 and ".modulation" not in key and int(np.prod(shape)) > 1024
            if quantized:
                block, size = gguf.GGML_QUANT_SIZES[T.Q8_0]
                byte_shape = (shape[0], shape[1] // block * size)
                writer.add_tensor_info(key, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=T.Q8_0)
            else:
                writer.add_tensor_info(key, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            plan.append((shape, quantized))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        for shape, quantized in plan:
            if quantized:
                blocks = q8((shape[0], shape[1] // 32, 32)).view(np.uint8)
                data = np.concatenate([np.broadcast_to(scale, (*blocks.shape[:2], 2)), blocks], axis=-1)
                writer.write_tensor_data(data.reshape(shape[0], -1))
            else:
                writer.write_tensor_data(f32(shape))
        writer.close()
    else:
        raise ValueError(layout)


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM belongs to the address space exec made, whereas
    getrusage's ru_maxrss carries over the peak of the parent that forked it (the writer of the weights)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def child(args) -> None:
    """One load in this (fresh) process; writes its measurements to --result-json."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.wan.transformer_loading import load_transformer

    quantize = None if args.quantize == "none" else args.quantize
    start = time.perf_counter()
    dit = load_transformer(args.path, dtype=jnp.dtype(args.dtype), quantize=quantize)
    jax.block_until_ready(nnx.state(dit))
    seconds = time.perf_counter() - start
    stats = jax.devices()[0].memory_stats() or {}
    params = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(dit)))
    result = {"seconds": seconds, "rss_gb": _peak_rss_bytes() / 1e9,
              "params_gb": params / 1e9, "device_gb": stats.get("bytes_in_use", 0) / 1e9 if stats else None,
              "device_peak_gb": stats.get("peak_bytes_in_use", 0) / 1e9 if stats else None,
              "quantization": dit.quantization}
    with open(args.result_json, "w") as f:
        json.dump(result, f)


def _native(mode: str) -> bool:
    """Whether the device runs `mode` on its own matrix units (asked in a fresh process: the parent leaves the
    device to its children)."""
    code = ("import jax; from wan_tpu.wan.quantize import supported; d = jax.devices()[0]; "
            f"print(d.platform != 'cpu' and supported(d, {mode!r})[0])")
    proc = harness.run_fresh([sys.executable, "-c", code])
    return proc.stdout.strip().endswith("True")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=False, help="scratch folder for the checkpoints (one at a time)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--tiny", action="store_true", help="the tiny preset's DiT (CPU smoke run)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-resident-gb", type=float, default=16.0)
    p.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quantize", default="none", help=argparse.SUPPRESS)
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not args.workdir:
        p.error(f"unknown layout {unknown[0]}" if unknown else "--workdir is required")
    harness.print_env()
    cfg = _config(args.tiny)
    os.makedirs(args.workdir, exist_ok=True)
    modes = {"fp8_scaled": "fp8", "gguf_q8_0": "int8"}
    rows, verdict = [], None
    for layout in layouts:
        path = os.path.join(args.workdir, {"fp8_scaled": "wan_fp8_scaled.safetensors",
                                           "gguf_q8_0": "wan-Q8_0.gguf"}.get(layout, layout))
        if os.path.exists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        _, write_s = harness.timed(write, layout, path, cfg)
        size = _size(path)
        mode = modes.get(layout)
        quantize = mode if mode and _native(mode) else "none"
        result, why = harness.run_part([sys.executable, os.path.abspath(__file__), "--child", layout, "--path", path,
                                        "--dtype", args.dtype, "--quantize", quantize])
        if not args.keep:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if result is None:
            rows.append((layout, why))
            continue
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append((layout, f"{size / 1e9:.2f}", f"{write_s:.1f}", f"{result['seconds']:.2f}", fmt(result["rss_gb"]),
                     fmt(result["params_gb"]), fmt(result["device_gb"]), fmt(result["device_peak_gb"]),
                     result["quantization"] or args.dtype))
        if layout == "fp8_scaled" and result["quantization"] == "fp8":
            verdict = (result["device_gb"] or result["params_gb"]) <= args.max_resident_gb
    print(harness.table(("layout", "file GB", "write s", "load s", "peak RSS GB", "params GB", "device GB",
                         "device peak GB", "weights"), rows))
    if verdict is not None:
        print(f"fp8_scaled 14B resident within {args.max_resident_gb:g} GB: {'yes' if verdict else 'NO'}")
        if not verdict:
            sys.exit(1)


if __name__ == "__main__":
    main()
