"""Load and fault benchmark of the video server (`wan-serve`): concurrent `openai` clients against one server.

    python benchmarks/bench_serve_load.py                                  # 10 clients, 50 tiny jobs (CPU: ~1 min)
    python benchmarks/bench_serve_load.py --model tiny --clients 10 --jobs 50 --queue-size 8

The server runs as its own process (`python -m wan_tpu.serve --port 0`, a fresh job store, `--max-body-mb 1`).
Each client submits its share of the jobs with `client.videos.create` (a full queue's 429 is counted and
retried after a pause), deletes every fifth job right after creating it (a cancel: queued or running),
and sends its share of faults: a malformed size, an unknown field, a body over the limit, a request whose
body never arrives (the connection dropped), a retrieve of an unknown id. Then every accepted job is
polled to its end; completed ones are downloaded and decoded (a playable mp4 of the requested frames),
failed ones must carry a reason, cancelled ones must be gone (404). Printed: requests, completions,
p50 / p95 latency of the API calls by kind, errors by kind. Asserted: every accepted job ends completed
or failed with a reason or was cancelled, none lost; the store folder holds exactly the completed jobs'
files (no temporaries); the server's thread count after the load stays within its thread pool; a SIGTERM
then drains it with exit status 143.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

TERMINAL = ("completed", "failed")
# anyio's default worker-thread limit: the server's thread pool may grow to it under load and stay there.
THREAD_POOL = 40


def _raw(url: str, data: bytes, *, read: bool = True) -> int | None:
    """Send raw bytes on a new connection; the status of the answer (None: closed without reading one)."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        if not read:
            return None
        head = s.recv(4096).split(b"\r\n", 1)[0]
        return int(head.split()[1])


def run_load(url: str, *, clients: int, jobs: int, api_key: str = "none", seed: int = 0,
             timeout: float = 900, cancel_every: int = 5) -> dict:
    """Drive `url` with `clients` threads submitting `jobs` jobs in all (module docstring); returns the counts,
    the latencies and the problems found (empty `problems`: every check held)."""
    import openai

    from wan_tpu.runtime.video import read_video

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    lock = threading.Lock()
    latencies = collections.defaultdict(list)
    errors = collections.Counter()
    accepted, cancelled = [], []
    auth = f"Authorization: Bearer {api_key}\r\n".encode()

    def call(kind, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with lock:
                latencies[kind].append(time.perf_counter() - start)

    def client(index: int) -> None:
        api = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)
        for k in range(index, jobs, clients):
            while True:
                try:
                    video = call("create", api.videos.create, prompt=f"job {k}: a cat walks on the grass",
                                 extra_body={"seed": seed + k})
                    break
                except openai.RateLimitError:
                    with lock:
                        errors["429 queue full (retried)"] += 1
                    time.sleep(0.2)
            with lock:
                accepted.append(video.id)
            if k % cancel_every == cancel_every - 1:
                call("delete", api.videos.delete, video.id)
                with lock:
                    cancelled.append(video.id)
        faults = [("400 malformed size", lambda: api.videos.create(prompt="x", size="100x7")),
                  ("400 unknown field", lambda: api.videos.create(prompt="x", extra_body={"colour": "red"})),
                  ("404 unknown id", lambda: api.videos.retrieve("video_" + "0" * 32))]
        for kind, fault in faults:
            try:
                call("fault", fault)
                problems.append(f"{kind}: accepted")
            except openai.APIStatusError as e:
                with lock:
                    errors[kind] += 1
                if e.status_code != int(kind[:3]) or "\n" in e.message:
                    problems.append(f"{kind}: answered {e.status_code} {e.message}")
        oversized = _raw(url, b"POST /v1/videos HTTP/1.1\r\nHost: x\r\n" + auth +
                         b"Content-Type: application/json\r\nContent-Length: 2000000000\r\n\r\n{")
        with lock:
            errors["413 oversized"] += oversized == 413
        if oversized != 413:
            problems.append(f"oversized body answered {oversized}")
        _raw(url, b"POST /v1/videos HTTP/1.1\r\nHost: x\r\n" + auth +
             b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"prompt\": ", read=False)
        with lock:
            errors["disconnect mid-body"] += 1

    problems: list[str] = []
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), name=f"load-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    submitted = time.perf_counter() - started

    api = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=2, timeout=120)
    outcome = collections.Counter()
    deadline = time.monotonic() + timeout
    for job_id in accepted:
        if job_id in cancelled:
            try:
                call("retrieve", api.videos.retrieve, job_id)
                problems.append(f"{job_id}: deleted but still listed")
            except openai.NotFoundError:
                outcome["cancelled"] += 1
            continue
        while True:
            video = call("retrieve", api.videos.retrieve, job_id)
            if video.status in TERMINAL or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        outcome[video.status] += 1
        if video.status == "completed":
            data = call("content", api.videos.download_content, job_id).content
            with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
                f.write(data)
                f.flush()
                frames, _ = read_video(f.name)
            if frames.ndim != 4 or len(frames) == 0:
                problems.append(f"{job_id}: the mp4 decodes to {frames.shape}")
        elif video.status == "failed":
            if not (video.error and video.error.message):
                problems.append(f"{job_id}: failed without a reason")
        else:
            problems.append(f"{job_id}: lost ({video.status} after {timeout:.0f} s)")
    listed = {v.id for v in api.videos.list(limit=100, order="asc")}
    missing = set(accepted) - set(cancelled) - listed
    problems += [f"{job_id}: not listed" for job_id in sorted(missing)]
    requests = sum(len(v) for v in latencies.values()) + 2 * clients
    return {"requests": requests, "accepted": len(accepted), "cancelled": len(cancelled), "outcome": dict(outcome),
            "latencies": {k: list(v) for k, v in latencies.items()}, "errors": dict(errors), "problems": problems,
            "submit_seconds": submitted, "seconds": time.perf_counter() - started,
            "completed_ids": sorted(set(accepted) - set(cancelled))}


