"""End-to-end generate benchmark: text encode → 50 UniPC steps with CFG → VAE decode → mp4, per mesh.

    python benchmarks/bench_e2e.py --config 14b --prepare-only --workdir outputs/bench_e2e
    python benchmarks/bench_e2e.py --config 14b --meshes 2,1,2 2,2,1 --steps 10 --time-limit 540 \
        --workdir outputs/bench_e2e
    python benchmarks/bench_e2e.py --config tiny --steps 2 --size 32*32     # a smoke run on CPU
    python benchmarks/bench_e2e.py --config 1.3b --peer diffusers --workdir outputs/bench_e2e
    python benchmarks/bench_e2e.py --config 14b --steps 10 --peer diffusers --workdir outputs/bench_e2e
    # our whole command on 4 GPUs: one process on mesh 2,2,1, or 4 processes of one run (1 GPU each)
    python benchmarks/bench_e2e.py --config 14b --peer diffusers --entries ours-cold --command-mesh 2,2,1
    python benchmarks/bench_e2e.py --config 14b --peer diffusers --entries ours-cold --command-mesh 1,4,1 --processes 4
    python benchmarks/bench_e2e.py --config tiny --peer diffusers --steps 2 --size 32*32 --frames 5   # CPU smoke
    # each side's step cache at its default threshold (diffusers: FirstBlockCacheConfig / MagCacheConfig)
    python benchmarks/bench_e2e.py --config 1.3b --peer diffusers --cache magcache --workdir outputs/bench_e2e
    # the 4-step recipe with a random rank-64 kohya LoRA merged on both sides (diffusers: fuse_lora)
    python benchmarks/bench_e2e.py --config 14b --peer diffusers --few-step --lora-rank 64 --workdir outputs/bench_e2e
    # ours with its FP8 options (FP8 linears, 8-bit self-attention; Hopper), the peer in bf16
    python benchmarks/bench_e2e.py --config 1.3b --peer diffusers --quantize fp8 --attention pallas_gpu_fp8 --workdir outputs/bench_e2e

Wan 2.1 T2V (`--config 14b`: 720×1280, 81 frames, 50 steps, guidance 5 by default; `1.3b`: 480×832;
`tiny`: the test-sized model) with RANDOM weights, written once in the diffusers layout
(`model_index.json`, `transformer/`, `vae/`, `text_encoder/` (UMT5-XXL, as in the Wan-AI repos),
`tokenizer/` (the in-process tokenizer), `scheduler/`) under `--workdir` and reused when present.
The DiT and UMT5 are stored bf16, the VAE float32 (the dtypes they run in). Each tensor is drawn
with numpy straight into its safetensors shard, chunk by chunk, shards in parallel threads: the
14B checkpoint (~41 GB) never sits in memory. Parameter names and shapes come from diffusers' and
transformers' own modules built on the meta device, so the files are what those libraries save.

Each mesh `dp,sp,tp` loads the checkpoint through `WanPipeline.from_pretrained(path, mesh=...)` and
runs the whole generate path, printing seconds per stage: load (text encoder, transformer, VAE),
text encode and VAE decode (first call, compile included, then a warm repeat), denoise with and
without compilation (without: the steps' wall time with the first, compiling, step counted at the
median step), s/step, mp4 write, total (one generate: every stage once, load included, warm
repeats left out; with fewer steps than the model's default also projected to the default), MFU
and peak device memory (per device, `memory_stats()['peak_bytes_in_use']`). MFU = DiT model FLOPs
(`wan_tpu.runtime.profiling.dit_forward_flops`, the anchors' per-layer formula) × 2 (CFG) × steps ÷ denoise
time without compilation ÷ (devices × peak); the peak is an 8192³ bf16 matmul measured on the first
device in the same process (`--peak-matmul 0`: the table figure of `wan_tpu.runtime.profiling`).

`--peer diffusers` times whole commands instead, each in a fresh process from spawn to exit (mp4
written), on the same checkpoint and settings: `python -m wan_tpu.generate` with an empty compilation
cache (cold), the same command again with the cache it filled (warm), and diffusers' `WanPipeline` as a
user's script (load → text → denoise → decode → mp4; bf16 DiT and UMT5, float32 VAE), eager and with
`transformer.compile_repeated_blocks(fullgraph=True)`. It prints each one's wall time, its parts (load,
text, denoise, decode, write; other = start-up, imports, exit), s/step and the ratio to diffusers eager;
with fewer steps than the model's default (e.g. 14B with `--steps 10`) each wall is also projected to
the default with the entry's own s/step, and the ratios use the projection. `--entries` picks entries.

With several meshes (or a `--time-limit`) each mesh runs in its own process: clean peak memory,
nothing left over from the previous mesh, and a mesh still running at the time limit is stopped so
that the final table (one row per mesh) is always printed. A mesh needing more devices than the
machine has is reported as skipped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

from wan_tpu.errors import WanInputError  # noqa: E402

PROMPT = "a cat walks on the grass, realistic"
SEED = 0
FEW_STEP_SIGMAS = [1.0, 0.75, 0.5, 0.25]  # lightx2v's 4-step list (1000, 750, 500, 250) as sigmas, shifted by 5
FEW_STEP_SHIFT = 5.0
CHUNK = 1 << 23  # elements drawn per numpy call: bounds each writer thread to ~50 MB
SHARD_BYTES = 2 << 30  # ~22 shards at 14B: enough to keep a many-core host busy
DONE = "bench_e2e_checkpoint.json"  # written last: its presence means the checkpoint is complete


def umt5_xxl_config():
    """UMT5-XXL encoder, as in Wan-AI/Wan2.1-T2V-14B-Diffusers/text_encoder/config.json."""
    from transformers import UMT5Config

    return UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24,
                      num_heads=64, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True,
                      layer_norm_epsilon=1e-6, scalable_attention=True, tie_word_embeddings=False,
                      dropout_rate=0.1, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    variant: str  # key of wan_tpu.configs.models.VARIANTS
    vae: str  # "tiny" (the tiny preset's 16-channel VAE) or a key of VAE_PRESETS

    def parts(self):
        """(WanTransformerConfig, WanVAEConfig, UMT5Config) of the checkpoint."""
        from wan_tpu.configs.models import VARIANTS
        from wan_tpu.configs.vae import VAE_PRESETS
        from wan_tpu.wan import presets

        dit = VARIANTS[self.variant].transformer
        if self.vae == "tiny":
            return dit, presets.TINY_VAE, presets.hf_umt5_config(presets.tiny_umt5_config(dit.text_dim))
        return dit, VAE_PRESETS[self.vae], umt5_xxl_config()


CONFIGS = {
    "14b": BenchConfig("wan2.1-t2v-14b", "wan2.1"),
    "1.3b": BenchConfig("wan2.1-t2v-1.3b", "wan2.1"),
    "tiny": BenchConfig("tiny", "tiny"),
}


# ---- the random checkpoint ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    mean: float
    std: float

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def init_stats(name: str, shape: tuple[int, ...], vae: bool) -> tuple[float, float]:
    """(mean, std) of one random tensor: scales that keep activations O(1) through every layer.

    Matrices and convolutions N(0, g²/fan_in) (g = 0.5 in the VAE, whose deep conv stack would
    otherwise grow), modulation tables N(0, 1/dim), norm gains 1 (the VAE's 1 ± 0.2: gains of
    exactly 1 would hide a layout bug), biases small.
    """
    if name.endswith("gamma"):
        return 1.0, 0.2
    if name.endswith("scale_shift_table"):
        return 0.0, shape[-1] ** -0.5
    if len(shape) >= 2:
        return 0.0, (0.5 if vae else 1.0) / math.sqrt(math.prod(shape[1:]))
    if name.endswith(".weight"):
        return 1.0, 0.0
    return 0.0, 0.05 if vae else 0.02


def module_tensors(module, vae: bool = False) -> list[TensorSpec]:
    """What `save_pretrained` stores for a torch module (built on the meta device): its state dict
    less tied aliases (UMT5's `encoder.embed_tokens.weight` is `shared.weight`)."""
    every = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    aliases = every - {n for n, _ in module.named_parameters()}
    return [TensorSpec(n, tuple(t.shape), *init_stats(n, tuple(t.shape), vae))
            for n, t in module.state_dict().items() if n not in aliases]


def _write_shard(path: str, tensors: list[TensorSpec], dtype, seed: int) -> None:
    import ml_dtypes

    code = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}[np.dtype(dtype)]
    item = np.dtype(dtype).itemsize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + t.size * item]}
        offset += t.size * item
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    draw = np.empty(min(CHUNK, max(t.size for t in tensors)), np.float32)
    out = np.empty(draw.shape, dtype)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors:
            rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
            for start in range(0, t.size, CHUNK):
                n = min(CHUNK, t.size - start)
                if t.std:
                    rng.standard_normal(out=draw[:n], dtype=np.float32)
                    np.multiply(draw[:n], np.float32(t.std), out=draw[:n])
                    np.add(draw[:n], np.float32(t.mean), out=draw[:n])
                else:
                    draw[:n] = t.mean
                out[:n] = draw[:n]
                f.write(out[:n].view(np.uint8))


