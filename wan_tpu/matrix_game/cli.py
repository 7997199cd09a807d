"""Play Matrix-Game-2 from one image: `python -m wan_tpu.matrix_game`.

    python -m wan_tpu.matrix_game --model matrix-game-tiny --image start.png --random-actions --frames 33 --output o.mp4
    python -m wan_tpu.matrix_game --model mg2 --variant universal --image start.png --actions moves.json --output o.mp4
    python -m wan_tpu.matrix_game --model mg2 --image start.png --interactive --output o.mp4   # one action per line

`--model` is a folder made by `wan_tpu/matrix_game/convert.py` or the `matrix-game-tiny`
preset (random weights). Actions come from exactly one of: `--actions FILE` (.json / .npz, one row
per video frame, or one action line per chunk: see `wan_tpu.matrix_game.actions`), `--random-actions`
(the authors' random benchmark trajectories, seeded by `--seed`), or `--interactive` (one line of
the grammar per chunk on stdin, read as each chunk is wanted; an empty line repeats the last action;
`quit` or end of input stops). A video has 12n - 3 frames (9 in the first chunk, 12 in each later
one); `--frames` defaults to the action file's length, 597 (the authors' 150 latent frames) for
random actions, and bounds an interactive session. Frames go into the mp4 (12 fps, as the authors)
as each chunk arrives; the file appears under its name when the video ends.

At the end a table gives the time of each stage and every chunk's fps = video frames ÷ (denoise +
decode) as the authors' profile mode prints it (the first chunk includes the wait for the one program
every chunk runs, compiled or loaded meanwhile); `--profile DIR` writes a JAX trace whose
regions follow the authors' profiling tags (see `wan_tpu.matrix_game.pipeline`). Bad input (image, actions,
frame count, model folder, an existing output) prints one line and exits with status 2, leaving no file.
"""

from __future__ import annotations

import sys

from wan_tpu.errors import WanInputError
from wan_tpu.runtime.cli import CliParser, add_common_args, check_attention, dtype_of, parse_mesh, run_cli

RANDOM_FRAMES = 597  # the authors' default: 150 latent frames


def build_parser() -> CliParser:
    p = CliParser(prog="python -m wan_tpu.matrix_game", description=__doc__.split("\n\n")[0])
    add_common_args(p, model_default="matrix-game-tiny",
                    model_help="converted Matrix-Game-2 folder or the matrix-game-tiny preset (default)",
                    dtype_default="bfloat16", dtype_help="DiT and CLIP dtype (default: bfloat16)",
                    seed_default=0, seed_help="seed of the noise (and of --random-actions)",
                    output_default="output.mp4", output_help="mp4 to write (default: output.mp4)")
    p.add_argument("--variant", default=None, help="universal, gta_drive or templerun (default: universal, else the only one)")
    p.add_argument("--image", required=True, help="the first frame (PNG/JPEG), centre-cropped to the video's aspect")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--actions", default=None, metavar="FILE", help="actions per video frame (.json or .npz)")
    source.add_argument("--random-actions", action="store_true", help="the authors' random benchmark actions (--seed)")
    source.add_argument("--interactive", action="store_true", help="one action line per chunk from stdin")
    p.add_argument("--frames", type=int, default=None, help="video frames, 12n-3 (9, 21, 33, ...)")
    p.add_argument("--vae-dtype", choices=("bfloat16", "float32"), default="float32", help="VAE dtype")
    return p


def scripted_actions(args, pipe):
    """(keyboard, mouse) for the whole video from --actions or --random-actions, checked."""
    from wan_tpu.matrix_game import actions

    space, f = pipe.action_space, pipe.frames_per_chunk
    if args.actions is not None:
        keyboard, mouse = actions.load_actions(args.actions, space, f)
        if args.frames is not None and args.frames != len(keyboard):
            raise WanInputError(f"--frames {args.frames} but {args.actions} holds {len(keyboard)} frames of actions; "
                                f"drop --frames or give one action row per frame")
    else:
        frames = RANDOM_FRAMES if args.frames is None else args.frames
        actions.check_frames(frames, f)
        keyboard, mouse = actions.random_actions(space, frames, args.seed)
    actions.check_frames(len(keyboard), f)
    return keyboard, mouse


def interactive_lines(space, stream=None, prompt=None):
    """Parsed (keyboard, mouse) per chunk from the lines of `stream`, until a stop word or its end; a line
    the grammar rejects is reported and the next one read, an empty line repeats the last action."""
    from wan_tpu.matrix_game import actions

    stream, prompt = stream or sys.stdin, prompt or sys.stderr
    last = ""
    chunk = 0
    while True:
        print(f"chunk {chunk} action> ", end="", file=prompt, flush=True)
        line = stream.readline()
        if not line or line.strip().lower() in actions.STOP_WORDS:
            return
        line = line.strip() or last
        try:
            parsed = actions.parse_line(line, space)
        except WanInputError as e:
            print(f"error: {e}", file=prompt)
            continue
        last = line
        chunk += 1
        yield parsed


