"""Stage 1: prompt (and image) → embeddings, written to a stage file.

    wan-stage1-encode --model tiny --prompt "a cat walks on the grass" --output stage1.safetensors

Takes the prompt, model and run flags of `python -m wan_tpu.generate` (the official Wan names too).
The file records them (model, size, frames, guidance, dtype, prompts), and stage 2 takes them from
it: `--size`, `--frames` and `--guidance` given to stage 2 must match (CFG needs the negative
embeddings; I2V/TI2V encode `--image` at that size and length). `--overwrite` replaces an existing
output.
"""

from wan_tpu.runtime.cli import CliParser, run_cli
from wan_tpu.runtime.profiling import StageTimer
from wan_tpu.runtime.validate import check_output
from wan_tpu.wan.cli import (
    add_model_args,
    add_prompt_args,
    add_run_args,
    check_jobs,
    encode_stage,
    load_pipeline,
    resolve_defaults,
    run_settings,
    single_job,
    stage1_meta,
)


def run(args):
    from wan_tpu.runtime import interrupt
    from wan_tpu.wan.stages import save_stage

    resolve_defaults(args)
    check_output(args.output, args.overwrite, ".safetensors")
    timer = StageTimer(since=args.started, progress=not args.quiet)
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
    add_model_args(p, output_default="stage1.safetensors", output_help="stage file to write (default: stage1.safetensors)",
                   seed=False, profile=False)
    add_run_args(p)
    return p


def main(argv=None) -> int:
    return run_cli(run, parser(), argv)
