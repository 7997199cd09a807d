"""The live page's routes and WebSocket protocol (`wan_tpu/serve/play.py`) on the `matrix-game-tiny`
preset, float32 on CPU, served by uvicorn and driven by a `websockets` client.

Reference: the frames a stream sends as PNG (lossless) equal, bit for bit, the frames
`pipe.stream(image, seed).step(keyboard, mouse)` makes through the Python API with the action rows the
frames' headers say each chunk was made with.
"""

import io
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image
from play_support import IMAGE, example_image

from wan_tpu.errors import WanInputError
from wan_tpu.serve.play import EXAMPLES, Slots, play_routes, unpack

websockets = pytest.importorskip("websockets.sync.client")


class Client:
    """One socket: JSON messages in `texts`, frames (header, payload) in `frames`, in arrival order."""

    def __init__(self, base: str, **options):
        self.ws = websockets.connect(base.replace("http://", "ws://") + "/play/ws", max_size=None, **options).__enter__()
        self.texts, self.frames, self.videos = [], [], []
        self.hello = self.until(lambda: self.texts and self.texts[0]["type"] == "hello", 10)

    def send(self, **message):
        self.ws.send(json.dumps(message))

    def receive(self, timeout: float):
        message = self.ws.recv(timeout=timeout)
        if isinstance(message, str):
            self.texts.append(json.loads(message))
            assert "\n" not in self.texts[-1].get("message", ""), self.texts[-1]
        else:
            header, payload = unpack(message)
            (self.frames if header["kind"] == "frame" else self.videos).append((header, payload, time.monotonic()))

    def until(self, done, timeout: float = 180):
        deadline = time.monotonic() + timeout
        while not done():
            self.receive(max(deadline - time.monotonic(), 0.001))
        return self.texts[-1] if self.texts else None

    def text(self, kind: str, timeout: float = 180) -> dict:
        """The next JSON message of type `kind` from now on (frames meanwhile are kept)."""
        seen = len(self.texts)
        self.until(lambda: any(t["type"] == kind for t in self.texts[seen:]), timeout)
        return next(t for t in self.texts[seen:] if t["type"] == kind)

    def close(self):
        self.ws.close()


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def test_page_examples_and_static_files(play_server):
    page = get(play_server + "/play").decode()
    assert '<canvas id="screen"' in page and 'src="play/static/play.js"' in page
    assert 'src="play/static/play.js?api_key=k%26y"' in get(play_server + "/play?api_key=k%26y").decode()
    assert b"new WebSocket" in get(play_server + "/play/static/play.js")
    assert b"canvas" in get(play_server + "/play/static/play.css")
    listed = json.loads(get(play_server + "/play/examples"))
    assert [e["name"] for e in listed] == list(EXAMPLES)
    for example in listed:
        image = Image.open(io.BytesIO(get(f"{play_server}/{example['url']}")))
        assert image.mode == "RGB" and image.size == (320, 176)
        assert np.asarray(image).std() > 10  # a picture, not a flat colour
    with pytest.raises(urllib.error.HTTPError) as missing:
        get(play_server + "/play/examples/nothing.png")
    assert missing.value.code == 404


def test_hello_names_the_variant_keys_and_sizes(play_server, play_pipe):
    client = Client(play_server)
    try:
        hello = client.hello
        assert hello["variant"] == "matrix-game-tiny" and hello["size"] == list(play_pipe.size) and hello["fps"] == 12
        assert hello["chunk_frames"] == [9, 12] and hello["mouse"] is True
        by_code = {b["code"]: b for b in hello["bindings"]}
        assert by_code["KeyW"]["keys"] == ["w"] and by_code["KeyW"]["does"] == "forward"
        assert by_code["ArrowUp"]["word"] == "w"
        assert by_code["KeyJ"]["keys"] == [] and by_code["KeyJ"]["mouse"] == [0.0, -0.1]
        assert by_code["KeyJ"]["does"] == "camera left"
        assert "KeyQ" not in by_code and "KeyU" not in by_code  # the grammar's "nothing" and "camera still"
    finally:
        client.close()


