"""What the serving tests share: one `tiny` Wan pipeline (its programs compile once for every module), real
servers on loopback ports, run in a thread of the test process (uvicorn, as `wan-serve` runs it), and the
live page's fixtures (a `matrix-game-tiny` pipeline, the chunks its server made, the server; their
helpers are in `play_support.py`)."""

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


def _wan_server(pipe, name: str, tmp_path_factory):
    from wan_tpu.serve.cli import make_state

    lines = []
    state = make_state("wan", pipe, name, output=str(tmp_path_factory.mktemp("store")),
                       log=lambda **fields: lines.append(fields))
    state.worker.start()
    with live(state) as server:
        server.log = lines
        yield server


@pytest.fixture(scope="module")
def wan_server(wan_pipe, tmp_path_factory):
    """A Wan server on `tiny` with a job store of its own, its worker running; `.log` holds its log lines."""
    yield from _wan_server(wan_pipe, "tiny", tmp_path_factory)


@pytest.fixture(scope="module")
def ti2v_server(tmp_path_factory):
    """The same on the `tiny-ti2v` preset (text and image to video)."""
    from wan_tpu.wan.pipeline import WanPipeline

    yield from _wan_server(WanPipeline.from_pretrained("tiny-ti2v"), "tiny-ti2v", tmp_path_factory)


# ---- the live page (`wan_tpu.serve.play`) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def play_pipe():
    from play_support import tiny_pipeline

    return tiny_pipeline()


@pytest.fixture(scope="module")
def play_chunks():
    """(chunk, frames, keyboard, mouse) of every chunk `play_server` made, as `play_routes(on_chunk=...)` saw them."""
    return []


@pytest.fixture(scope="module")
def play_server(play_pipe, play_chunks):
    """The live page's routes, one stream at a time; its base URL."""
    from play_support import serve

    from wan_tpu.serve.play import play_routes

    with serve(play_routes(play_pipe, max_sessions=1, on_chunk=lambda *chunk: play_chunks.append(chunk))) as base:
        yield base