def _plan_shards(folder: str, prefix: str, tensors: list[TensorSpec], item: int) -> list[tuple[str, list]]:
    groups, size = [[]], 0
    for t in tensors:
        if groups[-1] and size + t.size * item > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.size * item
    if len(groups) == 1:
        return [(os.path.join(folder, f"{prefix}.safetensors"), groups[0])]
    names = [f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    index = {"metadata": {"total_size": sum(t.size for t in tensors) * item},
             "weight_map": {t.name: name for name, group in zip(names, groups) for t in group}}
    with open(os.path.join(folder, f"{prefix}.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return [(os.path.join(folder, name), group) for name, group in zip(names, groups)]


def checkpoint_plan(config: BenchConfig):
    """Meta-device modules of every component: (sub-folder, module, file prefix, tensors, dtype)."""
    import diffusers
    import ml_dtypes
    import torch
    from transformers import UMT5EncoderModel

    from wan_tpu.configs.models import config_to_json

    dit_cfg, vae_cfg, umt5_cfg = config.parts()
    # clip_output is a Wan 2.2 config.json key that AutoencoderKLWan's constructor does not take.
    vae_kwargs = {f.name: (list(v) if isinstance(v, tuple) else v) for f in dataclasses.fields(vae_cfg)
                  if f.name != "clip_output" and (v := getattr(vae_cfg, f.name)) is not None}
    with torch.device("meta"):
        dit = diffusers.WanTransformer3DModel(**config_to_json(dit_cfg))
        vae = diffusers.AutoencoderKLWan(**vae_kwargs)
        umt5 = UMT5EncoderModel(umt5_cfg)
    bf16 = ml_dtypes.bfloat16
    return [
        ("transformer", dit, "diffusion_pytorch_model", module_tensors(dit), bf16),
        ("vae", vae, "diffusion_pytorch_model", module_tensors(vae, vae=True), np.float32),
        ("text_encoder", umt5, "model", module_tensors(umt5), bf16),
    ]


def write_random_checkpoint(path: str, config: BenchConfig, seed: int = SEED, workers: int | None = None) -> int:
    """Write the checkpoint into `path` (a new folder); returns the bytes written."""
    import diffusers
    import torch

    from wan_tpu.encoders.tokenizers import tiny_hf_tokenizer

    plan = checkpoint_plan(config)
    total = sum(t.size * np.dtype(dtype).itemsize for *_, tensors, dtype in plan for t in tensors)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < total * 1.05:
        raise WanInputError(f"the random checkpoint needs {total / 2**30:.1f} GiB but {parent} has "
                            f"{free / 2**30:.1f} GiB free; pass --workdir on a larger disk")
    jobs = []
    for folder, module, prefix, tensors, dtype in plan:
        sub = os.path.join(path, folder)
        os.makedirs(sub)
        if folder == "text_encoder":
            module.config.dtype = torch.bfloat16
            module.config.save_pretrained(sub)
        else:
            module.save_config(sub)
        shards = _plan_shards(sub, prefix, tensors, np.dtype(dtype).itemsize)
        jobs += [(file, group, dtype) for file, group in shards]
    tiny_hf_tokenizer().save_pretrained(os.path.join(path, "tokenizer"))
    diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                      flow_shift=5.0).save_config(os.path.join(path, "scheduler"))
    index = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
             "vae": ["diffusers", "AutoencoderKLWan"]}
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    # Largest shards first, so that the last thread to finish does not start late on a big one.
    jobs.sort(key=lambda j: -sum(t.size for t in j[1]))
    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        for future in [pool.submit(_write_shard, file, group, dtype, seed) for file, group, dtype in jobs]:
            future.result()
    return total


# Wan's (original-format) block linears a LoRA targets, with their (out, in) in units of (dim, ffn_dim).
_LORA_MODULES = [(f"self_attn.{m}", "dd") for m in "qkvo"] + [(f"cross_attn.{m}", "dd") for m in "qkvo"] + \
                [("ffn.0", "fd"), ("ffn.2", "df")]


def write_lora(path: str, config_name: str, rank: int) -> str:
    """A random rank-`rank` LoRA in the kohya / original Wan format over every block linear (bf16, alpha = rank)."""
    import ml_dtypes

    from wan_tpu.configs.models import VARIANTS

    cfg = VARIANTS[CONFIGS[config_name].variant].transformer
    size = {"d": cfg.inner_dim, "f": cfg.ffn_dim}
    tensors = []
    for i in range(cfg.num_layers):
        for module, (out, inp) in _LORA_MODULES:
            key = f"diffusion_model.blocks.{i}.{module}"
            tensors += [TensorSpec(f"{key}.lora_down.weight", (rank, size[inp]), 0.0, size[inp] ** -0.5),
                        TensorSpec(f"{key}.lora_up.weight", (size[out], rank), 0.0, 0.02 / math.sqrt(rank)),
                        TensorSpec(f"{key}.alpha", (), float(rank), 0.0)]
    if not os.path.isfile(path):
        partial = f"{path}.partial-{os.getpid()}"
        _write_shard(partial, tensors, ml_dtypes.bfloat16, SEED + 1)
        os.replace(partial, path)
    return path


def ensure_checkpoint(workdir: str, config_name: str) -> str:
    """The checkpoint folder for `config_name` under `workdir`, written first if it is not complete."""
    path = os.path.join(os.path.abspath(workdir), f"{CONFIGS[config_name].variant}-random")
    if os.path.isfile(os.path.join(path, DONE)):
        print(f"reusing random checkpoint {path}", flush=True)
        return path
    if os.path.exists(path):
        shutil.rmtree(path)  # an interrupted write
    partial = f"{path}.partial-{os.getpid()}"
    start = time.perf_counter()
    try:
        total = write_random_checkpoint(partial, CONFIGS[config_name])
        seconds = time.perf_counter() - start
        with open(os.path.join(partial, DONE), "w") as f:
            json.dump({"config": config_name, "seed": SEED, "bytes": total, "write_seconds": seconds}, f)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            shutil.rmtree(partial)
    print(f"wrote random checkpoint {path}: {total / 2**30:.1f} GiB in {seconds:.1f} s", flush=True)
    return path


# ---- one mesh ---------------------------------------------------------------------------------


def parse_mesh(spec: str) -> tuple[int, int, int]:
    parts = spec.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise WanInputError(f"mesh {spec!r} is not dp,sp,tp with positive sizes; pass e.g. --meshes 2,1,4 2,2,2")
    return tuple(int(p) for p in parts)


def run_mesh(ckpt: str, mesh_spec: str, args) -> dict:
    """Load `ckpt` on mesh `mesh_spec` and run one whole generate; a result row (see `print_detail`)."""
    import jax
    import jax.numpy as jnp

    from wan_tpu.parallel.mesh import make_mesh
    from wan_tpu.runtime.profiling import StageTimer, dit_forward_flops, measured_peak_flops, peak_flops
    from wan_tpu.runtime.video import write_video
    from wan_tpu.wan.cli import parse_size
    from wan_tpu.wan.pipeline import WanPipeline

    dp, sp, tp = parse_mesh(mesh_spec)
    need, devices = dp * sp * tp, jax.devices()
    row = {"mesh": mesh_spec, "devices": need}
    if len(devices) < need:
        return {**row, "status": f"skipped (needs {need} devices, {len(devices)} here)"}
    devices = devices[:need]
    mesh = make_mesh(dp=dp, sp=sp, tp=tp, devices=devices)
    side = args.peak_matmul if args.peak_matmul is not None else 0 if jax.default_backend() == "cpu" else 8192
    if side:
        peak = measured_peak_flops(side, devices[0])
        basis = f"{side}^3 bf16 matmul measured here"
    else:
        peak, basis = peak_flops(devices[0])
    pipe = WanPipeline.from_pretrained(ckpt, mesh=mesh, dtype=jnp.bfloat16, attention=args.attention,
                                       quantize=args.quantize)
    width, height = parse_size(args.size)
    s = pipe.settings(height=height, width=width, num_frames=args.frames, num_inference_steps=args.steps)
    timer, steps = StageTimer(), []
    tag = f"[mesh {mesh_spec}]"

    def stage(name):
        print(f"{tag} {name} ...", flush=True)
        return timer.stage(name)

    with stage("load text encoder"):
        pipe.text_encoder
    for name in ("text encode", "text encode (warm)"):
        with stage(name):
            embeds = jax.block_until_ready(pipe.encode_prompt(PROMPT, None, s.guidance_scale))
    pipe.release("text_encoder")
    with stage("load transformer"):
        pipe.transformer
    with stage(f"denoise ({s.num_inference_steps} steps)"):
        latents = jax.block_until_ready(pipe.denoise(
            embeds, seed=SEED, height=s.height, width=s.width, num_frames=s.num_frames,
            num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale, progress=True,
            step_seconds=steps))
    pipe.release("transformer")
    with stage("load vae"):
        pipe.vae
    for name in ("vae decode", "vae decode (warm)"):
        with stage(name):
            frames = pipe.decode(latents)
    out = os.path.join(os.path.abspath(args.workdir), f"bench_e2e_{args.config}_{mesh_spec.replace(',', 'x')}.mp4")
    with stage("mp4 write"):
        write_video(out, frames, pipe.variant.fps, overwrite=True)

    sec = timer.seconds
    denoise = sec[f"denoise ({s.num_inference_steps} steps)"]
    per_step = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
    # Without compilation: the steps' wall time with the first (compiling) step counted at the median.
    warm = sum(steps[1:]) + per_step
    compile_s = denoise - warm
    shape = pipe.latent_shape(s.height, s.width, s.num_frames)
    cfg = pipe.variant.transformer
    tokens = math.prod(n // p for n, p in zip(shape[2:], cfg.patch_size))
    flops = dit_forward_flops(cfg, tokens) * (2 if s.do_cfg else 1) * s.num_inference_steps
    stats = [d.memory_stats() or {} for d in devices]
    peaks = [st.get("peak_bytes_in_use") for st in stats]
    load = sec["load text encoder"] + sec["load transformer"] + sec["load vae"]
    total = load + sec["text encode"] + denoise + sec["vae decode"] + sec["mp4 write"]
    return {
        **row, "status": "ok", "size": s.size, "frames": s.num_frames, "steps": s.num_inference_steps,
        "default_steps": pipe.variant.sample_steps, "cfg": s.do_cfg, "tokens": tokens,
        "stages": sec, "load": load, "denoise": denoise, "denoise_excl_compile": warm, "compile": compile_s,
        "s_per_step": per_step, "total": total,
        "total_default_steps": total + (pipe.variant.sample_steps - s.num_inference_steps) * per_step,
        "mfu": None if peak is None else flops / warm / (need * peak), "peak_flops": peak, "peak_basis": basis,
        "peak_bytes": peaks, "device_kind": devices[0].device_kind, "jax": jax.__version__, "output": out,
    }


# ---- reporting -------------------------------------------------------------------------------


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.1f}"


def print_detail(r: dict, out=None) -> None:
    out = out or sys.stdout
    if r["status"] != "ok":
        print(f"mesh {r['mesh']}: {r['status']}", file=out)
        return
    lines = [(name, f"{v:9.2f} s") for name, v in r["stages"].items()]
    lines += [
        ("denoise excl. compile", f"{r['denoise_excl_compile']:9.2f} s  (compile ≈ {r['compile']:.2f} s)"),
        ("s/step (median)", f"{r['s_per_step']:9.3f} s"),
        ("total (one generate)", f"{r['total']:9.2f} s  (load {r['load']:.2f} s; warm repeats left out)"),
    ]
    if r["steps"] != r["default_steps"]:
        lines.append((f"total at {r['default_steps']} steps", f"{r['total_default_steps']:9.2f} s  (projected)"))
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    peak = "unknown" if r["peak_flops"] is None else f"{r['peak_flops'] / 1e12:.0f} TFLOP/s"
    lines.append(("MFU", f"{mfu:>9}  (peak {peak} per device × {r['devices']}: {r['peak_basis']})"))
    lines.append(("peak memory GiB/device", " ".join(_gib(b) for b in r["peak_bytes"])))
    width = max(len(k) for k, _ in lines)
    print(f"mesh {r['mesh']} ({r['device_kind']}, jax {r['jax']}): {r['size']}, {r['frames']} frames, "
          f"{r['steps']} steps, {'CFG' if r['cfg'] else 'no CFG'}, {r['tokens']} tokens → {r['output']}", file=out)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in lines), file=out)


