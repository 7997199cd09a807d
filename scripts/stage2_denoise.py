"""Stage 2: embeddings → final latents (the DiT loop), from and to stage files.

    python scripts/stage2_denoise.py --model tiny --input stage1.safetensors --output stage2.safetensors --seed 0

Takes the model, run and denoising flags of `python -m wan_tpu.generate`. The input's metadata
must match this run (model, `--size`, `--frames`, `--guidance`, `--dtype`); a mismatch is refused
with a message naming each difference. `--overwrite` replaces an existing output.
"""

import sys

from wan_tpu.generate import (CliParser, add_adapter_args, add_denoise_args, add_model_args, add_run_args,
                              check_stage_output, cli, denoise_stage, load_pipeline, report, run_settings,
                              stage1_expect, stage2_meta)
from wan_tpu.profiling import StageTimer, trace


def run(args):
    from wan_tpu.stages import load_stage, save_stage

    check_stage_output(args.output, args.overwrite)
    timer = StageTimer()
    step_seconds = []
    pipe = load_pipeline(args)
    s = run_settings(pipe, args)
    embeds, meta = load_stage(args.input, expect=stage1_expect(pipe, args, s))
    with trace(args.profile):
        latents = denoise_stage(pipe, args, s, embeds, timer, step_seconds)
    save_stage(args.output, {"latents": latents}, stage2_meta(pipe, args, s, meta.prompt, meta.negative_prompt),
               overwrite=args.overwrite)
    print(f"wrote {args.output}")
    report(pipe, s, timer, step_seconds)


def parser():
    p = CliParser(prog="scripts/stage2_denoise.py", description="Stage 2: embeddings → latents")
    add_model_args(p)
    add_run_args(p)
    add_denoise_args(p)
    add_adapter_args(p)
    p.add_argument("--input", default="stage1.safetensors", help="stage-1 file (default: stage1.safetensors)")
    p.add_argument("--output", default="stage2.safetensors", help="stage file to write (default: stage2.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--profile", default=None, metavar="DIR", help="write a JAX profiler trace into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


if __name__ == "__main__":
    sys.exit(cli(run, parser()))
