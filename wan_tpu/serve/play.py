"""Matrix-Game-2 played live in a browser: the page, its start images and its WebSocket.

    from starlette.applications import Starlette
    app = Starlette(routes=play_routes(MatrixGamePipeline.from_pretrained("matrix-game-tiny")))
    # uvicorn.run(app, port=8000), then open http://127.0.0.1:8000/play

`play_routes(pipeline, *, max_sessions=2, on_chunk=None)` gives `GET /play` (the page: `static/play.html`,
`play.js`, `play.css`), `GET /play/examples` (the built-in start images, JSON) and
`GET /play/examples/NAME.png`, the static files under `/play/static/`, and the WebSocket `/play/ws`.
One socket is one stream (`pipeline.stream`); at most `max_sessions` streams run at once, the others are
told "waiting: N sessions in use" and start, in arrival order, as soon as one ends or its tab closes.

The page sends JSON text messages:
- `{"type": "start", "image": NAME | "data:image/...;base64,...", "seed": 0, "fps": 12, "format": "jpeg",
  "smooth": false}`: a new stream from a built-in example or an uploaded image (any of the fields but
  `image` may be left out; `fps`: the pace frames are sent at, default the model's video frame rate;
  `format`: "jpeg" or "png" (lossless); `smooth`: every frame is played, so an action waits for the
  frames queued before it; by default an action change starts the next chunk at once and the frames
  still queued from before are dropped: the quickest response, at the cost of skipped frames; other
  fields are refused). Sent again, it replaces the stream.
- `{"type": "action", "keys": ["w", "j"], "mouse": [0.0, 0.05], "seq": 7}`: the action held now, as words of
  the interactive grammar (`wan_tpu.matrix_game.actions`), plus the pointer's [vertical, horizontal]
  camera motion (variants with a mouse). The latest one is applied to each chunk when it starts.
- `{"type": "pause"}`, `{"type": "resume"}`, `{"type": "reset"}` (the same image and seed again),
  `{"type": "record", "on": true | false}`: frames from now on are encoded into an mp4 on the server
  (`wan_tpu.runtime.video.VideoWriter`); turning it off sends the file.

The server sends JSON text messages (`hello`: the variant, its key bindings and sizes; `waiting`;
`started`; `state`; `end`; `error`: one line, and the stream goes on) and binary messages: a 4-byte
big-endian header length, a JSON header, then the payload: `{"kind": "frame", "stream", "index", "chunk",
"t" (seconds into the video), "action" (the `seq` of the action the chunk was made with), "format"}` + the
encoded frame, or `{"kind": "video", "frames", "name"}` + the mp4.

Each chunk is made in a worker thread (JAX releases the GIL), never in the event loop, in two parts
(`session.begin_step`: the denoising and its first latent frame's decode, whose frames are queued at
once; `end_step`: the cache pass and the other frames' decode), and as late as the frames already queued
allow: a chunk starts when the queued frames' playing time falls to about what the recent chunks took to
give their first frames (or their rest, beyond what the first frames play for), so the action it is
made with is as fresh as the pace permits.
Frames are encoded one at a time, each while the one before it plays: a chunk's first frame does not
wait for the others' encodes, and dropped frames are never encoded. By default an action shows one
chunk's first part after it comes, plus the rest of the chunk being made then, if one is (made with the
action before: a chunk in progress cannot be stopped); the new chunk's first frame goes out as soon as
its first part is done and the frame encoded. With `smooth` it shows after the frames queued when it
came: on average half a chunk's playing time (12 frames ÷ fps) plus one chunk's first part.
A closed tab frees its place at once; its chunk in progress finishes in its thread and is dropped. So does a
tab navigated away from: the page closes its socket as it is hidden. A page that keeps its socket open but
takes no message for `STALL_SECONDS` (frozen, as a browser's back/forward cache keeps a page left for
another) frees its place then.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import contextlib
import functools
import io
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass

import numpy as np
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from wan_tpu.errors import WanInputError
from wan_tpu.serve import videos

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
MAX_IMAGE_BYTES = 8 * 2**20
FPS_RANGE = (1, 120)
FORMATS = {"jpeg": ("JPEG", {"quality": 90}), "png": ("PNG", {"compress_level": 1})}
MESSAGES = ("start", "action", "pause", "resume", "reset", "record")
START_FIELDS = ("image", "seed", "fps", "format", "smooth")
# A chunk starts once the queued frames play for less than this many times the slowest of the last
# three chunks' generation, plus a margin: jitter then rarely stalls the picture.
LEAD_FACTOR, LEAD_MARGIN = 1.25, 0.03
ARROWS = {"ArrowUp": "w", "ArrowDown": "s", "ArrowLeft": "a", "ArrowRight": "d"}
# A send that waits this long (the network buffers full) means the page takes no more: it is taken as gone.
# Else its stream would hold its place, sending to no one, for as long as the page is kept: uvicorn's
# keepalive cannot end it (its ping waits behind the unread frames, and its close waits for them to flush).
STALL_SECONDS = 15.0

log = logging.getLogger(__name__)


def play_routes(pipeline, *, max_sessions: int = 2, on_chunk=None) -> list:
    """Starlette routes of the live page for a `MatrixGamePipeline` (see the module docstring).

    `on_chunk(chunk, frames, keyboard, mouse)`, if given, is called in the worker thread with each chunk's
    uint8 frames (n, H, W, 3) and the action row it was made with, once the chunk is whole (its first
    frames may be sent before). The pipeline is best prepared with `prepare(live=True)`: each chunk is
    made in two parts (`session.begin_step`, `end_step`), whose programs it compiles ahead."""
    if not isinstance(max_sessions, int) or max_sessions < 1:
        raise WanInputError(f"max_sessions must be a positive integer, got {max_sessions!r}")
    play = Play(pipeline, max_sessions, on_chunk)
    return [Route("/play", play.page, methods=["GET"]),
            Route("/play/examples", play.example_list, methods=["GET"]),
            Route("/play/examples/{name}", play.example, methods=["GET"]),
            WebSocketRoute("/play/ws", play.socket),
            Mount("/play/static", StaticFiles(directory=STATIC), name="play-static")]


# ---- start images -----------------------------------------------------------------------------------

EXAMPLES = {  # name → (sky top, sky at the horizon, far ground, near ground, road), RGB
    "meadow": ((70, 130, 210), (190, 220, 240), (90, 140, 70), (60, 120, 40), (150, 130, 100)),
    "desert": ((40, 110, 200), (230, 210, 170), (210, 170, 110), (190, 140, 80), (120, 110, 100)),
    "snow": ((120, 140, 170), (220, 225, 235), (225, 230, 240), (245, 245, 250), (110, 100, 95)),
}


@functools.lru_cache(maxsize=None)
def example_png(name: str, width: int = 320, height: int = 176) -> bytes:
    """A built-in start image: a landscape with hills and a road to the horizon, drawn from a fixed seed."""
    from PIL import Image

    sky_top, sky_low, far, near, road = (np.asarray(c, np.float32) for c in EXAMPLES[name])
    rng = np.random.default_rng(sorted(EXAMPLES).index(name))
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    phase = rng.uniform(0, 2 * np.pi, 3)
    horizon = 0.45 + 0.04 * np.sin(7 * x + phase[0]) + 0.02 * np.sin(17 * x + phase[1])
    sky = sky_top + (sky_low - sky_top) * np.clip(y / horizon, 0, 1)
    depth = np.clip((y - 0.45) / 0.55, 0, 1)
    ground = far + (near - far) * depth
    image = np.where(y < horizon, sky, ground)
    on_road = (np.abs(x - 0.5 - 0.05 * np.sin(3 * depth + phase[2])) < 0.01 + 0.3 * depth) & (y >= 0.45)
    image = np.where(on_road, road, image)
    image = image * (1 + 0.06 * rng.standard_normal((height, width, 1)).astype(np.float32))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def decode_image(value: str):
    """A start image from a `start` message: a built-in example's name or a base64 data URL → PIL RGB."""
    if not isinstance(value, str) or not value:
        raise WanInputError("start needs an image: a built-in example's name or a data:image/...;base64 URL")
    if value in EXAMPLES:
        data = example_png(value)
    elif value.startswith("data:") and ";base64," in value:
        encoded = value.split(";base64,", 1)[1]
        if len(encoded) * 3 // 4 > MAX_IMAGE_BYTES:
            raise WanInputError(f"the image is over {MAX_IMAGE_BYTES // 2**20} MiB; upload a smaller PNG or JPEG")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise WanInputError("the image's data URL is not valid base64; upload a PNG or JPEG file") from None
    else:
        raise WanInputError(f"unknown example {value[:40]!r}; pick one of {', '.join(EXAMPLES)} or upload an image")
    return videos.decode_image(data, "the image", "upload a PNG or JPEG file")


