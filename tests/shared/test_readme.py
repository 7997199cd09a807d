"""The README runs as written on a one-device CPU machine: its Python API snippet (in a fresh process
with one device, in an empty folder) and its `python ...` commands (install-and-run, stages, many
videos; in-process, in an empty folder). The commands that need a real checkpoint (`/ckpt/...`) are
left out, and so are the `pip` and `pytest` lines: CI runs those itself."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

from wan_tpu.wan.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:] if end < 0 else README[start:end]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_python_api_snippet_runs_as_written(tmp_path):
    (snippet,) = blocks(section("Python API"), "python")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["clip_0.mp4", "clip_1.mp4"]


def _run(line: str, cwd) -> int:
    argv = shlex.split(line, comments=True)
    if argv[:3] == ["python", "-m", "wan_tpu.generate"]:
        return main(argv[3:])
    if argv[0] == "python" and argv[1].startswith("scripts/"):
        spec = importlib.util.spec_from_file_location("stage", os.path.join(ROOT, argv[1]))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.cli(module.run, module.parser(), argv[2:])
    return subprocess.run(line, shell=True, cwd=cwd).returncode


def test_readme_commands_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = []
    for title in ("Install and run", "Stages", "Many videos, one process"):
        for block in blocks(section(title), "bash"):
            for line in block.splitlines():
                commands += [c.strip() for c in line.split("&&")
                             if c.strip() and not c.strip().startswith(("pip ", "python -m pytest"))]
    assert len(commands) == 6, commands
    for command in commands:
        assert _run(command, tmp_path) == 0, command
    assert {"tiny.mp4", "cat.mp4", "cat_001.mp4", "cat_002.mp4", "stage1.safetensors", "stage2.safetensors"} <= set(
        os.listdir(tmp_path))
