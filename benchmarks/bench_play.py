"""The live Matrix-Game-2 page's WebSocket (`wan_tpu.serve.play`) under play: displayed fps and the latency
from an action to the first frame made with it, measured by a client that decodes frames as the page does.

    # device (one H100/H200): a converted universal folder of random weights (written by our code alone,
    # benchmarks/random_folders.py), the server in a child process, 60 s of play at a 25 fps pace:
    python benchmarks/random_folders.py matrix-game /tmp/mg/converted
    python benchmarks/bench_play.py --model /tmp/mg/converted --seconds 60 --fps 25
    python benchmarks/bench_play.py --model /tmp/mg/converted --seconds 60 --fps 25 --smooth
    # CPU smoke test (the matrix-game-tiny preset):
    python benchmarks/bench_play.py --model matrix-game-tiny --dtype float32 --seconds 5 --fps 25
    python benchmarks/bench_play.py --model matrix-game-tiny --dtype float32 --seconds 5 --fps 25 --smooth
    # a server already running (python -m wan_tpu.serve --model ...):
    python benchmarks/bench_play.py --url ws://127.0.0.1:8000/play/ws --seconds 60

The client starts a stream from a built-in image as JPEG at `--fps`, then changes its action (keys and
camera, drawn from the variant's bindings with `--seed`) every 0.6-1.4 s, and decodes every frame with
PIL as it arrives (the page decodes and draws on arrival: the server paces the frames). Measured from
the third chunk on (the first two compile their programs): displayed fps (frames ÷ time, and the worst
one-second window), stalls (gaps over 2.5 frame periods), and per action change the time from sending
it to the first decoded frame whose header says its chunk was made with it (p50 / p95 / max; each
change's own in `--result-json`). By default the stream starts the next chunk at once on an action
change and drops the frames queued before it: about one chunk's generation, plus the rest of the chunk
being made when the action came, if one was. `--smooth` asks for the stream's smooth mode (every frame
played): an action waits for the next chunk start (a chunk starts when the frames queued before it play
for about its generation time: up to one chunk's playing time, 12 frames ÷ fps) plus one generation.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

PORT_LINE = "PLAY_PORT "


def serve(args) -> None:
    """The child: the pipeline prepared, its routes served by uvicorn on a free local port (printed)."""
    import socket

    import jax.numpy as jnp
    import uvicorn
    from starlette.applications import Starlette

    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline
    from wan_tpu.serve.play import play_routes

    pipe = MatrixGamePipeline.from_pretrained(args.model, dtype=getattr(jnp, args.dtype))
    with pipe.prepare(live=True):
        pass
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # connections wait in the backlog until uvicorn takes the socket over
    print(PORT_LINE + str(listener.getsockname()[1]), flush=True)
    uvicorn.Server(uvicorn.Config(Starlette(routes=play_routes(pipe, max_sessions=1)), log_level="warning",
                                  lifespan="off")).run(sockets=[listener])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def play(url: str, args) -> dict:
    from PIL import Image
    from websockets.asyncio.client import connect

    rng = random.Random(args.seed)
    shown, sent, latencies, sizes, decode = [], {}, [], [], []
    async with connect(url, max_size=None) as ws:
        hello = json.loads(await ws.recv())
        words = sorted({b["word"] for b in hello["bindings"]})
        step = max([abs(v) for b in hello["bindings"] for v in b["mouse"]] or [0.0])
        await ws.send(json.dumps({"type": "start", "image": "meadow", "seed": args.seed, "fps": args.fps,
                                  "format": "jpeg", "smooth": args.smooth}))
        seq, measure_from, next_change, end = 0, None, None, None
        while end is None or time.perf_counter() < end:
            timeout = None if next_change is None else max(next_change - time.perf_counter(), 0.0)
            try:
                message = await asyncio.wait_for(ws.recv(), timeout)
            except TimeoutError:
                message = None
            now = time.perf_counter()
            if message is None or (next_change is not None and now >= next_change):
                seq += 1
                action = {"type": "action", "keys": rng.sample(words, rng.randint(0, min(2, len(words)))), "seq": seq}
                if hello["mouse"]:
                    action["mouse"] = [rng.choice((-step, 0.0, step)) / 2, rng.choice((-step, 0.0, step)) / 2]
                await ws.send(json.dumps(action))
                sent[seq] = time.perf_counter()
                next_change = time.perf_counter() + rng.uniform(0.6, 1.4)
            if message is None:
                continue
            if isinstance(message, str):
                text = json.loads(message)
                if text["type"] in ("error", "end"):
                    raise SystemExit(f"the server said: {text['message']}")
                continue
            n = int.from_bytes(message[:4], "big")
            header = json.loads(message[4 : 4 + n])
            start = time.perf_counter()
            Image.open(io.BytesIO(message[4 + n :])).convert("RGB").load()
            done = time.perf_counter()
            decode.append(done - start)
            if header["chunk"] < 2:
                continue
            if measure_from is None:  # the compiles are through: measure from here
                measure_from, end = done, done + args.seconds
                next_change = done
                sent.clear()
                continue
            shown.append(done)
            sizes.append(len(message) - 4 - n)
            for s in [s for s in sent if s <= header["action"]]:
                latencies.append(done - sent.pop(s))
    span = shown[-1] - shown[0]
    windows = [sum(1 for t in shown if w <= t < w + 1) for w in [shown[0] + i for i in range(int(span))]]
    gaps = [b - a for a, b in zip(shown, shown[1:])]
    return {"frames": len(shown), "seconds": span, "fps": (len(shown) - 1) / span,
            "fps_worst_1s": min(windows) if windows else None,
            "stalls": sum(g > 2.5 / args.fps for g in gaps), "actions": len(latencies),
            "latency_p50_ms": 1e3 * percentile(latencies, 50), "latency_p95_ms": 1e3 * percentile(latencies, 95),
            "latency_max_ms": 1e3 * max(latencies), "latencies_ms": [round(1e3 * v, 1) for v in latencies],
            "frame_kib": statistics.mean(sizes) / 1024,
            "decode_ms": 1e3 * statistics.median(decode), "variant": hello["variant"], "size": hello["size"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="matrix-game-tiny", help="converted Matrix-Game-2 folder or matrix-game-tiny")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="DiT and CLIP dtype")
    p.add_argument("--url", default=None, help="ws://HOST:PORT/play/ws of a running server (else one is started)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds measured, after the first two chunks")
    p.add_argument("--fps", type=float, default=25.0, help="the pace asked of the server")
    p.add_argument("--seed", type=int, default=0, help="noise seed and the action schedule's")
    p.add_argument("--smooth", action="store_true", help="the stream's smooth mode: every frame played, an action "
                   "waiting for the frames queued before it (default: an action change drops them)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    p.add_argument("--result-json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    harness.print_env()
    child = None
    url = args.url
    if url is None:
        child = subprocess.Popen([sys.executable, __file__, "--serve", "--model", args.model, "--dtype", args.dtype],
                                 stdout=subprocess.PIPE, text=True)
        for line in child.stdout:
            if line.startswith(PORT_LINE):
                url = f"ws://127.0.0.1:{int(line[len(PORT_LINE):])}/play/ws"
                break
        if url is None:
            raise SystemExit(f"the server did not start (exit status {child.wait()})")
    try:
        started = time.perf_counter()
        result = asyncio.run(play(url, args))
        result["wall_s"] = time.perf_counter() - started
    finally:
        if child is not None:
            child.terminate()
            child.wait(30)
    h, w = result["size"]
    print(f"{result['variant']} {w}x{h}, pace {args.fps:g} fps{', smooth' if args.smooth else ''}, "
          f"{result['seconds']:.1f} s measured, {result['actions']} action changes")
    print(harness.table(["", "measured", "target"], [
        ("displayed fps", f"{result['fps']:.1f}", "≥ 25 (universal 352×640, one H100/H200)"),
        ("displayed fps, worst 1-s window", result["fps_worst_1s"], ""),
        ("stalls (gap > 2.5 frames)", result["stalls"], "0"),
        ("action → first affected frame p50", f"{result['latency_p50_ms']:.0f} ms", "250 ms"),
        ("action → first affected frame p95", f"{result['latency_p95_ms']:.0f} ms", "400 ms"),
        ("action → first affected frame max", f"{result['latency_max_ms']:.0f} ms", ""),
        ("frame size (JPEG) / decode", f"{result['frame_kib']:.1f} KiB / {result['decode_ms']:.2f} ms", "")]))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
