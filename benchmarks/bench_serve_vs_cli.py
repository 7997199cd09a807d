"""A Wan 1.3B server's jobs beside the warm CLI: the server's second and later jobs should take within 5% of the
denoise + decode of `python -m wan_tpu.generate` run with a filled compilation cache (a loaded server pays no
start, load or compile; the CLI's whole command is shown beside).

    # one H100 or H200 (the random checkpoint is written with diffusers' own modules, so the device needs diffusers)
    python benchmarks/bench_serve_vs_cli.py --steps 10 --repeats 2 --jobs 3 --workdir outputs/bench_e2e
    python benchmarks/bench_serve_vs_cli.py --tiny                  # CPU: the tiny preset, a quick check

In order, all on the same settings (Wan 2.1 T2V 1.3B, random weights in the diffusers layout written once under
`--workdir` by `bench_e2e.ensure_checkpoint` and reused, 832*480, 81 frames, `--steps`, one prompt and seed):

1. the CLI `python -m wan_tpu.generate --model CKPT --size 832*480 --frames 81 --steps N ...` once with an
   empty compilation cache (it fills it), then `--repeats` times warm; each is a fresh process timed from spawn
   to exit (mp4 written), with the denoise and decode seconds of the command's own timing table;
2. `python -m wan_tpu.serve --model CKPT --steps N` on the same cache folder, bound to 127.0.0.1 on a free port,
   timed from spawn until `/healthz` answers (start-to-ready);
3. `--jobs` jobs of the same settings, one after another, through the `openai` client
   (`videos.create_and_poll`, polling every 0.1 s, then `download_content`): each job's seconds from create to
   completed, and its run seconds as the server's log reports them. The downloaded mp4 is decoded and compared
   with the CLI's (same frames expected: the same programs on the same inputs);
4. SIGTERM, and the server's exit status checked (143).

The first job may still wait for the server's compile-ahead; the second and later ones (create → completed) are
compared with the median of the warm CLI's denoise + decode, from its own timing table (ratio; target ≤ 1.05).
Exit status 1 when a command or a job failed or the server's exit status was not 143; a missed target is
reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
from bench_e2e import PROMPT, SEED, ensure_checkpoint  # noqa: E402

from wan_tpu.errors import WanInputError  # noqa: E402

TARGET = 1.05
API_KEY = "bench"
POLL_MS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timing_table(text: str) -> dict[str, float]:
    """The CLI's timing table (`name   1.23 s` lines) as name → seconds."""
    return {k: float(v) for k, v in re.findall(r"^(\S.*?)\s{2,}([\d.]+) s\s*$", text, flags=re.M)}


def run_cli(model: str, args, env: dict, out: str) -> dict:
    """One `python -m wan_tpu.generate` in a fresh process: its wall (spawn to exit) and timing table."""
    argv = [sys.executable, "-m", "wan_tpu.generate", "--model", model, "--prompt", args.prompt, "--seed", str(SEED),
            "--output", out, "--overwrite", "--quiet"]
    for flag, value in (("--size", args.size), ("--frames", args.frames), ("--steps", args.steps)):
        if value is not None:
            argv += [flag, str(value)]
    proc = harness.run_fresh(argv, env=env, timeout=args.timeout)
    if proc.rc:
        print(proc.output[-3000:], file=sys.stderr)
        return {"rc": proc.rc, "wall": proc.wall}
    return {"rc": 0, "wall": proc.wall, "table": timing_table(proc.output)}


