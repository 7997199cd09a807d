"""How much of a GPU a command line reserves at start (`wan_tpu.runtime.memory.claim_device_memory`): most of
it for Wan, what the run needs for a world model, nothing chosen over the user's own setting."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from wan_tpu.runtime import memory
from wan_tpu.runtime.cli import CliParser, run_cli

GiB = memory.GiB
VARIABLES = (*memory.FRACTION_VARIABLES, "XLA_PYTHON_CLIENT_PREALLOCATE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_most_of_a_gpu_without_a_need(clean_env):
    assert memory.claim_device_memory() == memory.GPU_MEMORY_FRACTION
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == memory.GPU_MEMORY_FRACTION


def test_the_need_rounded_up_to_the_percent_and_capped(clean_env):
    def claim(need, total):
        clean_env.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
        clean_env.setattr(memory, "gpu_total_bytes", lambda: total)
        fraction = memory.claim_device_memory(need)
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == fraction
        return fraction

    assert claim(30 * GiB, 140 * GiB) == "0.22"  # 21.4% → 22%: never below the need
    assert claim(14 * GiB, 140 * GiB) == "0.1"
    assert claim(200 * GiB, 140 * GiB) == memory.GPU_MEMORY_FRACTION  # a card smaller than the need
    assert claim(30 * GiB, None) == memory.GPU_MEMORY_FRACTION  # no driver to ask: the usual share
    assert memory.claim_device_memory(1) is None  # set once: a second claim finds the process's setting


@pytest.mark.parametrize("name,value", [("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5"), ("XLA_CLIENT_MEM_FRACTION", "0.5"),
                                        ("XLA_PYTHON_CLIENT_PREALLOCATE", "false")])
def test_the_users_setting_stays(clean_env, name, value):
    clean_env.setattr(memory, "gpu_total_bytes", lambda: 140 * GiB)
    clean_env.setenv(name, value)
    assert memory.claim_device_memory(30 * GiB) is None
    assert os.environ[name] == value
    # jaxlib refuses XLA_CLIENT_MEM_FRACTION beside the older name: the claim must not add it.
    others = [v for v in memory.FRACTION_VARIABLES if v != name]
    assert not any(v in os.environ for v in others)


def test_no_driver_asked_when_jax_is_told_another_platform(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert memory.gpu_total_bytes() is None


def test_a_world_models_need_from_its_weight_files(tmp_path):
    save_file({"w": np.zeros((256, 1024), np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "sub").mkdir()
    save_file({"v": np.zeros((1024,), np.float16)}, str(tmp_path / "sub" / "vae.safetensors"))
    (tmp_path / "config.json").write_text("{}")  # not weights
    (tmp_path / "gone.safetensors").symlink_to(tmp_path / "blob-not-downloaded")  # a broken link counts 0
    weights = os.path.getsize(tmp_path / "model.safetensors") + os.path.getsize(tmp_path / "sub" / "vae.safetensors")
    assert weights > 256 * 1024 * 4
    assert memory.weights_on_disk(str(tmp_path)) == weights
    assert memory.weights_on_disk(str(tmp_path / "model.safetensors")) < weights
    assert memory.weights_on_disk("matrix-game-tiny") == 0  # a preset's name
    assert memory.world_model_need(argparse.Namespace(model=str(tmp_path))) == 2 * weights + 16 * GiB


def test_a_command_line_reserves_what_its_family_names(clean_env, tmp_path):
    clean_env.setattr(memory, "gpu_total_bytes", lambda: 100 * GiB)
    clean_env.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # a command line adds its defaults: undone after
    parser = CliParser(prog="test")
    parser.add_argument("--model")
    seen = {}
    clean_env.setattr(sys, "argv", ["test", "--model", "m"])
    assert run_cli(lambda args: seen.update(model=args.model), parser, device_memory=lambda args: 25 * GiB) == 0
    assert seen == {"model": "m"}
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"
    # A call from Python (argv given) leaves the process's memory settings to its caller.
    clean_env.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert run_cli(lambda args: None, parser, ["--model", "m"], device_memory=lambda args: 25 * GiB) == 0
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


@pytest.mark.parametrize("module", ["wan_tpu.matrix_game.cli", "wan_tpu.unifolm.cli", "wan_tpu.serve.cli"])
def test_world_model_commands_pass_their_need(clean_env, module, tmp_path):
    """Each world model's command line (and a server of one) hands `run_cli` its need (`run_cli` stubbed: nothing
    parses or loads), and whether it compiles in worker processes: UnifoLM's command (not the one that becomes a
    server) and a Wan or UnifoLM server do; Matrix-Game-2's does not (they gained it nothing)."""
    import importlib

    cli = importlib.import_module(module)
    got = {}

    def fake_run_cli(run, parser, argv=None, *, device_memory=None, compile_workers=None, spaced_gc=True):
        got["need"], got["workers"], got["spaced_gc"] = device_memory, compile_workers, spaced_gc
        return 0

    clean_env.setattr(cli, "run_cli", fake_run_cli)
    cli.main([])
    need = got["need"]
    assert need is not None
    if module == "wan_tpu.serve.cli":
        assert need(argparse.Namespace(model="tiny", family=None, max_sessions=1)) is None  # Wan: the usual share
        assert need(argparse.Namespace(model="matrix-game-tiny", family=None, max_sessions=1)) == 16 * GiB
        assert need(argparse.Namespace(model="matrix-game-tiny", family=None, max_sessions=3)) == 48 * GiB
    else:
        assert need(argparse.Namespace(model=str(tmp_path))) == 16 * GiB
    assert got["spaced_gc"] is (module != "wan_tpu.serve.cli")  # a server keeps Python's garbage collections
    workers = got["workers"]
    if module == "wan_tpu.matrix_game.cli":
        assert workers is None
    elif module == "wan_tpu.unifolm.cli":
        assert workers(argparse.Namespace(serve=None)) and not workers(argparse.Namespace(serve=8000))
    else:
        assert [workers(argparse.Namespace(model=m, family=None)) for m in ("tiny", "unifolm-tiny", "matrix-game-tiny")
                ] == [True, True, False]
