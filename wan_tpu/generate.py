"""Generate a video from a prompt (and an image for I2V/TI2V): `python -m wan_tpu.generate`.

    python -m wan_tpu.generate --model tiny --prompt "a cat walks on the grass"
    python -m wan_tpu.generate --model /ckpt/Wan2.1-T2V-1.3B-Diffusers --prompt "..." --size 832*480 \\
        --frames 81 --steps 50 --mesh 2,1,4 --keep-stages stages/ --output cat.mp4

`--model` takes a diffusers-format checkpoint folder or a built-in preset; it defaults to `tiny`,
random weights that only show the machinery works (a notice says so). Settings left out take the
official Wan defaults of the model (size, frames, steps, guidance, shift: see `wan_tpu.settings`).
The three stages (text encode → denoise → VAE decode) hand over arrays in memory; `--keep-stages DIR`
also writes them as `DIR/stage1.safetensors` (embeddings) and `DIR/stage2.safetensors` (latents),
the files the stage scripts in `scripts/` read and write. At the end a table gives the time of
each stage, s/step and the DiT's model FLOPs utilization (MFU).

Bad input prints one line on stderr naming the fix and exits with status 2, leaving no file behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from wan_tpu.errors import WanInputError

DTYPES = ("bfloat16", "float32")
STAGE_FILES = ("stage1.safetensors", "stage2.safetensors")


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors, exit status 2 (what every bad input of the CLI gives)."""

    def error(self, message):
        raise WanInputError(f"{message}; see {self.prog} --help")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="diffusers-format checkpoint folder or preset name (default: tiny)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="DiT and text encoder dtype (VAE: float32)")
    p.add_argument("--mesh", default=None, help="device mesh dp,sp,tp (product = number of devices; default: one device)")
    p.add_argument("--attention", default=None, help="DiT attention kernel (reference, splash_exp2, pallas_gpu, cudnn)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="neither read nor write the persistent compilation cache (see wan_tpu.compile_cache)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, help="W*H, e.g. 832*480 (default: the model's)")
    p.add_argument("--frames", type=int, default=None, help="number of frames, 4n+1 (default: the model's, 81)")
    p.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale (<= 1: no CFG)")
    p.add_argument("--guidance-2", type=float, default=None, help="guidance of the low-noise expert (Wan 2.2 A14B)")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True,
                   help="what the video shows (may be empty only with a non-empty negative prompt and guidance > 1)")
    p.add_argument("--negative-prompt", default=None,
                   help="what to steer away from (default: the official Wan negative prompt; '' for none)")
    p.add_argument("--image", default=None, help="first frame for image-to-video models (PNG/JPEG)")


