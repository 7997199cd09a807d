"""The first-contact contract of the three command lines (`python -m wan_tpu.generate`, `wan_tpu.matrix_game`,
`wan_tpu.unifolm`), probed as a user would, in fresh processes on the tiny presets:

- bad input: exit 2, one line on stderr that names the fix, no traceback, no file left behind;
- Ctrl-C / SIGTERM at any point (imports, loading, each stage, the write): exit 130 / 143, one line, no
  traceback, no partial file; a signal is never dropped.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The README's preset commands (the same programs: whichever test runs first fills the shared compile cache).
WAN = ["-m", "wan_tpu.generate", "--model", "tiny", "--prompt", "a cat walks on the grass", "--quiet"]
MG = ["-m", "wan_tpu.matrix_game", "--model", "matrix-game-tiny", "--image", "img.png", "--random-actions", "--frames", "33",
      "--quiet"]
UNI = ["-m", "wan_tpu.unifolm", "--model", "unifolm-tiny", "--mode", "decision", "--observation", "obs.npz", "--steps", "2",
       "--quiet"]
UNI_WORLD = ["-m", "wan_tpu.unifolm", "--mode", "world", "--observation", "obs.npz", "--steps", "2", "--quiet"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A folder with the probes' input files (images, observations, action files) and two decoys."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("probes")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / "img.png")
    images = rng.integers(0, 256, (2, 128, 128, 3), dtype=np.uint8)
    states = rng.uniform(0, 1, (2, 7)).astype(np.float32)
    np.savez(folder / "obs.npz", images=images, states=states)
    nan_states = states.copy()
    nan_states[0, 0] = np.nan
    np.savez(folder / "nan_obs.npz", images=images, states=nan_states)
    np.savez(folder / "nan_actions.npz", actions=np.full((16, 7), np.nan, np.float32))
    np.savez(folder / "actions8.npz", actions=np.zeros((16, 8), np.float32))
    (folder / "obs_nan.json").write_text('{"images": ' + json.dumps(images.tolist()) + ', "states": [[NaN, 0, 0, 0, 0, 0, 0], '
                                         '[0, 0, 0, 0, 0, 0, 0]]}')
    (folder / "big_mouse.json").write_text(json.dumps({"keyboard": [[1, 0, 0, 0]] * 9, "mouse": [[1e30, 0]] * 9}))
    (folder / "nan_mouse.json").write_text('{"keyboard": ' + json.dumps([[1, 0, 0, 0]] * 9) + ', "mouse": '
                                           + json.dumps([[0, 0]] * 8) [:-1] + ', [NaN, 0]]}')
    (folder / "exists.mp4").write_bytes(b"mine")
    (folder / "afile").write_bytes(b"x")
    return folder


def run(folder, argv, timeout=600, **kwargs):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *argv], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def outputs(folder) -> list[str]:
    """What a probe left behind: anything but the inputs."""
    keep = {"img.png", "obs.npz", "nan_obs.npz", "nan_actions.npz", "actions8.npz", "obs_nan.json", "big_mouse.json",
            "nan_mouse.json", "exists.mp4", "afile"}
    return sorted(p for p in os.listdir(folder) if p not in keep)


PROBES = [
    # Wan
    ("wan size", WAN + ["--size", "33*32"], "--size"),
    ("wan frames", WAN + ["--frames", "4"], "4n+1"),
    ("wan steps", WAN + ["--steps", "0"], "steps"),
    ("wan output in /sys", WAN + ["--output", "/sys/x.mp4"], "cannot write"),
    ("wan output under a file", WAN + ["--output", "afile/x.mp4"], "is a file"),
    ("wan output exists", WAN + ["--output", "exists.mp4"], "--overwrite"),
    ("wan output is a folder", WAN + ["--output", "."], "must end in .mp4"),
    ("wan mesh", WAN + ["--mesh", "1,2"], "dp,sp,tp"),
    ("wan attention", WAN + ["--attention", "nope"], "--attention"),
    ("wan dtype", WAN + ["--dtype", "float16"], "--dtype"),
    ("wan image for t2v", WAN + ["--image", "img.png"], "drop --image"),
    ("wan model", WAN + ["--model", "nowhere"], "preset"),
    # Matrix-Game-2
    ("mg image", MG + ["--image", "missing.png"], "--image"),
    ("mg mouse 1e30", MG[:6] + ["--actions", "big_mouse.json", "--quiet"], "outside"),
    ("mg mouse NaN", MG[:6] + ["--actions", "nan_mouse.json", "--quiet"], "NaN"),
    ("mg frames 0", MG + ["--frames", "0"], "--frames"),
    ("mg frames 10", MG + ["--frames", "10"], "12n-3"),
    ("mg output in /sys", MG + ["--output", "/sys/x.mp4"], "cannot write"),
    ("mg output under a file", MG + ["--output", "afile/x.mp4"], "is a file"),
    ("mg output exists", MG + ["--output", "exists.mp4"], "--overwrite"),
    ("mg model", MG + ["--model", "nowhere"], "wan-convert-matrix-game"),
    ("mg variant", MG + ["--variant", "nope"], "--variant"),
    ("mg mesh", MG + ["--mesh", "1,2"], "dp,sp,tp"),
    ("mg attention", MG + ["--attention", "nope"], "--attention"),
    # UnifoLM-WMA
    ("unifolm no mode", UNI[:2] + ["--observation", "obs.npz"], "--mode"),
    ("unifolm steps 0", UNI + ["--steps", "0"], "--steps"),
    ("unifolm eta -1", UNI + ["--eta", "-1"], "--eta"),
    ("unifolm eta 2", UNI + ["--eta", "2"], "--eta"),
    ("unifolm iterations 0", UNI[:2] + ["--mode", "interact", "--observation", "obs.npz", "--iterations", "0"], "--iterations"),
    ("unifolm sampling programs 0", UNI + ["--sampling-programs", "0"], "--sampling-programs"),
    ("unifolm sampling programs 99", UNI + ["--sampling-programs", "99"], "sampling programs must be a whole number from 1"),
    ("unifolm NaN state", UNI[:6] + ["--observation", "nan_obs.npz"], "NaN"),
    ("unifolm NaN state json", UNI[:6] + ["--observation", "obs_nan.json"], "NaN"),
    ("unifolm NaN action", UNI_WORLD + ["--actions", "nan_actions.npz"], "NaN"),
    ("unifolm dof", UNI_WORLD + ["--actions", "actions8.npz"], "dof"),
    ("unifolm actions outside world", UNI + ["--actions", "actions8.npz"], "--actions"),
    ("unifolm output in /sys", UNI + ["--output", "/sys/x.mp4"], "cannot write"),
    ("unifolm output under a file", UNI + ["--output", "afile/x.mp4"], "is a file"),
    ("unifolm output exists", UNI + ["--output", "exists.mp4"], "--overwrite"),
    ("unifolm serve with mode", ["-m", "wan_tpu.unifolm", "--serve", "0", "--mode", "decision"], "drop --mode"),
    ("unifolm model", UNI + ["--model", "nowhere"], "wan-convert-unifolm"),
    ("unifolm mesh", UNI + ["--mesh", "1,2"], "dp,sp,tp"),
    ("unifolm generate with heads", UNI[:2] + ["--mode", "generate", "--observation", "obs.npz", "--steps", "2"],
     "--mode decision or world"),
    ("unifolm observation missing", UNI[:6] + ["--observation", "missing.npz"], "does not exist"),
]


@pytest.mark.parametrize("name,argv,fix", PROBES, ids=[p[0] for p in PROBES])
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(inputs, name, argv, fix):
    if "--output" not in argv:
        argv = [*argv, "--output", "out.mp4"]
    done = run(inputs, argv)
    err = done.stderr.strip()
    assert done.returncode == 2, (name, done.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and err.startswith("error: "), (name, err[-2000:])
    assert "Traceback" not in err and fix in err, (name, err)
    assert outputs(inputs) == [], name
    assert (inputs / "exists.mp4").read_bytes() == b"mine"


@pytest.fixture(scope="module")
def warm(inputs, tmp_path_factory):
    """Each command run once to its end, so that the signal probes find every program in the compile cache
    (the test processes share one): a probe killed mid-run stores nothing, so without this every probe
    would compile afresh. Done once for all test workers, under a file lock."""
    shared = tmp_path_factory.getbasetemp().parent
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(shared / "cli_contract_warm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # The three commands side by side: each spends much of its time in single-threaded compiles, and
        # the cache's entries are written through a rename, so concurrent writers are safe.
        started = {}
        for name, argv in (("wan", WAN), ("matrix_game", MG), ("unifolm", UNI)):
            if not (shared / f"cli_contract_warm_{name}").exists():
                started[name] = subprocess.Popen([sys.executable, *argv, "--output", f"warm_{name}.mp4", "--overwrite"],
                                                 cwd=inputs, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True)
        for name, proc in started.items():
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, (name, err[-2000:])
            (shared / f"cli_contract_warm_{name}").touch()
    for name in outputs(inputs):
        os.remove(inputs / name)


# (command, pause point or None for "during the imports", signal). The pause points are the commands' safe
# points (`interrupt.check(point)`); with WAN_TPU_PAUSE_AT the process waits there for the signal.
SIGNALS = [
    (WAN, None, signal.SIGINT),
    (WAN, "denoise", signal.SIGTERM),
    (WAN, "write", signal.SIGINT),
    (MG, None, signal.SIGTERM),
    (MG, "load", signal.SIGINT),
    (MG, "denoise", signal.SIGTERM),
    (MG, "write", signal.SIGINT),
    (MG, "write", signal.SIGTERM),
    (UNI, None, signal.SIGINT),
    (UNI, "load", signal.SIGTERM),
    (UNI, "encode conditions", signal.SIGINT),
    (UNI, "sample", signal.SIGTERM),
    (UNI, "decode", signal.SIGINT),
    (UNI, "decode", signal.SIGTERM),
]


def _restore_default_signals():
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


@pytest.mark.parametrize("argv,point,signum", SIGNALS,
                         ids=[f"{a[1].split('.')[-1]}-{p or 'imports'}-{s.name}" for a, p, s in SIGNALS])
def test_a_signal_anywhere_stops_cleanly(inputs, warm, argv, point, signum):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if point is not None:
        env["WAN_TPU_PAUSE_AT"] = point
    proc = subprocess.Popen([sys.executable, *argv, "--output", "sig.mp4"], cwd=inputs, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_restore_default_signals)
    if point is None:
        time.sleep(0.4)  # inside the imports: jax alone takes longer than this
    else:
        deadline = time.monotonic() + 600
        line = ""
        while f"paused at {point}" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"ended before {point}"
            assert time.monotonic() < deadline
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=600)
    lines = [x for x in err.strip().splitlines() if not x.startswith(("paused at", f"{signum.name}: stopping"))]
    assert proc.returncode == 128 + signum, (proc.returncode, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("interrupted; "), err[-2000:]
    assert "Traceback" not in err
    left = outputs(inputs)
    if "kept" in lines[0]:
        assert left and all(name in lines[0] for name in left), (left, lines)
    else:
        assert left == [], left
    for name in left:
        os.remove(inputs / name)
