"""XLA compiles in worker processes: a start's programs compile at the same time instead of one after another.

    from wan_tpu.runtime import compile_workers
    compile_workers.start()      # what `generate`, `unifolm` and their server do (`run_cli`); from Python: before the work
    ...                          # every large program compiled from now on, in any thread, compiles in a worker
    compile_workers.stats()      # {"workers": 4, "compiled": 3, "fell_back": 0}

On an NVIDIA GPU, XLA compiles within one process largely queue on each other however many threads ask (an H200,
jax 0.11.2, `benchmarks/bench_compile_side_by_side.py`: Matrix-Game-2's decode program alone 10.5–12.5 s, three
copies in three threads 37.2 s with the CPUs 23% busy; in six workers, another day, three copies 17.8 s and six
21.6 s), so a cold start paid about the sum of its programs' compiles. Processes do not queue on each other.
So the one compile path every program takes (JAX's `backend_compile_and_load`, under `jax.jit`'s compile, the
persistent cache's misses, `prepare`'s threads) sends a large program (StableHLO bytecode of `MIN_BYTES` or more)
to an idle worker, which compiles it with the very compile options (XLA's flags and the program's own
`compiler_options` travel in them) on the same devices and sends the executable back serialised. This process
deserialises it, as JAX's persistent cache does a hit, and the rest (its cache write, the executable cache) goes
on as for a compile made here. Small programs (a single op, a cast) compile here: a round trip would cost more
than they do. This process is one more compile slot: a large program that finds every worker busy compiles here
when nothing else does. A program gains only when others compile beside it: one large program compiles no
faster in a worker and then takes seconds to deserialise (UnifoLM's sampling, which its pipeline therefore
cuts in 4 where workers run).

Workers start in the background (a Python process each: its JAX and the accelerator's client, 2–8 s) and take
work once ready. They hold no device memory between programs (their autotuning allocates what it measures and
frees it) and die with this process (`PR_SET_PDEATHSIG`; they ignore SIGINT, which the command handles). A worker
that fails a program or dies costs a compile here, never a wrong result: the program is then compiled in this
process, whose own error, if any, is the one raised. Off where a device belongs to one process (TPU), on CPUs
and on small GPUs (`default_count`); `WAN_TPU_COMPILE_WORKERS=N` sets the count (0: off). A program with host
callbacks, or for devices of several processes, compiles here.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time

ENV = "WAN_TPU_COMPILE_WORKERS"
# StableHLO bytecode at or above which a program compiles in a worker. The unifolm-tiny preset's: its stage programs
# 27–124 kB, its random-number programs and single ops 1–9 kB. On an H200 the real models' stage programs (UnifoLM's
# prepare, sampling pieces, image tower and decode; Wan's denoise step and decode) went to workers, the loaders'
# layout programs did not.
MIN_BYTES = 32 * 1024
MAX_DEFAULT = 4
MIN_GPU_BYTES = 40 * 2**30


def default_count() -> int:
    """`WAN_TPU_COMPILE_WORKERS` when set; else on an NVIDIA GPU of `MIN_GPU_BYTES` or more a worker per 4 cores, at
    most `MAX_DEFAULT`; else 0 (a TPU belongs to one process; a CPU's compiles are the cores' only work anyway; on a
    smaller card the workers' autotuning would compete with the run for its memory)."""
    value = os.environ.get(ENV, "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            from wan_tpu.errors import WanInputError

            raise WanInputError(f"{ENV}={value!r} is not a count; set a number of worker processes (0: off)") from None
    from wan_tpu.runtime.xla_defaults import nvidia_gpu_present

    if not nvidia_gpu_present():
        return 0
    from wan_tpu.runtime.memory import gpu_total_bytes

    if (gpu_total_bytes() or 0) < MIN_GPU_BYTES:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_DEFAULT, cores // 4)


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()
_COUNTS = {"compiled": 0, "fell_back": 0}
_COUNTS_LOCK = threading.Lock()
_STOP_AT_EXIT: list = []


def start(count: int | None = None, platform: str | None = None) -> bool:
    """Start `count` workers (default `default_count()`) for `platform` (JAX's name: "cuda", "cpu"; default: an
    NVIDIA GPU's) unless started; from here on large programs compile in them. Call it from a thread that lives
    as long as the work (the main thread): a worker ends with the thread that started it. → whether a pool runs."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            return True
        count = default_count() if count is None else count
        if count < 1 or not _install_hook():
            return False
        _POOL = _Pool(count, platform or "cuda")
        if not _STOP_AT_EXIT:
            atexit.register(stop)
            _STOP_AT_EXIT.append(True)
        return True


def stop() -> None:
    """End the workers (a compile under way in one comes back here); later programs compile in this process."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


def running() -> bool:
    return _POOL is not None


def _count(what: str) -> None:
    with _COUNTS_LOCK:
        _COUNTS[what] += 1


def wait_started(timeout: float | None = None) -> int:
    """Wait until every worker started (or failed to), at most `timeout` seconds → how many are ready."""
    pool = _POOL
    if pool is None:
        return 0
    deadline = None if timeout is None else time.monotonic() + timeout
    with pool.cond:
        while pool.starting and not pool.closed:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            pool.cond.wait(left)
        return len(pool.idle)


def stats() -> dict:
    """Workers alive (started or starting), programs they compiled, and large programs that fell back here after a
    worker failed them."""
    pool = _POOL
    return {"workers": 0 if pool is None else pool.alive, **_COUNTS}


class here:
    """`with compile_workers.here():` compiles in this thread stay in this process."""

    def __enter__(self):
        self._before = getattr(_LOCAL, "here", False)
        _LOCAL.here = True

    def __exit__(self, *exc):
        _LOCAL.here = self._before


# ---- the hook on JAX's compile ------------------------------------------------------------------------------

_ORIGINAL = None


def _install_hook() -> bool:
    """Route `jax._src.compiler.backend_compile_and_load` (module global, looked up at each call) through
    `_compile`; False where this JAX has no such function (the pool then stays off)."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return True
    try:
        from jax._src import compiler
    except ImportError:
        return False
    original = getattr(compiler, "backend_compile_and_load", None)
    if original is None:
        return False
    _ORIGINAL = original
    compiler.backend_compile_and_load = _compile
    return True


def _compile(backend, module, executable_devices, options, host_callbacks):
    pool = _POOL
    if pool is None or host_callbacks or getattr(_LOCAL, "here", False) or not pool.serves(backend, executable_devices):
        return _ORIGINAL(backend, module, executable_devices, options, host_callbacks)
    from jax._src.interpreters import mlir

    data = mlir.module_to_bytecode(module)
    if len(data) < MIN_BYTES:
        return _ORIGINAL(backend, module, executable_devices, options, host_callbacks)
    worker = pool.acquire()
    if not isinstance(worker, _Worker):  # here: in this process's own slot, or with no worker left
        try:
            return _ORIGINAL(backend, module, executable_devices, options, host_callbacks)
        finally:
            pool.release(worker)
    from wan_tpu.runtime.executable_cache import span

    try:
        with span("compile in a worker", _module_name(module)):
            reply = worker.request((data, options.SerializeAsString(), [d.id for d in executable_devices]))
    except _WorkerGone:
        pool.drop(worker)
        reply = None
    else:
        pool.release(worker)
    if reply is not None and reply[0] == "ok":
        executable = backend.deserialize_executable(reply[1], executable_devices, options)
        _count("compiled")
        return executable
    from wan_tpu.runtime import interrupt

    if interrupt.pending() is not None:  # stopping: no compile of minutes here on the way out
        raise interrupt.Interrupted(interrupt.pending())
    _count("fell_back")
    return _ORIGINAL(backend, module, executable_devices, options, host_callbacks)


def _module_name(module) -> str:
    try:
        from jax._src.lib.mlir import ir

        return ir.StringAttr(module.operation.attributes["sym_name"]).value
    except Exception:  # noqa: BLE001 - a name for the timeline only
        return "program"


# ---- the pool -------------------------------------------------------------------------------------------------

class _WorkerGone(Exception):
    pass


HERE_SLOT, HERE = "here, in this process's slot", "here, no worker left"


class _Worker:
    """One worker process and its pipes: one request at a time, framed pickles (`_send` / `_recv`)."""

    def __init__(self, platform: str):
        env = dict(os.environ)
        # No pool of device memory held: the worker's autotuning allocates what it measures and gives it back
        # (CUDA's own allocator). A pool grown on demand keeps what autotuning took, and this process's next
        # allocation beyond its reservation then failed (Matrix-Game-2 on an H200: CUDA_ERROR_OUT_OF_MEMORY).
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
        for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION", "WAN_TPU_PAUSE_AT"):
            env.pop(name, None)
        env["JAX_PLATFORMS"] = platform
        env[ENV] = "0"
        env["_WAN_TPU_COMPILE_PARENT"] = str(os.getpid())
        self.proc = subprocess.Popen([sys.executable, "-m", "wan_tpu.runtime.compile_workers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def wait_ready(self) -> None:
        """Wait for the worker's hello (its backend started)."""
        reply = self._recv()
        if reply is None or reply[0] != "ready":
            raise _WorkerGone()

    def request(self, message):
        try:
            _send(self.proc.stdin, message)
        except (OSError, ValueError):
            raise _WorkerGone() from None
        reply = self._recv()
        if reply is None:
            raise _WorkerGone()
        return reply

    def _recv(self):
        try:
            return _recv(self.proc.stdout)
        except (OSError, ValueError, EOFError, pickle.UnpicklingError):
            return None

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class _Pool:
    def __init__(self, count: int, platform: str):
        self.platform = platform
        self.cond = threading.Condition()
        self.idle: list[_Worker] = []
        self.workers: list[_Worker] = []
        self.starting = count
        self.local_busy = False
        self.closed = False
        for _ in range(count):
            try:
                worker = _Worker(platform)
            except OSError:
                self.starting -= 1
                continue
            self.workers.append(worker)
            threading.Thread(target=self._ready, args=(worker,), name="wan_tpu-compile-worker-start",
                             daemon=True).start()

    @property
    def alive(self) -> int:
        with self.cond:
            return len(self.workers)

    def _ready(self, worker: _Worker) -> None:
        try:
            worker.wait_ready()
        except _WorkerGone:
            self.drop(worker)
            return
        finally:
            with self.cond:
                self.starting -= 1
                self.cond.notify_all()
        with self.cond:
            if not self.closed:
                self.idle.append(worker)
                self.cond.notify_all()

    def serves(self, backend, executable_devices) -> bool:
        """A program for this pool's platform on devices of this process alone; on a CPU only with the caches off:
        XLA:CPU (jax 0.10.2) serialises an executable it deserialised without its functions, so the persistent
        cache's entry for it fails a later process ("Function wrapped_broadcast not found")."""
        platform = getattr(backend, "platform", None)
        if platform != {"cuda": "gpu", "rocm": "gpu"}.get(self.platform, self.platform):
            return False
        if platform == "cpu":
            from wan_tpu.runtime import compile_cache

            if compile_cache.is_enabled():
                return False
        try:
            return all(d.process_index == backend.process_index() for d in executable_devices)
        except Exception:  # noqa: BLE001 - a client without process indices: one process
            return True

    def acquire(self) -> _Worker | str:
        """An idle worker; else `HERE_SLOT` (this process's slot, taken) when that is free, or `HERE` when no
        worker is left or coming (compiled here, side by side as without a pool); else wait for whichever frees
        first."""
        with self.cond:
            while True:
                if self.idle:
                    return self.idle.pop()
                if not self.local_busy:
                    self.local_busy = True
                    return HERE_SLOT
                if not self.workers and not self.starting:
                    return HERE
                self.cond.wait()

    def release(self, taken: _Worker | str) -> None:
        """Give back what `acquire` gave."""
        with self.cond:
            if taken == HERE_SLOT:
                self.local_busy = False
            elif isinstance(taken, _Worker) and not self.closed:
                self.idle.append(taken)
            self.cond.notify_all()

    def drop(self, worker: _Worker) -> None:
        with self.cond:
            if worker in self.workers:
                self.workers.remove(worker)
            if worker in self.idle:
                self.idle.remove(worker)
            self.cond.notify_all()
        worker.close()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            workers, self.workers, self.idle = list(self.workers), [], []
            self.cond.notify_all()
        for worker in workers:
            worker.close()


def _send(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _recv(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


# ---- the worker -------------------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """SIGKILL when the thread that started this process ends (Linux), and leave if it ended already."""
    parent = int(os.environ.get("_WAN_TPU_COMPILE_PARENT", "0"))
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:
        os._exit(0)


def serve() -> None:
    """A worker's loop: compile each request on this process's client, send the executable back serialised."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command's Ctrl-C is the parent's to handle
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr, never into the replies
    import jax
    from jax._src import xla_bridge
    from jax._src.lib import xla_client as xc

    backend = xla_bridge.get_backend()
    by_id = {d.id: d for d in jax.devices()}
    _send(replies, ("ready", sorted(by_id)))
    mosaic = False
    while True:
        message = _recv(requests)
        if message is None:
            return
        data, options, device_ids = message
        try:
            if not mosaic and b"mosaic_gpu" in data:  # the kernels' custom call is registered on import
                import jax.experimental.mosaic.gpu  # noqa: F401

                mosaic = True
            devices = xc.DeviceList(tuple(by_id[i] for i in device_ids))
            start = time.perf_counter()
            executable = backend.compile_and_load(data, executable_devices=devices,
                                                  compile_options=xc.CompileOptions.ParseFromString(options))
            reply = ("ok", backend.serialize_executable(executable), time.perf_counter() - start)
            del executable
        except Exception as e:  # noqa: BLE001 - the parent compiles it itself and raises its own error
            reply = ("error", f"{type(e).__name__}: {str(e)[:2000]}")
        try:
            _send(replies, reply)
        except (OSError, ValueError):
            return


if __name__ == "__main__":
    serve()
