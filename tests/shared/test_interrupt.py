"""Ctrl-C and SIGTERM (`wan_tpu.runtime.interrupt`), delivered to real child processes with the signal
dispositions a terminal gives them (both at their defaults), during each stage of a `generate` run:
load, text encode, denoise, decode and mp4 write. Every case: exit status 130 (SIGINT) / 143
(SIGTERM), one closing line on stderr, no traceback, no partial file; repeated.

`WAN_TPU_PAUSE_AT=<stage>` holds the run at that stage until a signal arrives, so the signal lands
inside the stage every time. To keep this quick, one child process runs `wan_tpu.wan.cli.main` over
and over (it builds and compiles once); a fresh `python -m wan_tpu.generate` process checks the
process exit status itself, and a bare child checks that a second signal ends a process stuck in C
code at once.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POINTS = ("load", "encode", "denoise", "decode", "write")
RUN = ["--model", "tiny", "--prompt", "a cat", "--size", "32*32", "--frames", "5", "--steps", "2", "--quiet"]
REPEAT = 3


def _spawn(args, env=None):
    """A child with the dispositions a shell in a terminal gives a foreground command: SIGINT and
    SIGTERM at their defaults. Handlers are reset by exec; only an ignored signal is inherited, so
    an ignored one is set to the default while the child starts."""
    env = {**os.environ, **(env or {})}
    env["XLA_FLAGS"] = os.environ["ONE_DEVICE_XLA_FLAGS"]  # one CPU device, as a user's machine has
    ignored = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is signal.SIG_IGN]
    for s in ignored:
        signal.signal(s, signal.SIG_DFL)
    try:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, bufsize=1)
    finally:
        for s in ignored:
            signal.signal(s, signal.SIG_IGN)


def without_notice(lines, sig):
    """`lines` without the notice a stop slower than a second prints first (leaving the run waits for a
    background compile in flight, at most one program's: `wan_tpu.runtime.compile_ahead`), which is all it may add."""
    notice = f"{signal.Signals(sig).name}: stopping at the next safe point (again to stop at once)"
    return [line for line in lines if line != notice]


def _read_until(stream, marker, timeout=300):
    """Lines of `stream` up to and including the first that contains `marker`."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} in {lines}")


# Runs `main` once per stdin line "<pause point> <output> [flags]". The tiny preset's components are
# built once and handed out again (same objects, so nothing recompiles): each run then takes a
# fraction of a second, and the runs differ only in where the signal lands.
DRIVER = textwrap.dedent("""
    import os, sys
    from wan_tpu.wan import presets
    from wan_tpu.wan.cli import main

    built, tiny = {}, presets.PRESETS["tiny"]

    def reusing_tiny(cls, **kwargs):
        pipe = tiny(cls, **kwargs)
        loaders = pipe._loaders
        pipe._loaders = {n: (lambda n=n: built.get(n) or built.setdefault(n, loaders[n]())) for n in loaders}
        return pipe

    presets.PRESETS["tiny"] = reusing_tiny
    for line in sys.stdin:
        point, out, *extra = line.split()
        os.environ["WAN_TPU_PAUSE_AT"] = point
        code = main(sys.argv[1:] + ["--output", out, *extra])
        print(f"rc={code}", file=sys.stderr, flush=True)
""")


def test_signal_in_every_stage_stops_cleanly(tmp_path):
    child = _spawn([sys.executable, "-c", DRIVER, *RUN])
    try:
        cases = [(point, sig) for _ in range(REPEAT) for point in POINTS for sig in (signal.SIGINT, signal.SIGTERM)]
        for n, (point, sig) in enumerate(cases):
            out = tmp_path / f"run{n}"
            out.mkdir()
            child.stdin.write(f"{point} {out / 'v.mp4'}\n")
            child.stdin.flush()
            _read_until(child.stderr, f"paused at {point}")
            child.send_signal(sig)
            after = _read_until(child.stderr, "rc=")
            assert after[-1] == f"rc={128 + sig}", (point, sig, after)
            assert without_notice(after[:-1], sig) == ["interrupted; nothing written"], (point, sig, after)
            assert os.listdir(out) == [], (point, sig)  # no mp4, no temporary
        # --keep-stages: the complete stage files are kept and named; the mp4 is not written.
        out = tmp_path / "kept"
        out.mkdir()
        child.stdin.write(f"write {out / 'v.mp4'} --keep-stages {out / 'stages'}\n")
        child.stdin.flush()
        _read_until(child.stderr, "paused at write")
        child.send_signal(signal.SIGINT)
        after = _read_until(child.stderr, "rc=")
        kept = [str(out / "stages" / "stage1.safetensors"), str(out / "stages" / "stage2.safetensors")]
        assert after == [f"interrupted; kept {', '.join(kept)}", "rc=130"]
        assert os.listdir(out) == ["stages"] and sorted(os.listdir(out / "stages")) == sorted(map(os.path.basename, kept))
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == 0


@pytest.mark.parametrize("point,sig", [("encode", signal.SIGTERM)])
def test_generate_process_exit_status(point, sig, tmp_path):
    """The `python -m wan_tpu.generate` process itself exits 143 / 130 with one line and nothing written."""
    proc = _spawn([sys.executable, "-m", "wan_tpu.generate", *RUN, "--output", str(tmp_path / "v.mp4")],
                  env={"WAN_TPU_PAUSE_AT": point})
    _read_until(proc.stderr, f"paused at {point}")
    proc.send_signal(sig)
    rest = proc.stderr.read().strip().splitlines()
    proc.wait(timeout=60)
    assert proc.returncode == 128 + sig
    assert without_notice(rest, sig) == ["interrupted; nothing written"]
    assert os.listdir(tmp_path) == []


def test_second_signal_stops_at_once_and_removes_temporaries(tmp_path):
    """A main thread stuck in C code (a blocking read here, a compile in real life) cannot reach a safe
    point; the second signal ends the process anyway, removing the registered temporary file."""
    partial = tmp_path / ".v.mp4.partial.mp4"
    script = textwrap.dedent(f"""
        import os, sys
        from wan_tpu.runtime import interrupt
        with interrupt.handled(), interrupt.temporary({str(partial)!r}):
            open({str(partial)!r}, "w").close()
            r, w = os.pipe()
            print("ready", file=sys.stderr, flush=True)
            os.read(r, 1)  # never returns: nothing is written to w
    """)
    proc = _spawn([sys.executable, "-c", script])
    _read_until(proc.stderr, "ready", timeout=60)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    assert proc.poll() is None  # the first signal waits for a safe point
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode == 130
    assert "stopped at once" in proc.stderr.read()
    assert not partial.exists()


def test_ignored_signal_stays_ignored():
    """A command started with SIGINT ignored (nohup, a background job) keeps ignoring it."""
    script = textwrap.dedent("""
        import signal
        from wan_tpu.runtime import interrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupt.handled():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    """)
    proc = _spawn([sys.executable, "-c", script])
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
