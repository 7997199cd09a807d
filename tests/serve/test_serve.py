"""The video server (`wan_tpu/serve/`) on a loopback port, driven by the official `openai` client: the videos
it makes equal the Python API's, the job lifecycle (retrieve, list, delete, cancel), the error shapes, the
API key, `/metrics`, the access log, and a small run of the load benchmark."""

import json
import os
import sys
import threading
import time

import numpy as np
import pytest
from starlette.testclient import TestClient

from wan_tpu.errors import WanInputError
from wan_tpu.runtime.video import read_video, write_video

openai = pytest.importorskip("openai")
# The openai client marks its Videos API deprecated (its own service's end), not the protocol this server speaks.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def client(wan_server):
    return openai.OpenAI(base_url=wan_server.url + "/v1", api_key="unused", max_retries=0)


def _decoded(data: bytes, tmp_path, name: str, fps: int = 16) -> np.ndarray:
    path = tmp_path / name
    path.write_bytes(data)
    frames, written_fps = read_video(str(path))
    assert written_fps == fps
    return frames


def _idle(worker, timeout=60):
    """Until no job runs (a deleted one runs on to its next step) and the store holds none queued or in progress:
    a job goes from queued to in progress in one update before the worker names it `running`, so between the
    two the name and the queue alone would both miss it."""
    deadline = time.monotonic() + timeout
    while worker.running is not None or (counts := worker.store.counts())["queued"] or counts["in_progress"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_openai_client_video_equals_the_python_api(client, wan_pipe, wan_server, tmp_path):
    """`create_and_poll` + `download_content` give a playable mp4 whose frames are those of the same run
    through `WanPipeline` written by `write_video` (bit for bit after decoding); the thumbnail is frame 0."""
    video = client.videos.create_and_poll(prompt="a cat walks on the grass", size="64x64",
                                          extra_body={"seed": 7, "negative_prompt": "blurry", "guidance": 4.0},
                                          poll_interval_ms=50)
    assert (video.status, video.progress, video.size, video.model, video.seconds) == ("completed", 100, "64x64", "tiny",
                                                                                         "0.3125")
    served = _decoded(client.videos.download_content(video.id).content, tmp_path, "served.mp4")
    frames = wan_pipe("a cat walks on the grass", negative_prompt="blurry", guidance_scale=4.0, seed=7, progress=False)
    write_video(str(tmp_path / "api.mp4"), frames, fps=16)
    expected, _ = read_video(str(tmp_path / "api.mp4"))
    assert served.shape == (5, 64, 64, 3)
    np.testing.assert_array_equal(served, expected)
    from PIL import Image

    (tmp_path / "thumb.jpg").write_bytes(client.videos.download_content(video.id, variant="thumbnail").content)
    Image.fromarray(frames[0]).save(tmp_path / "first.jpg", format="JPEG", quality=90)
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "thumb.jpg")), np.asarray(Image.open(tmp_path / "first.jpg")))


def test_retrieve_list_pages_and_delete(client, wan_server):
    ids = [client.videos.create(prompt=f"clip {i}", extra_body={"seed": i}).id for i in range(3)]
    assert all(client.videos.retrieve(i).status in ("queued", "in_progress", "completed") for i in ids)
    _idle(wan_server.state.worker)
    first = client.videos.list(limit=2, order="asc")
    assert len(first.data) == 2 and first.has_more
    every = [v.id for v in client.videos.list(limit=2, order="asc")]
    assert every[-3:] == ids and len(every) == len(set(every))
    assert [v.id for v in client.videos.list(limit=3, order="desc").data] == ids[::-1]
    store = wan_server.state.store
    assert os.path.isfile(store.video_path(ids[0]))
    deleted = client.videos.delete(ids[0])
    assert deleted.deleted and deleted.id == ids[0] and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(ids[0])
    assert not os.path.exists(store.video_path(ids[0])) and not os.path.exists(store.thumbnail_path(ids[0]))


