"""The ASGI app (Starlette): the OpenAI Videos API for Wan models, UnifoLM's `/predict_action`, the
Matrix-Game-2 live page, and `/healthz`, `/metrics`.

    POST   /v1/videos                 create a job (multipart form as the openai client sends it, or JSON)
    GET    /v1/videos                 list jobs: after, limit (1..100, default 20), order (asc | desc)
    GET    /v1/videos/{id}            a job: status queued | in_progress | completed | failed, progress 0..100
    DELETE /v1/videos/{id}            cancel (at the next safe point) and delete it with its files
    GET    /v1/videos/{id}/content    the mp4 (variant=thumbnail: a JPEG of the first frame); 409 until completed
    POST   /predict_action            UnifoLM-WMA: the authors' robot client protocol (`wan_tpu.unifolm.server`)
    GET    /  →  /play, /play/ws      Matrix-Game-2: the live page and its WebSocket (`wan_tpu.serve.play`)
    GET    /healthz                   liveness, without the API key
    GET    /metrics                   Prometheus text

Errors have the OpenAI shape `{"error": {"message", "type", "param", "code"}}` (one-line messages; 400
for bad input, 401 for a missing or wrong key, 404, 409, 413 for a body over the limit, 429 when the
queue is full, 503 while draining); `/predict_action` answers in the authors' shape `{"result": "error",
"desc"}`. Every request is one JSON line in the access log.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from wan_tpu.errors import WanInputError
from wan_tpu.serve.metrics import CONTENT_TYPE, Metrics, route_label

PREDICT = "/predict_action"
COOKIE = "wan_tpu_api_key"
OPEN = ("/healthz",)  # the only route answered without the API key
POLL_AFTER_MS = "250"


@dataclass
class ServerState:
    """What the routes share. `family`: "wan", "matrix-game" or "unifolm"."""

    family: str
    model_name: str
    pipe: object = None
    store: object = None  # `wan_tpu.serve.store.JobStore` (Wan)
    worker: object = None  # `wan_tpu.serve.worker.Worker` (Wan)
    videos: object = None  # `wan_tpu.serve.videos.WanVideos` (Wan)
    api_key: str | None = None
    queue_size: int = 32
    max_body: int = 64 * 2**20
    predict_options: dict = field(default_factory=dict)  # UnifoLM: num_steps, eta, seed, fs
    max_sessions: int = 1  # Matrix-Game live sessions
    device_lock: threading.Lock = field(default_factory=threading.Lock)
    metrics: Metrics | None = None
    log: object = None  # callable(**fields): one structured line
    draining: bool = False


def api_error(status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
              param: str | None = None, headers: dict | None = None) -> JSONResponse:
    retry = {"x-should-retry": "true" if status in (429, 503) else "false"}
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status,
                        headers={**retry, **(headers or {})})


def predict_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"result": "error", "desc": message}, status)


def error_for(path: str, status: int, message: str, **kwargs) -> JSONResponse:
    return predict_error(status, message) if path == PREDICT else api_error(status, message, **kwargs)


def video_object(job, model_name: str) -> dict:
    r = job.request
    failed = job.status == "failed"
    return {"id": job.id, "object": "video", "created_at": job.created_at, "completed_at": job.completed_at,
            "expires_at": None, "model": model_name, "progress": 100 if job.status == "completed" else job.progress,
            "prompt": r["prompt"], "remixed_from_video_id": None, "seconds": r["seconds"],
            "size": f"{r['width']}x{r['height']}", "status": job.status,
            "error": {"code": job.error_code, "message": job.error_message} if failed else None}


# ---- the Videos API ---------------------------------------------------------------------------


async def _fields(request: Request) -> tuple[dict, bytes | None]:
    """The create request's fields and the uploaded image's bytes, from a multipart form or a JSON body."""
    from wan_tpu.serve.videos import image_from_reference

    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fields, image = {}, None
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form(max_files=1, max_fields=64)
        try:
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if key != "input_reference":
                        raise WanInputError(f"unexpected file field {key!r}; upload the image as input_reference")
                    image = await value.read()
                elif key == "input_reference[image_url]":
                    image = image_from_reference({"image_url": value})
                elif key.endswith("[]"):
                    fields.setdefault(key[:-2], []).append(value)
                else:
                    fields[key] = value
        finally:
            await form.close()
    elif kind == "application/json":
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WanInputError(f"the body is not JSON ({' '.join(str(e).split())[:120]})") from None
        if not isinstance(body, dict):
            raise WanInputError("the body must be a JSON object")
        fields = dict(body)
        if "input_reference" in fields:
            image = image_from_reference(fields.pop("input_reference"))
    else:
        raise WanInputError("send the request as multipart/form-data (as the openai client does) or application/json")
    return fields, image


def _check(state: ServerState, fields: dict, data: bytes | None):
    from wan_tpu.serve.videos import decode_image

    image = None if data is None else decode_image(data)
    return state.videos.check(fields, image), image


async def create_video(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    if state.draining:
        return api_error(503, "the server is shutting down; send the request to another server or retry later",
                         type="server_error", code="shutting_down")
    try:
        fields, data = await _fields(request)
        job_request, image = await run_in_threadpool(_check, state, fields, data)
    except WanInputError as e:
        return api_error(400, str(e), code="invalid_request")
    except ClientDisconnect:  # the client left before its body arrived: nothing was accepted
        return api_error(400, "the connection closed before the whole body arrived", code="incomplete_body")
    from wan_tpu.serve.videos import save_png

    job_id = state.store.new_id()
    if image is not None:
        save_png(state.store.input_path(job_id), image)
    job = state.store.add(job_id, job_request, max_queued=state.queue_size)
    if job is None:
        state.store.remove_files(job_id)
        return api_error(429, f"the queue is full ({state.queue_size} jobs waiting); retry later",
                         type="rate_limit_error", code="queue_full", headers={"retry-after": "1"})
    state.worker.notify()
    return JSONResponse(video_object(job, state.model_name))


def _job_or_404(state: ServerState, video_id: str):
    job = state.store.get(video_id)
    if job is None:
        raise HTTPException(404, f"no video {video_id}; list the videos with GET /v1/videos")
    return job


async def retrieve_video(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    job = _job_or_404(state, request.path_params["video_id"])
    headers = {"openai-poll-after-ms": POLL_AFTER_MS} if job.status in ("queued", "in_progress") else None
    return JSONResponse(video_object(job, state.model_name), headers=headers)


async def list_videos(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        return api_error(400, f"order must be asc or desc, got {order!r}", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        return api_error(400, f"limit must be an integer from 1 to 100, got {q.get('limit')!r}", param="limit")
    page = state.store.list(after=q.get("after"), limit=limit, order=order)
    if page is None:
        return api_error(400, f"after names no video ({q.get('after')!r}); pass the last id of the previous page",
                         param="after")
    jobs, more = page
    return JSONResponse({"object": "list", "data": [video_object(j, state.model_name) for j in jobs],
                         "first_id": jobs[0].id if jobs else None, "last_id": jobs[-1].id if jobs else None,
                         "has_more": more})


async def delete_video(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    job = _job_or_404(state, request.path_params["video_id"])
    await run_in_threadpool(state.worker.delete, job.id)
    return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})


async def video_content(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    job = _job_or_404(state, request.path_params["video_id"])
    variant = request.query_params.get("variant", "video")
    if variant not in ("video", "thumbnail"):
        return api_error(400, f"variant {variant!r} is not served; pass variant=video or variant=thumbnail", param="variant")
    if job.status != "completed":
        why = f"failed ({job.error_message})" if job.status == "failed" else f"{job.status} ({job.progress}%)"
        return api_error(409, f"video {job.id} is {why}; download it once its status is completed", code="video_not_ready")
    path = state.store.video_path(job.id) if variant == "video" else state.store.thumbnail_path(job.id)
    if not os.path.isfile(path):
        raise HTTPException(404, f"no video {job.id}; list the videos with GET /v1/videos")
    return FileResponse(path, media_type="video/mp4" if variant == "video" else "image/jpeg")


# ---- UnifoLM-WMA ------------------------------------------------------------------------------


async def predict_action_route(request: Request) -> Response:
    from wan_tpu.unifolm.server import one_line, predict_action

    state: ServerState = request.app.state.serve
    try:
        payload = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return predict_error(400, f"the body is not JSON: {one_line(e)}")

    def run():
        with state.device_lock:
            return predict_action(state.pipe, payload, **state.predict_options)

    status, response = await run_in_threadpool(run)
    return JSONResponse(response, status)


# ---- operations -------------------------------------------------------------------------------


async def healthz(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    return JSONResponse({"status": "draining" if state.draining else "ok", "model": state.model_name,
                         "family": state.family})


async def metrics_route(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    text = await run_in_threadpool(state.metrics.text)
    return Response(text, media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404 and not request.url.path.startswith("/v1/videos/"):
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_for(request.url.path, exc.status_code, message, code="not_found" if exc.status_code == 404 else None)


def build_app(state: ServerState) -> Starlette:
    routes = [Route("/healthz", healthz), Route("/metrics", metrics_route)]
    if state.family == "wan":
        routes += [Route("/v1/videos", create_video, methods=["POST"]),
                   Route("/v1/videos", list_videos, methods=["GET"]),
                   Route("/v1/videos/{video_id}", retrieve_video, methods=["GET"]),
                   Route("/v1/videos/{video_id}", delete_video, methods=["DELETE"]),
                   Route("/v1/videos/{video_id}/content", video_content, methods=["GET"])]
    elif state.family == "unifolm":
        routes.append(Route(PREDICT, predict_action_route, methods=["POST"]))
    elif state.family == "matrix-game":
        routes += [Route("/", to_play), *matrix_game_routes(state)]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.serve = state
    return Guard(app, state)


async def to_play(request: Request) -> Response:
    """`/` of a Matrix-Game server is its live page (the query, e.g. `api_key`, kept)."""
    return RedirectResponse("/play" + (f"?{request.url.query}" if request.url.query else ""))


def matrix_game_routes(state: ServerState) -> list:
    """The live page and WebSocket of `wan_tpu.serve.play` (imported only for a Matrix-Game model)."""
    try:
        from wan_tpu.serve import play
    except ModuleNotFoundError as e:
        if e.name != "wan_tpu.serve.play":
            raise
        raise WanInputError("this installation has no Matrix-Game live page (wan_tpu.serve.play); serve a Wan or "
                            "UnifoLM model, or play with wan-matrix-game --interactive") from None
    return list(play.play_routes(state.pipe, max_sessions=state.max_sessions))


def _with_cookie(send, key: str):
    async def send_cookie(message):
        if message["type"] == "http.response.start":
            cookie = f"{COOKIE}={key}; HttpOnly; SameSite=Strict; Path=/".encode("latin-1")
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
        await send(message)

    return send_cookie


class Guard:
    """ASGI middleware around every request: the API key, the body size limit, the access log line and the
    request metrics."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            if self._authorized(scope, page=True) is None:
                await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
                return
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path, method = scope["path"], scope["method"]
        sent = {"status": None, "bytes": 0}

        async def send_logged(message):
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body":
                sent["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self._guarded(scope, receive, send_logged, path, method)
        finally:
            status = sent["status"] or 500
            seconds = time.perf_counter() - started
            route = route_label(path)
            if self.state.metrics is not None:
                self.state.metrics.requests.labels(route, method, str(status)).inc()
                self.state.metrics.latency.labels(route).observe(seconds)
            if self.state.log is not None:
                client = scope.get("client")
                self.state.log(event="request", method=method, path=path, status=status, ms=round(1000 * seconds, 2),
                               bytes=sent["bytes"], client=client[0] if client else None)

    def _authorized(self, scope, page: bool = False) -> str | None:
        """How the request proved the key ("open", "header", "query", "cookie"), None if it did not. `page`: a
        browser's request (the live page, its files, its WebSocket), which cannot send headers: the key may
        come as `?api_key=`, after which a cookie carries it."""
        key = self.state.api_key
        if not key or scope["path"] in OPEN:
            return "open"
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode()):
            return "header"
        if not page:
            return None
        from http.cookies import SimpleCookie
        from urllib.parse import parse_qs

        for value in parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", []):
            if hmac.compare_digest(value.encode(), key.encode()):
                return "query"
        cookie = SimpleCookie(headers.get(b"cookie", b"").decode("latin-1")).get(COOKIE)
        return "cookie" if cookie is not None and hmac.compare_digest(cookie.value.encode(), key.encode()) else None

    async def _guarded(self, scope, receive, send, path, method):
        how = self._authorized(scope, page=method == "GET" and not path.startswith(("/v1/", "/metrics")))
        if how is None:
            response = error_for(path, 401, "missing or wrong API key; send the header Authorization: Bearer KEY",
                                 type="authentication_error", code="invalid_api_key")
            await response(scope, receive, send)
            return
        if how == "query":
            send = _with_cookie(send, self.state.api_key)
        limit = self.state.max_body
        headers = dict(scope.get("headers") or [])
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            length = -1
        if length < 0 or length > limit:
            response = error_for(path, 413 if length > limit else 400,
                                 f"the body must have a Content-Length of at most {limit} bytes", code="body_too_large")
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        received = 0

        async def counted():
            # A body without a Content-Length (chunked) is counted as it arrives; the route's error handler
            # answers the 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"the body must be at most {limit} bytes")
            return message

        await self.app(scope, counted, send)