def format_table(rows: list[dict]) -> str:
    """One row per mesh; skipped or failed meshes say why."""
    head = ("mesh dp,sp,tp", "load", "text enc", "denoise", "excl.compile", "s/step", "vae dec", "mp4", "total",
            "total@default", "MFU", "peak GiB")
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append((r["mesh"], r["status"]))
            continue
        st = r["stages"]
        peaks = [b for b in r["peak_bytes"] if b is not None]
        body.append((r["mesh"], f"{r['load']:.1f}", f"{st['text encode']:.1f}", f"{r['denoise']:.1f}",
                     f"{r['denoise_excl_compile']:.1f}", f"{r['s_per_step']:.3f}", f"{st['vae decode']:.1f}",
                     f"{st['mp4 write']:.1f}", f"{r['total']:.1f}", f"{r['total_default_steps']:.1f}",
                     "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", _gib(max(peaks) if peaks else None)))
    return harness.table(head, body) + "\n(seconds; peak GiB: the largest per-device peak; total@default: projected " \
                                       "to the model's default step count)"


# ---- whole commands beside the peer (--peer diffusers) ---------------------------------------------
# Each entry is one fresh process timed from spawn to exit (mp4 written), with the parts it reports; add
# an entry by adding a function that returns such a row and naming it in PEER_ENTRIES.

