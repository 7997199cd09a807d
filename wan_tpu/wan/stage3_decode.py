"""Stage 3: final latents → mp4 (VAE decode), from a stage file.

    wan-stage3-decode --input stage2.safetensors --output output.mp4

Only the VAE is loaded. The model, size and frames come from the input file unless given; the
input must come from the same model (checked), and `--size`/`--frames`, when given, must match.
The mp4 is written at the model's fps under a temporary name, then renamed; `--overwrite`
replaces an existing output.
"""

from wan_tpu.errors import WanInputError
from wan_tpu.runtime.cli import CliParser, run_cli
from wan_tpu.runtime.profiling import StageTimer
from wan_tpu.runtime.validate import check_output
from wan_tpu.wan.cli import add_model_args, decode_stage, load_pipeline, resolve_defaults, run_settings, stage3_expect


def run(args):
    from wan_tpu.wan.stages import load_stage, read_stage_meta

    resolve_defaults(args, read_stage_meta(args.input))
    check_output(args.output, args.overwrite, ".mp4")
    timer = StageTimer(since=args.started, progress=not args.quiet)
    pipe = load_pipeline(args)
    pipe.check_fits(run_settings(pipe, args), ("decode",))
    tensors, meta = load_stage(args.input, expect=stage3_expect(pipe, args))
    if "latents" not in tensors:
        raise WanInputError(f"{args.input} holds no 'latents' tensor; pass the file stage 2 wrote")
    frames = decode_stage(pipe, args, tensors["latents"], timer)
    print(f"wrote {args.output} ({frames.shape[0]} frames, {frames.shape[2]}x{frames.shape[1]}, {pipe.variant.fps} fps)")
    print(timer.table())


def parser():
    p = CliParser(prog="wan-stage3-decode", description="Stage 3: latents → mp4")
    add_model_args(p, output_default="output.mp4", output_help="mp4 to write (default: output.mp4)", seed=False,
                   profile=False)
    p.add_argument("--size", default=None, help="W*H the latents were made for (default: the input's; checked if given)")
    p.add_argument("--frames", "--frame_num", dest="frames", type=int, default=None,
                   help="frames the latents were made for (default: the input's; checked if given)")
    p.add_argument("--input", default="stage2.safetensors", help="stage-2 file (default: stage2.safetensors)")
    return p


def main(argv=None) -> int:
    return run_cli(run, parser(), argv)
