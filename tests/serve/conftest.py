"""What the serving tests share: one `tiny` Wan pipeline (its programs compile once for every module) and
a real server on a loopback port, run in a thread of the test process (uvicorn, as `wan-serve` runs it)."""

import contextlib
import threading
import time

import pytest


@pytest.fixture(scope="session")
def wan_pipe():
    from wan_tpu.wan.pipeline import WanPipeline

    return WanPipeline.from_pretrained("tiny")


class LiveServer:
    """`state` (from `wan_tpu.serve.cli.make_state`) served at `self.url` until `close()`."""

    def __init__(self, state):
        import uvicorn

        from wan_tpu.serve.app import build_app
        from wan_tpu.serve.cli import bind

        self.state = state
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        if self.state.worker is not None:
            self.state.worker.drain(0)
            self.state.worker.notify()
            assert self.state.worker.join(30)


@contextlib.contextmanager
def live(state):
    server = LiveServer(state)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def wan_server(wan_pipe, tmp_path_factory):
    """A Wan server on `tiny` with a job store of its own, its worker running; `.log` holds its log lines."""
    from wan_tpu.serve.cli import make_state

    lines = []
    state = make_state("wan", wan_pipe, "tiny", output=str(tmp_path_factory.mktemp("store")),
                       log=lambda **fields: lines.append(fields))
    state.worker.start()
    with live(state) as server:
        server.log = lines
        yield server