PEER_PARTS = ("load", "text", "denoise", "decode", "write")
OUR_STAGES = {"load": ("load text encoder", "load transformer", "load vae"), "text": ("text encode",),
              "denoise": ("denoise",), "decode": ("decode",), "write": ("write",)}
PEER_CACHES = ("fbcache", "magcache")  # the step caches diffusers has (it has no TeaCache)


def diffusers_cache_config(name: str, steps: int):
    """diffusers' own step cache for our `--cache NAME`, at its defaults: `FirstBlockCacheConfig()`, or
    `MagCacheConfig` with Wan 2.1 1.3B's published magnitude ratios (the conditional curve)."""
    import numpy as np
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig

    from wan_tpu.configs.step_cache import MAGCACHE

    if name == "fbcache":
        return FirstBlockCacheConfig()
    mag = np.concatenate([[1.0], np.asarray(MAGCACHE["wan2.1-t2v-1.3b"].mag_ratios)[0::2]])
    return MagCacheConfig(mag_ratios=mag.tolist(), num_inference_steps=steps)


def run_settings(ckpt: str, args):
    """The run's settings, resolved once so that every entry runs exactly the same work."""
    from wan_tpu.wan.cli import parse_size
    from wan_tpu.wan.settings import resolve_settings, resolve_variant

    variant, vae = resolve_variant(ckpt)
    width, height = parse_size(args.size)
    steps = len(FEW_STEP_SIGMAS) if args.few_step else args.steps
    return variant, resolve_settings(variant, vae, height=height, width=width, num_frames=args.frames,
                                     num_inference_steps=steps, guidance_scale=1.0 if args.few_step else None)