def report(result: dict) -> str:
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    rows = [(kind, len(v), f"{1e3 * statistics.median(v):.1f}", f"{1e3 * pct(v, 0.95):.1f}")
            for kind, v in sorted(result["latencies"].items())]
    lines = [harness.table(("API call", "count", "p50 ms", "p95 ms"), rows), "",
             harness.table(("error kind", "count"), sorted(result["errors"].items())), "",
             f"requests {result['requests']}, accepted {result['accepted']}, cancelled {result['cancelled']}, "
             f"outcomes {result['outcome']}, wall {result['seconds']:.1f} s (submitting {result['submit_seconds']:.1f} s)"]
    return "\n".join(lines)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--queue-size", type=int, default=8, help="small, so that clients meet full-queue 429s")
    args = p.parse_args()
    harness.print_env()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        server = subprocess.Popen([sys.executable, "-m", "wan_tpu.serve", "--model", args.model, "--port", "0",
                                   "--output", store, "--max-body-mb", "1", "--queue-size", str(args.queue_size),
                                   "--api-key", "bench", "--grace", "5"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = server.stdout.readline()
            if not line.startswith("serving "):
                raise SystemExit(f"the server did not start: {line}{server.stderr.read()[-2000:]}")
            url = line.split()[1]
            threading.Thread(target=server.stdout.read, daemon=True).start()  # the access log, drained
            before = _threads(server.pid)
            result = run_load(url, clients=args.clients, jobs=args.jobs, api_key="bench")
            after = _threads(server.pid)
            print(report(result))
            files = sorted(os.listdir(os.path.join(store, "videos")))
            expected = sorted(f"{i}.{ext}" for i in result["completed_ids"] for ext in ("jpg", "mp4"))
            problems = list(result["problems"])
            if files != expected:
                problems.append(f"store folder: {sorted(set(files) ^ set(expected))[:5]} differ from the completed jobs")
            if after > before + THREAD_POOL:
                problems.append(f"server threads {before} → {after}")
            print(f"server threads: {before} before the load, {after} after")
        finally:
            server.send_signal(signal.SIGTERM)
            status = server.wait(120)
        print(f"SIGTERM: exit status {status}")
        if status != 143:
            problems.append(f"SIGTERM exit status {status}")
    if problems:
        raise SystemExit("FAILED:\n" + "\n".join(problems))
    print("every accepted job completed (a playable mp4), failed with a reason or was cancelled; none lost")


if __name__ == "__main__":
    main()
