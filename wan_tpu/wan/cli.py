"""Generate a video from a prompt (and an image for I2V/TI2V): `python -m wan_tpu.generate`.

    python -m wan_tpu.generate --model tiny --prompt "a cat walks on the grass"
    python -m wan_tpu.generate --model /ckpt/Wan2.1-T2V-1.3B-Diffusers --prompt "..." --size 832*480 \\
        --frames 81 --steps 50 --mesh 2,1,4 --keep-stages stages/ --output cat.mp4
    python -m wan_tpu.generate --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompts prompts.jsonl --output out/v.mp4

`--model` takes a diffusers-format checkpoint folder, a Hugging Face model id from the local cache
(`--download` fetches it if absent), an official Wan folder, a DiT file (`.safetensors` of any
ComfyUI precision, `.gguf`) with `--vae FILE --text-encoder FILE` (`--image-encoder FILE` for Wan 2.1
I2V; Wan 2.2 A14B: the high-noise file, `--model-low FILE` the low-noise one), a ComfyUI `models/`
folder (`wan_tpu.wan.model_files`) or a built-in preset; it defaults to `tiny`, random weights that
only show the machinery works (a notice says so). Settings left out take the official Wan defaults
of the model (size, frames, steps, guidance, shift: see `wan_tpu.wan.settings`). The official Wan
`generate.py` flag names work too (`--ckpt_dir`, `--frame_num`, `--sample_steps`, ...:
`wan_tpu.wan.official`). `--prompts FILE` makes one video per line, loading and compiling once
(`wan_tpu.wan.prompts`). The three stages (text encode → denoise → VAE decode) hand over arrays in
memory; `--keep-stages DIR` also writes them as `DIR/stage1.safetensors` (embeddings) and
`DIR/stage2.safetensors` (latents), the files the stage scripts in `scripts/` read and write. At the
end a table gives the time of each stage, s/step and the DiT's model FLOPs utilization (MFU).

Before anything is loaded every input is checked — the checkpoint's files, prompts, images, output
paths, and whether the run fits in memory (`wan_tpu.runtime.validate`, `wan_tpu.runtime.memory`); bad input prints
one line on stderr naming the fix and exits with status 2, leaving no file behind. Ctrl-C or
SIGTERM stops at the next safe point, removes partial files and exits 130 / 143 (`wan_tpu.runtime.interrupt`).
"""

from __future__ import annotations

import argparse
import os
import sys

from wan_tpu.errors import WanInputError
from wan_tpu.runtime.cli import CliParser, add_common_args, check_attention, dtype_of, parse_mesh, run_cli
from wan_tpu.runtime.validate import check_output
from wan_tpu.wan.official import unsupported_message

SCHEDULERS = ("unipc", "euler", "dpm++")
STAGE_FILES = ("stage1.safetensors", "stage2.safetensors")
# Defaults of flags whose value may also come from an input stage file (None = the model's own).
DEFAULTS = {"model": "tiny", "dtype": "bfloat16", "seed": 0, "scheduler": "unipc"}
# Settings a stage file records that the next stage takes when its flag is left out.
INHERITED = ("model", "dtype", "size", "frames", "guidance", "guidance_2", "shift", "steps", "seed", "scheduler")


def _alias(flag: str) -> list[str]:
    """`flag` and its official Wan generate.py name, when it has one."""
    from wan_tpu.wan.official import ALIASES

    return [flag] + ([ALIASES[flag]] if flag in ALIASES else [])


