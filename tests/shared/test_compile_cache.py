"""`wan_tpu.runtime.compile_cache`: where the cache lives, that a second `generate` in a fresh process loads its
programs from it, that stale (other version/device) and corrupt entries are ignored, and that latents
are bit-identical with the cache cold, warm, repaired and off (reference: the cold run's latents;
tolerance: none, bit for bit)."""

import os
import re
import subprocess
import sys
import threading

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
    env["XLA_FLAGS"] = os.environ["ONE_DEVICE_XLA_FLAGS"]  # one CPU device, as a user runs it
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


def _whole_loaded(output: str) -> int:
    """Programs the run read whole from the executable cache (the denoise step, the loaders' layout
    programs): those never reach XLA's cache, so its counts fall short of the entries by up to that many."""
    m = re.search(r"whole programs: (\d+) loaded", output)
    return int(m[1]) if m else 0


def _served(output: str, entries: int, *, compiled: bool) -> bool:
    """Every program of the run loaded from XLA's cache (or, with `compiled`, compiled and stored into it),
    but those read whole, and nothing else compiled."""
    hits, writes = _cache_row(output)
    done, other = (writes, hits) if compiled else (hits, writes)
    return other == 0 and entries - _whole_loaded(output) <= done <= entries


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
    assert _served(warm_out, len(entries), compiled=False), warm_out[-2000:]  # every program loaded, none compiled
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
    assert _served(bad_out, len(entries), compiled=True), bad_out[-2000:]  # all recompiled and rewritten
    assert np.array_equal(repaired, cold)
    assert "Traceback" not in bad_out
    assert (stale / entries[0]).read_bytes() == b"not a cache entry"  # other versions' folders are left alone

    again_out, _ = _generate(tmp_path, "again")
    assert _served(again_out, len(entries), compiled=False), again_out[-2000:]  # the rewritten entries load

    off_out, off = _generate(tmp_path, "off", "--no-compile-cache")
    assert re.search(r"compile cache\s+off", off_out)
    assert np.array_equal(off, cold)


def test_world_model_pipelines_and_clis_switch_the_cache():
    """Matrix-Game and UnifoLM hold the cache choice as `WanPipeline` does: on by default, off on request,
    in the pipeline and not in the process (their CLIs pass `--no-compile-cache` through; the timing tables
    print `compile_cache.summary()`)."""
    import wan_tpu
    from wan_tpu.matrix_game import cli as matrix_game_cli
    from wan_tpu.unifolm import cli as unifolm_cli

    before = compile_cache.cache_dir()
    for cls, name in ((wan_tpu.WanPipeline, "tiny"), (wan_tpu.MatrixGamePipeline, "matrix-game-tiny"),
                      (wan_tpu.UnifolmPipeline, "unifolm-tiny")):
        assert cls.from_pretrained(name).compile_cache is True
        assert cls.from_pretrained(name, compile_cache=False).compile_cache is False
        assert compile_cache.cache_dir() == before  # the process's state is left as it was
        with pytest.raises(TypeError):
            cls.from_pretrained(name, None)  # one positional argument: the rest is keyword-only
    for parser, required in ((matrix_game_cli.build_parser(), ["--image", "x.png", "--random-actions"]), (unifolm_cli.build_parser(), [])):
        assert parser.parse_args([*required, "--no-compile-cache"]).no_compile_cache
        assert not parser.parse_args(required).no_compile_cache


def _in_selection(enabled: bool, out: list) -> None:
    with compile_cache.selected(enabled):
        out.append(compile_cache.cache_dir())


def test_a_selection_holds_for_its_duration_and_is_restored(tmp_path, monkeypatch):
    """`selected(True)` turns the cache on in the default folder and off again on leaving; holders of the
    same choice share it (nested, or in other threads), one of the other choice waits until all have left."""
    monkeypatch.setenv("WAN_TPU_CACHE_DIR", str(tmp_path))
    before = compile_cache.cache_dir()
    compile_cache.disable()
    try:
        seen: list = []
        with compile_cache.selected(True):
            folder = compile_cache.cache_dir()
            assert folder == str(tmp_path / compile_cache.version_key()) and os.path.isdir(folder)
            with compile_cache.selected(True):
                assert compile_cache.cache_dir() == folder
            same = threading.Thread(target=_in_selection, args=(True, seen))
            same.start()
            same.join(60)
            assert seen == [folder]  # the same choice: not kept waiting
            other = threading.Thread(target=_in_selection, args=(False, seen))
            other.start()
            other.join(0.5)
            assert other.is_alive() and len(seen) == 1 and compile_cache.cache_dir() == folder
        other.join(60)
        assert seen == [folder, None]  # off, once the cache-on holder had left
        assert compile_cache.cache_dir() is None and compile_cache.summary().endswith(f"({folder})")
    finally:
        compile_cache.enable(before) if before else compile_cache.disable()


