"""`benchmarks/profile_compile.py`'s own parts: per-program XLA options (parsed, and applied to the named
program only), a run stopped at `--timeout` that still says where it was, XLA's pass and backend timers read
per module (`--pass-times`, lines as an H200 run printed them), the autotuning split's table and the critical path."""

import pathlib
import sys
import textwrap

import jax
import jax.numpy as jnp
import profile_compile
import pytest

from wan_tpu.runtime.autotune_packs import FOLDER


def test_program_options_parse():
    got = profile_compile.program_options(["_sample_loop:xla_gpu_autotune_level=0,xla_dump_to=/d",
                                           "jit(_decode_strip):xla_gpu_enable_x=true", "*:a=1"])
    assert got == {"jit(_sample_loop)": {"xla_gpu_autotune_level": 0, "xla_dump_to": "/d"},
                   "jit(_decode_strip)": {"xla_gpu_enable_x": True}, "*": {"a": 1}}
    for bad in ("_sample_loop", ":a=1", "f:a"):
        with pytest.raises(SystemExit, match="NAME:OPTION=VALUE"):
            profile_compile.program_options([bad])


def test_program_options_reach_only_the_named_program(monkeypatch):
    # An option XLA does not know fails that compile: the named program gets it, compiled ahead or by a plain
    # jitted call (which does not go through `Lowered.compile`), and the other program does not.
    from jax._src.interpreters import pxla

    monkeypatch.setattr(pxla.MeshComputation, "compile", pxla.MeshComputation.compile)  # undone after the test
    profile_compile.use_program_options({"jit(named)": {"no_such_xla_option": 1}})

    def named(x):
        return x + 1

    def other(x):
        return x * 2

    assert float(jax.jit(other).lower(jnp.ones(())).compile()(jnp.ones(()))) == 2.0
    assert float(jax.jit(other)(jnp.ones((2,)))[0]) == 2.0
    with pytest.raises(Exception, match="no_such_xla_option"):
        jax.jit(named).lower(jnp.ones(())).compile()
    with pytest.raises(Exception, match="no_such_xla_option"):
        jax.jit(named)(jnp.ones((3,)))


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


# XLA's log lines from an H200 run (two compile threads; a progress line's text before two of them).
XLA_LINES = (pathlib.Path(__file__).parents[1] / "data" / "xla_timer_lines.txt").read_text()


def test_pass_timers_read_per_module(capsys):
    got = profile_compile.compile_anatomy(XLA_LINES)
    assert got == {
        "jit__prepare_program": {"count": 1, "passes": 2.139373, "backend": 1.507358,
                                 "longest": {"triton-softmax-rewriter": 0.329962}},
        "jit__sample_loop": {"count": 1, "passes": 33.607074, "backend": 7.27003,
                             "longest": {"priority-fusion": 12.670975, "triton-softmax-rewriter": 11.731514}},
    }
    profile_compile.print_anatomy("cold", got)
    out = capsys.readouterr().out
    assert out.index("jit__sample_loop") < out.index("jit__prepare_program")  # the longest first
    assert "priority-fusion 12.67, triton-softmax-rewriter 11.73" in out
    assert profile_compile.compile_anatomy("no timers here\n") == {}
    # The warning counts; the rematerialization pass's own timer line does not.
    said = XLA_LINES + ("I1128 07:38:01.0 1432 hlo_pass_pipeline.cc:206] HLO pass: rematerialization time: 244 ms "
                        "(244198 us)\n")
    assert [line for line in said.splitlines() if profile_compile.REMAT in line] == XLA_LINES.splitlines()[-1:]


def test_remat_warnings_named_by_their_threads_module():
    warning = ("W1128 07:38:09.1 {} hlo_rematerialization.cc:3195] Can't reduce memory use below 106.25GiB (114084364697 "
               "bytes) by rematerialization; only reduced to 806.95GiB (866456000000 bytes), down from 806.95GiB "
               "(866456000000 bytes) originally\n")
    said = XLA_LINES + warning.format(1432) + warning.format(77)
    # The excerpt's own warning comes from a thread that logged no pipeline; 1432 last ran the softmax piece.
    assert [m for m, _ in profile_compile.remat_sources(said)] == [
        "thread 4149: no pass pipeline logged", "jit__sample_loop", "thread 77: no pass pipeline logged"]
    said = said.replace("W1128 07:38:09.1 1432", "I1128 07:38:09.0 1432 hlo_pass_pipeline.cc:302] Running HLO pass "
                        "pipeline on module extracted.12: autotune\nW1128 07:38:09.1 1432", 1)
    sources = profile_compile.remat_sources(said)
    assert sources[1] == ("extracted.12", "Can't reduce memory use below 106.25GiB by rematerialization; only reduced to "
                                          "806.95GiB, down from 806.95GiB originally")
    # A convolution autotuner's candidate, while one program's autotuning (its config-assigner pass) runs.
    tuned = ("I1129 02:01:28.7 3381 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module jit__sample_loop: "
             "config-assigner\n"
             "I1129 02:01:29.2 2470 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module "
             "cudnn-conv-bias-activation.115: remat-pipeline\n" + warning.format(2470) +
             "I1129 02:02:07.7 3381 hlo_pass_pipeline.cc:206] HLO pass: config-assigner time: 8.54 s (8544283 us)\n"
             + warning.format(2470))
    assert [m for m, _ in profile_compile.remat_sources(tuned)] == [
        "cudnn-conv-bias-activation.115 (autotuning jit__sample_loop)", "cudnn-conv-bias-activation.115"]