def play(args) -> None:
    from wan_tpu.runtime import interrupt
    from wan_tpu.runtime.images import load_image
    from wan_tpu.runtime.validate import check_output

    check_output(args.output, args.overwrite, ".mp4")
    image = load_image(args.image)  # fail on a bad image before loading anything
    if args.frames is not None and args.frames < 1:
        raise WanInputError(f"--frames must be positive, got {args.frames}")
    if args.model == "matrix-game-tiny":
        print("note: matrix-game-tiny has random weights; pass --model PATH (a converted Matrix-Game-2 folder) for a real video",
              flush=True)
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline
    from wan_tpu.runtime.profiling import StageTimer, scope, trace
    from wan_tpu.runtime.video import VideoWriter

    check_attention(args.attention)
    mesh = parse_mesh(args.mesh)
    timer = StageTimer(since=args.started, progress=not args.quiet)
    pipe = MatrixGamePipeline.from_pretrained(args.model, variant=args.variant, mesh=mesh, dtype=dtype_of(args.dtype),
                                              attention=args.attention, vae_dtype=dtype_of(args.vae_dtype),
                                              compile_cache=not args.no_compile_cache)
    scripted = None if args.interactive else scripted_actions(args, pipe)
    if args.interactive and args.frames is not None:
        from wan_tpu.matrix_game.actions import check_frames

        check_frames(args.frames, pipe.frames_per_chunk)
    # The three components read at once and every program loaded or compiled meanwhile; `stream` waits
    # for them where it needs them.
    pipe.prepare()
    max_frames = len(scripted[0]) if scripted is not None else args.frames
    with trace(args.profile), VideoWriter(args.output, pipe.variant.fps, args.overwrite) as video:
        interrupt.check("load")
        with timer.stage("load + data preparation"):
            session = pipe.stream(image, seed=args.seed, max_frames=max_frames)
        with scope("2_Pipeline_Inference"):
            for keyboard, mouse in _chunks(args, pipe, session, scripted):
                interrupt.check("denoise")
                with timer.stage("first chunk" if session.chunk == 0 else "chunks"):
                    frames = session.step(keyboard, mouse)
                with timer.stage("export"), scope("4_Video_Export"):
                    video.append(frames)
        if not video.frames:
            raise WanInputError("no action was given, so no chunk was made; type one action line per chunk (see --help)")
    interrupt.record(args.output)
    h, w = pipe.size
    print(f"wrote {args.output} ({video.frames} frames, {w}x{h}, {pipe.variant.fps} fps)")
    print(report(timer, session))


def _chunks(args, pipe, session, scripted):
    """(keyboard, mouse) per chunk: slices of the scripted actions, or parsed stdin lines."""
    if scripted is None:
        for k, (keyboard, mouse) in enumerate(interactive_lines(pipe.action_space)):
            if session.max_latents < pipe.frames_per_chunk * (k + 1):
                print(f"note: the stream is at its end ({len(session.keyboard)} frames)", file=sys.stderr)
                return
            yield keyboard, mouse
        return
    keyboard, mouse = scripted
    chunks = range((len(keyboard) + 3) // (4 * pipe.frames_per_chunk))
    if not args.quiet:
        from tqdm import tqdm

        chunks = tqdm(chunks, desc="chunks", unit="chunk")
    start = 0
    for k in chunks:
        n = pipe.chunk_frames(k)
        yield keyboard[start : start + n], None if mouse is None else mouse[start : start + n]
        start += n


def report(timer, session) -> str:
    """The stage table, then each chunk's fps and the whole video's."""
    frames, seconds = sum(session.chunk_frames), sum(session.chunk_seconds)
    steady = sorted(session.fps[2:]) or sorted(session.fps)
    from wan_tpu.runtime import compile_cache

    extra = [("compile cache", compile_cache.summary()),
             ("chunk count", f"{len(session.chunk_frames):9d}"),
             ("video fps (all chunks)", f"{frames / seconds:9.2f}" if seconds else "      n/a"),
             ("chunk fps (median from chunk 2)", f"{steady[len(steady) // 2]:9.2f}" if steady else "      n/a")]
    lines = [timer.table(extra), "", "chunk  frames  seconds      fps"]
    lines += [f"{k:5d}  {n:6d}  {s:7.3f}  {n / s:7.2f}"
              for k, (n, s) in enumerate(zip(session.chunk_frames, session.chunk_seconds))]
    return "\n".join(lines)


def main(argv=None) -> int:
    from wan_tpu.runtime.memory import world_model_need

    return run_cli(play, build_parser(), argv, device_memory=world_model_need)