# Size → the Wan tiny run; sizes no other test uses, so that each run compiles programs of its own here.
_SIZES = {"off": (48, 64), "on": (64, 48), "ahead": (48, 96), "beside": (96, 48)}


def _wan_run(pipe, size, prompt="a cat"):
    height, width = _SIZES[size]
    return pipe(prompt, height=height, width=width, num_frames=5, num_inference_steps=2, output_type="latent",
                progress=False)


@pytest.mark.slow  # about a minute on 2 cores: five tiny runs and two VAE decodes, compiled
def test_two_pipelines_in_one_process_keep_their_own_choice(tmp_path, monkeypatch):
    """A pipeline with the cache off and one with it on, in one process, interleaved (the off one made
    last, which used to turn the cache off for the whole process; its `prepare` threads compiling while
    the other runs): the off one neither reads nor writes JAX's cache or the executable cache, the on one
    does both, and neither changes the process's own state (off here). Reference: JAX's cache events
    (`jax.monitoring`) by thread, the files in the cache folder, and the outputs (bit for bit)."""
    import wan_tpu
    from wan_tpu.runtime import executable_cache

    monkeypatch.setenv("WAN_TPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(executable_cache, "_CALLED", {})
    before = compile_cache.cache_dir()
    compile_cache.disable()
    events: list = []
    watched = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses",
               compile_cache.PROGRAM_LOADED, compile_cache.PROGRAM_STORED)
    jax.monitoring.register_event_listener(
        lambda event, **kw: events.append((threading.current_thread().name, event)) if event in watched else None)
    folder = tmp_path / compile_cache.version_key()

    def entries():
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []

    try:
        on = wan_tpu.WanPipeline.from_pretrained("tiny")
        off = wan_tpu.WanPipeline.from_pretrained("tiny", compile_cache=False)
        assert compile_cache.cache_dir() is None

        plain = _wan_run(off, "off")
        assert not events and not entries()  # compiled, nothing read or written
        _wan_run(on, "on")
        written = entries()
        assert written and ("MainThread", "/jax/compilation_cache/cache_misses") in events
        assert compile_cache.cache_dir() is None  # on for its calls only

        # The off one compiles ahead in its threads while the on one runs (each waits for the other's choice).
        events.clear()
        s = off.settings(height=_SIZES["ahead"][0], width=_SIZES["ahead"][1], num_frames=5, num_inference_steps=2)
        with off.prepare(s):
            _wan_run(on, "beside")
        assert {thread for thread, _ in events} == {"MainThread"}  # the on one's call: none from the off one's threads
        assert len(entries()) > len(written)
        events.clear()
        _wan_run(off, "ahead")  # what its threads compiled
        assert not events

        # Reads: with the in-memory caches cleared, the off one compiles afresh, the on one loads from disk.
        jax.clear_caches()
        events.clear()
        again = _wan_run(off, "off")
        assert not events
        np.testing.assert_array_equal(np.asarray(again), np.asarray(plain))
        _wan_run(on, "on")
        assert ("MainThread", "/jax/compilation_cache/cache_hits") in events

        # The executable cache: the off one's stage program is compiled without storing, and the on one,
        # after it, compiles and stores its own (not the off one's, held in memory).
        from wan_tpu.unifolm.pipeline import UnifolmPipeline

        u_off = UnifolmPipeline.from_pretrained("unifolm-tiny", compile_cache=False)
        u_on = UnifolmPipeline.from_pretrained("unifolm-tiny")
        h, w = u_on.config.latent_size
        z = jnp.asarray(np.random.default_rng(0).standard_normal((1, u_on.vae_config.latent_channels, 2, h, w)),
                        jnp.float32)
        events.clear()
        video = np.asarray(u_off.decode(z))
        assert not events and not [n for n in entries() if n.startswith("executables/unifolm-decode")]
        np.testing.assert_array_equal(np.asarray(u_on.decode(z)), video)
        assert ("MainThread", compile_cache.PROGRAM_STORED) in events
        assert [n for n in entries() if n.startswith("executables/unifolm-decode")]
        assert compile_cache.cache_dir() is None
    finally:
        compile_cache.enable(before) if before else compile_cache.disable()
