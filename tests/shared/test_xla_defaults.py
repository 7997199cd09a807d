"""`wan_tpu.runtime.xla_defaults`: the XLA flags a command line sets for its own process."""

import os
import subprocess
import sys

import pytest

from wan_tpu.runtime import xla_defaults
from wan_tpu.runtime.xla_defaults import XLA_DEFAULTS, apply_jax_defaults, apply_xla_defaults


def test_defaults_join_the_users_flags_and_never_override_them(monkeypatch):
    monkeypatch.setattr(xla_defaults, "accelerator_present", lambda: True)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert apply_xla_defaults() == ["--xla_gpu_enable_triton_gemm=false"]
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
    assert apply_xla_defaults() == []  # twice: no duplicate
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=true")
    assert apply_xla_defaults() == []
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=true"
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm_any=true")  # another flag sharing the prefix
    assert apply_xla_defaults() == ["--xla_gpu_enable_triton_gemm=false"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    apply_xla_defaults()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", *(f"--{k}={v}" for k, v in XLA_DEFAULTS.items())]


def test_a_process_without_an_accelerator_compiles_at_llvm_level_1(monkeypatch):
    """Without a GPU or TPU, LLVM's level 1 joins the defaults (the user's own level wins); with one, it does not."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(xla_defaults, "accelerator_present", lambda: False)
    assert apply_xla_defaults() == ["--xla_gpu_enable_triton_gemm=false", "--xla_backend_optimization_level=1"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert apply_xla_defaults() == ["--xla_gpu_enable_triton_gemm=false"]
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0 --xla_gpu_enable_triton_gemm=false"
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(xla_defaults, "accelerator_present", lambda: True)
    assert apply_xla_defaults() == ["--xla_gpu_enable_triton_gemm=false"]


@pytest.mark.parametrize("platforms, present", [("cpu", False), (" cpu ,", False), ("cuda", True), ("cpu,tpu", True)])
def test_jax_platforms_decides_whether_an_accelerator_is_used(monkeypatch, platforms, present):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert xla_defaults.accelerator_present() is present
    # An NVIDIA GPU (Wan's early import of its Mosaic GPU kernel, the memory claim's driver query): only cuda/gpu.
    assert xla_defaults.nvidia_gpu_allowed() is (platforms == "cuda")
    if platforms != "cuda":
        assert not xla_defaults.nvidia_gpu_present()


def test_every_platform_parses_the_defaults():
    """XLA aborts the process on a flag it does not know: the GPU flags must parse on a CPU backend too."""
    code = ("from wan_tpu.runtime.xla_defaults import apply_xla_defaults; apply_xla_defaults(); import jax; "
            "print(float(jax.numpy.ones(3).sum()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "3.0", done.stderr[-2000:]


def test_a_command_line_applies_them_and_a_python_call_does_not(monkeypatch):
    """`wan_tpu.runtime.cli.run_cli` (every command line's entry) sets the defaults, and spaces out Python's
    garbage collections, only when the process is its own (argv from the command line), as it does for the GPU
    memory fraction."""
    import argparse
    import gc

    from wan_tpu.runtime.cli import GC_THRESHOLDS, run_cli

    monkeypatch.setattr(sys, "argv", ["generate"])
    seen, thresholds = [], gc.get_threshold()
    try:
        for argv, applied in (([], False), (None, True)):
            for name in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION"):  # restored after the test
                monkeypatch.delenv(name, raising=False)
            gc.set_threshold(700, 10, 10)
            run = lambda args: seen.append((os.environ.get("XLA_FLAGS", ""), gc.get_threshold()))  # noqa: E731
            assert run_cli(run, argparse.ArgumentParser(), argv) == 0
            assert ("--xla_gpu_enable_triton_gemm=false" in seen[-1][0]) == applied, (argv, seen)
            assert seen[-1][1] == (GC_THRESHOLDS if applied else (700, 10, 10)), (argv, seen)
        # A server keeps Python's collections (`spaced_gc=False`): its jobs' cycles may hold device buffers.
        gc.set_threshold(700, 10, 10)
        assert run_cli(run, argparse.ArgumentParser(), None, spaced_gc=False) == 0 and seen[-1][1] == (700, 10, 10)
        from wan_tpu.serve import cli as serve_cli

        asked = {}
        monkeypatch.setattr(serve_cli, "run_cli", lambda *a, **kw: asked.update(kw) or 0)
        assert serve_cli.main([]) == 0 and asked["spaced_gc"] is False
    finally:
        gc.set_threshold(*thresholds)


def test_programs_lowered_after_the_jax_defaults_carry_no_tracebacks(monkeypatch):
    """`apply_jax_defaults` (every command line's): each operation of a program lowered afterwards is located by its
    own source line and named scopes, not by the Python call chain that made it, which XLA would format into every
    kernel's profiler annotation each time the executable loads; a user's `JAX_TRACEBACK_IN_LOCATIONS_LIMIT` is
    kept."""
    import jax
    import jax.numpy as jnp

    name = "jax_traceback_in_locations_limit"

    def lowered():  # new functions each time: JAX keeps a function's lowering
        def inner(x):
            with jax.named_scope("block"):
                return jnp.sin(x) * 2

        def outer(x):
            return inner(x)

        text = jax.jit(outer).lower(1.0).as_text(debug_info=True)
        return text.count("callsite("), '"jit(outer)/block/sin"' in text

    before = getattr(jax.config, name)
    try:
        jax.config.update(name, 100)
        chains, scoped = lowered()
        assert chains > 0 and scoped
        monkeypatch.delenv(name.upper(), raising=False)
        assert apply_jax_defaults() == [name]
        assert getattr(jax.config, name) == 1 and lowered() == (0, True)
        jax.config.update(name, 100)
        monkeypatch.setenv(name.upper(), "100")
        assert apply_jax_defaults() == [] and getattr(jax.config, name) == 100
    finally:
        jax.config.update(name, before)


def test_a_command_line_starts_the_device_client_before_its_work(monkeypatch):
    """A command line starts the accelerator's client (`compile_ahead.start_transfers`, a thread) once its
    arguments are parsed, before the family's work begins; a call from Python leaves its process alone."""
    import argparse

    from wan_tpu.runtime import compile_ahead
    from wan_tpu.runtime.cli import CliParser, run_cli

    monkeypatch.setattr(sys, "argv", ["generate"])
    started, seen = [], []
    monkeypatch.setattr(compile_ahead, "start_transfers", lambda: started.append(True))
    for argv, starts in ((None, True), ([], False)):
        for name in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION"):  # restored after the test
            monkeypatch.delenv(name, raising=False)
        started.clear()
        assert run_cli(lambda args: seen.append(list(started)), argparse.ArgumentParser(), argv) == 0
        assert seen[-1] == ([True] if starts else []), argv
    bad = CliParser()
    bad.add_argument("--x", type=int)
    started.clear()
    monkeypatch.setattr(sys, "argv", ["generate", "--x", "nope"])
    assert run_cli(lambda args: None, bad) == 2 and started == []  # bad arguments: no device touched


def test_programs_run_once_per_stream_compile_without_the_fusion_autotuner():
    """The programs a stream calls once (the VAE's first-frame encode on request, the gray frames' encode, the DiT
    cache's first pass) carry `PER_RUN` in the jitted function itself, so a call without
    `prepare` compiles the program `prepare` compiles; the per-chunk programs keep XLA's autotuning. Every
    Matrix-Game-2 program carries `NO_SOFTMAX_REWRITER`. On a CPU the options change nothing: the VAE's encode gives
    the same bits either way (reference: the encode without them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from wan_tpu.configs.vae import VAE_PRESETS
    from wan_tpu.loading.random_init import random_module
    from wan_tpu.matrix_game import condition, programs
    from wan_tpu.vae.loading import abstract_vae
    from wan_tpu.vae.model import WanVAE

    assert xla_defaults.PER_RUN == {"xla_gpu_experimental_enable_fusion_autotuner": False}
    stream = tuple(xla_defaults.NO_SOFTMAX_REWRITER.items())
    per_run = tuple({**xla_defaults.PER_RUN, **xla_defaults.NO_SOFTMAX_REWRITER}.items())
    options = lambda jitted: jitted._jit_info.compiler_options_kvs  # noqa: E731
    for jitted in (condition.gray_latents, programs.cache_program):
        assert options(jitted) == per_run, jitted
    for jitted in (programs.chunk_denoise_program, programs.chunk_decode_program, programs.chunk_head_program,
                   programs.chunk_tail_program):
        assert options(jitted) == stream, jitted
    vae = random_module(None, 0, abstract=abstract_vae(VAE_PRESETS["tiny"], jnp.float32))
    assert isinstance(vae, WanVAE)
    shape = (1, vae.config.video_channels, 1, 16, 16)
    assert vae.lower_encode_chunk(shape, per_run=True)._lowering._compiler_options_kvs == per_run
    assert vae.lower_encode_chunk(shape)._lowering._compiler_options_kvs == ()
    frame = jax.random.uniform(jax.random.key(0), shape, minval=-1, maxval=1)
    tuned, untuned = vae.encode_chunk(frame), vae.encode_chunk(frame, per_run=True)
    for a, b in zip(jax.tree.leaves(tuned), jax.tree.leaves(untuned)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_softmax_rewriter_keeps_the_passes_the_user_turned_off(monkeypatch):
    """A program's `xla_disable_hlo_passes` replaces the flag's list for that program, so the option names the
    passes of the user's `XLA_FLAGS` too, once each; and XLA reads it: a pass named there does not run (CPU,
    `fusion`, without which each elementwise op is a kernel of its own)."""
    import jax
    import jax.numpy as jnp

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 "
                                    "--xla_disable_hlo_passes=algsimp,triton-softmax-rewriter")
    assert xla_defaults._without_passes("triton-softmax-rewriter") == {
        "xla_disable_hlo_passes": "algsimp,triton-softmax-rewriter"}
    monkeypatch.setenv("XLA_FLAGS", "")
    assert xla_defaults._without_passes("a", "b") == {"xla_disable_hlo_passes": "a,b"}
    f = jax.jit(lambda x: jnp.exp(x * 2.0 + 1.0).sum())
    kernels = lambda options: f.lower(jnp.ones(4)).compile(options).as_text().split("ENTRY")[-1].count(" fusion(")  # noqa: E731
    assert kernels({}) == 1 and kernels(xla_defaults._without_passes("fusion")) > 1
