"""The live-page tests' helpers (their fixtures, built on these, are in `conftest.py`): a `matrix-game-tiny`
pipeline (float32, prepared once per process, so its compiled programs serve every test), a built-in start
image, and routes served by uvicorn on a free port."""

import contextlib
import functools
import socket
import threading
import time

import numpy as np

IMAGE = "meadow"  # a built-in start image (`wan_tpu.serve.play.EXAMPLES`)


@functools.lru_cache(maxsize=None)
def tiny_pipeline():
    """The preset's pipeline with its programs compiling ahead (`prepare`), as the server runs it. Its own
    (attention named, the same kernel as the default on CPU), so that `prepare` does not change the
    pipeline the Matrix-Game tests share (they count the jitted chunk programs' compilations)."""
    import jax.numpy as jnp

    from wan_tpu.matrix_game import pipeline as mg

    pipe = mg.MatrixGamePipeline.from_pretrained(mg.PRESET, dtype=jnp.float32, attention="reference")
    pipe.prepare(live=True)
    return pipe


def example_image(name: str = IMAGE) -> np.ndarray:
    import io

    from PIL import Image

    from wan_tpu.serve.play import example_png

    return np.asarray(Image.open(io.BytesIO(example_png(name))).convert("RGB"))


@contextlib.contextmanager
def serve(routes):
    """A Starlette app of `routes` served by uvicorn in a thread; yields its base URL (http://127.0.0.1:PORT)."""
    import uvicorn
    from starlette.applications import Starlette

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