# ---- messages -----------------------------------------------------------------------------------------

def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


def pack(header: dict, payload: bytes) -> bytes:
    """A binary message: the JSON header's length (4 bytes, big-endian), the header, the payload."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(head)) + head + payload


def unpack(message: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack(">I", message[:4])
    return json.loads(message[4 : 4 + n]), message[4 + n :]


def encode_frame(frame: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    name, options = FORMATS[fmt]
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, name, **options)
    return buffer.getvalue()


@dataclass(frozen=True)
class StartRequest:
    image: object  # PIL RGB
    seed: int
    fps: float
    format: str
    smooth: bool = False  # every frame played; else an action change drops the frames queued before it


@dataclass
class QueuedFrame:
    """A frame waiting to be sent; `data` is its encoding, made while the frame before it plays."""

    stream: int
    header: dict
    pixels: np.ndarray
    data: bytes | None = None


def _number(message: dict, name: str, default, low, high, integer: bool = False):
    value = message.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()) \
            or not math.isfinite(value) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise WanInputError(f"{name} must be {kind} in [{low}, {high}], got {json.dumps(value)[:40]}")
    return int(value) if integer else float(value)


def _checked_keys(message: dict, pipeline) -> tuple:
    keys = message.get("keys", [])
    if not isinstance(keys, list) or len(keys) > 16 or not all(isinstance(k, str) and 0 < len(k) <= 32 for k in keys):
        raise WanInputError("keys must be a list of action words, e.g. [\"w\", \"a\"]")
    mouse = message.get("mouse")
    if mouse is not None:
        if not pipeline.action_space.mouse:
            raise WanInputError(f"the {pipeline.variant.name} variant has no mouse; leave mouse out")
        if not isinstance(mouse, list) or len(mouse) != 2 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in mouse):
            raise WanInputError("mouse must be [vertical, horizontal], two numbers")
    return pipeline.action_row(keys, mouse)


def bindings(pipeline) -> list[dict]:
    """The page's keys: every one-letter word of the variant's grammar (and the arrows for w/s/a/d), the
    keyboard columns it holds and the camera motion it adds (from the pipeline's own parser), and what it
    does in the grammar's spelled-out words."""
    space = pipeline.action_space
    idle, _ = pipeline.action_row([])
    spelled = {item: word for word, item in space.words.items() if item and len(word) > 1}
    letters = {}
    for word in sorted({*space.words, *space.keys}):
        if len(word) != 1 or not word.isalpha():
            continue
        keyboard, mouse = pipeline.action_row([word])
        held = [k for k, on, off in zip(space.keys, keyboard, idle) if on and not off]
        motion = [0.0, 0.0] if mouse is None else [round(float(v), 6) for v in mouse]
        if held or any(motion):
            does = [spelled.get(k, k) for k in held]
            does += [f"camera {'up' if motion[0] > 0 else 'down'}"] if motion[0] else []
            does += [f"camera {'right' if motion[1] > 0 else 'left'}"] if motion[1] else []
            letters[word] = {"code": f"Key{word.upper()}", "label": word.upper(), "word": word, "keys": held,
                             "mouse": motion, "does": " + ".join(does)}
    out = list(letters.values())
    for code, word in ARROWS.items():
        if word in letters:
            out.append({**letters[word], "code": code, "label": code[5:].lower()})
    return out


# ---- the waiting line -------------------------------------------------------------------------------------

class PageGone(ConnectionError):
    """The page took no message for `STALL_SECONDS`."""


class _Turn:
    def __init__(self):
        self.granted = False
        self.moved = asyncio.Event()


class Slots:
    """At most `limit` streams at once; the others wait in arrival order and are told where they stand
    (all in the event loop's thread: no locks)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._line: collections.deque[_Turn] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, waiting):
        """Hold a place while the body runs; `waiting(in_use, position)` (a coroutine) is awaited each
        time the wait starts or the line moves."""
        if self.used < self.limit and not self._line:
            self.used += 1
        else:
            turn = _Turn()
            self._line.append(turn)
            try:
                while not turn.granted:
                    await waiting(self.used, self._line.index(turn) + 1)
                    await turn.moved.wait()
                    turn.moved.clear()
            except BaseException:
                if turn.granted:
                    self._release()
                else:
                    self._line.remove(turn)
                    self._moved()
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self.used -= 1
        if self._line and self.used < self.limit:
            turn = self._line.popleft()
            turn.granted = True
            self.used += 1
            turn.moved.set()
        self._moved()

    def _moved(self) -> None:
        for turn in self._line:
            turn.moved.set()


# ---- the routes ----------------------------------------------------------------------------------------------

class Play:
    """What the routes share: the pipeline, the waiting line and the worker threads."""

    def __init__(self, pipeline, max_sessions: int, on_chunk=None):
        self.pipeline = pipeline
        self.slots = Slots(max_sessions)
        self.on_chunk = on_chunk
        # One worker per stream, and one for the chunk a closed tab leaves running.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_sessions + 1, thread_name_prefix="wan_tpu-play")
        # `stream` reads the components and splits them once; two first streams must not race to do it.
        self.stream_lock = threading.Lock()
        self.bindings = bindings(pipeline)
        h, w = pipeline.size
        fps = pipeline.variant.fps
        self.hello = {"type": "hello", "variant": pipeline.variant.name, "size": [h, w], "fps": fps,
                      "fps_range": list(FPS_RANGE), "chunk_frames": [pipeline.chunk_frames(0), pipeline.chunk_frames(1)],
                      "mouse": bool(pipeline.action_space.mouse), "bindings": self.bindings,
                      "formats": list(FORMATS), "examples": list(EXAMPLES), "max_sessions": max_sessions}

    async def page(self, request):
        with open(os.path.join(STATIC, "play.html"), encoding="utf-8") as f:
            html = f.read()
        # A server started with an API key is opened as /play?api_key=K: the page's own files need it too.
        key = request.query_params.get("api_key")
        query = "?" + urllib.parse.urlencode({"api_key": key}) if key else ""
        return HTMLResponse(html.replace("{{query}}", query))

    async def example_list(self, request):
        return JSONResponse([{"name": name, "url": f"play/examples/{name}.png"} for name in EXAMPLES])

    async def example(self, request):
        name = request.path_params["name"].removesuffix(".png")
        if name not in EXAMPLES:
            return JSONResponse({"error": f"no example {name!r}; the examples are {', '.join(EXAMPLES)}"}, 404)
        return Response(example_png(name), media_type="image/png")

    async def socket(self, websocket):
        await websocket.accept()
        player = Player(self, websocket)
        await player.send_json(self.hello)
        # The socket ends with the first of its parts to end: the page closing (`receive`), or a part failing,
        # a send the page did not take (`PageGone`) above all, which would leave the others holding the place.
        parts = [asyncio.create_task(part) for part in (player.receive(), player.run(), player.send_frames())]
        try:
            done, _ = await asyncio.wait(parts, return_when=asyncio.FIRST_COMPLETED)
            for part in done:
                if part.exception() is not None:  # the page has gone or takes nothing more: nothing to tell it
                    log.debug("a live page's socket ended: %s", one_line(part.exception()))
        finally:
            for part in parts:
                part.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
            player.close()


class Player:
    """One socket: its receiving side (`receive`), its stream (`run`, in the waiting line) and its paced
    frame sender (`send_frames`)."""

    def __init__(self, play: Play, websocket):
        self.play, self.pipe, self.websocket = play, play.pipeline, websocket
        self._send_lock = asyncio.Lock()
        self._gone = False  # a send stalled: the page is taken as gone, and every later send fails at once
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._request: StartRequest | None = None  # a start or reset waiting to be served
        self._last: StartRequest | None = None
        keyboard, mouse = self.pipe.action_row([])
        self.action = (keyboard, mouse, 0)
        self.paused = False
        self.stream = 0  # the current stream's number: frames of an older one are dropped
        self.fps = float(self.pipe.variant.fps)
        self._outbox: collections.deque = collections.deque()
        self._queued = asyncio.Event()
        self._due = 0.0  # when the next frame is due (time.monotonic)
        self._record = False  # what the page asked for
        self._recording: Recording | None = None

    # ---- sending -------------------------------------------------------------------

    async def send_json(self, message: dict) -> None:
        await self._send(self.websocket.send_text, json.dumps(message))

    async def send_bytes(self, data: bytes) -> None:
        await self._send(self.websocket.send_bytes, data)

    async def _send(self, send, data) -> None:
        async with self._send_lock:
            if not self._gone:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STALL_SECONDS):
                        return await send(data)
                self._gone = True
            raise PageGone(f"the page took no message for {STALL_SECONDS:g} s")

    async def error(self, message: str) -> None:
        await self.send_json({"type": "error", "message": message})

    async def send_state(self) -> None:
        await self.send_json({"type": "state", "paused": self.paused, "recording": self._record})

    def queued_seconds(self) -> float:
        """How long the frames not yet sent will take to play."""
        if not self._outbox:
            return 0.0
        return max(self._due - time.monotonic(), 0.0) + (len(self._outbox) - 1) / self.fps

    async def send_frames(self) -> None:
        """Send queued frames one every 1/fps seconds; after a stall (the next chunk came late), from now on.
        Each frame is encoded while the one before it plays, beside the event loop (a large frame's encode
        would hold the other streams' pacing)."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._outbox:
                self._queued.clear()
                await self._queued.wait()
            await self._resumed.wait()
            frame = self._outbox[0]
            if frame.data is None:
                frame.data = await loop.run_in_executor(None, encode_frame, frame.pixels, frame.header["format"])
                continue  # the line may have been cleared or paused meanwhile
            now = time.monotonic()
            if self._due > now:
                # Until the frame is due, or the line is replaced (a new action's chunk goes out at once).
                self._queued.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._due - now):
                        await self._queued.wait()
                continue
            self._outbox.popleft()
            if frame.stream == self.stream:
                await self.send_bytes(pack(frame.header, frame.data))
                # On the clock (a sleep's overshoot is made up), unless a frame period late: then from now on.
                self._due = (self._due if now - self._due < 1 / self.fps else now) + 1 / self.fps
            self._wake.set()

    # ---- receiving -------------------------------------------------------------------

    async def receive(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            try:
                if text is None:
                    raise WanInputError("send JSON text messages (see the page's protocol); binary messages are not taken")
                try:
                    body = json.loads(text)
                except json.JSONDecodeError as e:
                    raise WanInputError(f"a message is not JSON ({e.msg} at {e.pos}); send JSON objects") from None
                if not isinstance(body, dict) or body.get("type") not in MESSAGES:
                    kind = body.get("type") if isinstance(body, dict) else None
                    raise WanInputError(f"unknown message type {json.dumps(kind)[:40]}; send one of {', '.join(MESSAGES)}")
                await self.handle(body)
            except WanInputError as e:
                await self.error(str(e))

    async def handle(self, message: dict) -> None:
        kind = message["type"]
        if kind == "action":
            keyboard, mouse = _checked_keys(message, self.pipe)
            seq = _number(message, "seq", self.action[2], 0, 2**53, integer=True)
            self.action = (keyboard, mouse, seq)
        elif kind == "start":
            unknown = sorted(set(message) - {"type", *START_FIELDS})
            if unknown:
                raise WanInputError(f"start takes no {', '.join(unknown)[:60]}; its fields are {', '.join(START_FIELDS)}")
            fmt = message.get("format", "jpeg")
            if fmt not in FORMATS:
                raise WanInputError(f"format must be one of {', '.join(FORMATS)}, got {json.dumps(fmt)[:40]}")
            seed = _number(message, "seed", 0, 0, 2**32 - 1, integer=True)
            fps = _number(message, "fps", self.pipe.variant.fps, *FPS_RANGE)
            smooth = message.get("smooth", False)
            if not isinstance(smooth, bool):
                raise WanInputError(f"smooth must be true or false, got {json.dumps(smooth)[:40]}")
            # Decoded beside the event loop: an upload of several megapixels would hold the other streams' pacing.
            image = await asyncio.get_running_loop().run_in_executor(None, decode_image, message.get("image"))
            self._request = self._last = StartRequest(image, seed, fps, fmt, smooth)
        elif kind == "reset":
            if self._last is None:
                raise WanInputError("nothing to reset: start a stream first")
            self._request = self._last
        elif kind in ("pause", "resume"):
            self.paused = kind == "pause"
            if self.paused:
                self._resumed.clear()
            else:
                self._due = time.monotonic()
                self._resumed.set()
            await self.send_state()
        elif kind == "record":
            on = message.get("on")
            if not isinstance(on, bool):
                raise WanInputError("record needs \"on\": true or false")
            self._record = on
        self._wake.set()

    # ---- the stream -------------------------------------------------------------------

    async def work(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.play.executor, fn, *args)

    async def wait(self, timeout: float | None = None) -> None:
        """Until a message or a sent frame changes something, or `timeout`; recording follows the page's wish."""
        # Not `asyncio.wait_for`: in Python 3.11 it swallows a cancellation that comes as the event is set
        # (which each frame sent does), and a closed tab's stream would then play on, holding its place.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        self._wake.clear()
        await self.follow_recording()

    async def run(self) -> None:
        while True:
            while self._request is None:
                await self.wait()
            async with self.play.slots.hold(self.waiting):
                while self._request is not None:
                    request, self._request = self._request, None
                    try:
                        await self.play_stream(request)
                    except PageGone:
                        raise
                    except Exception as e:  # noqa: BLE001 - one line to the page, which may start again
                        log.exception("a live stream failed")
                        await self.error(f"the stream stopped: {one_line(e)}; press reset to start again")

    async def waiting(self, in_use: int, position: int) -> None:
        await self.send_json({"type": "waiting", "in_use": in_use, "position": position,
                              "message": f"waiting: {in_use} sessions in use (you are number {position} in line)"})

    def _start(self, request: StartRequest):
        with self.play.stream_lock:
            return self.pipe.stream(request.image, seed=request.seed)

    async def play_stream(self, request: StartRequest) -> None:
        """Chunks until the stream ends, or a start or reset replaces it (left in `_request`)."""
        self.stream += 1
        self._outbox.clear()
        self.fps = request.fps
        try:
            session = await self.work(self._start, request)
        except WanInputError as e:
            await self.error(str(e))
            return
        f = self.pipe.frames_per_chunk
        await self.send_json({"type": "started", "stream": self.stream, "seed": request.seed, "fps": request.fps,
                              "format": request.format, "smooth": request.smooth,
                              "max_frames": 4 * session.max_latents - 3})
        index, seconds, applied = 0, [], None
        while self._request is None:
            if f * (session.chunk + 1) > session.max_latents:
                await self.send_json({"type": "end", "frames": index,
                                      "message": f"the stream is at its end ({index} frames); press reset to play again"})
                return
            # The first chunks compile their programs: make them at once; then just in time.
            lead = queued = self.queued_seconds()
            if session.chunk >= 3 and seconds:
                lead = LEAD_FACTOR * max(seconds[-3:]) + LEAD_MARGIN
            keyboard, mouse, seq = self.action
            early = not request.smooth and applied is not None and seq != applied
            if self.paused or (queued > lead and not early):
                await self.wait(None if self.paused else queued - lead)
                continue
            applied = seq
            started = time.perf_counter()
            chunk = session.chunk
            head = await self.work(self._chunk_head, session, keyboard, mouse)
            head_seconds = time.perf_counter() - started
            if early:  # the new action's frames go out now: what is still queued from before is dropped
                self._outbox.clear()
                self._due = time.monotonic()
            index = self._queue(head, index, chunk, seq, request)
            rest = await self.work(self._chunk_tail, session, keyboard, mouse, head, self._recording)
            if chunk >= 2:
                # What the queue must cover when the next chunk starts: its first frames' wait, and then
                # the rest's beyond what those first frames play for.
                seconds.append(max(head_seconds, time.perf_counter() - started - len(head) / request.fps))
            index = self._queue(rest, index, chunk, seq, request)
            await self.follow_recording()

    def _queue(self, frames, index: int, chunk: int, seq: int, request: StartRequest) -> int:
        for pixels in frames:
            header = {"kind": "frame", "stream": self.stream, "index": index, "chunk": chunk,
                      "t": round(index / request.fps, 6), "action": seq, "format": request.format}
            self._outbox.append(QueuedFrame(self.stream, header, pixels))
            index += 1
        self._queued.set()
        return index

    def _chunk_head(self, session, keyboard, mouse) -> np.ndarray:
        return session.begin_step(keyboard, mouse)

    def _chunk_tail(self, session, keyboard, mouse, head, recording) -> np.ndarray:
        chunk = session.chunk
        rest = session.end_step()
        frames = np.concatenate([head, rest])
        if self.play.on_chunk is not None:
            self.play.on_chunk(chunk, frames, keyboard, mouse)
        if recording is not None:
            recording.append(frames)
        return rest

    # ---- recording -------------------------------------------------------------------

    async def follow_recording(self) -> None:
        if self._record and self._recording is None:
            self._recording = Recording(self.pipe.variant.fps)  # a folder and a name: ffmpeg starts with the frames
            await self.send_state()
        elif not self._record and self._recording is not None:
            recording, self._recording = self._recording, None
            try:
                frames, data = await self.work(recording.finish)
            except Exception as e:  # noqa: BLE001 - an encoder failure is reported; the stream goes on
                log.exception("finishing a recording failed")
                await self.error(f"the recording could not be written: {one_line(e)}")
                return
            await self.send_state()
            if data is None:
                await self.error("nothing was recorded: record while frames arrive")
            else:
                await self.send_bytes(pack({"kind": "video", "frames": frames, "name": recording.name}, data))

    def close(self) -> None:
        """The socket is gone: a recording in progress is dropped (after the chunk its thread may still add)."""
        if self._recording is not None:
            recording, self._recording = self._recording, None
            self.play.executor.submit(recording.finish, False)


class Recording:
    """A stream's frames encoded into an mp4 as they are made (`wan_tpu.runtime.video.VideoWriter`), in a
    folder of its own; `finish` gives the file and removes the folder."""

    def __init__(self, fps: int):
        from wan_tpu.runtime.video import VideoWriter

        self.folder = tempfile.mkdtemp(prefix="wan_tpu-play-")
        self.name = time.strftime("matrix-game-%Y%m%d-%H%M%S.mp4")
        self._stack = contextlib.ExitStack()
        self._writer = self._stack.enter_context(VideoWriter(os.path.join(self.folder, self.name), fps))
        self._lock = threading.Lock()  # a closed tab's recording is finished in another thread than its last chunk's
        self._open = True

    def append(self, frames: np.ndarray) -> None:
        with self._lock:
            if self._open:
                self._writer.append(frames)

    def finish(self, keep: bool = True) -> tuple[int, bytes | None]:
        """(frames, the mp4's bytes, or None when nothing was recorded or `keep` is False)."""
        with self._lock:
            if not self._open:
                return 0, None
            self._open = False
            try:
                if keep:
                    self._stack.close()
                else:
                    self._stack.__exit__(ConnectionError, ConnectionError("the page closed"), None)
                path = os.path.join(self.folder, self.name)
                if not keep or not os.path.exists(path):
                    return self._writer.frames, None
                with open(path, "rb") as f:
                    return self._writer.frames, f.read()
            finally:
                shutil.rmtree(self.folder, ignore_errors=True)