def add_model_args(p: argparse.ArgumentParser, *, output_default: str, output_help: str, seed: bool = True,
                   profile: bool = True) -> None:
    """The shared flags (`wan_tpu.runtime.cli.add_common_args`) with Wan's defaults and the official names,
    then Wan's own model flags."""
    from wan_tpu.wan.official import ALIASES

    add_common_args(p, aliases=ALIASES, model_default=None,
                    model_help="diffusers-format checkpoint folder, Hugging Face model id (org/name), official Wan "
                               "folder, DiT file (.safetensors, .gguf; with --vae/--text-encoder), ComfyUI models/ "
                               "folder or preset (default: tiny, or the input stage file's)",
                    dtype_default=None, dtype_help="DiT and text encoder dtype (default: bfloat16; VAE: float32)",
                    seed=seed, seed_default=None,
                    seed_help="seed of the initial noise (default 0; same seed → same video; negative: a random one)",
                    output_default=output_default, output_help=output_help, profile=profile)
    p.add_argument("--download", action="store_true", help="fetch a Hugging Face model id that is not in the local cache")
    p.add_argument("--task", default=None, help="official Wan task name (t2v-1.3B, i2v-14B, ...): checked against the checkpoint")
    p.add_argument("--no-memory-check", action="store_true",
                   help="run even when the estimated working set exceeds the free memory")
    p.add_argument("--quantize", choices=("fp8", "int8"), default=None,
                   help="the DiT's block linears in fp8 (H100/H200/Ada GPUs, TPU v7) or int8 (NVIDIA GPUs from A100 on, "
                        "TPU v5e/v5p/v6e/v7; under half of fp8's error)")
    p.add_argument("--model-low", default=None, metavar="FILE",
                   help="Wan 2.2 A14B as files: the low-noise DiT file, --model the high-noise one (ComfyUI "
                        "wan2.2_*_low_noise_14B_*.safetensors, ...)")
    p.add_argument("--vae", default=None, metavar="FILE",
                   help="VAE file for a --model DiT file or folder (Wan2.1_VAE.pth, ComfyUI wan_2.1_vae.safetensors, ...)")
    p.add_argument("--text-encoder", default=None, metavar="FILE",
                   help="UMT5 text encoder file for a --model DiT file or folder (models_t5_*.pth, ComfyUI umt5_xxl_*.safetensors)")
    p.add_argument("--image-encoder", default=None, metavar="FILE",
                   help="CLIP image encoder file for a Wan 2.1 I2V DiT file (ComfyUI clip_vision_h.safetensors, ...)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="UMT5 tokenizer folder for single files (default: google/umt5-xxl from the Hugging Face cache)")
    p.add_argument("--offload", default="auto", metavar="auto|none|blocks[:N]",
                   help="what leaves the device: auto (default: DiT blocks streamed from host memory only when the run "
                        "would not fit otherwise), none, blocks (every DiT block streamed) or blocks:N (N resident)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, help="W*H, e.g. 832*480 (default: the model's)")
    p.add_argument(*_alias("--frames"), dest="frames", type=int, default=None,
                   help="number of frames, 4n+1 (default: the model's, 81)")
    p.add_argument(*_alias("--guidance"), dest="guidance", type=float, default=None,
                   help="classifier-free guidance scale (<= 1: no CFG)")
    p.add_argument("--guidance-2", type=float, default=None, help="guidance of the low-noise expert (Wan 2.2 A14B)")


def add_prompt_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    what = p.add_mutually_exclusive_group(required=True) if many else p
    what.add_argument("--prompt", required=not many,
                      help="what the video shows; may be empty when guidance > 1 and the negative prompt is not")
    if many:
        what.add_argument("--prompts", default=None, metavar="FILE",
                          help="one prompt per line, or JSONL with prompt/negative_prompt/seed/image/output per line: "
                               "one video each, loading once (outputs: <output stem>_001.mp4, ...)")
    p.add_argument("--negative-prompt", default=None,
                   help="what to steer away from (default: the official Wan negative prompt; '' for none)")
    p.add_argument("--image", default=None, help="first frame for image-to-video models (PNG/JPEG)")


def add_denoise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(*_alias("--steps"), dest="steps", type=int, default=None,
                   help="denoising steps (default: the model's, 50 or 40)")
    p.add_argument(*_alias("--shift"), dest="shift", type=float, default=None,
                   help="flow shift (default: the model's; Wan 2.1: 3.0 up to 480p, 5.0 above)")
    p.add_argument(*_alias("--scheduler"), dest="scheduler", choices=SCHEDULERS, default=None,
                   help="flow sampler: unipc (default), dpm++ or euler")


def add_adapter_args(p: argparse.ArgumentParser) -> None:
    """LoRAs, a given schedule and step caches: what few-step (distilled) and cached sampling need."""
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                   help="merge a LoRA .safetensors into the DiT (repeatable; A14B: into both experts)")
    p.add_argument("--lora-high", action="append", default=[], metavar="PATH[:SCALE]",
                   help="Wan 2.2 A14B: a LoRA for the high-noise expert only (repeatable)")
    p.add_argument("--lora-low", action="append", default=[], metavar="PATH[:SCALE]",
                   help="Wan 2.2 A14B: a LoRA for the low-noise expert only (repeatable)")
    p.add_argument("--sigmas", default=None, metavar="S1,S2,...",
                   help="given noise levels in (0, 1], one per step, before --shift (e.g. 1,0.75,0.5,0.25)")
    p.add_argument("--timesteps", default=None, metavar="T1,T2,...",
                   help="given model timesteps in (0, 1000], one per step, used as they are (--scheduler euler)")
    p.add_argument("--cache", choices=("teacache", "magcache", "fbcache"), default=None,
                   help="skip the DiT blocks on steps whose input changed little (default: off)")
    p.add_argument("--cache-threshold", type=float, default=None,
                   help="the cache's threshold (default: the method's published value for the model; 0: never skip)")


def lora_specs(args) -> list[tuple[str, float, str | None]]:
    """(path, scale, expert) of every --lora, --lora-high and --lora-low flag."""
    specs = []
    for flag, expert in (("lora", None), ("lora_high", "high"), ("lora_low", "low")):
        for spec in getattr(args, flag, None) or []:
            path, _, scale = spec.rpartition(":")
            try:
                specs.append((path, float(scale), expert) if path else (spec, 1.0, expert))
            except ValueError:
                specs.append((spec, 1.0, expert))  # a ':' inside the path, no scale
    return specs


def parse_floats(text: str | None, flag: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise WanInputError(f"{flag} {text!r} is not a comma-separated list of numbers; pass e.g. "
                            f"{flag} 1,0.75,0.5,0.25") from None


def sampling_kwargs(args) -> dict:
    """The given schedule and step cache of this run, as `WanPipeline.denoise` takes them."""
    return {"sigmas": parse_floats(getattr(args, "sigmas", None), "--sigmas"),
            "timesteps": parse_floats(getattr(args, "timesteps", None), "--timesteps"),
            "cache": getattr(args, "cache", None), "cache_threshold": getattr(args, "cache_threshold", None)}


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m wan_tpu.generate", description=__doc__.split("\n\n")[0], unknown_hint=unsupported_message)
    add_prompt_args(p, many=True)
    add_model_args(p, output_default="output.mp4",
                   output_help="mp4 to write (default: output.mp4; with --prompts: the stem of the numbered outputs)")
    add_run_args(p)
    add_denoise_args(p)
    add_adapter_args(p)
    p.add_argument("--keep-stages", default=None, metavar="DIR", help="also write the stage files into DIR")
    return p


# ---- shared by the CLI and the stage scripts ------------------------------------------------------


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """`W*H` → (width, height); None → (None, None), the model's default."""
    if size is None:
        return None, None
    parts = size.lower().replace("x", "*").split("*")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise WanInputError(f"size {size!r} is not W*H; pass e.g. --size 832*480")
    return int(parts[0]), int(parts[1])


def resolve_defaults(args, meta=None) -> None:
    """Fill the flags left out: from the input stage file's metadata `meta` where it records them,
    else `DEFAULTS` (None stays None: the model's default). A negative seed draws a random one."""
    for name in INHERITED:
        if hasattr(args, name) and getattr(args, name) is None:
            value = None if meta is None else getattr(meta, name)
            setattr(args, name, DEFAULTS.get(name) if value is None else value)
    if getattr(args, "seed", None) is not None and args.seed < 0:
        import secrets

        args.seed = secrets.randbelow(2**31)
        print(f"seed: {args.seed} (random; pass --seed {args.seed} to make the same video again)")


def load_pipeline(args):
    from wan_tpu.wan.pipeline import WanPipeline

    check_attention(args.attention)
    mesh = parse_mesh(args.mesh)
    dtype = dtype_of(args.dtype)
    pipe = WanPipeline.from_pretrained(args.model, mesh=mesh, dtype=dtype, attention=args.attention,
                                       download=args.download, check_memory=not args.no_memory_check,
                                       quantize=getattr(args, "quantize", None),
                                       transformer_2=getattr(args, "model_low", None),
                                       **{k: getattr(args, k, None) for k in ("vae", "text_encoder", "image_encoder",
                                                                               "tokenizer")},
                                       offload=getattr(args, "offload", "auto"),
                                       compile_cache=not args.no_compile_cache)
    for path, scale, expert in lora_specs(args):
        pipe.load_lora_weights(path, scale=scale, expert=expert)  # checked now, merged when the DiT loads
    return pipe


def run_settings(pipe, args):
    from wan_tpu.wan.official import check_task
    from wan_tpu.wan.pipeline import schedule_steps

    check_task(args.task, pipe.variant)
    width, height = parse_size(getattr(args, "size", None))
    given = sampling_kwargs(args)
    steps = schedule_steps(getattr(args, "steps", None), given["sigmas"], given["timesteps"])
    s = pipe.settings(height=height, width=width, num_frames=getattr(args, "frames", None),
                      num_inference_steps=steps, guidance_scale=getattr(args, "guidance", None),
                      guidance_scale_2=getattr(args, "guidance_2", None), flow_shift=getattr(args, "shift", None))
    if hasattr(args, "scheduler"):
        pipe.sampling(s, args.scheduler, **given)  # a bad schedule or cache fails now, not after loading
    return s


def chosen_negative_prompt(args, job=None) -> str | None:
    """The job's negative prompt, else --negative-prompt; None: the official one."""
    return args.negative_prompt if job is None or job.negative_prompt is None else job.negative_prompt


def negative_prompt(args, job=None) -> str:
    from wan_tpu.encoders.umt5_text import WAN_NEGATIVE_PROMPT

    chosen = chosen_negative_prompt(args, job)
    return WAN_NEGATIVE_PROMPT if chosen is None else chosen


def single_job(args, output: str | None = None):
    from wan_tpu.wan.prompts import Job

    return Job(args.prompt, output or getattr(args, "output", ""), image=getattr(args, "image", None))


def plan_jobs(args) -> list:
    """The videos to make (`--prompt`: one; `--prompts FILE`: one per line), outputs checked: none may
    exist without --overwrite, each folder must exist and take a new file."""
    from wan_tpu.wan.prompts import read_prompts

    jobs = [single_job(args)] if args.prompts is None else read_prompts(args.prompts, args.output)
    for job in jobs:
        try:
            check_output(job.output, args.overwrite, ".mp4")
        except WanInputError as e:
            raise WanInputError(f"{job.where(args.prompts)}{e}") from None
    return jobs


def check_jobs(pipe, args, s, jobs, stages) -> None:
    """Each job's prompts and image, then (once) the memory the run needs: before anything loads."""
    for job in jobs:
        try:
            pipe.check_run(s, job.image or args.image, prompt=job.prompt,
                           negative_prompt=chosen_negative_prompt(args, job), stages=stages, memory=False)
        except WanInputError as e:
            raise WanInputError(f"{job.where(getattr(args, 'prompts', None))}{e}") from None
    image = any((job.image or args.image) is not None for job in jobs)
    pipe.check_fits(s, stages, keep_dit=len(jobs) > 1, image=image)


def stage_meta(pipe, stage: str, s, args, **fields):
    """Metadata of a stage file: what the next stage must match (and takes as its defaults)."""
    from wan_tpu.wan.stages import StageMeta, config_hash

    model = os.path.abspath(args.model) if os.path.isdir(args.model) else args.model
    return StageMeta(stage, config_hash=config_hash(pipe.model_id), size=s.size, frames=s.num_frames,
                     dtype=args.dtype, model=model, **fields)


def encode_stage(pipe, args, s, timer, jobs) -> list[dict]:
    """Stage 1: prompt embeddings (+ image conditioning) of each job; each encoder loads once."""
    with timer.stage("load text encoder"):
        pipe.text_encoder
    embeds = []
    with timer.stage("text encode"):
        for job in jobs:
            out = pipe.encode_prompt(job.prompt, negative_prompt(args, job), s.guidance_scale)
            embeds.append({k: _ready(v) for k, v in out.items()})
    pipe.release("text_encoder")
    if any((job.image or args.image) is not None for job in jobs):
        with timer.stage("image encode"):
            for job, e in zip(jobs, embeds):
                image = job.image or args.image
                e.update({k: _ready(v) for k, v in pipe.encode_image(image, s.height, s.width, s.num_frames).items()})
        pipe.release("image_encoder")
    return embeds


def stage1_meta(pipe, args, s, job=None):
    job = job or single_job(args)
    return stage_meta(pipe, "prompt", s, args, prompt=job.prompt, negative_prompt=negative_prompt(args, job),
                      guidance=s.guidance_scale, guidance_2=s.guidance_scale_2)


def stage1_expect(pipe, args, s) -> dict:
    """What a stage-1 file must match for this denoising run."""
    meta = stage_meta(pipe, "prompt", s, args, guidance=s.guidance_scale)
    return {"stage": "prompt", **{k: v for k, v in _meta_dict(meta).items() if k != "model"}}


def denoise_stage(pipe, args, s, embeds, timer, step_seconds, seed=None, release=True) -> object:
    """Stage 2: final latents from the stage-1 arrays (the DiT stays loaded unless `release`)."""
    names = ["transformer"] + (["transformer_2"] if pipe.variant.boundary_ratio is not None else [])
    with timer.stage("load transformer"):
        for name in names:
            pipe.component(name)
    with timer.stage("denoise"):
        latents = _ready(pipe.denoise(embeds, seed=args.seed if seed is None else seed, height=s.height, width=s.width,
                                      num_frames=s.num_frames, num_inference_steps=s.num_inference_steps,
                                      guidance_scale=s.guidance_scale, guidance_scale_2=s.guidance_scale_2,
                                      flow_shift=s.flow_shift, scheduler=args.scheduler, progress=not args.quiet,
                                      step_seconds=step_seconds,
                                      **sampling_kwargs(args)))
    if release:
        pipe.release(*names)
    return latents


def stage2_meta(pipe, args, s, prompt: str | None, negative: str | None, seed=None):
    return stage_meta(pipe, "latents", s, args, prompt=prompt, negative_prompt=negative,
                      seed=args.seed if seed is None else seed, steps=s.num_inference_steps, shift=s.flow_shift,
                      guidance=s.guidance_scale, guidance_2=s.guidance_scale_2, scheduler=args.scheduler)


def stage3_expect(pipe, args) -> dict:
    """What a stage-2 file must match to be decoded by this model (size/frames only if given)."""
    from wan_tpu.wan.stages import config_hash

    width, height = parse_size(args.size)
    return {"stage": "latents", "config_hash": config_hash(pipe.model_id),
            "size": None if width is None else f"{width}*{height}", "frames": args.frames}


def decode_stage(pipe, args, latents, timer, output=None):
    """Stage 3: frames, written to `output` (default `args.output`)."""
    from wan_tpu.runtime import interrupt
    from wan_tpu.runtime.profiling import scope
    from wan_tpu.runtime.video import write_video

    output = output or args.output
    with timer.stage("load vae"):
        pipe.vae
    with timer.stage("decode"):
        frames = pipe.decode(latents)
    with timer.stage("write"), scope("export"):
        write_video(output, frames, pipe.variant.fps, overwrite=args.overwrite)
    interrupt.record(output)
    return frames


def report(pipe, s, timer, step_seconds, out=None) -> None:
    """Per-stage times, s/step (compile excluded: the first step is left out when there are more) and MFU."""
    import jax

    from wan_tpu.runtime import compile_cache
    from wan_tpu.runtime.profiling import dit_forward_flops, mfu

    extra = [("compile cache", compile_cache.summary())]
    cache = pipe.cache_stats
    if cache is not None:
        extra.append(("steps skipped", f"{cache.skipped:9d} of {cache.steps}  ({cache.method}, threshold "
                                        f"{cache.threshold:g})"))
    if step_seconds:
        steady = step_seconds[1:] or step_seconds
        per_step = sorted(steady)[len(steady) // 2]
        shape = pipe.latent_shape(s.height, s.width, s.num_frames)
        pt, ph, pw = pipe.variant.transformer.patch_size
        tokens = (shape[2] // pt) * (shape[3] // ph) * (shape[4] // pw)
        image_len = 257 if pipe.variant.uses_clip_image else 0
        flops = dit_forward_flops(pipe.variant.transformer, tokens, image_len=image_len) * (2 if s.do_cfg else 1)
        n = pipe.mesh.devices.size if pipe.mesh is not None else 1
        value, basis = mfu(flops, per_step, n, jax.devices()[0])
        extra.append(("s/step (median)", f"{per_step:9.3f} s"))
        if cache is None or not cache.skipped:  # skipped steps do a fraction of the model FLOPs
            extra.append(("MFU", f"{value:>9}  ({basis})"))
    print(timer.table(extra), file=out or sys.stdout)


def _ready(x):
    import jax

    return jax.block_until_ready(x)


def _meta_dict(meta) -> dict:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(meta).items() if v is not None and k != "stage"}


def stage_paths(args) -> tuple[str, str] | None:
    folder = args.keep_stages
    if folder is None:
        return None
    if args.prompts is not None:
        raise WanInputError("--keep-stages writes the stage files of one video; drop it with --prompts "
                            "(or run the stage scripts for the prompt you want to inspect)")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise WanInputError(f"--keep-stages {folder} is a file; pass a folder")
    paths = tuple(os.path.join(folder, n) for n in STAGE_FILES)
    for path in paths:
        if os.path.exists(path) and not args.overwrite:
            raise WanInputError(f"stage file {path} already exists; pass --overwrite or choose another --keep-stages folder")
    return paths


def generate(args) -> None:
    from wan_tpu.runtime import interrupt
    from wan_tpu.runtime.profiling import StageTimer, scope, trace
    from wan_tpu.wan.stages import save_stage

    resolve_defaults(args)
    from wan_tpu.runtime.xla_defaults import nvidia_gpu_present

    if nvidia_gpu_present():
        from wan_tpu.runtime.compile_ahead import start_imports

        start_imports("wan_tpu.kernels.flash_mgpu")  # the Hopper attention kernel a cold step's trace imports
    jobs = plan_jobs(args)
    stages = stage_paths(args)
    timer = StageTimer(since=getattr(args, "started", None), progress=not args.quiet)
    step_seconds: list[float] = []
    if args.model in ("tiny", "tiny-ti2v"):
        print(f"note: --model {args.model} has random weights; pass --model PATH (a diffusers-format Wan checkpoint) for a real video",
              flush=True)
    pipe = load_pipeline(args)
    s = run_settings(pipe, args)
    check_jobs(pipe, args, s, jobs, ("text", "image", "denoise", "decode"))
    if stages is not None:
        os.makedirs(args.keep_stages, exist_ok=True)
    # Read every component and compile the denoise step and the decode in background threads; the
    # stages below wait only for what they need, and no thread outlives them (an error cancels the rest).
    image = any((job.image or args.image) is not None for job in jobs)
    with pipe.prepare(s, scheduler=args.scheduler, image=image, **sampling_kwargs(args)), trace(args.profile), \
            scope("pipeline"):
        with scope("data_preparation"):
            embeds = encode_stage(pipe, args, s, timer, jobs)
        if stages is not None:
            save_stage(stages[0], embeds[0], stage1_meta(pipe, args, s), overwrite=args.overwrite)
            interrupt.record(stages[0])
        # Several videos: the DiT and the VAE stay loaded from one video to the next.
        for i, (job, embed) in enumerate(zip(jobs, embeds)):
            seed = args.seed if job.seed is None else job.seed
            latents = denoise_stage(pipe, args, s, embed, timer, step_seconds, seed, release=i == len(jobs) - 1)
            if stages is not None:
                meta = stage2_meta(pipe, args, s, job.prompt, negative_prompt(args, job), seed)
                save_stage(stages[1], {"latents": latents}, meta, overwrite=args.overwrite)
                interrupt.record(stages[1])
            decode_stage(pipe, args, latents, timer, job.output)
            print(f"wrote {job.output} ({s.num_frames} frames, {s.width}x{s.height}, {pipe.variant.fps} fps)")
    report(pipe, s, timer, step_seconds)


def main(argv=None) -> int:
    # The denoise step's and the decode's programs compile at once in worker processes.
    return run_cli(generate, build_parser(), argv, compile_workers=lambda args: True)