def _failed(name: str, rc: int, out: str) -> dict:
    print(out[-3000:], file=sys.stderr)
    return {"entry": name, "status": f"failed (exit status {rc}; its output is above)"}


def entry_ours(name: str, ckpt: str, args, s, cache: str) -> dict:
    """`python -m wan_tpu.generate` in a fresh process, its compilation cache in `cache`."""
    out = os.path.join(os.path.abspath(args.workdir), f"peer_{args.config}_ours.mp4")
    argv = [sys.executable, "-m", "wan_tpu.generate", "--model", ckpt, "--prompt", PROMPT, "--seed", str(SEED),
            "--size", f"{s.width}*{s.height}", "--frames", str(s.num_frames), "--steps", str(s.num_inference_steps),
            "--output", out, "--overwrite", "--quiet"] + (["--attention", args.attention] if args.attention else [])
    argv += ["--quantize", args.quantize] if args.quantize else []
    if args.few_step:
        argv += ["--scheduler", "euler", "--sigmas", ",".join(map(str, FEW_STEP_SIGMAS)), "--shift", str(FEW_STEP_SHIFT),
                 "--guidance", "1"]
    if args.lora:
        argv += ["--lora", args.lora]
    if args.cache:
        argv += ["--cache", args.cache]
    if args.command_mesh:
        argv += ["--mesh", args.command_mesh]
    if args.processes > 1:
        wall, rc, text = _run_processes(argv, args, cache)
        proc = harness.Process(rc, wall, text)
    else:
        env = {"WAN_TPU_CACHE_DIR": cache}
        if args.command_mesh and harness.device_kind() == "cpu":  # a CPU host: that many host devices
            env["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count="
                                f"{_mesh_devices(args.command_mesh)}").strip()
        proc = harness.run_fresh(argv, env=env)
    wall, text = proc.wall, proc.output
    if proc.rc:
        return _failed(name, proc.rc, text)
    rows = dict(re.findall(r"^(\S.*?)\s{2,}([\d.]+) s\s*$", text, flags=re.M))
    print("\n".join(f"    {line}" for line in text.splitlines() if re.match(r"(startup|load|text|denoise|decode|write"
                                                                         r"|total|compile cache) ", line)), flush=True)
    parts = {part: sum(float(rows.get(stage, 0.0)) for stage in stages) for part, stages in OUR_STAGES.items()}
    # What the CLI's table cannot see: printing it, the interpreter's exit, and the spawn.
    print(f"    after the table (wall - its total): {wall - float(rows['total']):.2f} s", flush=True)
    return {"entry": name, "status": "ok", "wall": wall, "parts": parts,
            "s_per_step": float(rows["s/step (median)"]), "startup": float(rows.get("startup", "nan"))}