def test_autotune_split_table(capsys):
    span = lambda start, end, name: (start, end, "t", "XLA compile", name)  # noqa: E731
    cold = {"wall": 79.5, "timed_out": False, "remat": ["x"] * 3,
            "spans": [span(0, 53.0, "jit(_sample_loop)"), span(1, 13.5, "jit(_prepare_program)"), span(2, 2.1, "jit(k)")]}
    tuned = {"wall": 75.0, "timed_out": False, "remat": [],
             "spans": [span(0, 45.5, "jit(_sample_loop)"), span(1, 5.5, "jit(_prepare_program)"), span(2, 2.1, "jit(k)")]}
    profile_compile.print_autotune_split(cold, tuned)
    out = capsys.readouterr().out
    assert "first result" not in out  # no stage named
    for run, end in ((cold, 78.0), (tuned, 73.25)):
        run.update(spawn=0.5, spans=run["spans"] + [(60.0, end, "main", profile_compile.STAGE, "sample")])
    profile_compile.print_autotune_split(cold, tuned, "sample")
    out = capsys.readouterr().out
    assert "first result (end of 'sample'): 72.75 s with the results loaded, 77.50 s cold" in out
    assert "75.00 s whole command (cold 79.50 s); rematerialisation warnings 0 (cold 3)" in out
    assert "| jit(_sample_loop) | 53.00 | 45.50 | 7.50 |" in out
    assert "| jit(_prepare_program) | 12.50 | 4.50 | 8.00 |" in out
    assert "jit(k)" not in out  # under half a second
    assert "| all | 65.60 | 50.10 | 15.50 |" in out


def test_autotune_split_runs_after_the_first_cold_run_with_only_its_autotuning_results(monkeypatch, tmp_path):
    """The split's run starts from a cache folder holding the first cold run's per-fusion autotuning results
    (which every process of a run, compile workers included, reads and writes) and nothing else; the other
    runs keep their own flags and folders."""
    calls = []
    version = "jax-0.11.2_jaxlib-0.11.2_gpu_NVIDIA-H200"

    def fake_run(argv, env, timeout=None):
        cache = pathlib.Path(env["WAN_TPU_CACHE_DIR"])
        found = sorted(str(f.relative_to(cache)) for f in cache.rglob("*") if f.is_file()) if cache.exists() else []
        calls.append((cache.name, env.get("XLA_FLAGS", ""), env.get("TF_CPP_VMODULE"), found))
        if cache.name == "cache-0" and not found:  # what a GPU run writes: programs and autotuning results
            tuning = cache / version / FOLDER
            tuning.mkdir(parents=True)
            (tuning / "a1b2.textproto").write_text("results")
            (cache / version / "jit__step-0123").write_bytes(b"program")
        return dict(wall=2.0, first_output=1.0, remat=[], timed_out=False, anatomy={}, spans=[], spawn=0.0, counts={})

    monkeypatch.setattr(profile_compile, "run_timed", fake_run)
    monkeypatch.setattr(profile_compile, "write_inputs", lambda *a: None)
    monkeypatch.setattr(profile_compile, "command", lambda *a: ["python"] * 6)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    profile_compile.main(["matrix-game", "--runs", "2", "--autotune-split", "--pass-times", "--keep", str(tmp_path)])
    assert [c for c, *_ in calls] == ["cache-0", "cache-tuned", "cache-1", "cache-0", "cache-0"]
    assert calls[1][3] == [f"{version}/{FOLDER}/a1b2.textproto"]
    assert all(flags == "" for _, flags, _, _ in calls)
    assert [v for _, _, v, _ in calls] == [profile_compile.PASS_TIMERS["TF_CPP_VMODULE"]] * 3 + [None] * 2
    assert profile_compile.seed_autotuning(str(tmp_path / "cache-1"), str(tmp_path / "none")) == 0  # no GPU: none


