"""Stage 2: embeddings → final latents (the DiT loop), from and to stage files.

    wan-stage2-denoise --input stage1.safetensors --output stage2.safetensors --seed 0

Takes the model, run and denoising flags of `python -m wan_tpu.generate` (the official Wan names
too). Flags left out take the input file's values (model, size, frames, guidance, dtype); a flag
given with another value than the file's is refused with a message naming each difference. The
output records the run (seed, steps, shift, scheduler too) for stage 3. `--overwrite` replaces an
existing output.
"""

from wan_tpu.runtime.cli import CliParser, run_cli
from wan_tpu.runtime.profiling import StageTimer, trace
from wan_tpu.runtime.validate import check_output
from wan_tpu.wan.cli import (
    add_adapter_args,
    add_denoise_args,
    add_model_args,
    add_run_args,
    denoise_stage,
    load_pipeline,
    report,
    resolve_defaults,
    run_settings,
    stage1_expect,
    stage2_meta,
)


def run(args):
    from wan_tpu.runtime import interrupt
    from wan_tpu.wan.stages import load_stage, read_stage_meta, save_stage

    resolve_defaults(args, read_stage_meta(args.input))
    check_output(args.output, args.overwrite, ".safetensors")
    timer = StageTimer(since=args.started, progress=not args.quiet)
    step_seconds = []
    pipe = load_pipeline(args)
    s = run_settings(pipe, args)
    pipe.check_fits(s, ("denoise",))
    embeds, meta = load_stage(args.input, expect=stage1_expect(pipe, args, s))
    with trace(args.profile):
        latents = denoise_stage(pipe, args, s, embeds, timer, step_seconds)
    save_stage(args.output, {"latents": latents}, stage2_meta(pipe, args, s, meta.prompt, meta.negative_prompt),
               overwrite=args.overwrite)
    interrupt.record(args.output)
    print(f"wrote {args.output}")
    report(pipe, s, timer, step_seconds)


def parser():
    p = CliParser(prog="wan-stage2-denoise", description="Stage 2: embeddings → latents")
    add_model_args(p, output_default="stage2.safetensors", output_help="stage file to write (default: stage2.safetensors)")
    add_run_args(p)
    add_denoise_args(p)
    add_adapter_args(p)
    p.add_argument("--input", default="stage1.safetensors", help="stage-1 file (default: stage1.safetensors)")
    return p


def main(argv=None) -> int:
    return run_cli(run, parser(), argv)