def add_denoise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's, 50 or 40)")
    p.add_argument("--shift", type=float, default=None, help="flow shift (default: the model's, 5.0; 3.0 for 2.1 I2V 480p)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise (same seed → same video)")
    p.add_argument("--scheduler", choices=("unipc", "euler"), default="unipc", help="flow sampler (default: unipc)")


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m wan_tpu.generate", description=__doc__.split("\n\n")[0])
    add_prompt_args(p)
    add_model_args(p)
    add_run_args(p)
    add_denoise_args(p)
    p.add_argument("--output", default="output.mp4", help="mp4 to write (default: output.mp4)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output and stage files")
    p.add_argument("--keep-stages", default=None, metavar="DIR", help="also write the stage files into DIR")
    p.add_argument("--profile", default=None, metavar="DIR", help="write a JAX profiler trace into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
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


def parse_mesh(spec: str | None):
    """`dp,sp,tp` → a mesh over all devices (None → no mesh: one device)."""
    if spec is None:
        return None
    parts = spec.split(",")
    if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise WanInputError(f"mesh {spec!r} is not dp,sp,tp; pass e.g. --mesh 2,1,4 (product = number of devices)")
    from wan_tpu.mesh import make_mesh

    dp, sp, tp = (int(p) for p in parts)
    return make_mesh(dp=dp, sp=sp, tp=tp)


def load_pipeline(args):
    import jax.numpy as jnp

    from wan_tpu.pipeline import WanPipeline

    if args.attention is not None:
        import jax

        from wan_tpu.layers.attention import runnable_impls

        choices = runnable_impls(jax.default_backend())
        if args.attention not in choices:
            raise WanInputError(f"attention kernel {args.attention!r} cannot run on {jax.default_backend()}; "
                                f"choose one of {', '.join(choices)} or leave --attention out")
    mesh = parse_mesh(args.mesh)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    return WanPipeline.from_pretrained(args.model, mesh=mesh, dtype=dtype, attention_impl=args.attention,
                                       compile_cache=not args.no_compile_cache)


def run_settings(pipe, args):
    width, height = parse_size(getattr(args, "size", None))
    s = pipe.settings(height=height, width=width, num_frames=getattr(args, "frames", None),
                      num_inference_steps=getattr(args, "steps", None), guidance_scale=getattr(args, "guidance", None),
                      guidance_scale_2=getattr(args, "guidance_2", None), flow_shift=getattr(args, "shift", None))
    image = getattr(args, "image", None)
    if image is not None and pipe.variant.task == "t2v":
        raise WanInputError(f"{pipe.variant.name} is a text-to-video model and takes no image; drop --image")
    if image is None and pipe.variant.task == "i2v" and hasattr(args, "image"):
        raise WanInputError(f"{pipe.variant.name} is an image-to-video model; pass the first frame with --image PATH")
    return s


def negative_prompt(args) -> str:
    from wan_tpu.text_encoder import WAN_NEGATIVE_PROMPT

    return WAN_NEGATIVE_PROMPT if args.negative_prompt is None else args.negative_prompt


def stage_meta(pipe, stage: str, s, args, **fields):
    """Metadata of a stage file: what the next stage must match."""
    from wan_tpu.stages import StageMeta, config_hash

    return StageMeta(stage, config_hash=config_hash(pipe.model_id), size=s.size, frames=s.num_frames,
                     dtype=args.dtype, **fields)


def encode_stage(pipe, args, s, timer) -> dict:
    """Stage 1: prompt embeddings (+ image conditioning) for this run."""
    from wan_tpu.pipeline import check_prompts

    neg = negative_prompt(args)
    check_prompts(args.prompt, neg, s.do_cfg)
    if args.image is not None:
        from wan_tpu.conditioning import load_image

        load_image(args.image)  # fail on a bad image before minutes of loading
    with timer.stage("load text encoder"):
        pipe.text_encoder
    with timer.stage("text encode"):
        embeds = pipe.encode_prompt(args.prompt, neg, s.guidance_scale)
        embeds = {k: _ready(v) for k, v in embeds.items()}
    pipe.release("text_encoder")
    if args.image is not None:
        with timer.stage("image encode"):
            embeds.update({k: _ready(v) for k, v in pipe.encode_image(args.image, s.height, s.width, s.num_frames).items()})
        pipe.release("image_encoder")
    return embeds


def stage1_meta(pipe, args, s):
    return stage_meta(pipe, "prompt", s, args, prompt=args.prompt, negative_prompt=negative_prompt(args),
                      guidance=s.guidance_scale)


def stage1_expect(pipe, args, s) -> dict:
    """What a stage-1 file must match for this denoising run."""
    return {"stage": "prompt", **_meta_dict(stage_meta(pipe, "prompt", s, args, guidance=s.guidance_scale))}


def denoise_stage(pipe, args, s, embeds, timer, step_seconds) -> object:
    """Stage 2: final latents from the stage-1 arrays."""
    names = ["transformer"] + (["transformer_2"] if pipe.variant.boundary_ratio is not None else [])
    with timer.stage("load transformer"):
        for name in names:
            pipe.component(name)
    with timer.stage("denoise"):
        latents = _ready(pipe.denoise(embeds, seed=args.seed, height=s.height, width=s.width, num_frames=s.num_frames,
                                      num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale,
                                      guidance_scale_2=s.guidance_scale_2, flow_shift=s.flow_shift,
                                      scheduler=args.scheduler, progress=not args.quiet, step_seconds=step_seconds))
    pipe.release(*names)
    return latents


def stage2_meta(pipe, args, s, prompt: str | None, negative: str | None):
    return stage_meta(pipe, "latents", s, args, prompt=prompt, negative_prompt=negative, seed=args.seed,
                      steps=s.num_inference_steps, shift=s.flow_shift, guidance=s.guidance_scale,
                      guidance_2=s.guidance_scale_2, scheduler=args.scheduler)


def stage3_expect(pipe, args) -> dict:
    """What a stage-2 file must match to be decoded by this model (size/frames only if given)."""
    from wan_tpu.stages import config_hash

    width, height = parse_size(args.size)
    return {"stage": "latents", "config_hash": config_hash(pipe.model_id),
            "size": None if width is None else f"{width}*{height}", "frames": args.frames}


def decode_stage(pipe, args, latents, timer):
    """Stage 3: frames, written to `args.output`."""
    from wan_tpu.profiling import scope
    from wan_tpu.video import write_video

    with timer.stage("load vae"):
        pipe.vae
    with timer.stage("decode"):
        frames = pipe.decode(latents)
    with timer.stage("write"), scope("export"):
        write_video(args.output, frames, pipe.variant.fps, overwrite=args.overwrite)
    return frames


def report(pipe, s, timer, step_seconds, out=sys.stdout) -> None:
    """Per-stage times, s/step (compile excluded: the first step is left out when there are more) and MFU."""
    import jax

    from wan_tpu import compile_cache
    from wan_tpu.profiling import dit_forward_flops, mfu

    extra = [("compile cache", f"{compile_cache.stats()}  ({compile_cache.cache_dir()})" if compile_cache.is_enabled()
              else "off")]
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
        extra += [("s/step (median)", f"{per_step:9.3f} s"), ("MFU", f"{value:>9}  ({basis})")]
    print(timer.table(extra), file=out)


def _ready(x):
    import jax

    return jax.block_until_ready(x)


def _meta_dict(meta) -> dict:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(meta).items() if v is not None and k != "stage"}