def _run_processes(argv: list[str], args, cache: str) -> tuple[float, int, str]:
    """`argv` as one run over `args.processes` processes (`--coordinator localhost:PORT`), spawned together, each
    with its share of the devices (one GPU each; on a CPU host that many host devices each) → (seconds from the
    spawn to the last exit, the worst exit status, process 0's output). Each process keeps its own cache folder:
    a shared one would let a later process read what an earlier one wrote in the same run."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    n = args.processes
    gpus = harness.device_kind() != "cpu"
    per = _mesh_devices(args.command_mesh) // n if args.command_mesh else 1
    procs, logs = [], []
    start = time.perf_counter()
    for i in range(n):
        env = {**os.environ, "WAN_TPU_CACHE_DIR": os.path.join(cache, f"process{i}")}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * per + k) for k in range(per))
        else:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={per}".strip()
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen([*argv, "--coordinator", f"localhost:{port}", "--num-processes", str(n),
                                       "--process-id", str(i)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      text=True))
    codes = [p.wait() for p in procs]
    wall = time.perf_counter() - start
    logs[0].seek(0)
    return wall, max(codes, key=abs), logs[0].read()


def _mesh_devices(mesh: str) -> int:
    return math.prod(parse_mesh(mesh))


def entry_diffusers(name: str, ckpt: str, args, s, compiled: bool) -> dict:
    """diffusers' `WanPipeline` as a whole script (load → text → denoise → decode → mp4) in a fresh process."""
    argv = [sys.executable, os.path.abspath(__file__), "--diffusers-child", ckpt, "--workdir", args.workdir,
            "--config", args.config, "--size", f"{s.width}*{s.height}", "--frames", str(s.num_frames),
            "--steps", str(s.num_inference_steps)]
    argv += (["--compile"] if compiled else []) + (["--few-step"] if args.few_step else [])
    argv += ["--cache", args.cache] if args.cache else []
    proc = harness.run_fresh(argv + (["--lora-file", args.lora] if args.lora else []), result_json=True)
    if proc.rc or proc.result is None:
        return _failed(name, proc.rc, proc.output)
    return {"entry": name, "status": "ok", "wall": proc.wall, **proc.result}


def diffusers_pipeline(ckpt: str, device: str):
    """diffusers' `WanPipeline` on `ckpt` as a user loads it: bf16 DiT and UMT5, float32 VAE, on `device`."""
    import diffusers
    import torch

    vae = diffusers.AutoencoderKLWan.from_pretrained(ckpt, subfolder="vae", torch_dtype=torch.float32)
    return diffusers.WanPipeline.from_pretrained(ckpt, vae=vae, torch_dtype=torch.bfloat16).to(device)


def merge_lora(pipe, path: str) -> None:
    """The LoRA file merged into the pipeline's DiT, like ours: no LoRA matmuls in the steps."""
    pipe.load_lora_weights(path)
    pipe.fuse_lora()
    pipe.unload_lora_weights()


def few_step_scheduler():
    """Euler at `FEW_STEP_SIGMAS`, shift `FEW_STEP_SHIFT`, whatever step count the pipeline asks for."""
    import diffusers

    class Given(diffusers.FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, **_):
            super().set_timesteps(device=device, sigmas=FEW_STEP_SIGMAS)

    return Given(shift=FEW_STEP_SHIFT)


def diffusers_decode(vae, latents):
    """The VAE decode of diffusers' `WanPipeline` (latents denormalised, then decoded): the video tensor."""
    import torch

    z = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return vae.decode(z * std + mean, return_dict=False)[0]


def diffusers_child(args) -> dict:
    """The peer's script: what a diffusers user runs, timed part by part (the parent times the process)."""
    import torch
    from diffusers.utils import export_to_video

    from wan_tpu.encoders.umt5_text import WAN_NEGATIVE_PROMPT

    ckpt, parts, steps = args.diffusers_child, {}, []
    width, height = (int(v) for v in args.size.split("*"))
    device = harness.torch_device()

    def part(name, start):
        harness.torch_sync()
        parts[name] = time.perf_counter() - start
        return time.perf_counter()

    t = time.perf_counter()
    pipe = diffusers_pipeline(ckpt, device)
    vae = pipe.vae
    if args.lora:  # part of "load", as our merge is part of the transformer's load
        merge_lora(pipe, args.lora)
    t = part("load", t)
    if args.cache:
        pipe.transformer.enable_cache(diffusers_cache_config(args.cache, args.steps))
    if args.compile:
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    guidance = 1.0 if args.few_step else 5.0
    if args.few_step:
        pipe.scheduler = few_step_scheduler()
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(PROMPT, WAN_NEGATIVE_PROMPT, do_classifier_free_guidance=guidance > 1,
                                              max_sequence_length=512, device=device)
    t = part("text", t)

    def on_step(pipeline, i, timestep, kwargs):
        harness.torch_sync()
        steps.append(time.perf_counter())
        return kwargs

    latents = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, height=height, width=width,
                   num_frames=args.frames, num_inference_steps=args.steps, guidance_scale=guidance,
                   generator=torch.Generator(device).manual_seed(SEED), output_type="latent",
                   callback_on_step_end=on_step).frames
    denoise_start = t
    t = part("denoise", t)
    with torch.no_grad():
        video = diffusers_decode(vae, latents)
        frames = pipe.video_processor.postprocess_video(video, output_type="np")[0]
    t = part("decode", t)
    export_to_video(list(frames), os.path.join(os.path.abspath(args.workdir), f"peer_{args.config}_diffusers.mp4"),
                    fps=16)
    part("write", t)
    durations = np.diff([denoise_start, *steps])
    per_step = float(np.median(durations[1:] if len(durations) > 1 else durations))
    return {"parts": parts, "s_per_step": per_step}