def test_delete_stops_a_running_job_at_its_next_step(client, wan_server, monkeypatch):
    """A job paused inside its second denoise step (progress 25% of 4 steps) is deleted: it stops at the step's
    end, writes nothing and is gone."""
    state = wan_server.state
    monkeypatch.setattr(state.videos, "run", state.videos.run)  # undone after the test: the gate goes
    inside, release = _gated(state, 2)
    video = client.videos.create(prompt="stopped half way", extra_body={"seed": 99})
    assert inside.wait(60)
    running = client.videos.retrieve(video.id)
    assert (running.status, running.progress) == ("in_progress", 25)
    assert client.videos.delete(video.id).deleted
    release.set()
    _idle(state.worker)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    assert not [n for n in os.listdir(state.store.videos) if video.id in n]
    assert any(line.get("event") == "job_deleted" and line["id"] == video.id for line in wan_server.log)


def _gated(state, at_step: int):
    """Make the state's jobs wait inside denoise step `at_step` (events: `inside` set there, `release` lets it go on)."""
    inside, release = threading.Event(), threading.Event()
    run = state.videos.run

    def paused(request, image, video, thumbnail, on_step):
        def step(done, total):
            if done == at_step:
                inside.set()
                assert release.wait(30)
            on_step(done, total)

        return run(request, image, video, thumbnail, step)

    state.videos.run = paused
    return inside, release


@pytest.mark.parametrize("grace, outcome", [(30.0, "completed"), (0.0, "queued")])
def test_a_drain_finishes_or_requeues_the_running_job(wan_pipe, tmp_path, grace, outcome):
    """SIGTERM's drain: the job inside its second step finishes within a long grace, or, with none, stops at
    that step's end and goes back to the queue (progress 0); the job behind it is not started either way."""
    from wan_tpu.serve.cli import make_state

    state = make_state("wan", wan_pipe, "tiny", output=str(tmp_path), log=lambda **_: None)
    inside, release = _gated(state, 2)
    running = state.store.add(state.store.new_id(), state.videos.check({"prompt": "drained"}, None))
    behind = state.store.add(state.store.new_id(), state.videos.check({"prompt": "behind"}, None))
    state.worker.start()
    assert inside.wait(60)
    state.worker.drain(grace)
    release.set()
    assert state.worker.join(60)
    job = state.store.get(running.id)
    assert (job.status, job.progress) == ((outcome, 100) if outcome == "completed" else (outcome, 0))
    assert os.path.isfile(state.store.video_path(running.id)) == (outcome == "completed")
    assert state.store.get(behind.id).status == "queued"


def test_metrics_parse_and_every_request_is_logged(wan_server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.videos.create_and_poll(prompt="counted", poll_interval_ms=50)
    import httpx

    response = httpx.get(wan_server.url + "/metrics")
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("wan_serve_jobs", (("state", "completed"),))] >= 1
    assert ("wan_serve_queue_depth", ()) in samples
    assert samples[("wan_serve_step_seconds_count", ())] >= 4
    assert ("wan_serve_compile_cache_hits", ()) in samples
    assert samples[("wan_serve_requests_total", (("method", "POST"), ("route", "/v1/videos"), ("status", "200")))] >= 1
    requests = [line for line in wan_server.log if line.get("event") == "request"]
    assert {"/v1/videos", "/metrics"} <= {line["path"] for line in requests}
    assert all(set(line) >= {"method", "path", "status", "ms", "client"} for line in requests)


@pytest.fixture(scope="module")
def paused(wan_pipe, tmp_path_factory):
    """An app whose worker never starts (jobs stay queued), a queue of 1 and a 4 KiB body limit, in process."""
    from wan_tpu.serve.app import build_app
    from wan_tpu.serve.cli import make_state

    state = make_state("wan", wan_pipe, "tiny", output=str(tmp_path_factory.mktemp("paused")), queue_size=1,
                       max_body=4096, log=lambda **_: None)
    with TestClient(build_app(state)) as http:
        http.state = state
        yield http


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return error


