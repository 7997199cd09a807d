"""The server for the world models: a Matrix-Game-2 model mounts the live page (`wan_tpu.serve.play`) behind
the API key; `wan-unifolm --serve PORT` becomes `wan-serve` with the same model and flags and answers the
authors' `/predict_action` (the protocol itself: `tests/unifolm/test_unifolm.py`)."""

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from wan_tpu.serve import cli as serve_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_family_comes_from_the_model():
    assert [serve_cli.detect_family(m) for m in ("tiny", "matrix-game-tiny", "unifolm-tiny", "unifolm-tiny-base",
                                                  "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")] == \
        ["wan", "matrix-game", "unifolm", "unifolm", "wan"]


def test_a_matrix_game_model_serves_the_live_page_behind_the_key():
    pytest.importorskip("wan_tpu.serve.play")
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline
    from wan_tpu.serve.app import build_app

    pipe = MatrixGamePipeline.from_pretrained("matrix-game-tiny")
    state = serve_cli.make_state("matrix-game", pipe, "matrix-game-tiny", api_key="k", log=lambda **_: None)
    app = build_app(state)
    with pytest.raises(WebSocketDisconnect):
        with TestClient(app).websocket_connect("/play/ws") as ws:
            ws.receive_text()
    http = TestClient(app)
    assert http.get("/play").status_code == 401
    page = http.get("/?api_key=k")  # redirected to /play, and the key kept in a cookie for the page's own requests
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert http.get("/play/examples").status_code == 200
    assert http.get("/v1/videos").status_code == 401  # the API takes the header only
    missing = http.get("/v1/videos", headers={"Authorization": "Bearer k"})
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_unifolm_serve_flag_starts_the_server(tmp_path):
    """`python -m wan_tpu.unifolm --serve 0` execs `python -m wan_tpu.serve` with the same flags: it listens
    on 127.0.0.1, answers a bad request in the authors' shape with one line, and SIGTERM ends it with 143."""
    from wan_tpu.unifolm.cli import build_parser
    from wan_tpu.unifolm.server import serve_argv

    args = build_parser().parse_args(["--serve", "8123", "--steps", "2", "--fs", "5", "--eta", "0.5",
                                      "--sampling-programs", "3"])
    served = serve_cli.build_parser().parse_args(serve_argv(args))
    assert (served.family, served.model, served.port, served.steps, served.fs, served.eta, served.seed, served.dtype,
            served.host, served.sampling_programs) == ("unifolm", "unifolm-tiny", 8123, 2, 5, 0.5, 123, "float32",
                                                       "127.0.0.1", 3)

    proc = subprocess.Popen([sys.executable, "-m", "wan_tpu.unifolm", "--serve", "0", "--steps", "2"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:") and "(unifolm: unifolm-tiny)" in line, line
        request = urllib.request.Request(line.split()[1] + "/predict_action", b"{not json",
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=60)
        reply = json.loads(answer.value.read())
        assert answer.value.code == 400 and reply["result"] == "error" and "not JSON" in reply["desc"]
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(120)
    assert status == 143 and proc.stderr.read().strip().splitlines()[-1].startswith("interrupted")
    assert os.listdir(tmp_path) == []


def test_the_readme_play_commands_run_as_written(tmp_path):
    """The README's "Play Matrix-Game-2 live" commands: each parses; the preset one (on a free port rather
    than 8000) serves the page and ends with 143 on SIGTERM, leaving nothing behind."""
    import re
    import shlex

    readme = open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "README.md"), encoding="utf-8").read()
    start = readme.index("\n## Play Matrix-Game-2 live\n")
    (block,) = re.findall(r"```sh\n(.*?)```", readme[start:readme.index("\n## ", start + 1)], re.S)
    commands = [shlex.split(line, comments=True) for line in block.strip().splitlines()]
    serves = [c for c in commands if c[:3] == ["python", "-m", "wan_tpu.serve"]]
    assert [serve_cli.build_parser().parse_args(c[3:]).model for c in serves] == ["mg2", "matrix-game-tiny"]
    proc = subprocess.Popen([sys.executable, *serves[1][1:], "--port", "0"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        with urllib.request.urlopen(line.split()[1] + "/play", timeout=60) as page:
            assert page.status == 200 and "text/html" in page.headers["content-type"]
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(120)
    assert status == 143
    assert os.listdir(tmp_path) in ([], ["wan_serve"])