PEER_ENTRIES = ("ours-cold", "ours-warm", "diffusers-eager", "diffusers-compile")


def run_peer(ckpt: str, args) -> list[dict]:
    """Every entry in `args.entries` once, in order, on one checkpoint and one set of settings."""
    variant, s = run_settings(ckpt, args)
    cache = tempfile.mkdtemp(prefix="bench_e2e_cache_", dir=os.path.abspath(args.workdir))  # empty: cold
    where = ""
    if args.command_mesh:
        where = f", mesh {args.command_mesh}" + (f", {args.processes} processes" if args.processes > 1 else "")
    entries = {
        "ours-cold": lambda: entry_ours(f"wan_tpu, empty cache (cold){where}", ckpt, args, s, cache),
        "ours-warm": lambda: entry_ours(f"wan_tpu, cache filled (warm){where}", ckpt, args, s, cache),
        "diffusers-eager": lambda: entry_diffusers("diffusers eager", ckpt, args, s, False),
        "diffusers-compile": lambda: entry_diffusers("diffusers compile_repeated_blocks", ckpt, args, s, True),
    }
    rows = []
    try:
        for key in args.entries or PEER_ENTRIES:
            if key.startswith("diffusers") and args.cache and args.cache not in PEER_CACHES:
                rows.append({"entry": key, "key": key, "status": f"skipped: diffusers has no {args.cache}"})
                continue
            print(f"[peer] {key} ...", flush=True)
            rows.append({**entries[key](), "key": key})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    default = s.num_inference_steps if args.few_step else variant.sample_steps
    warm = next((r for r in rows if r["key"] == "ours-warm" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok":
            # A cold run of few steps has no steady step to time (on a GPU the decode's autotuning, compiling
            # beside the first steps, holds their dispatch back): it runs the warm run's very step program.
            per_step = warm["s_per_step"] if r["key"] == "ours-cold" and warm else r["s_per_step"]
            r["projected"] = r["wall"] + (default - s.num_inference_steps) * per_step
    return rows, s, default


def format_peer_table(rows: list[dict], s, default_steps: int) -> str:
    """Walls, parts and the ratios to diffusers eager (projected to the model's step count if fewer ran)."""
    projected = s.num_inference_steps != default_steps
    base = next((r for r in rows if r.get("key") == "diffusers-eager" and r["status"] == "ok"), None)
    head = ("entry", "wall", *PEER_PARTS, "other", "s/step", *([f"wall@{default_steps}"] if projected else []),
            "vs diffusers eager")
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append((r["entry"], r["status"]))
            continue
        parts = [r["parts"].get(p, 0.0) for p in PEER_PARTS]
        key = "projected" if projected else "wall"
        ratio = f"{r[key] / base[key]:.2f}x" if base else "n/a"
        body.append((r["entry"], f"{r['wall']:.1f}", *(f"{v:.1f}" for v in parts), f"{r['wall'] - sum(parts):.1f}",
                     f"{r['s_per_step']:.3f}", *([f"{r['projected']:.1f}"] if projected else []), ratio))
    note = (f"\n(wall@{default_steps}: projected from {s.num_inference_steps} steps to {default_steps} with each "
            "entry's own s/step, the cold run with the warm run's; the ratios use it)") if projected else ""
    return harness.table(head, body) + ("\n(seconds, whole process from spawn to exit, mp4 written; other = start-up, "
                                        "imports and exit)") + note


# ---- driver ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="14b", help="model size (default: 14b)")
    p.add_argument("--size", default=None, help="W*H (default: the model's, 1280*720 for 14b)")
    p.add_argument("--frames", type=int, default=None, help="frames, 4n+1 (default: 81)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's, 50)")
    p.add_argument("--mesh", "--meshes", dest="meshes", nargs="+", action="extend", metavar="DP,SP,TP",
                   help="one or more meshes to run; several run one process each (default: 1,1,1)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "wan_tpu_bench_e2e"),
                   help="where the random checkpoint (reused when present) and the mp4s go")
    p.add_argument("--attention", default=None, help="DiT attention kernel (default: the backend's fastest)")
    p.add_argument("--quantize", choices=("fp8", "int8"), default=None,
                   help="ours' DiT linears quantised (`generate --quantize`); the diffusers peer stays bf16")
    p.add_argument("--peak-matmul", type=int, default=None, metavar="N",
                   help="measure the MFU peak with an N³ bf16 matmul (default 8192; 0 or CPU default: table figure)")
    p.add_argument("--prepare-only", action="store_true", help="write the random checkpoint and stop")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop a mesh still running this long after the start (checkpoint writing included) and "
                        "skip the rest, so that the table is printed before an outer limit kills the run")
    p.add_argument("--peer", choices=("diffusers",), default=None,
                   help="time whole commands in fresh processes instead: ours cold (empty compilation cache) and "
                        "warm, diffusers' WanPipeline eager and with compile_repeated_blocks")
    p.add_argument("--entries", nargs="+", choices=PEER_ENTRIES, default=None,
                   help=f"with --peer: which entries to run, in order (default: all: {' '.join(PEER_ENTRIES)})")
    p.add_argument("--few-step", action="store_true",
                   help=f"with --peer: {len(FEW_STEP_SIGMAS)} Euler steps at sigmas {FEW_STEP_SIGMAS} (shift "
                        f"{FEW_STEP_SHIFT:g}), guidance 1: what step-distill LoRAs run")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="with --peer: merge a random rank-R LoRA in the kohya format (written under --workdir) on both sides")
    p.add_argument("--cache", choices=("teacache", "magcache", "fbcache"), default=None,
                   help="with --peer: our step cache at its default threshold; diffusers runs its own FBCache / "
                        "MagCache (it has no TeaCache: its entries are then skipped)")
    p.add_argument("--command-mesh", default=None, metavar="DP,SP,TP",
                   help="with --peer: our commands run on this mesh (`generate --mesh`); diffusers stays on one GPU")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="with --peer and --command-mesh: our commands as N processes of one run (`--coordinator "
                        "localhost:PORT`), each with its share of the GPUs; the wall is from the spawn to the last exit")
    p.add_argument("--lora-file", dest="lora", default=None, help=argparse.SUPPRESS)  # the peer's script: its LoRA
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # a mesh's row, for the parent process
    p.add_argument("--diffusers-child", default=None, help=argparse.SUPPRESS)  # checkpoint: run the peer's script
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the peer's script: compile_repeated_blocks
    return p


