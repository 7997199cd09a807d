"""`python -m wan_tpu.serve` as its own process: killed (SIGKILL) in the middle of a job and started again on
the same folder, it loses no accepted job; SIGTERM drains and exits 143 (what a drain does to a running job:
`test_serve.py::test_a_drain_finishes_or_requeues_the_running_job`)."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx

from wan_tpu.runtime.video import read_video

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Process:
    def __init__(self, store: str, *extra: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "wan_tpu.serve", "--model", "tiny", "--port", "0",
                                      "--output", store, *extra], cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        for line in self.proc.stdout:  # the job log (jobs put back in the queue) may come first
            if line.startswith("serving "):
                break
            self.out.append(line)
        assert line.startswith("serving http://127.0.0.1:"), line + self.proc.stderr.read()
        self.url = line.split()[1]
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, ls=lines: ls.extend(s), daemon=True).start()

    def create(self, **body) -> str:
        response = httpx.post(self.url + "/v1/videos", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["id"]

    def get(self, job_id: str) -> dict:
        return httpx.get(f"{self.url}/v1/videos/{job_id}", timeout=60).json()

    def wait(self, condition, timeout=120):
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.err)[-3000:]
            time.sleep(0.02)


def _rows(store: str) -> dict:
    with sqlite3.connect(os.path.join(store, "jobs.sqlite3")) as db:
        return {r[0]: (r[1], r[2]) for r in db.execute("SELECT id, status, progress FROM jobs")}


def test_killed_restarted_and_drained_without_losing_a_job(tmp_path):
    store = str(tmp_path / "store")
    # 1. Killed (SIGKILL) while its first job is inside a denoise step, the second one waiting.
    first = Process(store, env={"WAN_TPU_PAUSE_AT": "denoise"})
    running, waiting = first.create(prompt="running when killed", seed=1), first.create(prompt="waiting", seed=2)
    first.wait(lambda: "paused at denoise\n" in first.err)
    first.proc.kill()
    assert first.proc.wait(60) == -signal.SIGKILL
    assert _rows(store) == {running: ("in_progress", 0), waiting: ("queued", 0)}

    # 2. Started again: the interrupted job runs again from the start, the waiting one after it.
    second = Process(store, "--grace", "0")  # the interrupted job runs again: its log line comes before "serving"
    second.wait(lambda: all(second.get(i)["status"] == "completed" for i in (running, waiting)))
    content = httpx.get(f"{second.url}/v1/videos/{running}/content", timeout=60)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    (tmp_path / "got.mp4").write_bytes(content.content)
    assert read_video(str(tmp_path / "got.mp4"))[0].shape == (5, 64, 64, 3)

    # 3. SIGTERM with --grace 0 and a job just sent: it is kept (queued again, or done), exit status 143, one line.
    last = second.create(prompt="sent last")
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(120) == 143, "".join(second.err)[-3000:]
    time.sleep(0.1)  # the reader threads take the last lines
    assert second.err[-1].startswith("interrupted; kept ") and second.err[-1].count("\n") == 1
    rows = _rows(store)
    assert rows[running][0] == rows[waiting][0] == "completed" and rows[last][0] in ("queued", "completed")
    done = [i for i in (running, waiting, last) if rows[i][0] == "completed"]
    assert sorted(os.listdir(os.path.join(store, "videos"))) == sorted(f"{i}.{e}" for i in done for e in ("jpg", "mp4"))
    events = [json.loads(line) for line in first.out + second.out if line.startswith("{")]
    assert any(e["event"] == "job_requeued" and e["id"] == running for e in events)
    assert any(e["event"] == "draining" and e["signal"] == "SIGTERM" for e in events)
    assert all(line.startswith(("{", "serving ")) for line in first.out + second.out)