def test_stream_equals_the_python_api_and_bad_messages_leave_it_playing(play_server, play_pipe, play_chunks):
    """`smooth` (the opt-out of dropping frames): frames as PNG over the socket = the Python API's frames for
    the same actions, every frame sent, paced at the asked rate, the action applied from a later chunk on;
    every bad message is answered with one line while the stream goes on."""
    play_chunks.clear()
    client = Client(play_server)
    try:
        client.send(type="start", image=IMAGE, seed=3, fps=30, format="png", smooth=True)
        started = client.text("started")
        assert (started["fps"], started["seed"], started["format"], started["smooth"]) == (30, 3, "png", True)
        client.until(lambda: len(client.frames) >= 1)
        client.send(type="action", keys=["w", "j"], mouse=[0.05, 0.0], seq=1)
        bad = [b"\x00binary", "not json", json.dumps([1]), json.dumps({"type": "jump"}),
               json.dumps({"type": "action", "keys": ["x"]}), json.dumps({"type": "action", "keys": "w"}),
               json.dumps({"type": "action", "keys": [], "mouse": [float("nan"), 0]}),
               json.dumps({"type": "action", "keys": [], "mouse": [5, 0]}),
               json.dumps({"type": "action", "keys": [], "mouse": [0]}),
               json.dumps({"type": "start", "image": "nowhere"}),
               json.dumps({"type": "start", "image": "data:image/png;base64,@@@"}),
               json.dumps({"type": "start", "image": "data:image/png;base64,aGVsbG8="}),
               json.dumps({"type": "start", "image": IMAGE, "fps": 1000}),
               json.dumps({"type": "start", "image": IMAGE, "seed": -1}),
               json.dumps({"type": "start", "image": IMAGE, "format": "gif"}),
               json.dumps({"type": "record"}),
               json.dumps({"type": "start", "image": IMAGE, "smooth": "yes"}),
               json.dumps({"type": "start", "image": IMAGE, "skip": False})]
        errors = len([t for t in client.texts if t["type"] == "error"])
        for message in bad:
            client.ws.send(message)
        client.until(lambda: len([t for t in client.texts if t["type"] == "error"]) == errors + len(bad), 30)
        messages = [t["message"] for t in client.texts if t["type"] == "error"][errors:]
        assert all(m and "Traceback" not in m for m in messages), messages
        assert "unknown action 'x'" in messages[4] and "NaN" in messages[6] and "outside [-1, 1]" in messages[7]
        assert "fps must be a number in [1, 120]" in messages[12]
        assert "smooth must be true or false" in messages[16] and "start takes no skip" in messages[17]
        client.until(lambda: len(client.frames) >= 9 + 12 * 3)
        assert all(t["type"] != "started" for t in client.texts[1:] if t is not started)  # never restarted
    finally:
        client.close()

    frames = [(h, np.asarray(Image.open(io.BytesIO(p)))) for h, p, _ in client.frames]
    assert [h["index"] for h, _ in frames] == list(range(len(frames)))
    assert all(abs(h["t"] - h["index"] / 30) < 1e-6 for h, _ in frames)
    # The action is applied from a chunk's start on: the first chunk had none, a later one w + camera.
    applied = {h["chunk"]: h["action"] for h, _ in frames}
    assert applied[0] == 0 and applied[max(applied)] == 1
    sent = {0: play_pipe.action_row([]), 1: play_pipe.action_row(["w", "j"], [0.05, 0.0])}
    session = play_pipe.stream(example_image(), seed=3)
    # `on_chunk` sees a chunk once it is whole; its first frames may have come before (live play's two parts).
    deadline = time.monotonic() + 60
    while len(play_chunks) <= max(applied) and time.monotonic() < deadline:
        time.sleep(0.05)
    for k in sorted(applied):
        expected = session.step(*sent[applied[k]])
        got = np.stack([f for h, f in frames if h["chunk"] == k])
        np.testing.assert_array_equal(got, expected[: len(got)])
        np.testing.assert_array_equal(play_chunks[k][1], expected)  # what `on_chunk` saw
    # Paced: 30 frames a second once the first chunks (their compiles) are through.
    steady = [t for h, _, t in client.frames if h["chunk"] >= 2]
    assert len(steady) >= 12 and (steady[-1] - steady[0]) >= 0.9 * (len(steady) - 1) / 30