def test_wan_device_command_takes_bench_e2e_recipe(monkeypatch, tmp_path):
    """`wan --device --config 14b --few-step --lora-rank 64`: bench_e2e.py's checkpoint, 720p size, 4-step recipe
    and LoRA file on the command line (the checkpoint and LoRA writers stubbed: only the command is checked)."""
    import argparse

    import bench_e2e

    written = []
    monkeypatch.setattr(bench_e2e, "ensure_checkpoint", lambda workdir, config: f"{workdir}/{config}-random")
    monkeypatch.setattr(bench_e2e, "write_lora", lambda path, config, rank: written.append((config, rank)) or path)
    args = argparse.Namespace(what="wan", model=None, device=True, workdir=str(tmp_path), config="14b",
                              few_step=True, lora_rank=64, rest=["--quiet"])
    argv = profile_compile.command(args, str(tmp_path), "out.mp4")
    line = " ".join(argv)
    assert f"--model {tmp_path}/14b-random" in line and written == [("14b", 64)]
    assert "--steps 4 --scheduler euler --sigmas 1.0,0.75,0.5,0.25 --shift 5.0 --guidance 1" in line
    # The later flags win (argparse keeps the last): 720p and 4 steps over the 1.3B defaults; `--` args last.
    assert argv.index("1280*720") > argv.index("832*480") and argv[-1] == "--quiet"
    assert "--lora" in argv and argv[argv.index("--lora") + 1].endswith("-lora-r64.safetensors")


def test_critical_path_names_the_last_compile_waited_for(capsys):
    """Spans as a cold Wan 1.3B run on an H200 recorded them (seconds from spawn 100): the first step waited
    for the decode's second strip program, lowered after the step's own lowering held the GIL."""
    s = lambda a, b, thread, kind, name: (100 + a, 100 + b, thread, kind, name)  # noqa: E731
    run = {"spawn": 100, "spans": [
        s(5.05, 9.38, "wan_tpu-compile-denoise", "lower", "jit(_step)"),
        s(5.16, 5.53, "wan_tpu-compile-decode", "trace", "_decode_strip"),
        s(6.63, 8.57, "wan_tpu-compile-decode", "lower", "jit(_decode_strip)"),
        s(8.58, 15.73, "wan_tpu-compile-decode-9", "XLA compile", "jit(_decode_strip)"),
        s(8.67, 8.98, "wan_tpu-compile-decode", "trace", "_decode_strip"),
        s(9.01, 9.41, "wan_tpu-compile-decode", "lower", "jit(_decode_strip)"),
        s(9.39, 14.94, "wan_tpu-compile-wan-step", "XLA compile", "jit(_step)"),
        s(9.41, 17.21, "wan_tpu-compile-decode-12", "XLA compile", "jit(_decode_strip)"),
        s(9.43, 16.82, "wan_tpu-compile-decode-12", "compile in a worker", "jit__decode_strip"),
        s(10.88, 12.07, "MainThread", "wait", "background"),
        s(12.47, 60.68, "MainThread", profile_compile.STAGE, "denoise"),
        s(12.47, 14.97, "MainThread", "wait", "denoise"),
        s(14.97, 17.24, "MainThread", "wait", "decode"),
        s(17.25, 17.25, "MainThread", "wait", "vae"),  # done already: not what the step waited for
        s(60.84, 62.53, "MainThread", profile_compile.STAGE, "decode"),
    ]}
    path = profile_compile.critical_path(run, "denoise")
    assert path["wait"][:2] == pytest.approx((14.97, 17.24)) and path["wait"][2] == "decode"
    assert path["program"] == "jit(_decode_strip)"
    assert path["compile"] == pytest.approx((9.41, 17.21)) and path["worker"] == pytest.approx(7.39)
    assert path["lower"] == pytest.approx((9.01, 9.41)) and path["trace"] == pytest.approx((8.67, 8.98))
    assert path["others_python"] == pytest.approx(0.71)  # the step's lowering, 8.67-9.38 s, and not its own spans
    profile_compile.print_critical_path(run, "denoise")
    out = capsys.readouterr().out
    assert "'decode', 14.97–17.24 s" in out and "jit(_decode_strip), traced 8.67–8.98 s, lowered 9.01–9.41 s" in out
    assert "compiled 9.41–17.21 s (7.80 s, in a worker process 7.39 s)" in out
    warm = {"spawn": 0, "spans": [(8.2, 11.8, "MainThread", profile_compile.STAGE, "denoise")]}
    assert profile_compile.critical_path(warm, "denoise") is None
    profile_compile.print_critical_path(warm, "denoise")
    assert "waited for nothing" in capsys.readouterr().out