def _child(args, mesh: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--workdir", args.workdir,
            "--mesh", mesh]
    for flag, value in (("--size", args.size), ("--frames", args.frames), ("--steps", args.steps),
                        ("--attention", args.attention), ("--quantize", args.quantize),
                        ("--peak-matmul", args.peak_matmul)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _run_child(args, mesh: str, deadline: float | None) -> dict:
    """Run one mesh in a child process (stopped at `deadline`, a perf_counter time); its result row."""
    row, why = harness.run_part(_child(args, mesh), deadline, args.time_limit)
    return row if why is None else {"mesh": mesh, "status": why}


def run(args) -> list[dict]:
    start = time.perf_counter()
    meshes = args.meshes or ["1,1,1"]
    for m in meshes:
        parse_mesh(m)
    ckpt = ensure_checkpoint(args.workdir, args.config)
    if args.prepare_only:
        return []
    if len(meshes) == 1 and args.time_limit is None:
        rows = [run_mesh(ckpt, meshes[0], args)]
        print_detail(rows[0])
    else:
        deadline = None if args.time_limit is None else start + args.time_limit
        rows = [_run_child(args, m, deadline) for m in meshes]
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows[0], f)
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.diffusers_child:
        with open(args.result_json, "w") as f:
            json.dump(diffusers_child(args), f)
        return 0
    if not args.result_json:  # this process leaves the device to the meshes' and the entries' processes
        harness.print_env()
    try:
        if args.peer:
            if args.processes < 1 or (args.processes > 1 and (
                    not args.command_mesh or _mesh_devices(args.command_mesh) % args.processes)):
                raise WanInputError(f"--processes {args.processes} needs --command-mesh with a multiple of "
                                    f"{args.processes} devices; pass e.g. --command-mesh 1,4,1 --processes 4")
            if args.command_mesh:
                parse_mesh(args.command_mesh)
            ckpt = ensure_checkpoint(args.workdir, args.config)
            if args.lora_rank:
                args.lora = write_lora(os.path.join(os.path.abspath(args.workdir), f"{CONFIGS[args.config].variant}"
                                                    f"-lora-r{args.lora_rank}.safetensors"), args.config, args.lora_rank)
            rows, s, default = run_peer(ckpt, args)
            how = (f"{s.num_inference_steps} Euler steps (sigmas {FEW_STEP_SIGMAS}, shift {FEW_STEP_SHIFT:g}), guidance 1"
                   if args.few_step else f"{s.num_inference_steps} steps, CFG {s.guidance_scale:g}")
            lora = f", a random rank-{args.lora_rank} kohya LoRA merged" if args.lora_rank else ""
            lora += f", step cache {args.cache} at its default threshold" if args.cache else ""
            lora += f", ours with --quantize {args.quantize} (diffusers bf16)" if args.quantize else ""
            lora += f", ours with --attention {args.attention}" if args.attention else ""
            print(f"\nWan 2.1 T2V {args.config}, random weights (bf16 DiT/UMT5, float32 VAE), {s.width}*{s.height}, "
                  f"{s.num_frames} frames, {how}{lora}, whole commands:")
            print(format_peer_table(rows, s, default))
            return 0
        rows = run(args)
    except WanInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rows and not args.result_json:
        print(f"\nWan 2.1 T2V {args.config}, random weights, bf16 DiT/UMT5, float32 VAE, whole generate path:")
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