def test_pause_record_reset(play_server, play_pipe, tmp_path):
    from wan_tpu.runtime.video import read_video

    client = Client(play_server)
    try:
        client.send(type="reset")
        assert "start a stream first" in client.text("error")["message"]
        client.send(type="start", image=IMAGE, fps=120, format="png")
        client.text("started")
        client.send(type="record", on=True)
        assert client.text("state")["recording"] is True
        client.until(lambda: len(client.frames) >= 30)
        client.send(type="pause")
        assert client.text("state")["paused"] is True
        paused_at = len(client.frames)
        with pytest.raises(TimeoutError):
            client.until(lambda: False, 0.5)
        assert len(client.frames) <= paused_at + 1  # at most the frame on its way
        client.send(type="record", on=False)
        client.until(lambda: client.videos)
        header, mp4, _ = client.videos[0]
        assert header["name"].endswith(".mp4") and header["frames"] >= 12
        (tmp_path / "v.mp4").write_bytes(mp4)
        video, fps = read_video(str(tmp_path / "v.mp4"))
        assert video.shape == (header["frames"], *play_pipe.size, 3) and fps == 12
        client.send(type="resume")
        client.until(lambda: len(client.frames) > paused_at + 12)
        first = [p for h, p, _ in client.frames if h["index"] < 9]
        client.send(type="reset")
        assert client.text("started")["stream"] == 2
        client.until(lambda: sum(h["stream"] == 2 for h, _, _ in client.frames) >= 9)
        again = [p for h, p, _ in client.frames if h["stream"] == 2][:9]
        assert again == first  # the same image, seed and (no) actions: the same frames
    finally:
        client.close()


def test_by_default_a_new_action_shows_after_one_chunk_dropping_the_frames_queued(play_server):
    """By default an action sent as a chunk's frames begin (a second of them queued at 12 fps) is shown one
    generation later, not after them: the frames between are never sent. At a pace of one frame a second,
    its chunk's first frame goes out as soon as it is made, not on the pace's clock."""
    client = Client(play_server)
    try:
        client.send(type="start", image=IMAGE, fps=12)
        assert client.text("started")["smooth"] is False
        client.until(lambda: client.frames and client.frames[-1][0]["chunk"] == 4)  # past the compiles, just in time
        sent = time.monotonic()
        client.send(type="action", keys=["d"], seq=1)
        client.until(lambda: client.frames[-1][0]["action"] == 1, 60)
        (header, _, arrived), (before, _, _) = client.frames[-1], client.frames[-2]
        assert header["chunk"] == before["chunk"] + 1 and header["index"] > before["index"] + 1  # frames dropped
        assert arrived - sent < 11 / 12  # sooner than the chunk's queued frames would have played

        client.send(type="start", image=IMAGE, fps=1)
        stream = client.text("started")["stream"]
        client.until(lambda: client.frames[-1][0]["stream"] == stream)
        sent = time.monotonic()
        client.send(type="action", keys=["w"], seq=2)
        client.until(lambda: client.frames[-1][0]["action"] == 2, 60)
        assert time.monotonic() - sent < 0.9 and client.frames[-1][0]["index"] > 1
    finally:
        client.close()


def test_one_stream_at_a_time_and_a_closed_socket_frees_its_place(play_server):
    """Each socket closes while its frames flow (the moment a cancelled stream could miss its cancel)."""
    a, b, c = Client(play_server), Client(play_server), Client(play_server)
    try:
        a.send(type="start", image=IMAGE, fps=120)
        a.until(lambda: len(a.frames) >= 1)
        b.send(type="start", image="desert", fps=120)
        waiting = b.text("waiting")
        assert waiting["in_use"] == 1 and waiting["position"] == 1
        assert waiting["message"].startswith("waiting: 1 sessions in use")
        c.send(type="start", image="snow", fps=120)
        assert c.text("waiting")["position"] == 2
        for closing, next_up, behind in ((a, b, c), (b, c, None)):
            closing.until(lambda: len(closing.frames) >= 3)
            closing.close()
            closed = time.monotonic()
            next_up.text("started", 60)
            next_up.until(lambda: len(next_up.frames) >= 1)
            assert time.monotonic() - closed < 30
            if behind is not None:
                assert behind.text("waiting")["position"] == 1 and not behind.frames
    finally:
        for client in (a, b, c):
            client.close()