def test_bad_requests_answer_in_the_api_error_shape(paused, wan_pipe):
    """400 with the pipeline's own one-line messages, 404, 409, 413, 429; nothing queued by a refused request."""
    with pytest.raises(WanInputError) as cli_message:
        wan_pipe.settings(width=63, height=64)
    assert _error(paused.post("/v1/videos", json={"prompt": "x", "size": "63x64"}), 400)["message"] == str(cli_message.value)
    for body, message in [({"prompt": "x", "colour": "red"}, "unknown field colour"),
                          ({"size": "64x64"}, "prompt is required"),
                          ({"prompt": "x", "frames": 6}, "is not 4n+1"),
                          ({"prompt": "x", "seconds": "2", "frames": 5}, "not both"),
                          ({"prompt": "x", "steps": "many"}, "steps must be an integer"),
                          ({"prompt": "x", "seed": -1}, "seed must be an integer from 0"),
                          ({"prompt": "x", "lora": "fast"}, "was not loaded at start"),
                          ({"prompt": "x", "model": "sora-2"}, "serves 'tiny'"),
                          ({"prompt": "x", "scheduler": "ddim"}, "scheduler 'ddim'"),
                          ({"prompt": "x", "input_reference": {"image_url": "https://example.com/a.png"}}, "fetches no URL")]:
        assert message in _error(paused.post("/v1/videos", json=body), 400)["message"], body
    png = paused.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", b"not a png", "image/png")})
    assert "cannot be read as an image" in _error(png, 400)["message"]
    t2v = paused.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", _png(), "image/png")})
    assert "takes no image" in _error(t2v, 400)["message"]
    assert "not JSON" in _error(paused.post("/v1/videos", content=b"{", headers={"content-type": "application/json"}), 400)["message"]
    assert _error(paused.post("/v1/videos", json={"prompt": "x" * 5000}), 413)["code"] == "body_too_large"
    assert paused.state.store.counts()["queued"] == 0 and not os.listdir(paused.state.store.inputs)

    queued = paused.post("/v1/videos", json={"prompt": "waits"})
    assert queued.status_code == 200 and queued.json()["status"] == "queued"
    full = paused.post("/v1/videos", json={"prompt": "one too many"})
    assert _error(full, 429)["code"] == "queue_full" and full.headers["retry-after"]
    job = queued.json()["id"]
    assert "is queued" in _error(paused.get(f"/v1/videos/{job}/content"), 409)["message"]
    assert _error(paused.get(f"/v1/videos/{job}/content?variant=spritesheet"), 400)["param"] == "variant"
    assert _error(paused.get("/v1/videos/video_" + "0" * 32), 404)["code"] == "not_found"
    assert _error(paused.get("/v1/videos/../../etc/passwd"), 404)["code"] == "not_found"
    assert _error(paused.get("/v1/videos?limit=0"), 400)["param"] == "limit"
    assert _error(paused.get("/v1/videos?after=video_nope"), 400)["param"] == "after"
    assert _error(paused.delete("/v1/videos/video_" + "1" * 32), 404)
    assert paused.delete(f"/v1/videos/{job}").json()["deleted"]
    assert paused.state.store.counts()["queued"] == 0
    assert _error(paused.post("/v1/nothing"), 404)