def check_stage_output(path: str, overwrite: bool) -> None:
    """Fail before any work when a stage file cannot be written."""
    from wan_tpu.stages import check_output_path

    check_output_path(path, overwrite, ".safetensors")


def stage_paths(folder: str | None, overwrite: bool) -> tuple[str, str] | None:
    if folder is None:
        return None
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise WanInputError(f"--keep-stages {folder} is a file; pass a folder")
    paths = tuple(os.path.join(folder, n) for n in STAGE_FILES)
    for path in paths:
        if os.path.exists(path) and not overwrite:
            raise WanInputError(f"stage file {path} already exists; pass --overwrite or choose another --keep-stages folder")
    return paths


def generate(args) -> None:
    from wan_tpu.profiling import StageTimer, scope, trace
    from wan_tpu.stages import save_stage
    from wan_tpu.stages import check_output_path

    check_output_path(args.output, args.overwrite, ".mp4")
    stages = stage_paths(args.keep_stages, args.overwrite)
    timer = StageTimer(since=getattr(args, "started", None))
    step_seconds: list[float] = []
    pipe = load_pipeline(args)
    s = run_settings(pipe, args)
    if stages is not None:
        os.makedirs(args.keep_stages, exist_ok=True)
    if args.model == "tiny":
        print("note: --model tiny has random weights; pass --model PATH (a diffusers-format Wan checkpoint) for a real video")
    # Read every component and compile the denoise step and the decode in background threads; the
    # stages below wait only for what they need, and no thread outlives them (an error cancels the rest).
    with pipe.prepare(s, scheduler=args.scheduler, image=args.image is not None), trace(args.profile), \
            scope("pipeline"):
        with scope("data_preparation"):
            embeds = encode_stage(pipe, args, s, timer)
        if stages is not None:
            save_stage(stages[0], embeds, stage1_meta(pipe, args, s), overwrite=args.overwrite)
        latents = denoise_stage(pipe, args, s, embeds, timer, step_seconds)
        if stages is not None:
            save_stage(stages[1], {"latents": latents}, stage2_meta(pipe, args, s, args.prompt, negative_prompt(args)),
                       overwrite=args.overwrite)
        decode_stage(pipe, args, latents, timer)
    print(f"wrote {args.output} ({s.num_frames} frames, {s.width}x{s.height}, {pipe.variant.fps} fps)")
    report(pipe, s, timer, step_seconds)


def cli(run, parser: argparse.ArgumentParser, argv=None) -> int:
    """Run `run(args)`; user errors → one line on stderr and status 2, NaN latents → status 1."""
    called = time.perf_counter()
    import warnings

    from wan_tpu.denoise import NonFiniteLatentsError
    from wan_tpu.profiling import process_start

    # torchax and jax warn that int64 token ids become int32 (x64 is off); harmless for ids < 2^31.
    warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
    try:
        args = parser.parse_args(argv)
        # `startup` counts from the process start for a command line, from this call for a call from Python.
        args.started = process_start() if argv is None else called
        run(args)
    except WanInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLatentsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    return cli(generate, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
