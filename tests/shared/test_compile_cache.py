"""`wan_tpu.runtime.compile_cache`: where the cache lives, that a second `generate` in a fresh process loads its
programs from it, that stale (other version/device) and corrupt entries are ignored, and that latents
are bit-identical with the cache cold, warm, repaired and off (reference: the cold run's latents;
tolerance: none, bit for bit)."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wan_tpu.runtime import compile_cache
from wan_tpu.wan.stages import load_stage


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("WAN_TPU_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.base_dir() == str(tmp_path / "own")
    monkeypatch.delenv("WAN_TPU_CACHE_DIR")
    assert compile_cache.base_dir() == str(tmp_path / "xdg" / "wan_tpu")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.base_dir() == str(tmp_path / "home" / ".cache" / "wan_tpu")
    key = compile_cache.version_key()
    assert key.startswith(f"jax-{jax.__version__}_jaxlib-") and f"_{jax.devices()[0].platform}_" in key
    assert re.fullmatch(r"[A-Za-z0-9.+_-]+", key)


def test_enable_writes_disable_stops(tmp_path):
    try:
        folder = compile_cache.enable(str(tmp_path))
        assert folder == str(tmp_path / compile_cache.version_key()) == compile_cache.cache_dir()
        before = compile_cache.stats()
        np.asarray(jax.jit(lambda x: jnp.sin(x) * 3.25)(jnp.arange(7.0)))
        assert compile_cache.stats().writes > before.writes
        assert any(n.endswith("-cache") for n in os.listdir(folder))
        compile_cache.disable()
        assert not compile_cache.is_enabled()
        written = set(os.listdir(folder))
        np.asarray(jax.jit(lambda x: jnp.cos(x) * 1.75)(jnp.arange(5.0)))
        assert set(os.listdir(folder)) == written
    finally:
        compile_cache.enable()  # back to the session's folder (conftest)


def _generate(tmp_path, name, *extra):
    """One tiny `generate` in a fresh process with the cache under $XDG_CACHE_HOME; (stdout+stderr, latents)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WAN_TPU_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    stages = tmp_path / name
    argv = [sys.executable, "-m", "wan_tpu.generate", "--model", "tiny", "--prompt", "a cat", "--size", "32*32",
            "--frames", "5", "--steps", "2", "--quiet", "--output", str(tmp_path / f"{name}.mp4"),
            "--keep-stages", str(stages), *extra]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    latents, _ = load_stage(str(stages / "stage2.safetensors"))
    return run.stdout + run.stderr, latents["latents"]


def _cache_row(output: str) -> tuple[int, int]:
    m = re.search(r"compile cache\s+(\d+) loaded, (\d+) compiled and stored", output)
    assert m, output[-2000:]
    return int(m[1]), int(m[2])


@pytest.mark.slow
def test_second_process_loads_from_the_cache_and_bad_entries_are_ignored(tmp_path):
    cold_out, cold = _generate(tmp_path, "cold")
    roots = os.listdir(tmp_path / "xdg" / "wan_tpu")
    assert len(roots) == 1 and roots[0].startswith("jax-")
    folder = tmp_path / "xdg" / "wan_tpu" / roots[0]
    entries = sorted(n for n in os.listdir(folder) if n.endswith("-cache"))
    hits, writes = _cache_row(cold_out)
    assert entries and writes == len(entries) and hits == 0

    warm_out, warm = _generate(tmp_path, "warm")
    assert _cache_row(warm_out) == (len(entries), 0)  # every program loaded, none compiled
    assert np.array_equal(warm, cold)

    # A stale cache (another jax version / device kind) sits beside ours; every entry of ours is corrupt:
    # half truncated (a writer killed mid-write), half garbage.
    stale = tmp_path / "xdg" / "wan_tpu" / "jax-0.0.1_jaxlib-0.0.1_gpu_Some-Other-GPU"
    stale.mkdir()
    (stale / entries[0]).write_bytes(b"not a cache entry")
    for i, name in enumerate(entries):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2] if i % 2 else os.urandom(len(data)))
    bad_out, repaired = _generate(tmp_path, "repaired")
    assert _cache_row(bad_out) == (0, len(entries))  # all recompiled and rewritten
    assert np.array_equal(repaired, cold)
    assert "Traceback" not in bad_out
    assert (stale / entries[0]).read_bytes() == b"not a cache entry"  # other versions' folders are left alone

    again_out, _ = _generate(tmp_path, "again")
    assert _cache_row(again_out) == (len(entries), 0)  # the rewritten entries load

    off_out, off = _generate(tmp_path, "off", "--no-compile-cache")
    assert re.search(r"compile cache\s+off", off_out)
    assert np.array_equal(off, cold)


def test_world_model_pipelines_and_clis_switch_the_cache():
    """Matrix-Game and UnifoLM turn the cache on by default and off on request, as `WanPipeline` does
    (their CLIs pass `--no-compile-cache` through; the timing tables print `compile_cache.summary()`)."""
    from wan_tpu.matrix_game import cli as matrix_game_cli
    from wan_tpu.unifolm import cli as unifolm_cli
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline
    from wan_tpu.unifolm.pipeline import UnifolmPipeline

    before = compile_cache.cache_dir()
    folder = before or os.path.join(compile_cache.base_dir(), compile_cache.version_key())  # a folder in use is kept
    try:
        for load in (lambda on: MatrixGamePipeline.from_pretrained("matrix-game-tiny", compile_cache=on),
                     lambda on: UnifolmPipeline.from_pretrained("unifolm-tiny", compile_cache=on)):
            load(False)
            assert not compile_cache.is_enabled() and compile_cache.summary() == "off"
            load(True)
            assert compile_cache.is_enabled() and compile_cache.cache_dir() == folder
            assert compile_cache.summary().endswith(f"({folder})")
    finally:
        compile_cache.enable() if before else compile_cache.disable()
    for parser, required in ((matrix_game_cli.build_parser(), ["--image", "x.png", "--random-actions"]), (unifolm_cli.build_parser(), [])):
        assert parser.parse_args([*required, "--no-compile-cache"]).no_compile_cache
        assert not parser.parse_args(required).no_compile_cache