def _png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_api_key_is_checked_on_every_route_but_healthz(wan_pipe, tmp_path):
    from wan_tpu.serve.app import build_app
    from wan_tpu.serve.cli import make_state

    state = make_state("wan", wan_pipe, "tiny", output=str(tmp_path), api_key="s3cret", log=lambda **_: None)
    http = TestClient(build_app(state))
    assert http.get("/healthz").json()["status"] == "ok"
    for method, path in (("get", "/v1/videos"), ("get", "/metrics"), ("post", "/v1/videos"),
                         ("get", "/v1/videos/video_" + "0" * 32 + "/content")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert _error(getattr(http, method)(path, headers=headers), 401)["code"] == "invalid_api_key"
    assert http.get("/v1/videos", headers={"Authorization": "Bearer s3cret"}).json()["data"] == []


def test_the_command_refuses_a_public_address_without_a_key(tmp_path, capsys, monkeypatch):
    from wan_tpu.serve.cli import main

    monkeypatch.delenv("WAN_TPU_API_KEY", raising=False)
    assert main(["--host", "0.0.0.0", "--output", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key" in err and not (tmp_path / "store").exists()
    import socket

    taken = socket.create_server(("127.0.0.1", 0))
    for argv, message in ((["--port", "70000"], "--port"), (["--lora", "nofile"], "NAME=PATH"),
                          (["--port", str(taken.getsockname()[1]), "--output", str(tmp_path / "s")], "cannot listen"),
                          (["--model", "nope", "--port", "0", "--output", str(tmp_path / "s")], "neither a checkpoint folder"),
                          (["--lora", f"a={tmp_path / 'missing.safetensors'}"], "does not exist"),
                          (["--output", __file__], "is a file")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    taken.close()
    assert os.listdir(tmp_path) == []


def test_one_server_per_store_folder(wan_server):
    from wan_tpu.serve.store import JobStore

    with pytest.raises(WanInputError, match="another server uses"):
        JobStore(wan_server.state.store.folder)


def test_a_small_load_loses_nothing(wan_server):
    """The load benchmark's run, bounded: 3 clients, 6 jobs (one cancelled), their faults; every accepted job
    ends completed with a playable mp4 or was cancelled; no worker or request thread is left behind."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
    import bench_serve_load

    before = {t.name for t in threading.enumerate()}
    result = bench_serve_load.run_load(wan_server.url, clients=3, jobs=6, timeout=120)
    assert result["problems"] == [], result["problems"]
    assert result["outcome"] == {"completed": 5, "cancelled": 1}, result["outcome"]
    assert result["errors"]["413 oversized"] == 3 and result["errors"]["400 malformed size"] == 3
    # Left: at most the server's pooled request threads (anyio's, idle), nothing of the clients or the worker.
    assert {t.name for t in threading.enumerate()} - before <= {"AnyIO worker thread"}
    videos = os.listdir(wan_server.state.store.videos)
    assert not [n for n in videos if n.startswith(".")]
    print(json.dumps({k: result[k] for k in ("requests", "accepted", "outcome", "errors")}))


def test_the_readme_serve_examples_run_as_written(wan_server, tmp_path):
    """The README's Serve section: its start command parses, its curl lines and its `openai` snippet run
    against a server (this module's, at its own port) and give playable videos."""
    import re
    import shlex
    import subprocess

    from wan_tpu.serve.cli import build_parser

    readme = open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("\n## Serve\n"):readme.index("\n## ", readme.index("\n## Serve\n") + 1)]
    (start, curls), (snippet,) = re.findall(r"```sh\n(.*?)```", section, re.S), re.findall(r"```python\n(.*?)```", section, re.S)
    command = shlex.split(start, comments=True)
    assert command[0] == "wan-serve" and build_parser().parse_args(command[1:]).model == "tiny"
    video_id = None
    for line in curls.strip().splitlines():
        line = line.replace("http://127.0.0.1:8000", wan_server.url).replace("VIDEO_ID", str(video_id))
        done = subprocess.run(line, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        if video_id is None:
            video_id = json.loads(done.stdout)["id"]
            _idle(wan_server.state.worker)
    assert read_video(str(tmp_path / "cat.mp4"))[0].shape == (5, 64, 64, 3)
    (tmp_path / "cat.mp4").unlink()
    done = subprocess.run([sys.executable, "-c", snippet.replace("http://127.0.0.1:8000", wan_server.url)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_video(str(tmp_path / "cat.mp4"))[0].shape == (5, 64, 64, 3)


def _random_png(height: int = 40, width: int = 48) -> tuple[np.ndarray, bytes]:
    import io

    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return pixels, buffer.getvalue()


def test_an_image_model_stores_the_uploaded_first_frame(tmp_path):
    """For an image-to-video model (the `tiny-ti2v` preset: the pipeline's own checks, nothing loaded),
    `input_reference` as an upload or as a data URL is decoded, checked and stored by the server as PNG under
    the job's own id; a refused job stores nothing. (What the run does with the image: the next test.)"""
    import base64

    from PIL import Image

    from wan_tpu.serve.app import build_app
    from wan_tpu.serve.cli import make_state
    from wan_tpu.wan.pipeline import WanPipeline

    pipe = WanPipeline.from_pretrained("tiny-ti2v")
    state = make_state("wan", pipe, "tiny-ti2v", output=str(tmp_path / "store"), log=lambda **_: None)
    pixels, png = _random_png()
    http = TestClient(build_app(state))
    uploaded = http.post("/v1/videos", data={"prompt": "x", "size": "64x64", "seconds": "0.25"},
                         files={"input_reference": ("frame.png", png, "image/png")})
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    as_url = http.post("/v1/videos", json={"prompt": "x", "size": "64x64", "frames": 5, "input_reference": {"image_url": url}})
    assert _error(http.post("/v1/videos", json={"prompt": "x", "size": "63x64", "input_reference": {"image_url": url}}), 400)
    for response, frames in ((uploaded, 9), (as_url, 5)):  # 0.25 s at TI2V's 24 fps: 6 frames, taken to 4n+1 = 9
        assert response.status_code == 200, response.text
        job = state.store.get(response.json()["id"])
        assert job.request["image"] and job.request["frames"] == frames
        np.testing.assert_array_equal(np.asarray(Image.open(state.store.input_path(job.id))), pixels)
    assert sorted(os.listdir(state.store.inputs)) == sorted(f"{r.json()['id']}.png" for r in (uploaded, as_url))
    assert not pipe._loaded  # checked from the configs alone


def test_an_image_job_equals_the_cli_run(ti2v_server, tmp_path):
    """`tiny-ti2v` end to end: the `openai` client's `create_and_poll` with an uploaded `input_reference`, then
    `download_content`, gives the frames of `python -m wan_tpu.generate --model tiny-ti2v --image` with the same
    settings (bit for bit after decoding both mp4s); an image that cannot be read is a one-line 400."""
    from wan_tpu.wan.cli import main as generate

    _, png = _random_png()
    (tmp_path / "first.png").write_bytes(png)
    settings = dict(prompt="a cat walks on the grass", negative_prompt="blurry", frames=5, steps=2, seed=5)
    assert generate(["--model", "tiny-ti2v", "--image", str(tmp_path / "first.png"), "--size", "64*64", "--quiet",
                     "--output", str(tmp_path / "cli.mp4"),
                     *(f"--{k.replace('_', '-')}={v}" for k, v in settings.items())]) == 0
    expected, fps = read_video(str(tmp_path / "cli.mp4"))

    client = openai.OpenAI(base_url=ti2v_server.url + "/v1", api_key="unused", max_retries=0)
    video = client.videos.create_and_poll(prompt=settings.pop("prompt"), size="64x64", poll_interval_ms=50,
                                          input_reference=("first.png", png, "image/png"), extra_body=settings)
    assert (video.status, video.model, video.size) == ("completed", "tiny-ti2v", "64x64"), video.error
    served = _decoded(client.videos.download_content(video.id).content, tmp_path, "served.mp4", fps=24)
    assert fps == 24 and served.shape == (5, 64, 64, 3)
    np.testing.assert_array_equal(served, expected)
    inputs = os.listdir(ti2v_server.state.store.inputs)
    with pytest.raises(openai.BadRequestError) as bad:
        client.videos.create(prompt="x", input_reference=("first.png", b"not a png", "image/png"))
    message = bad.value.body["message"]
    assert "input_reference cannot be read as an image" in message and "\n" not in message
    assert os.listdir(ti2v_server.state.store.inputs) == inputs  # the refused upload stored nothing


def test_a_lora_named_at_start_changes_only_its_own_jobs(wan_pipe, tmp_path):
    """`--lora style=FILE`: a job naming it differs from the same job without it; the job after it equals the
    one before (the LoRA is merged for its job and unmerged after it, exactly)."""
    from safetensors.numpy import save_file

    from wan_tpu.serve.app import build_app
    from wan_tpu.serve.cli import make_state

    d = wan_pipe.variant.transformer.inner_dim
    rng = np.random.default_rng(0)
    path = str(tmp_path / "style.safetensors")
    save_file({"diffusion_model.blocks.0.cross_attn.o.lora_down.weight": rng.normal(size=(4, d)).astype(np.float32),
               "diffusion_model.blocks.0.cross_attn.o.lora_up.weight": rng.normal(size=(d, 4)).astype(np.float32)}, path)
    state = make_state("wan", wan_pipe, "tiny", output=str(tmp_path / "store"), loras={"style": (path, 1.0)},
                       log=lambda **_: None)
    http = TestClient(build_app(state))
    ids = [http.post("/v1/videos", json={"prompt": "a cat", "seed": 3, **extra}).json()["id"]
           for extra in ({}, {"lora": "style:0.5"}, {})]
    state.worker.start()
    _idle(state.worker)
    state.worker.drain(0)
    assert state.worker.join(30)
    plain, styled, again = (read_video(state.store.video_path(i))[0] for i in ids)
    np.testing.assert_array_equal(plain, again)
    assert not np.array_equal(plain, styled)
    assert state.store.get(ids[1]).request["lora"] == [["style", 0.5]]
