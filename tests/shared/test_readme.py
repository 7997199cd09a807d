"""The README runs as written on a one-device CPU machine: its Python API snippet (in a fresh process
with one device, in an empty folder) and every command of its `bash` blocks that runs on a preset
(install-and-run, stages, many videos, the Matrix-Game-2 and UnifoLM-WMA presets), each in a process of its
own, in one empty folder, in the README's order; the first one twice, since it must run again as it is.
Left out: the `pip` and `pytest` lines (CI runs those itself) and the commands that need a download or a
real checkpoint (`--model` naming a folder or model id, `hf download`, the converters). A console script
runs as its installed wrapper runs it (the target in `pyproject.toml`'s `[project.scripts]`), `python ...`
with this interpreter, anything else in a shell."""

import os
import re
import shlex
import subprocess
import sys
import tomllib

import imageio.v3 as iio
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    SCRIPTS = tomllib.load(f)["project"]["scripts"]
PRESETS = {"tiny", "matrix-game-tiny", "unifolm-tiny", "unifolm-tiny-base"}


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:] if end < 0 else README[start:end]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_python_api_snippet_runs_as_written(tmp_path):
    (snippet,) = blocks(section("Python API"), "python")
    env = {**os.environ, "XLA_FLAGS": os.environ["ONE_DEVICE_XLA_FLAGS"]}  # one CPU device
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["clip_0.mp4", "clip_1.mp4"]


def test_unifolm_python_snippet_runs_as_written(tmp_path):
    """The UnifoLM-WMA API, whole calls and stage by stage, on the unifolm-tiny preset."""
    (snippet,) = blocks(section("UnifoLM-WMA (robot world model + actions)"), "python")
    checks = ("\nassert out.video.shape == (16, 128, 128, 3) and out.actions.shape == (16, 7)"
              "\nassert sim.states.shape == (16, 7) and len(episode.decisions) == 1"
              "\nassert video.shape == (1, 3, 16, 128, 128) and np.isfinite(np.asarray(video)).all()")
    proc = subprocess.run([sys.executable, "-c", snippet + checks], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_matrix_game_python_snippet_runs_as_written(tmp_path):
    (snippet,) = blocks(section("Matrix-Game-2: playing from an image"), "python")
    checks = "\nassert video.shape[0] == 21 and video.dtype == np.uint8 and frames.shape[0] == 9 and (len(first), len(rest)) == (4, 8)"
    proc = subprocess.run([sys.executable, "-c", snippet + checks], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _process(command: str) -> list[str] | None:
    """The process a command line starts, with this interpreter: a console script as its wrapper runs it
    (`sys.exit(func())` of its `pyproject.toml` target), `python ...` as it is; None: a shell line."""
    argv = shlex.split(command, comments=True)
    if argv[0] in SCRIPTS:
        module, _, func = SCRIPTS[argv[0]].partition(":")
        return [sys.executable, "-c", f"import sys; sys.argv[0] = {argv[0]!r}; from {module} import {func}; "
                                      f"sys.exit({func}())", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return None


def _run(command: str, cwd) -> None:
    env = {**os.environ, "XLA_FLAGS": os.environ["ONE_DEVICE_XLA_FLAGS"]}  # one CPU device
    argv = _process(command)
    proc = subprocess.run(command if argv is None else argv, shell=argv is None, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _needs_download(command: str) -> bool:
    argv = shlex.split(command, comments=True)
    if argv[0] in ("pip", "hf", "ruff") or argv[0].startswith("wan-convert-") or argv[1:3] == ["-m", "pytest"]:
        return True
    models = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--model", "--ckpt_dir")]
    return any(m not in PRESETS for m in models)


def readme_commands() -> list[str]:
    commands = []
    for block in blocks(README, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            commands += [c.strip() for c in line.split("&&") if c.strip() and not c.strip().startswith("#")]
    return [c for c in commands if not _needs_download(c)]


def test_readme_commands_run_as_written(tmp_path):
    # The inputs the preset commands name: any picture, and an observation at unifolm-tiny's size.
    iio.imwrite(tmp_path / "img.png", np.random.default_rng(0).integers(0, 256, (96, 160, 3), dtype=np.uint8))
    np.savez(tmp_path / "obs.npz", images=np.zeros((2, 128, 128, 3), np.uint8), states=np.zeros((2, 16), np.float32))
    commands = readme_commands()
    assert len(commands) == 8, commands
    assert commands[0].startswith("python -m wan_tpu.generate --model tiny") and "--overwrite" in commands[0]
    for command in commands + commands[:1]:
        _run(command, tmp_path)
    assert {"tiny.mp4", "cat.mp4", "cat_001.mp4", "cat_002.mp4", "stage1.safetensors", "stage2.safetensors",
            "o.mp4", "unifolm.mp4"} <= set(os.listdir(tmp_path))


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs exactly the README's install-lint-test line."""
    line = next(x for x in README.splitlines() if "pytest" in x and x.startswith("pip install"))
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert line in ci.splitlines()
