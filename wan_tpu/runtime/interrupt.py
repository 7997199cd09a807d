"""Ctrl-C and SIGTERM: stop at the next safe point, leave no partial file, exit 130 / 143.

    with interrupt.handled():            # the CLIs: SIGINT/SIGTERM only set a flag from here on
        ...
        interrupt.check("denoise")       # at safe points: raises `Interrupted` if a signal came

Python turns SIGINT into a `KeyboardInterrupt` raised wherever the main thread happens to be, which
can be inside a JAX garbage-collection callback (where it is printed and swallowed: the run goes on)
or deep in a library (a 60-line traceback). Inside `handled()` the signal only sets a flag; the
pipeline checks it between stages, between denoising steps and between video frames, and raises
`Interrupted` there. Files are written under temporary names and renamed into place, and the
`finally` blocks on the way out remove the temporaries, so an interrupted run leaves only complete
files. The CLI prints one line (`interrupted; nothing written`, or the complete files it kept) and
exits 128 + the signal number: 130 for SIGINT, 143 for SIGTERM.

A second signal exits at once (same status), even while the main thread is inside a long compile
or a weight read, where Python cannot run signal handlers: a watcher thread reads the signal
numbers from `signal.set_wakeup_fd`, removes the temporary files registered with `temporary(path)`
and calls `os._exit`.

Testing hook: with `WAN_TPU_PAUSE_AT=<point>` set, `check(point)` prints `paused at <point>` on
stderr and waits (up to a minute) for a signal, which makes "a signal during stage X" deterministic
in subprocess tests. Points: load, encode, denoise, decode, write.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state = {"signum": None, "count": 0, "said": False, "depth": 0, "owned": False}
_temporaries: set[str] = set()
_written: list[str] = []
_lock = threading.Lock()


class Interrupted(BaseException):
    """A SIGINT/SIGTERM arrived; raised at the next safe point. BaseException, like
    KeyboardInterrupt, so that `except Exception` in a library does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def check(point: str | None = None) -> None:
    """A safe point: raise `Interrupted` if a signal has arrived."""
    if point is not None and point == os.environ.get("WAN_TPU_PAUSE_AT"):
        print(f"paused at {point}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 60
        while _state["signum"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
    if _state["signum"] is not None:
        raise Interrupted(_state["signum"])


def pending() -> int | None:
    """The signal number taken and not yet acted on (None: none)."""
    return _state["signum"]


def record(path: str) -> None:
    """Note a complete output file, for the closing line of an interrupted run."""
    _written.append(path)


def written() -> list[str]:
    """The complete outputs recorded since `handled()` began."""
    return list(_written)


@contextlib.contextmanager
def temporary(path: str):
    """Register `path` (a temporary file being written) for removal on an immediate second-signal exit."""
    with _lock:
        _temporaries.add(path)
    try:
        yield path
    finally:
        with _lock:
            _temporaries.discard(path)


def _received(signum: int) -> None:
    with _lock:
        _state["count"] += 1
        _state["signum"] = _state["signum"] or signum
        count = _state["count"]
    if count == 1:
        # Said only when the next safe point is slow to come (a compile, a weight read): usually the
        # run stops first and its one closing line is all the user sees.
        _notice.start()
    else:
        with _lock:
            for path in list(_temporaries):
                with contextlib.suppress(OSError):
                    os.remove(path)
        print("interrupted again; stopped at once", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + _state["signum"])


def _say_stopping():
    with _lock:
        if _state["said"]:
            return
        sys.stderr.write(f"{signal.Signals(_state['signum']).name}: stopping at the next safe point (again to stop at once)\n")
        sys.stderr.flush()


def say(line: str) -> None:
    """Print a command's closing line on stderr in one write, after which the "stopping" notice stays quiet
    (the notice runs on a timer thread: two prints could otherwise share a line)."""
    with _lock:
        _state["said"] = True
        _notice.cancel()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def install() -> None:
    """For a command line's first instruction: SIGINT/SIGTERM set the flag from now on, for the whole
    process, so that a signal during the imports before the command's `handled()` is kept and stops the
    command at its first safe point instead of raising inside an import."""
    handled().__enter__()
    _state["owned"] = True


def process_ends_at_once() -> bool:
    """Whether this process is a command line that leaves through `os._exit` once interrupted
    (`install`): background work need not be waited for, the exit ends it."""
    return _state["owned"]


_notice = threading.Timer(1.0, _say_stopping)


def _handler(signum, frame):
    # Runs on the main thread between bytecodes; the watcher thread does the counting.
    _state["signum"] = _state["signum"] or signum


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in SIGNALS:
                _received(signum)


@contextlib.contextmanager
def handled():
    """SIGINT and SIGTERM set a flag (see the module docstring) inside; the previous handlers after.

    Nested inside another `handled()` (or after `install()`) it changes nothing, so that a signal taken
    earlier stays pending for the next `check`. Outside the main thread (where Python cannot install
    handlers) this does nothing. A signal that was ignored when the process started (`nohup`, a
    background job) stays ignored.
    """
    global _notice
    if threading.current_thread() is not threading.main_thread() or _state["depth"]:
        yield
        return
    _state.update(signum=None, count=0, said=False, depth=1)
    _written.clear()
    _notice = threading.Timer(1.0, _say_stopping)
    _notice.daemon = True
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="wan_tpu-signals", daemon=True)
    watcher.start()
    for s in SIGNALS:
        if previous[s] is not signal.SIG_IGN:
            signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _notice.cancel()
        signal.set_wakeup_fd(old_fd)
        os.close(write_fd)  # the watcher reads EOF and ends
        watcher.join(timeout=1)
        os.close(read_fd)
        # A signal taken here must not stop later work of this process (a notebook, the next run).
        _state.update(signum=None, count=0, depth=0)
