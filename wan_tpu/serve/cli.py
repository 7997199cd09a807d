"""`python -m wan_tpu.serve` / `wan-serve`: one process that keeps a model loaded and compiled and serves it.

    wan-serve --model tiny                                   # http://127.0.0.1:8000, jobs in ./wan_serve/
    wan-serve --model /ckpt/Wan2.1-T2V-1.3B-Diffusers --lora fast=lightx2v.safetensors --port 8000
    wan-serve --model /ckpt/unifolm-wma-0 --steps 16          # the authors' POST /predict_action
    WAN_TPU_API_KEY=secret wan-serve --model tiny --host 0.0.0.0

Wan models answer the OpenAI Videos API (`wan_tpu.serve.app`), with the jobs in a SQLite store under
`--output` (`wan_tpu.serve.store`): a server started again on the same folder serves the finished videos
and runs the jobs that were waiting or running. UnifoLM-WMA models answer `/predict_action`, Matrix-Game-2
models the live page of `wan_tpu.serve.play`. Bound to 127.0.0.1 unless `--host` says otherwise; another
address needs an API key. SIGTERM or Ctrl-C drains: no new requests, the running job finishes within
`--grace` seconds or goes back to the queue at its next safe point; exit status 143 / 130. A second
signal stops at once (the running job then runs again at the next start).

Over several processes (Wan; `--coordinator HOST:PORT --num-processes N --process-id I`, as every command,
`wan_tpu.runtime.distributed`): every process loads the model on the whole mesh; process 0 binds HTTP, owns
the job store and takes the requests, and the others bind nothing and follow (`wan_tpu.serve.worker.follow`):
each job runs on every process, process 0 writes its video, a delete or a drain stops it on all at the same
step, and the server's end (a signal on any process) ends them all with its status.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import socket
import sys
import time

from wan_tpu.errors import WanInputError
from wan_tpu.runtime import interrupt
from wan_tpu.runtime.cli import CliParser, add_common_args, check_attention, dtype_of, parse_mesh, run_cli
from wan_tpu.unifolm.server import MAX_BODY

FAMILIES = ("wan", "matrix-game", "unifolm")


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m wan_tpu.serve", description="serve a model over HTTP: the OpenAI Videos API (Wan), "
                  "/predict_action (UnifoLM-WMA), the live page (Matrix-Game-2)")
    add_common_args(p, model_default="tiny",
                    model_help="checkpoint folder, Hugging Face model id (Wan) or preset (tiny, tiny-ti2v, matrix-game-tiny, "
                    "unifolm-tiny)",
                    dtype_default=None, dtype_help="the main model's dtype (default: the family's; Wan, Matrix-Game "
                    "bfloat16, UnifoLM float32)",
                    seed_default=None, seed_help="the seed of a request that gives none (Wan: 0; UnifoLM: 123)",
                    output_default="wan_serve", output_help="the job store folder (jobs.sqlite3, videos/); reused: "
                    "a restart resumes its jobs", profile=False)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "any other needs --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--api-key", default=None, help="the Bearer key every route but /healthz requires "
                   "(default: $WAN_TPU_API_KEY; required off 127.0.0.1)")
    p.add_argument("--family", choices=FAMILIES, default=None, help="the model's family (default: from --model)")
    p.add_argument("--queue-size", type=int, default=32, help="jobs that may wait; more are refused with 429 (default 32)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds a SIGTERM lets the running job finish before it "
                   "is stopped and queued again (default 30)")
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY / 2**20,
                   help=f"largest request body in MiB (default {MAX_BODY // 2**20})")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:SCALE]",
                   help="Wan: a LoRA requests may name (extra body field lora=NAME[:SCALE]); repeatable")
    p.add_argument("--steps", type=int, default=None, help="steps of a request that gives none (Wan: the model's; "
                   "UnifoLM /predict_action: 16, as the authors' server)")
    p.add_argument("--eta", type=float, default=1.0, help="UnifoLM: DDIM eta (default 1.0)")
    p.add_argument("--fs", type=int, default=None, help="UnifoLM: frame-stride condition (default: the config's)")
    p.add_argument("--stats", default=None, help="UnifoLM: LeRobot stats.safetensors (default: the checkpoint's)")
    p.add_argument("--encoder-dtype", choices=("float32", "bfloat16"), default="float32", help="UnifoLM: CLIP towers' dtype")
    p.add_argument("--sampling-programs", type=int, default=None, metavar="K",
                   help="UnifoLM: each DDIM step as K programs compiled side by side (default: 4 where compile "
                        "workers run, else 1: one program)")
    p.add_argument("--variant", default=None, help="Matrix-Game-2: universal, gta_drive or templerun")
    p.add_argument("--max-sessions", type=int, default=1, help="Matrix-Game-2: live sessions at once (default 1)")
    return p


def detect_family(model: str) -> str:
    from wan_tpu.matrix_game.pipeline import INDEX_FILE, PRESET
    from wan_tpu.unifolm.presets import PRESETS as UNIFOLM_PRESETS

    if model == PRESET:
        return "matrix-game"
    if model in UNIFOLM_PRESETS:
        return "unifolm"
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, INDEX_FILE)):
            return "matrix-game"
        if not os.path.isfile(os.path.join(model, "model_index.json")) and os.path.isfile(os.path.join(model, "config.json")):
            return "unifolm"
    return "wan"


def parse_loras(specs: list[str]) -> dict[str, tuple[str, float]]:
    loras = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        path, scale = rest, 1.0
        if ":" in rest and rest.rsplit(":", 1)[1].replace(".", "", 1).lstrip("-").isdigit():
            path, scale = rest.rsplit(":", 1)[0], float(rest.rsplit(":", 1)[1])
        if not eq or not name.strip() or not path:
            raise WanInputError(f"--lora {spec!r} is not NAME=PATH[:SCALE]; pass e.g. --lora fast=lightx2v.safetensors")
        if name in loras:
            raise WanInputError(f"--lora names {name!r} twice; give each LoRA its own name")
        if not os.path.isfile(path):
            raise WanInputError(f"--lora {name}: {path} does not exist; pass an existing .safetensors file")
        loras[name] = (path, scale)
    return loras


def check_args(args) -> str | None:
    """Every flag that can be checked before loading; returns the API key."""
    if not 0 <= args.port <= 65535:
        raise WanInputError(f"--port must be 0..65535, got {args.port}")
    for flag, value, low in (("--queue-size", args.queue_size, 1), ("--max-sessions", args.max_sessions, 1),
                             ("--sampling-programs", args.sampling_programs, 1)):
        if value is not None and value < low:
            raise WanInputError(f"{flag} must be at least {low}, got {value}")
    if not args.grace >= 0:
        raise WanInputError(f"--grace must be 0 or more seconds, got {args.grace}")
    if not args.max_body_mb > 0:
        raise WanInputError(f"--max-body-mb must be positive, got {args.max_body_mb}")
    if args.steps is not None and args.steps < 1:
        raise WanInputError(f"--steps must be at least 1, got {args.steps}")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise WanInputError(f"--seed must be 0 to {2**32 - 1} (a request's own seed replaces it), got {args.seed}")
    if not 0.0 <= args.eta <= 1.0:
        raise WanInputError(f"--eta must be in [0, 1], got {args.eta}")
    key = args.api_key or os.environ.get("WAN_TPU_API_KEY") or None
    if key is None and not is_loopback(args.host):
        raise WanInputError(f"--host {args.host} exposes the server beyond this machine; pass --api-key KEY (or set "
                            "WAN_TPU_API_KEY), or bind to 127.0.0.1")
    return key


def check_store_folder(folder: str) -> None:
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise WanInputError(f"--output {folder} is a file; pass a folder for the job store")
    if os.path.isdir(folder) and os.listdir(folder) and not os.path.isfile(os.path.join(folder, "jobs.sqlite3")):
        raise WanInputError(f"--output {folder} holds other files; pass an empty or new folder, or one a server made")
    from wan_tpu.runtime.validate import check_writable

    # Probes the folder, or the nearest existing folder above it (the store is made only once the model has loaded).
    probe = os.path.abspath(folder)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    check_writable(os.path.join(probe, "jobs.sqlite3"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise WanInputError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port (0: any free port) "
                            "or --host") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def log_line(**fields) -> None:
    """One JSON line on stdout (the access log and the job events)."""
    sys.stdout.write(json.dumps({"time": round(time.time(), 3), **fields}, default=str) + "\n")
    sys.stdout.flush()


def load(args, family: str):
    """The pipeline, loaded and compiling its programs ahead in background threads."""
    mesh = parse_mesh(args.mesh)
    cache = not args.no_compile_cache
    if family == "wan":
        from wan_tpu.wan.pipeline import WanPipeline

        pipe = WanPipeline.from_pretrained(args.model, mesh=mesh, dtype=dtype_of(args.dtype or "bfloat16"),
                                           attention=args.attention, compile_cache=cache)
        settings = pipe.settings(num_inference_steps=args.steps)
        pipe.check_fits(settings)
        return pipe, lambda: pipe.prepare(settings)
    if family == "unifolm":
        from wan_tpu.unifolm.pipeline import UnifolmPipeline

        pipe = UnifolmPipeline.from_pretrained(args.model, mesh=mesh, dtype=dtype_of(args.dtype or "float32"),
                                               attention=args.attention, stats=args.stats,
                                               encoder_dtype=dtype_of(args.encoder_dtype), compile_cache=cache,
                                               sampling_programs=args.sampling_programs)
        if not pipe.has_heads:
            raise WanInputError(f"{pipe.name} has no action head; serve a UnifoLM-WMA-0 checkpoint")
        return pipe, lambda: pipe.prepare("decision", num_steps=args.steps or 16, eta=args.eta, keep_action_tokens=False)
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline

    pipe = MatrixGamePipeline.from_pretrained(args.model, mesh=mesh, dtype=dtype_of(args.dtype or "bfloat16"),
                                              attention=args.attention, compile_cache=cache, variant=args.variant)
    return pipe, lambda: pipe.prepare(live=True)  # the chunk's two programs of live play


def wan_videos(pipe, name: str, loras: dict | None = None, steps: int | None = None, seed: int | None = None):
    """The Wan request checks and job runs of a loaded pipeline (`wan_tpu.serve.videos.WanVideos`), each LoRA
    checked against the DiT now (on the devices: every process of a server's job does it), merged per job later."""
    from wan_tpu.serve.videos import WanVideos

    for path, scale in (loras or {}).values():
        pipe.load_lora_weights(path, scale)
        pipe.unload_lora_weights()
    return WanVideos(pipe, name, loras, default_steps=steps, default_seed=0 if seed is None else seed)


def make_state(family: str, pipe, name: str, *, output: str | None = None, loras: dict | None = None,
               steps: int | None = None, seed: int | None = None, eta: float = 1.0, fs: int | None = None,
               api_key: str | None = None, queue_size: int = 32, max_body: int = MAX_BODY, max_sessions: int = 1,
               log=log_line):
    """What the app serves for a loaded pipeline: for Wan, the job store in `output` (its interrupted jobs put
    back in the queue), the request checks and the worker (not started; in a job of several processes, telling
    the others each job); for UnifoLM the request options."""
    from wan_tpu.runtime import distributed
    from wan_tpu.serve.app import ServerState
    from wan_tpu.serve.metrics import Metrics

    state = ServerState(family=family, model_name=name, pipe=pipe, api_key=api_key, queue_size=queue_size,
                        max_body=max_body, max_sessions=max_sessions, log=log)
    if family == "wan":
        from wan_tpu.serve.store import JobStore

        state.videos = wan_videos(pipe, name, loras, steps, seed)
        state.store = JobStore(output)
        for job_id in state.store.recover():
            log(event="job_requeued", id=job_id, why="the server stopped while it ran")
    elif family == "unifolm":
        state.predict_options = dict(num_steps=steps or 16, eta=eta, fs=fs, seed=123 if seed is None else seed)
    state.metrics = Metrics(state.store)
    if state.store is not None:
        from wan_tpu.serve.worker import JobChannel, Worker

        channel = JobChannel() if distributed.process_count() > 1 else None
        state.worker = Worker(state.store, state.videos, state.metrics, log, state.device_lock, channel)
    return state


def run(args) -> None:
    from wan_tpu.runtime import distributed
    from wan_tpu.serve.app import build_app

    key = check_args(args)
    family = args.family or detect_family(args.model)
    loras = parse_loras(args.lora)
    if loras and family != "wan":
        raise WanInputError("--lora applies to Wan models; drop it")
    if distributed.process_count() > 1 and family != "wan":
        raise WanInputError(f"a server over several processes serves Wan models (the Videos API); serve this {family} "
                            "model from one process: drop --coordinator, --num-processes and --process-id")
    serves = distributed.is_writer()  # the others bind nothing and keep no store: they follow process 0
    if family == "wan" and serves:
        check_store_folder(args.output)
    check_attention(args.attention)
    sock = bind(args.host, args.port) if serves else None
    pipe, prepare = load(args, family)
    name = os.path.basename(os.path.normpath(args.model))
    if not serves:
        from wan_tpu.serve.worker import follow

        videos = wan_videos(pipe, name, loras, args.steps, args.seed)
        interrupt.check("load")
        prepare()
        follow(videos)
        return
    state = make_state(family, pipe, name, output=args.output, loras=loras, steps=args.steps, seed=args.seed,
                       eta=args.eta, fs=args.fs, api_key=key, queue_size=args.queue_size,
                       max_body=int(args.max_body_mb * 2**20), max_sessions=args.max_sessions)
    app = build_app(state)
    interrupt.check("load")
    prepare()
    host, port = sock.getsockname()[:2]
    print(f"serving http://{host}:{port} ({family}: {name}); SIGTERM or Ctrl-C drains", flush=True)
    signum = asyncio.run(serve(app, sock, state, args.grace))
    if state.worker is not None and state.worker.channel is not None:
        state.worker.channel.close(signum)
    if signum is not None:
        if state.store is not None:
            interrupt.record(state.store.folder)
        raise interrupt.Interrupted(signum)


async def serve(app, sock, state, grace: float) -> int | None:
    """Serve until a signal, then drain; returns the signal number (None if the server stopped by itself)."""
    import uvicorn

    class Server(uvicorn.Server):
        # The signals are this function's (below), taken on the event loop, not uvicorn's.
        def capture_signals(self):
            import contextlib

            return contextlib.nullcontext()

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=max(1, int(grace))))
    loop = asyncio.get_running_loop()
    taken: list[int] = []

    def on_signal(signum: int) -> None:
        if taken:
            sys.stderr.write("interrupted again; stopped at once\n")
            sys.stderr.flush()
            os._exit(128 + taken[0])
        taken.append(signum)
        state.draining = True
        server.should_exit = True
        if state.worker is not None:
            state.worker.drain(grace)
        log_line(event="draining", signal=signal.Signals(signum).name, running=state.worker and state.worker.running)

    # The event loop takes over the process's signal wake-up from `wan_tpu.runtime.interrupt` while it serves:
    # a signal drains instead of raising at the running job's next safe point.
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal, s)
    if interrupt.pending() is not None:  # taken before the loop took the signals over
        on_signal(interrupt.pending())
    elif state.worker is not None:
        # Started only now: from here on no signal reaches the pipeline's own safe points, so a job is
        # stopped by the drain alone.
        state.worker.start()
    try:
        await server.serve(sockets=[sock])
        if state.worker is not None and state.worker.thread.is_alive():
            state.worker.drain(grace)
            while not state.worker.join(0):
                await asyncio.sleep(0.05)
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(s)
    return taken[0] if taken else None


def device_memory(args) -> int | None:
    """A world model's server reserves what its command would (`world_model_need`), plus a working set for each
    further live session (`--max-sessions`, each its own stream); Wan's the usual share."""
    from wan_tpu.runtime.memory import WORLD_MODEL_WORKING_SET, world_model_need

    if (args.family or detect_family(args.model)) == "wan":
        return None
    return world_model_need(args) + (max(args.max_sessions, 1) - 1) * WORLD_MODEL_WORKING_SET


def main(argv=None) -> int:
    # A Wan or UnifoLM server's large programs compile at once in worker processes (Matrix-Game-2's gained nothing).
    return run_cli(run, build_parser(), argv, device_memory=device_memory,
                   compile_workers=lambda args: (args.family or detect_family(args.model)) in ("wan", "unifolm"),
                   spaced_gc=False)
