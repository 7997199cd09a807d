"""`benchmarks/profile_compile.py`'s own parts: per-program XLA options (parsed, and applied to the named
program only) and a run stopped at `--timeout` that still says where it was."""

import sys
import textwrap

import jax
import jax.numpy as jnp
import profile_compile
import pytest


def test_program_options_parse():
    got = profile_compile.program_options(["_sample_loop:xla_gpu_autotune_level=0,xla_dump_to=/d",
                                           "jit(_decode_strip):xla_gpu_enable_x=true", "*:a=1"])
    assert got == {"jit(_sample_loop)": {"xla_gpu_autotune_level": 0, "xla_dump_to": "/d"},
                   "jit(_decode_strip)": {"xla_gpu_enable_x": True}, "*": {"a": 1}}
    for bad in ("_sample_loop", ":a=1", "f:a"):
        with pytest.raises(SystemExit, match="NAME:OPTION=VALUE"):
            profile_compile.program_options([bad])


def test_program_options_reach_only_the_named_program(monkeypatch):
    # An option XLA does not know fails that compile: the named program gets it, the other does not.
    monkeypatch.setattr(jax.stages.Lowered, "compile", jax.stages.Lowered.compile)  # undone after the test
    profile_compile.use_program_options({"jit(named)": {"no_such_xla_option": 1}})

    def named(x):
        return x + 1

    def other(x):
        return x * 2

    assert float(jax.jit(other).lower(jnp.ones(())).compile()(jnp.ones(()))) == 2.0
    with pytest.raises(Exception, match="no_such_xla_option"):
        jax.jit(named).lower(jnp.ones(())).compile()


def test_timeout_keeps_the_spans_that_ended(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import sys, time
        sys.stderr.write("\\n{profile_compile.SPAN}[1.0, 2.0, \\"MainThread\\", \\"stage\\", \\"load\\"]\\n")
        sys.stderr.flush()
        print("load: 00:01\\rload: 00:02", flush=True)
        time.sleep(60)
    """))
    run = profile_compile.run_timed([sys.executable, str(child)], {}, timeout=3)
    assert run["timed_out"] and 3 <= run["wall"] < 30
    assert run["spans"] == [(1.0, 2.0, "MainThread", "stage", "load")]
    assert run["tail"] == ["load: 00:02"]
