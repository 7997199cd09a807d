"""Stage 3: final latents → mp4 (VAE decode), from a stage file.

    python scripts/stage3_decode.py --model tiny --input stage2.safetensors --output output.mp4

Only the VAE is loaded. The input must come from the same model (checked); `--size`/`--frames`,
when given, are checked too. The mp4 is written at the model's fps under a temporary name, then
renamed; `--overwrite` replaces an existing output.
"""

import sys

from wan_tpu.errors import WanInputError
from wan_tpu.generate import CliParser, add_model_args, cli, decode_stage, load_pipeline, stage3_expect
from wan_tpu.profiling import StageTimer


def run(args):
    from wan_tpu.stages import load_stage
    from wan_tpu.stages import check_output_path

    check_output_path(args.output, args.overwrite, ".mp4")
    timer = StageTimer()
    pipe = load_pipeline(args)
    tensors, meta = load_stage(args.input, expect=stage3_expect(pipe, args))
    if "latents" not in tensors:
        raise WanInputError(f"{args.input} holds no 'latents' tensor; pass the file stage 2 wrote")
    frames = decode_stage(pipe, args, tensors["latents"], timer)
    print(f"wrote {args.output} ({frames.shape[0]} frames, {frames.shape[2]}x{frames.shape[1]}, {pipe.variant.fps} fps)")
    print(timer.table())


def parser():
    p = CliParser(prog="scripts/stage3_decode.py", description="Stage 3: latents → mp4")
    add_model_args(p)
    p.add_argument("--size", default=None, help="W*H the latents must have been made for (checked if given)")
    p.add_argument("--frames", type=int, default=None, help="frames the latents must have been made for (checked if given)")
    p.add_argument("--input", default="stage2.safetensors", help="stage-2 file (default: stage2.safetensors)")
    p.add_argument("--output", default="output.mp4", help="mp4 to write (default: output.mp4)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


if __name__ == "__main__":
    sys.exit(cli(run, parser()))
