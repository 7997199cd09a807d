"""Stage 1: prompt (and image) → embeddings, written to a stage file.

    wan-stage1-encode --model tiny --prompt "a cat walks on the grass" --output stage1.safetensors

Takes the prompt, model and run flags of `python -m wan_tpu.generate` (the official Wan names too).
The file records them (model, size, frames, guidance, dtype, prompts), and stage 2 takes them from
it: `--size`, `--frames` and `--guidance` given to stage 2 must match (CFG needs the negative
embeddings; I2V/TI2V encode `--image` at that size and length). `--overwrite` replaces an existing
output.
"""

import sys

from wan_tpu.wan.cli import (CliParser, add_model_args, add_prompt_args, add_run_args, check_jobs, check_output, cli,
                              encode_stage, load_pipeline, resolve_defaults, run_settings, single_job, stage1_meta)
from wan_tpu.runtime.profiling import StageTimer


def run(args):
    from wan_tpu.runtime import interrupt
    from wan_tpu.wan.stages import save_stage

    resolve_defaults(args)
    check_output(args.output, args.overwrite, ".safetensors")
    timer = StageTimer()
    pipe = load_pipeline(args)
    s = run_settings(pipe, args)
    job = single_job(args, args.output)
    check_jobs(pipe, args, s, [job], ("text", "image"))
    (embeds,) = encode_stage(pipe, args, s, timer, [job])
    save_stage(args.output, embeds, stage1_meta(pipe, args, s, job), overwrite=args.overwrite)
    interrupt.record(args.output)
    print(f"wrote {args.output}")
    print(timer.table())


def parser():
    p = CliParser(prog="wan-stage1-encode", description="Stage 1: prompt (and image) → embeddings")
    add_prompt_args(p)
    add_model_args(p)
    add_run_args(p)
    p.add_argument("--output", "--save_file", dest="output", default="stage1.safetensors",
                   help="stage file to write (default: stage1.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


def main(argv=None) -> int:
    return cli(run, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