def test_a_page_that_takes_no_more_frames_gives_up_its_place(play_server, monkeypatch):
    """A page kept frozen with its socket open (as a browser's back/forward cache keeps one) reads nothing:
    once a send to it has waited `STALL_SECONDS`, its stream ends and the next in line starts; the frozen
    page, reading again, finds its socket closed by the server."""
    import socket

    from websockets.exceptions import ConnectionClosed

    from wan_tpu.serve import play

    monkeypatch.setattr(play, "STALL_SECONDS", 3.0)
    host, port = play_server.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connecting: a small window, soon full
    sock.connect((host, int(port)))
    # Reads no further while a message waits unread, and sends no ping of its own (a frozen page does not).
    frozen = Client(play_server, sock=sock, max_queue=1, ping_interval=None)
    waiting = Client(play_server)
    try:
        frozen.send(type="start", image=IMAGE, fps=120, format="png")
        frozen.until(lambda: len(frozen.frames) >= 1)
        waiting.send(type="start", image="desert", fps=30)
        assert waiting.text("waiting")["position"] == 1
        waiting.text("started", 60)
        waiting.until(lambda: len(waiting.frames) >= 1, 60)
        with pytest.raises(ConnectionClosed):
            frozen.until(lambda: False, 30)
    finally:
        frozen.close()
        waiting.close()


def test_the_line_of_waiting_streams():
    """`Slots` alone: arrival order, positions told as the line moves, a waiter that leaves is dropped."""
    import asyncio

    async def scenario():
        slots, told, order = Slots(1), [], []

        async def stream(name, hold):
            async def waiting(in_use, position):
                told.append((name, in_use, position))

            async with slots.hold(waiting):
                order.append(name)
                await hold.wait()

        holds = {n: asyncio.Event() for n in "abcd"}
        tasks = {n: asyncio.create_task(stream(n, holds[n])) for n in "abcd"}
        await asyncio.sleep(0)
        tasks["c"].cancel()
        await asyncio.sleep(0)
        holds["a"].set()
        await asyncio.sleep(0.01)
        holds["b"].set()
        holds["d"].set()
        await asyncio.gather(tasks["a"], tasks["b"], tasks["d"])
        return order, told, slots.used

    order, told, used = asyncio.run(scenario())
    assert order == ["a", "b", "d"] and used == 0
    assert ("b", 1, 1) in told and ("d", 1, 3) in told and ("d", 1, 2) in told and ("d", 1, 1) in told


def test_routes_refuse_a_bad_session_limit(play_pipe):
    with pytest.raises(WanInputError, match="max_sessions"):
        play_routes(play_pipe, max_sessions=0)


def test_the_benchmark_client_measures_fps_and_latency(play_server):
    """`benchmarks/bench_play.py`'s client (the device benchmark) against this server for a second and a half."""
    import argparse
    import asyncio
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "bench_play.py")
    spec = importlib.util.spec_from_file_location("bench_play", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(seed=0, fps=60.0, seconds=1.5, smooth=False)
    result = asyncio.run(bench.play(play_server.replace("http://", "ws://") + "/play/ws", args))
    assert result["variant"] == "matrix-game-tiny" and result["frames"] >= 30
    assert 20 < result["fps"] < 70 and result["actions"] >= 1
    assert 0 < result["latency_p50_ms"] <= result["latency_p95_ms"] <= result["latency_max_ms"]


def test_a_chunk_in_two_parts_refuses_other_steps_until_it_is_whole(play_pipe):
    """Live play's chunk in two parts (`begin_step`, `end_step`): the first latent frame's frames, then the
    rest; nothing else runs on the stream between them, and the stream goes on after. Their frames are
    `step`'s bit for bit (`test_stream_equals_the_python_api...`: the server makes its chunks this way)."""
    session = play_pipe.stream(example_image(), seed=5)
    with pytest.raises(WanInputError, match="no chunk is open: call begin_step first"):
        session.end_step()
    head = session.begin_step(*play_pipe.action_row(["w"]))
    for refused in (session.step, session.begin_step):
        with pytest.raises(WanInputError, match="a chunk is open: call end_step before the next chunk"):
            refused(*play_pipe.action_row([]))
    rest = session.end_step()
    assert (len(head), len(rest), session.chunk, session.chunk_frames) == (1, 8, 1, [9])
    head, rest = session.begin_step(*play_pipe.action_row([])), session.end_step()
    assert (len(head), len(rest), session.chunk) == (4, 8, 2)
