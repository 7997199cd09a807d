"""Compile worker processes (`wan_tpu.runtime.compile_workers`) on the CPU, with the caches off (as the module
requires there): a program compiled in a worker gives this process's bits; a worker's failure or death costs a
compile here, never a result; workers end with their process; the command lines start them only where asked."""

import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wan_tpu.errors import WanInputError
from wan_tpu.runtime import compile_cache, compile_workers, executable_cache


@pytest.fixture
def pool(monkeypatch):
    """One CPU worker, ready, every program large enough for it, the caches off."""
    monkeypatch.setattr(compile_workers, "MIN_BYTES", 0)
    with compile_cache.selected(False):
        assert compile_workers.start(1, platform="cpu")
        try:
            assert compile_workers.wait_started(120) == 1
            yield compile_workers._POOL
        finally:
            compile_workers.stop()
    assert not compile_workers.running()


def program(scale: float):
    """A new jitted function each call (nothing shared with another's compile)."""

    def f(x):
        for i in range(12):
            x = jnp.tanh(x @ x.T * scale + i)
        return x

    return jax.jit(f)


X = np.linspace(-1, 1, 32 * 32, dtype=np.float32).reshape(32, 32)


def test_a_program_compiled_in_a_worker_gives_the_same_bits(pool):
    x = jnp.asarray(X)
    before = compile_workers.stats()
    there = program(0.5)(x)
    after = compile_workers.stats()
    assert after["compiled"] == before["compiled"] + 1 and after["fell_back"] == before["fell_back"]
    with compile_workers.here():
        here = program(0.5)(x)
    assert compile_workers.stats()["compiled"] == after["compiled"]
    np.testing.assert_array_equal(np.asarray(there), np.asarray(here))
    # The program's own XLA options travel in its compile options: the same refusal as a compile here.
    before = compile_workers.stats()["fell_back"]
    with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option'"):
        program(0.25).lower(x).compile({"xla_no_such_option": True})
    assert compile_workers.stats()["fell_back"] == before + 1


def test_a_worker_that_died_costs_a_compile_here(pool):
    x = jnp.asarray(X)
    worker = pool.workers[0]
    worker.proc.kill()
    worker.proc.wait(30)
    before = compile_workers.stats()
    y = program(2.0)(x)
    with compile_workers.here():
        np.testing.assert_array_equal(np.asarray(y), np.asarray(program(2.0)(x)))
    after = compile_workers.stats()
    assert after["workers"] == 0 and after["fell_back"] == before["fell_back"] + 1
    assert after["compiled"] == before["compiled"]
    program(3.0)(x)  # no worker left: compiled here at once, without waiting for one
    assert compile_workers.stats()["fell_back"] == after["fell_back"] and not pool.local_busy
    pool.local_busy = True  # another thread's compile holds this process's slot: no wait either, the slot kept
    program(5.0)(x)
    assert pool.local_busy
    pool.local_busy = False


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_workers_end_with_their_process():
    """A command line leaves through `os._exit` (no atexit): its workers end with it all the same."""
    code = textwrap.dedent("""
        import os
        from wan_tpu.runtime import compile_workers
        compile_workers.start(2, platform="cpu")
        assert compile_workers.wait_started(120) == 2
        print(" ".join(str(w.proc.pid) for w in compile_workers._POOL.workers), flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in pids)


def test_the_default_count(monkeypatch):
    from wan_tpu.runtime import memory, xla_defaults

    monkeypatch.setenv(compile_workers.ENV, "3")
    assert compile_workers.default_count() == 3
    monkeypatch.setenv(compile_workers.ENV, "0")
    assert compile_workers.default_count() == 0
    monkeypatch.setenv(compile_workers.ENV, "many")
    with pytest.raises(WanInputError, match=r"WAN_TPU_COMPILE_WORKERS='many' is not a count; set a number"):
        compile_workers.default_count()
    monkeypatch.delenv(compile_workers.ENV)
    monkeypatch.setattr(xla_defaults, "nvidia_gpu_present", lambda: False)
    assert compile_workers.default_count() == 0  # a CPU, a TPU
    monkeypatch.setattr(xla_defaults, "nvidia_gpu_present", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(memory, "gpu_total_bytes", lambda: 24 * 2**30)
    assert compile_workers.default_count() == 0  # their autotuning would compete for a small card's memory
    monkeypatch.setattr(memory, "gpu_total_bytes", lambda: 141 * 2**30)
    assert compile_workers.default_count() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert compile_workers.default_count() == 1


RUN = textwrap.dedent("""
    import sys
    from wan_tpu.runtime import compile_workers
    from wan_tpu.runtime.cli import CliParser, exit_now, run_cli

    def run(args):
        print("workers", compile_workers.running(), flush=True)

    parser = CliParser(prog="x")
    parser.add_argument("mode")
    # As a command line's `__main__` leaves: the accelerator client's start thread may still be inside XLA.
    exit_now(run_cli(run, parser, compile_workers=lambda args: args.mode == "asks"))
""")


@pytest.mark.parametrize("asks, setting, out", [
    ("asks", None, "workers False"),  # asked, but no NVIDIA GPU here: none by default
    ("asks", "1", "workers True"),
    ("silent", "1", "workers True"),  # the setting decides for every command line
    ("silent", None, "workers False"),
    ("asks", "0", "workers False"),
])
def test_a_command_line_starts_workers_where_asked_or_set(asks, setting, out):
    env = {k: v for k, v in os.environ.items() if k != compile_workers.ENV}
    env["JAX_PLATFORMS"] = "cpu"
    if setting is not None:
        env[compile_workers.ENV] = setting
    done = subprocess.run([sys.executable, "-c", RUN, asks], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == out, done.stderr[-2000:]


def test_a_bad_setting_is_one_line_and_status_2():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", compile_workers.ENV: "-x"}
    done = subprocess.run([sys.executable, "-c", RUN, "silent"], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("error: WAN_TPU_COMPILE_WORKERS='-x' is not a count; set a number of worker "
                                   "processes (0: off)")


def test_the_setting_keys_no_stored_program(monkeypatch):
    monkeypatch.delenv(compile_workers.ENV, raising=False)
    without = executable_cache._environment()
    monkeypatch.setenv(compile_workers.ENV, "2")
    assert executable_cache._environment() == without


def test_with_the_cache_on_a_cpu_program_compiles_here(monkeypatch):
    """XLA:CPU serialises an executable it deserialised without its functions: a worker's program would break the
    persistent cache's entry, so with the cache on the CPU compiles everything itself."""
    monkeypatch.setattr(compile_workers, "MIN_BYTES", 0)
    with compile_cache.selected(True):
        assert compile_workers.start(1, platform="cpu")
        try:
            assert compile_workers.wait_started(120) == 1
            before = compile_workers.stats()
            program(4.0)(jnp.asarray(X))
            assert compile_workers.stats() == before
        finally:
            compile_workers.stop()


def test_generate_asks_for_workers(monkeypatch):
    """`generate`'s denoise step and decode programs compile side by side: its command line asks for workers
    (`run_cli` stubbed: nothing parses or loads)."""
    import argparse

    from wan_tpu.wan import cli

    got = {}

    def fake_run_cli(run, parser, argv=None, *, device_memory=None, compile_workers=None):
        got["workers"] = compile_workers
        return 0

    monkeypatch.setattr(cli, "run_cli", fake_run_cli)
    cli.main([])
    assert got["workers"](argparse.Namespace()) is True