def wait_ready(server: subprocess.Popen, url: str, timeout: float) -> bool:
    """Poll `/healthz` until it answers 200 (True), the server exits or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def run_jobs(url: str, args, folder: str) -> list[dict]:
    """`--jobs` jobs one after another: create→completed seconds, download seconds, the mp4 written to `folder`."""
    import openai

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # the client's notice about OpenAI's own service
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=args.timeout)
    body = {"seed": SEED, **({"frames": args.frames} if args.frames else {}), **({"steps": args.steps} if args.steps else {})}
    size = {"size": args.size.replace("*", "x")} if args.size else {}
    jobs = []
    for j in range(args.jobs):
        start = time.perf_counter()
        video = client.videos.create_and_poll(prompt=args.prompt, poll_interval_ms=POLL_MS, extra_body=body, **size)
        seconds = time.perf_counter() - start
        job = {"id": video.id, "status": video.status, "seconds": seconds}
        if video.status != "completed":
            job["error"] = video.error.message if video.error else "no reason given"
            jobs.append(job)
            continue
        start = time.perf_counter()
        data = client.videos.download_content(video.id).content
        job["download"] = time.perf_counter() - start
        job["mp4"] = os.path.join(folder, f"job{j + 1}.mp4")
        with open(job["mp4"], "wb") as f:
            f.write(data)
        jobs.append(job)
        print(f"[server] job {j + 1}: {seconds:.2f} s create→completed, {job['download']:.2f} s download", flush=True)
    return jobs


def run_seconds(log_path: str) -> dict[str, float]:
    """Each completed job's run seconds, from the server's JSON log lines."""
    found = {}
    with open(log_path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "job_completed":
                found[event["id"]] = float(event["seconds"])
    return found


def same_frames(a: str, b: str) -> str:
    """Whether two mp4s decode to the same frames: "yes", or how they differ."""
    import numpy as np

    from wan_tpu.runtime.video import read_video

    fa, fb = read_video(a)[0], read_video(b)[0]
    if fa.shape != fb.shape:
        return f"no (shapes {fa.shape} vs {fb.shape})"
    diff = int(np.abs(fa.astype(np.int16) - fb.astype(np.int16)).max())
    return "yes" if diff == 0 else f"no (max |diff| {diff}/255)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_serve_vs_cli.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny preset on CPU at its own size (a quick check)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "wan_tpu_bench_e2e"),
                   help="where the random 1.3B checkpoint (reused when present, shared with bench_e2e.py) and this "
                        "run's cache, job store and mp4s go")
    p.add_argument("--size", default=None, help="W*H (default 832*480; --tiny: the preset's)")
    p.add_argument("--frames", type=int, default=None, help="frames, 4n+1 (default 81; --tiny: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--repeats", type=int, default=2, help="warm CLI commands timed (default 2)")
    p.add_argument("--jobs", type=int, default=3, help="server jobs, one after another (default 3; at least 2)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one command or job may take")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.jobs < 2 or args.repeats < 1:
        raise SystemExit("--jobs must be at least 2 (the second job is the one compared) and --repeats at least 1")
    if not args.tiny:
        args.size = args.size or "832*480"
        args.frames = args.frames or 81
    harness.print_env()  # this process leaves the device to its children
    try:  # before minutes of CLI runs: the jobs go through the `openai` client
        import openai  # noqa: F401
    except ImportError as e:
        print(f"error: the jobs need the openai client ({e}): pip install openai", file=sys.stderr)
        return 2
    try:
        model = "tiny" if args.tiny else ensure_checkpoint(args.workdir, "1.3b")
    except WanInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench_serve_vs_cli_", dir=os.path.abspath(args.workdir))
    env = {"WAN_TPU_CACHE_DIR": os.path.join(tmp, "cache"), **({"JAX_PLATFORMS": "cpu"} if args.tiny else {})}
    problems, rows = [], []
    try:
        print("[cli] cold (fills an empty compilation cache) ...", flush=True)
        cli_mp4 = os.path.join(tmp, "cli.mp4")
        cold = run_cli(model, args, env, cli_mp4)
        warm = []
        for i in range(args.repeats if not cold["rc"] else 0):
            print(f"[cli] warm {i + 1}/{args.repeats} ...", flush=True)
            warm.append(run_cli(model, args, env, cli_mp4))
        for name, r in [("CLI, empty cache (cold)", cold), *((f"CLI warm {i + 1}", r) for i, r in enumerate(warm))]:
            if r["rc"]:
                problems.append(f"{name}: exit status {r['rc']}")
                rows.append((name, f"failed (exit status {r['rc']})"))
                continue
            t = r["table"]
            rows.append([name, f"{r['wall']:.2f}", f"{t.get('denoise', float('nan')):.2f}",
                         f"{t.get('decode', float('nan')):.2f}", ""])
        walls = [r["wall"] for r in warm if not r["rc"]]
        base = statistics.median(walls) if walls else None
        # What the warm CLI spends on the job itself, as the target reads: its denoise + decode.
        works = [r["table"].get("denoise", math.nan) + r["table"].get("decode", math.nan) for r in warm if not r["rc"]]
        work = statistics.median(works) if works else math.nan
        for row in rows:
            if base and len(row) > 2:
                row.append(f"{float(row[1]) / base:.3f}")
        if base is None:
            raise SystemExit("FAILED: no warm CLI command completed:\n" + "\n".join(problems))

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = os.path.join(tmp, "server.log")
        argv = [sys.executable, "-m", "wan_tpu.serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                "--output", os.path.join(tmp, "store"), "--api-key", API_KEY, "--seed", str(SEED)]
        argv += ["--steps", str(args.steps)] if args.steps else []
        print(f"[server] starting on {url} ...", flush=True)
        with open(log_path, "w") as log:
            start = time.perf_counter()
            server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            if not wait_ready(server, url, args.timeout):
                with open(log_path) as f:
                    raise SystemExit(f"FAILED: the server did not become ready:\n{f.read()[-3000:]}")
            ready = time.perf_counter() - start
            print(f"[server] ready after {ready:.2f} s", flush=True)
            rows.append(("server start → /healthz ready", f"{ready:.2f}"))
            jobs = run_jobs(url, args, tmp)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                status = server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                status = f"none: still running 120 s after SIGTERM, killed (exit status {server.wait()})"
        if status != 143:
            problems.append(f"server exit status after SIGTERM: {status} (143 expected)")
        ran = run_seconds(log_path)
        later = []
        for j, job in enumerate(jobs, 1):
            name = f"server job {j}" + (" (first)" if j == 1 else "")
            if job["status"] != "completed":
                problems.append(f"{name}: {job['status']}: {job['error']}")
                rows.append((name, f"{job['status']}: {job['error']}"))
                continue
            if j > 1:
                later.append(job["seconds"])
            served = ran.get(job["id"])
            rows.append((name, f"{job['seconds']:.2f}", "", "", "n/a" if served is None else f"{served:.2f}",
                         f"{job['seconds'] / base:.3f}", f"{job['seconds'] / work:.3f}"))
        frames = same_frames(cli_mp4, jobs[-1]["mp4"]) if jobs and "mp4" in jobs[-1] else "n/a (no job completed)"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    where = "tiny preset" if args.tiny else "Wan 2.1 T2V 1.3B, random weights (bf16 DiT/UMT5, float32 VAE)"
    steps = f"{args.steps} steps" if args.steps else "the model's steps"
    print(f"\n{where}, {args.size or 'its size'}, {args.frames or 'its'} frames, {steps}, CFG; the CLI's and the "
          "server's jobs on the same compilation cache:")
    print(harness.table(("run", "seconds", "denoise", "decode", "server run", "vs warm CLI", "vs its denoise + decode"),
                        rows))
    print("(CLI: spawn to exit, mp4 written; denoise / decode: the command's own table. Server jobs: create → "
          f"completed through the openai client, polled every {POLL_MS} ms; server run: the job's seconds in the "
          "server's log. vs warm CLI: against the warm commands' median, spawn to exit; vs its denoise + decode: "
          "against the median of the warm commands' denoise + decode, the job's own work)")
    if later:
        ratio = statistics.median(later) / work
        verdict = "met" if ratio <= TARGET else "NOT met"
        print(f"server jobs 2..{len(jobs)}: median {statistics.median(later):.2f} s create → completed vs the warm CLI's "
              f"denoise + decode {work:.2f} s: ratio {ratio:.3f} (target ≤ {TARGET}): {verdict}; the whole warm CLI "
              f"command takes {base:.2f} s ({statistics.median(later) / base:.3f})")
    print(f"the last job's video = the CLI's (decoded frames): {frames}")
    print(f"SIGTERM: server exit status {status}")
    if problems:
        print("FAILED:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
