"""`python -m wan_tpu.serve` over two processes of one job on localhost (`wan_tpu.serve.worker.follow`): process 0
serves HTTP and writes, process 1 binds nothing (both are given the same port) and runs every job with it; a job
through the API gives the frames of a one-process server on the same mesh (sp2 over two CPU devices, whose
all-reduces add two operands: the same sum in a job and outside one), and a SIGTERM to process 0 ends both.
What process 0 tells the others (each job, each step's outcome, the end) is checked apart, over an in-memory
store: a job stopped at a step stops there on the others too."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from wan_tpu.runtime.video import read_video

REQUEST = {"prompt": "a cat walks on the grass", "seed": 3, "steps": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(tmp_path, store: str) -> tuple[list[subprocess.Popen], str]:
    port, coordinator = _free_port(), _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('ONE_DEVICE_XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"}
    procs = []
    for i in range(2):
        (tmp_path / f"w{i}").mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "wan_tpu.serve", "--model", "tiny", "--port", str(port), "--output", store,
             "--coordinator", f"localhost:{coordinator}", "--num-processes", "2", "--process-id", str(i)],
            cwd=tmp_path / f"w{i}", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs, f"http://127.0.0.1:{port}"


def _one_process_frames(tmp_path) -> np.ndarray:
    """The job through a one-process server's API (in this process) on the two-device mesh the job makes."""
    import jax
    from starlette.testclient import TestClient

    from wan_tpu.parallel.mesh import make_mesh
    from wan_tpu.serve.app import build_app
    from wan_tpu.serve.cli import make_state
    from wan_tpu.wan.pipeline import WanPipeline

    pipe = WanPipeline.from_pretrained("tiny", mesh=make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    state = make_state("wan", pipe, "tiny", output=str(tmp_path / "one"), log=lambda **_: None)
    state.worker.start()
    try:
        with TestClient(build_app(state)) as client:
            job = client.post("/v1/videos", json=REQUEST).json()["id"]
            _wait(lambda: client.get(f"/v1/videos/{job}").json()["status"] == "completed")
            (tmp_path / "one.mp4").write_bytes(client.get(f"/v1/videos/{job}/content").content)
    finally:
        state.worker.drain(0)
        state.worker.notify()
        assert state.worker.join(30)
    return read_video(str(tmp_path / "one.mp4"))[0]


def _wait(condition, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


# Two server processes and the single-process reference compile the tiny pipeline three times over on the 2-core CI
# machine (about 47 s); the suite's budget leaves it to a run that asks for it, as tests/shared/test_multihost.py's
# whole Matrix-Game and UnifoLM commands.
@pytest.mark.skipif(not os.environ.get("WAN_TPU_TEST_MULTIHOST_COMMANDS"),
                    reason="two server processes compile for most of a minute on 2 cores; "
                           "set WAN_TPU_TEST_MULTIHOST_COMMANDS=1 to run it")
def test_two_processes_serve_one_job_and_stop_together(tmp_path):
    store = str(tmp_path / "store")
    procs, url = _launch(tmp_path, store)
    try:
        expected = _one_process_frames(tmp_path)
        line = procs[0].stdout.readline()
        assert line.startswith(f"serving {url} "), line + procs[0].stderr.read()
        response = httpx.post(url + "/v1/videos", json=REQUEST, timeout=60)
        assert response.status_code == 200, response.text
        job = response.json()["id"]
        _wait(lambda: httpx.get(f"{url}/v1/videos/{job}", timeout=60).json()["status"] in ("completed", "failed"))
        assert httpx.get(f"{url}/v1/videos/{job}", timeout=60).json()["status"] == "completed"
        (tmp_path / "got.mp4").write_bytes(httpx.get(f"{url}/v1/videos/{job}/content", timeout=60).content)
        np.testing.assert_array_equal(read_video(str(tmp_path / "got.mp4"))[0], expected)
        procs[0].send_signal(signal.SIGTERM)
        results = [(p.wait(60), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            p.kill()
    err = [_quiet(e) for _, _, e in results]
    assert [rc for rc, _, _ in results] == [143, 143], err
    assert err[0].splitlines()[-1] == f"interrupted; kept {store}" and err[1] == "interrupted; nothing written\n", err
    # Process 1 said who serves and nothing else; it made no file (its folder is empty, the store is process 0's).
    assert results[1][1] == "process 1 of 2: process 0 writes the outputs\n"
    assert list((tmp_path / "w1").iterdir()) == []
    assert sorted(os.listdir(os.path.join(store, "videos"))) == [f"{job}.jpg", f"{job}.mp4"]


def _quiet(stderr: str) -> str:
    # gloo announces its connections from C++; not ours to silence.
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("[Gloo]"))


class MemoryStore:
    """The job's key-value store as `wan_tpu.runtime.distributed` offers it, in memory."""

    def __init__(self):
        self.values, self.changed = {}, threading.Condition()

    def publish(self, key, value):
        with self.changed:
            self.values[key] = value.encode() if isinstance(value, str) else value
            self.changed.notify_all()

    def lookup(self, key):
        return self.values.get(key)

    def wait_for(self, key, timeout_s):
        with self.changed:
            self.changed.wait_for(lambda: key in self.values, timeout_s)
            return self.values.get(key)

    def forget(self, prefix):
        with self.changed:
            for key in [k for k in self.values if k.startswith(prefix)]:
                del self.values[key]


def test_the_others_stop_each_job_where_process_0_does(monkeypatch, tmp_path):
    from wan_tpu.runtime import distributed, interrupt
    from wan_tpu.serve.worker import JobChannel, JobStopped, follow

    store = MemoryStore()
    for name in ("publish", "lookup", "wait_for", "forget"):
        monkeypatch.setattr(distributed, name, getattr(store, name))
    monkeypatch.setattr(distributed, "stop_together", lambda: None)

    class Videos:  # a job of three steps; records each run's steps and image
        def __init__(self):
            self.runs = []

        def run(self, request, image, video, thumbnail, on_step):
            self.runs.append((request["prompt"], [], None if image is None else open(image, "rb").read()))
            for done in (1, 2, 3):
                on_step(done, 3)
                self.runs[-1][1].append(done)

    ended, followed = [], Videos()

    def other():
        try:
            follow(followed)
        except interrupt.Interrupted as e:
            ended.append(e.signum)

    thread = threading.Thread(target=other)
    thread.start()
    channel, own = JobChannel(), Videos()

    def delete_after_2(done, total):
        if done == 2:
            raise JobStopped("deleted")

    try:
        with channel.announce("a", {"prompt": "deleted at step 2"}, None, delete_after_2) as step:
            own.run({"prompt": "deleted at step 2"}, None, "", "", step)
    except JobStopped:
        pass
    image = tmp_path / "in.png"
    image.write_bytes(os.urandom(3 * 2**20 // 2) * 3)  # more than one piece
    with channel.announce("b", {"prompt": "whole", "image": True}, str(image), lambda done, total: None) as step:
        own.run({"prompt": "whole"}, str(image), "", "", step)
    channel.close(signal.SIGTERM)
    thread.join(30)
    assert not thread.is_alive() and ended == [signal.SIGTERM]
    # The deleted job stopped after step 1 on both (its step 2 raised on process 0); the next ran whole on both.
    assert own.runs == followed.runs[:1] + [("whole", [1, 2, 3], image.read_bytes())]
    assert followed.runs[1] == ("whole", [1, 2, 3], image.read_bytes())
    assert own.runs[0] == ("deleted at step 2", [1], None)
    assert not any(key.startswith("serve/1/") for key in store.values)  # the first job's keys went with the second
