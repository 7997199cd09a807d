"""`benchmarks/harness.py`, what every benchmark script shares: timing (warm-up apart, batches, results held
or dropped), fresh processes (wall time, RESULT lines, a `--result-json` file, the time-limit messages), the
authors'-code importer (stand-ins, packages without their `__init__`), markdown tables and the line that says
what ran where."""

import os
import sys
import textwrap
import time
import types
import weakref

import harness
import pytest


class Box:
    """A call's result that a weak reference can watch."""


def test_measure_runs_warmup_apart_and_batches():
    calls, waited = [], []

    def call():
        calls.append(1)
        return len(calls)

    timing = harness.measure(call, waited.append, iters=3, warmup=2, batch=4)
    assert len(calls) == 2 + 3 * 4 and waited == [1, 2, 6, 10, 14]  # only a batch's last call is waited for
    assert len(timing.times) == 3 and timing.first is not None and timing.out == 14
    assert timing.min <= timing.median <= timing.max and timing.ms == pytest.approx(timing.median * 1e3)
    assert timing.span[0] <= timing.span[1]
    assert harness.measure(call, None, iters=0, warmup=0).first is None


@pytest.mark.parametrize("hold", [False, True])
def test_measure_drops_or_holds_the_previous_result(hold):
    alive = []
    last = [None]

    def call():
        alive.append(last[0] is not None and last[0]() is not None)
        box = Box()
        last[0] = weakref.ref(box)
        return box

    harness.measure(call, None, iters=3, hold=hold)
    assert alive == [False] + [hold] * 3


def test_timed():
    out, seconds = harness.timed(lambda x: time.sleep(0.01) or x + 1, 1)
    assert out == 2 and seconds >= 0.01


CHILD = textwrap.dedent("""
    import json, os, sys
    print("noise")
    print("RESULT " + json.dumps({"start": os.environ.get("HARNESS_T0"), "extra": os.environ.get("EXTRA")}))
    if "--result-json" in sys.argv:
        with open(sys.argv[sys.argv.index("--result-json") + 1], "w") as f:
            json.dump({"written": True}, f)
    sys.exit(int(os.environ.get("RC", "0")))
""")


def test_run_fresh_times_a_whole_process_and_reads_its_results():
    before = time.time()
    proc = harness.run_fresh([sys.executable, "-c", CHILD], env={"EXTRA": "1"}, start_var="HARNESS_T0", result_json=True)
    assert proc.rc == 0 and proc.wall > 0 and proc.result == {"written": True}
    (found,) = proc.results()
    assert found["extra"] == "1" and before <= float(found["start"]) <= time.time()
    assert proc.output.startswith("noise\n")
    assert harness.run_fresh([sys.executable, "-c", CHILD]).result is None


def test_run_part_says_why_there_is_no_result():
    ok = [sys.executable, "-c", CHILD]
    assert harness.run_part(ok, time.perf_counter() + 60, 60) == ({"written": True}, None)
    assert harness.run_part(ok, time.perf_counter() - 1, 5) == (None, "not run (--time-limit 5 s reached)")
    assert harness.run_part([sys.executable, "-c", "import time; time.sleep(30)"], time.perf_counter() + 0.5,
                            0.5) == (None, "stopped at --time-limit 0.5 s")
    assert harness.run_part([sys.executable, "-c", "raise SystemExit(3)"]) == (
        None, "failed (exit status 3; see its output above)")


def test_xla_flags_env_appends():
    env = harness.xla_flags_env("--xla_b", OTHER="x")
    assert env["XLA_FLAGS"].endswith("--xla_b") and env["OTHER"] == "x"
    assert os.environ.get("XLA_FLAGS", "") in env["XLA_FLAGS"]


def test_table_is_markdown_and_pads_short_rows():
    text = harness.table(("a", "b", "c"), [(1, "x", 2.5), ("skipped", "why")])
    assert text.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | x | 2.5 |", "| skipped | why |  |"]


def test_env_line_names_the_versions_and_the_device():
    line = harness.env_line()
    for name in ("jax ", "jaxlib ", "torch ", "diffusers ", "device "):
        assert name in line
    devices = [types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")] * 2
    assert harness.device_kind(devices) == "2× NVIDIA H100 80GB HBM3"
    assert harness.env_line(devices[:1]).endswith("device NVIDIA H100 80GB HBM3")


@pytest.fixture
def clean_imports():
    modules, path = set(sys.modules), list(sys.path)
    yield
    for name in set(sys.modules) - modules:
        del sys.modules[name]
    sys.path[:] = path


def test_import_reference_with_stand_ins(tmp_path, clean_imports):
    """A checkout whose package `__init__` cannot run here, importing an attention library and an optional
    package that are not installed: the stand-ins take their place, an installed package is left alone."""
    (tmp_path / "theirpkg").mkdir()
    (tmp_path / "theirpkg" / "__init__.py").write_text("raise ImportError('needs what the machine lacks')\n")
    (tmp_path / "theirpkg" / "model.py").write_text(textwrap.dedent("""
        import json
        import harness_test_optional
        from harness_test_attn.ops import attend
        VALUE = attend(2) + harness_test_optional.OFFSET
        HAS_DUMPS = hasattr(json, "dumps")
    """))
    ref = harness.import_reference(
        str(tmp_path), ("theirpkg.model",), first=("json",), packages=("theirpkg",),
        stubs={"harness_test_attn": {}, "harness_test_attn.ops": {"attend": lambda x: 10 * x}},
        missing={"harness_test_optional": {"OFFSET": 1}, "json": {"dumps": None}})
    assert ref.root == str(tmp_path) and ref.model.VALUE == 21 and ref.model.HAS_DUMPS
    assert sys.modules["json"].dumps is not None  # installed: not replaced
    assert sys.modules["harness_test_attn"].ops is sys.modules["harness_test_attn.ops"]  # set on its parent
    assert sys.modules["harness_test_optional"].__spec__ is not None  # what find_spec probes
