"""`python -m wan_tpu.unifolm`: UnifoLM-WMA from the command line.

    python -m wan_tpu.unifolm --model ckpt/unifolm-wma-0 --mode interact --instruction "stack the boxes" \
        --observation obs.npz --iterations 3 --fs 7 --output episode.mp4
    python -m wan_tpu.unifolm --model unifolm-tiny --mode decision --instruction "pick" --observation obs.json --output plan.mp4
    python -m wan_tpu.unifolm --model unifolm-tiny --mode world --observation obs.npz --actions chunk.npz --output sim.mp4
    python -m wan_tpu.unifolm --model unifolm-tiny-base --mode generate --instruction "open the drawer" --observation first.npz
    python -m wan_tpu.unifolm --model ckpt/unifolm-wma-0 --serve 8000     # the authors' POST /predict_action, on 127.0.0.1

Inputs (`.npz`, or `.json` with the same keys as nested lists): `--observation` holds `images`
(n_obs, H, W, 3) uint8 at the model's size (fewer frames repeat the first, as the authors' queues) and
`states` (n_obs, dof); `--actions` holds `actions` (16, dof). With the dataset's min-max table (the
checkpoint's `stats.safetensors` or `--stats`) states and actions are in the robot's units, otherwise
already in [-1, 1]. Outputs: the video (8 fps, as the authors) and, beside it with the same stem,
`.npz` + `.json` with the predicted `actions` / `states` (unnormalised, cut to the robot's DoF; per
iteration for `interact`). Bad input: one line on stderr, exit status 2, no file written.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from wan_tpu.errors import NonFiniteError, WanInputError
from wan_tpu.runtime import distributed, interrupt
from wan_tpu.runtime.cli import CliParser, add_common_args, check_attention, dtype_of, parse_mesh, run_cli

MODES = ("decision", "world", "interact", "generate")


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m wan_tpu.unifolm", description="UnifoLM-WMA: decision-making, world model, interaction, generation")
    add_common_args(p, model_default="unifolm-tiny",
                    model_help="converted checkpoint folder or preset (unifolm-tiny, unifolm-tiny-base)",
                    dtype_default="float32", dtype_help="UNet and heads dtype (default: float32, as the authors; VAE: float32)",
                    seed_default=123, seed_help="random seed (authors: 123)",
                    output_default="unifolm.mp4", output_help="video path; actions/states go beside it (.npz, .json)")
    p.add_argument("--mode", choices=MODES, help="what to run (not with --serve)")
    p.add_argument("--instruction", default="", help="the task in words (decision, interact, generate)")
    p.add_argument("--observation", help=".npz/.json with images (n, H, W, 3) uint8 and states (n, dof)")
    p.add_argument("--actions", help=".npz/.json with actions (16, dof): the chunk the world model plays (world)")
    p.add_argument("--stats", help="LeRobot stats.safetensors (min-max table; default: the checkpoint's)")
    p.add_argument("--steps", type=int, default=None, help="DDIM steps (default: 50; 16 for generate, as the authors; the tiny presets: 2)")
    p.add_argument("--eta", type=float, default=1.0, help="DDIM eta (authors: 1.0; 0 is deterministic)")
    p.add_argument("--fs", type=int, default=None, help="frame-stride condition fps // stride (Z1 sets 7, G1 5; default: the config's 10)")
    p.add_argument("--iterations", type=int, default=1, help="interaction iterations (interact)")
    p.add_argument("--encoder-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the CLIP towers' dtype (bfloat16 halves their memory; the tiny presets' stay float32)")
    p.add_argument("--sampling-programs", type=int, default=None, metavar="K",
                   help="run each DDIM step as K programs, compiled side by side and shared by every step count "
                        "(default: 4 where compile workers run, an NVIDIA GPU of 40 GB or more; else 1, the whole "
                        "sampling as one program)")
    p.add_argument("--serve", type=int, metavar="PORT", help="serve POST /predict_action on 127.0.0.1:PORT instead of one "
                   "run (the process becomes wan-serve with the same flags)")
    return p


def read_arrays(path: str, what: str) -> dict:
    """The arrays of an `.npz` or `.json` input file (name → numpy array)."""
    if not path:
        raise WanInputError(f"pass --{what} FILE (.npz or .json)")
    if not os.path.isfile(path):
        raise WanInputError(f"--{what} {path!r} does not exist")
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        if path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError("the top level is not an object")
            return {k: np.asarray(v, np.float64) for k, v in data.items()}
    except (ValueError, OSError) as e:
        raise WanInputError(f"--{what} {path}: cannot be read ({str(e).splitlines()[0][:120]}); pass an .npz or a JSON object") from None
    raise WanInputError(f"--{what} {path!r} must be an .npz or .json file")


def _need(arrays: dict, key: str, path: str) -> np.ndarray:
    """`arrays[key]`, finite and numeric (images as uint8 0..255, vectors as float32)."""
    if key not in arrays:
        raise WanInputError(f"{path} has no {key!r} array; it holds {sorted(arrays)}")
    value = np.asarray(arrays[key])
    if value.dtype.kind not in "uif" or value.size == 0:
        raise WanInputError(f"{path}: {key!r} must be a non-empty array of numbers, got {value.dtype} {value.shape}")
    if not np.isfinite(value).all():
        raise WanInputError(f"{path}: {key!r} holds NaN or infinite values; pass finite numbers")
    if key == "images":
        if value.ndim != 4 or value.shape[-1] != 3:
            raise WanInputError(f"{path}: 'images' must be (n, H, W, 3), got shape {value.shape}")
        if value.min() < 0 or value.max() > 255:
            raise WanInputError(f"{path}: 'images' must hold pixel values 0..255")
        return value.astype(np.uint8)
    if value.ndim != 2:
        raise WanInputError(f"{path}: {key!r} must be (n, dof), got shape {value.shape}")
    return value.astype(np.float32)


def check_settings(args) -> None:
    """Every flag that can be checked before loading: counts, ranges and combinations."""
    if args.mode is None:
        raise WanInputError("pass --mode decision|world|interact|generate (or --serve PORT)")
    if args.steps is not None and args.steps < 1:
        raise WanInputError(f"--steps must be at least 1, got {args.steps}")
    if not 0.0 <= args.eta <= 1.0:
        raise WanInputError(f"--eta must be in [0, 1] (1: the authors' stochastic DDIM, 0: deterministic), got {args.eta}")
    if args.iterations < 1:
        raise WanInputError(f"--iterations must be at least 1, got {args.iterations}")
    if args.mode != "interact" and args.iterations != 1:
        raise WanInputError("--iterations applies to --mode interact only; drop it")
    if args.fs is not None and args.fs < 1:
        raise WanInputError(f"--fs must be at least 1 (fps // frame stride), got {args.fs}")
    if args.mode != "world" and args.actions is not None:
        raise WanInputError("--actions is the chunk --mode world plays; drop it for other modes")
    if args.sampling_programs is not None and args.sampling_programs < 1:
        raise WanInputError(f"--sampling-programs must be at least 1, got {args.sampling_programs}")


def output_paths(video: str, with_vectors: bool, overwrite: bool) -> list[str]:
    from wan_tpu.runtime.validate import check_output

    stem = video[: -len(".mp4")] if video.lower().endswith(".mp4") else video
    paths = [video] + ([stem + ".npz", stem + ".json"] if with_vectors else [])
    for path, suffix in zip(paths, (".mp4", ".npz", ".json")):
        check_output(path, overwrite, suffix)
    return paths


def write_vectors(npz_path: str, json_path: str, vectors: dict, meta: dict, overwrite: bool) -> None:
    """`.npz` and `.json` of the predicted vectors, each written under a temporary name then renamed."""
    for path, write in ((npz_path, lambda f: np.savez(f, **vectors)),
                        (json_path, lambda f: f.write(json.dumps({**meta, **{k: v.tolist() for k, v in vectors.items()}},
                                                                 allow_nan=False).encode()))):
        tmp = f"{path}.{os.getpid()}.partial"
        try:
            with interrupt.temporary(tmp), open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def run(args) -> None:
    check_settings(args)
    paths = output_paths(args.output, args.mode != "generate", args.overwrite)
    obs = read_arrays(args.observation, "observation")
    images = _need(obs, "images", args.observation)
    states = None if args.mode == "generate" else _need(obs, "states", args.observation)
    actions = _need(read_arrays(args.actions, "actions"), "actions", args.actions) if args.mode == "world" else None
    if actions is not None and actions.shape[1] != states.shape[1]:
        raise WanInputError(f"{args.actions} holds actions of {actions.shape[1]} dof but {args.observation} states of "
                            f"{states.shape[1]}; give both for the same robot")
    if args.model.startswith("unifolm-tiny"):
        print(f"note: {args.model} has random weights; pass --model PATH (a folder made by wan-convert-unifolm) for real "
              "predictions", flush=True)
    from wan_tpu.runtime.profiling import StageTimer, trace
    from wan_tpu.runtime.video import write_video
    from wan_tpu.unifolm.pipeline import FPS, UnifolmPipeline

    check_attention(args.attention)
    mesh = parse_mesh(args.mesh)
    timer = StageTimer(since=args.started, progress=not args.quiet)
    with timer.stage("load"):
        pipe = UnifolmPipeline.from_pretrained(args.model, mesh=mesh, dtype=dtype_of(args.dtype), attention=args.attention,
                                               stats=args.stats, encoder_dtype=dtype_of(args.encoder_dtype),
                                               compile_cache=not args.no_compile_cache,
                                               sampling_programs=args.sampling_programs)
    pipe.timer = timer
    steps = args.steps or pipe.default_steps[args.mode]
    common = dict(num_steps=steps, eta=args.eta, seed=args.seed, fs=args.fs)
    vectors = {}
    # Every component read and every stage program loaded or compiled in background threads at once; the
    # calls below wait only for what they need.
    with pipe.prepare(args.mode, num_steps=steps, eta=args.eta), trace(args.profile):
        if args.mode == "generate":
            out = pipe.generate(args.instruction, images, **common)
            video = out.video
        elif args.mode == "decision":
            out = pipe.decide(args.instruction, images, states, **common)
            video, vectors = out.video, {"actions": out.actions}
        elif args.mode == "world":
            out = pipe.predict(images, states, actions, **common)
            video, vectors = out.video, {"states": out.states}
        else:
            from tqdm import tqdm

            with tqdm(total=args.iterations, desc="interact", unit="it", disable=args.quiet) as bar:
                episode = pipe.interact(args.instruction, images, states, args.iterations,
                                        progress=lambda i: bar.update(1), **common)
            video = episode.video
            vectors = {"actions": np.stack([d.actions for d in episode.decisions]),
                       "states": np.stack([p.states for p in episode.predictions])}
    vectors = {name: distributed.to_host(value) for name, value in vectors.items()}
    for name, value in vectors.items():
        if not np.isfinite(np.asarray(value, np.float32)).all():
            raise NonFiniteError(f"the predicted {name} are NaN or infinite (numerical failure; try --dtype float32); "
                                 "nothing written")
    with timer.stage("write"):
        write_video(paths[0], video, FPS, overwrite=args.overwrite)
        if vectors:
            meta = {"model": pipe.name, "mode": args.mode, "seed": args.seed, "steps": steps, "eta": args.eta,
                    "unnormalised": pipe.stats is not None}
            if distributed.is_writer():
                write_vectors(paths[1], paths[2], {k: np.asarray(v, np.float32) for k, v in vectors.items()}, meta,
                              args.overwrite)
        for path in paths:
            interrupt.record(path)
    print(f"wrote {', '.join(paths)} ({len(video)} frames, {pipe.width}x{pipe.height}, {FPS} fps)")
    from wan_tpu.runtime import compile_cache

    print(timer.table([("steps", str(steps)), ("compile cache", compile_cache.summary())]))


def command(args) -> None:
    if args.serve is None:
        run(args)
        return
    if args.mode is not None:
        raise WanInputError("--serve answers the authors' /predict_action requests (decision-making); drop --mode, or drop --serve "
                            "for one run")
    import sys

    from wan_tpu.unifolm.server import serve_argv

    # The server is the `wan-serve` command (an entry point above the families): this process becomes it,
    # with the same model, flags and port.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "wan_tpu.serve", *serve_argv(args)])


def main(argv=None) -> int:
    from wan_tpu.runtime.memory import world_model_need

    # The sampling's pieces compile at once in worker processes (a server starts its own, in `wan-serve`).
    return run_cli(command, build_parser(), argv, device_memory=world_model_need,
                   compile_workers=lambda args: args.serve is None)
