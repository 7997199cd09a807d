"""One run over several processes: JAX's multi-controller runtime (TPU pod slices, N GPUs as N processes).

Every process runs the same command; `jax.distributed` joins them into one job whose mesh spans every
process's devices (`wan_tpu.make_mesh` over `jax.devices()`, not `jax.local_devices()`). It starts

- from the common flags `--coordinator HOST:PORT --num-processes N --process-id I` (`initialize_from_args`,
  called by the CLI harness before any device use), or the same three as `WAN_TPU_COORDINATOR`,
  `WAN_TPU_NUM_PROCESSES`, `WAN_TPU_PROCESS_ID`;
- else by itself where JAX detects the job (a multi-host Cloud TPU slice, Slurm, Open MPI, the
  `JAX_COORDINATOR_ADDRESS` variables: `wan_tpu.parallel.mesh.maybe_initialize_distributed`).

Then:
- each host reads only its devices' slices of the checkpoint (`wan_tpu.parallel.sharding.place_param`);
- process 0 is the one writer (`is_writer`): mp4 and stage files; results spread over processes are
  gathered first (`to_host`). The others print one line saying so and nothing else on stdout, and show
  no progress (`writer_output`): the "wrote" lines and the timing tables are process 0's;
- a job's result does not depend on how its devices are split over processes, bit for bit, a job of one
  process included (`--num-processes 1`). A process outside any job may differ from it by float rounding,
  on CPU alone: XLA's CPU all-reduce adds in device order there and in gloo's order in a job, and the
  sharded programs (UMT5, the DiT's embedders and cross-attention K/V, the VAE) add partial products with
  it; on GPUs both run NCCL's;
- a signal or a failure on any process stops every process at its next safe point: the process it
  happened in publishes it in the job's key-value store, and a watcher thread in every other process
  raises the same signal there (a failure is passed on as SIGTERM), so each ends with its one
  `wan_tpu.runtime.interrupt` line and status (130 / 143). A process that does not reach a safe point
  within `STOP_GRACE_S` is waiting inside a collective whose peers have left: the watcher sends the
  signal a second time, which exits at once and removes the temporary files;
- at the end (`finish`), the others wait until process 0 has ended (its files are written), then all
  leave the job together, so that no process sees the coordinator vanish;
- `publish` / `lookup` / `wait_for` / `forget`: values process 0 hands the others through the same store
  (a server's jobs: `wan_tpu.serve.worker`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from wan_tpu.errors import WanInputError

ENV = {"coordinator": "WAN_TPU_COORDINATOR", "num_processes": "WAN_TPU_NUM_PROCESSES", "process_id": "WAN_TPU_PROCESS_ID"}
# The variables `wan_tpu.parallel.mesh.maybe_initialize_distributed` reads: with none of them set there is no job
# to detect, and a command goes on without importing JAX yet.
DETECTED_ENV = ("WAN_TPU_COORDINATOR", "JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES",
                "TPU_PROCESS_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
STOP_GRACE_S = 10.0
POLL_S = 0.05
LEAVE_MARGIN_S = 0.5
# Long enough for a slow peer's last write; short enough that a crashed peer does not hold the others for minutes.
SHUTDOWN_TIMEOUT_S = 120
HEARTBEAT_TIMEOUT_S = 60

_STOP = "wan_tpu/stop/"
_END = "wan_tpu/end/"
_state = {"watcher": None, "stop_seen": None, "published": False, "finished": False, "together": False}


def _jax_started() -> bool:
    # Without jax imported there is no job to ask about, and `import wan_tpu` stays free of jax.
    if "jax" not in sys.modules:
        return False
    import jax

    return jax.distributed.is_initialized()


def process_index() -> int:
    """This process's rank in the job (0 when there is no job)."""
    if not _jax_started():
        return 0
    import jax

    return jax.process_index()


def process_count() -> int:
    if not _jax_started():
        return 1
    import jax

    return jax.process_count()


def is_writer() -> bool:
    """Whether this process writes the run's files: process 0, or the only one."""
    return process_index() == 0


def to_host(x):
    """A device array as numpy on this process; one spread over several processes is gathered whole
    (a collective: every process calls it at the same point)."""
    import numpy as np

    if "jax" in sys.modules:
        import jax

        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _parse(coordinator, num_processes, process_id) -> tuple[str | None, int | None, int | None]:
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    flags = {"coordinator": "--coordinator", "num_processes": "--num-processes", "process_id": "--process-id"}
    for key, value in given.items():
        if value is None and os.environ.get(ENV[key]):
            given[key] = os.environ[ENV[key]]
    coordinator = given["coordinator"]
    if coordinator is not None:
        host, _, port = str(coordinator).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise WanInputError(f"coordinator {coordinator!r} is not HOST:PORT; pass e.g. --coordinator 10.0.0.2:8476 "
                                "(process 0's address, the same on every process)")
    numbers = {}
    for key in ("num_processes", "process_id"):
        value = given[key]
        if value is None:
            numbers[key] = None
            continue
        try:
            numbers[key] = int(value)
        except (TypeError, ValueError):
            raise WanInputError(f"{flags[key]} {value!r} is not a whole number; pass e.g. {flags[key]} 1") from None
    n, i = numbers["num_processes"], numbers["process_id"]
    if n is not None and n < 1:
        raise WanInputError(f"--num-processes {n}: pass the number of processes of the job (1 or more)")
    if (n is None) != (i is None) or (coordinator is None and n is not None):
        raise WanInputError("--coordinator, --num-processes and --process-id go together (or leave all three out "
                            "where JAX detects the job: a TPU pod slice, Slurm, Open MPI)")
    if n is not None and not 0 <= i < n:
        raise WanInputError(f"--process-id {i} is outside 0..{n - 1}; number the {n} processes from 0")
    return coordinator, n, i


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join the multi-process job, before any device use; True if this call started it.

    Arguments left out are read from `WAN_TPU_COORDINATOR`, `WAN_TPU_NUM_PROCESSES`, `WAN_TPU_PROCESS_ID`;
    with none of them, JAX's own detection decides (nothing happens on a single host). Every process of
    the job calls it with the same coordinator and job size and its own id. A job of one process is a job
    too: it computes what a job of several computes on the same devices (module docstring)."""
    coordinator, n, i = _parse(coordinator, num_processes, process_id)
    if coordinator is None and not any(os.environ.get(name) for name in DETECTED_ENV):
        return False
    import jax

    from wan_tpu.parallel.mesh import maybe_initialize_distributed

    if jax.distributed.is_initialized():
        return False
    # JAX's preemption service takes SIGTERM for itself; the interrupt contract (143, no partial file) needs it.
    jax.config.update("jax_enable_preemption_service", False)
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        # A CPU job's collectives need an implementation across processes (tests, CPU-only hosts).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator is None:
        started = maybe_initialize_distributed()
    else:
        try:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=i,
                                       heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                       shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
        except RuntimeError as e:
            raise WanInputError(f"could not join the job at {coordinator} as process {i} of {n} ({str(e).splitlines()[0]}); "
                                "start every process with the same --coordinator (process 0's HOST:PORT) and "
                                "--num-processes, before any other JAX work") from None
        started = True
    if started:
        _start_watcher()
    return started


def initialize_from_args(args) -> bool:
    """`initialize` from a command's parsed common flags (those of `wan_tpu.runtime.cli.add_common_args`)."""
    return initialize(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                      getattr(args, "process_id", None))


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


@contextlib.contextmanager
def writer_output(args=None):
    """Around a command's work: on a process other than 0, one line saying that process 0 writes, then nothing
    on stdout and no progress bars (`args.quiet` set); errors and the interrupt line still reach stderr."""
    if is_writer():
        yield
        return
    print(f"process {process_index()} of {process_count()}: process 0 writes the outputs", flush=True)
    if args is not None and hasattr(args, "quiet"):
        args.quiet = True
    # The descriptor too: gloo's C++ prints its connections on stdout.
    saved = os.dup(1)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


_SHARED = "wan_tpu/shared/"


def publish(key: str, value: bytes | str) -> None:
    """Put `value` in the job's key-value store under `key`, for the other processes (`lookup`, `wait_for`);
    a key holds one value until `forget`."""
    _client().key_value_set_bytes(_SHARED + key, value.encode() if isinstance(value, str) else value)


def lookup(key: str) -> bytes | None:
    """The value published under `key`, None if there is none yet."""
    try:
        return _client().key_value_try_get_bytes(_SHARED + key)
    except Exception as e:  # JaxRuntimeError; only its message tells a missing key from a lost coordinator
        if "NOT_FOUND" in str(e):
            return None
        raise


def wait_for(key: str, timeout_s: float) -> bytes | None:
    """The value published under `key`, waiting up to `timeout_s` for it; None if none came."""
    try:
        return _client().blocking_key_value_get_bytes(_SHARED + key, max(1, int(timeout_s * 1000)))
    except Exception as e:
        if "DEADLINE_EXCEEDED" in str(e):
            return None
        raise


def forget(prefix: str) -> None:
    """Remove `prefix` and every key under it (`prefix` ending in "/") from the store."""
    _client().key_value_delete(_SHARED + prefix)


def _publish_stop(signum: int) -> None:
    if _state["published"]:
        return
    _state["published"] = True
    with contextlib.suppress(Exception):
        _client().key_value_set(f"{_STOP}{process_index()}", str(int(signum)))


def _peer_stop() -> int | None:
    """The signal another process published, if any."""
    me = f"{_STOP}{process_index()}"
    for key, value in _client().key_value_dir_get(_STOP):
        if key.rstrip("/") != me:
            return int(value)
    return None


def _watch() -> None:
    from wan_tpu.runtime import interrupt

    while not _state["finished"]:
        time.sleep(POLL_S)
        try:
            local = interrupt.pending()
            if local is not None:
                _publish_stop(local)
            peer = None if _state["stop_seen"] is not None else _peer_stop()
        except Exception:  # the job is ending (a peer left, the coordinator closed): nothing to pass on
            return
        if peer is not None and local is None:
            _state["stop_seen"] = time.monotonic()
            _state["published"] = True  # this process stops because of the peer; it has nothing to add
            os.kill(os.getpid(), peer)
        if _state["stop_seen"] is not None and time.monotonic() - _state["stop_seen"] > STOP_GRACE_S:
            # Still running: blocked in a collective the stopped peers will never join.
            os.kill(os.getpid(), interrupt.pending() or signal.SIGTERM)
            return
        if local is not None and _state["stop_seen"] is None:
            _state["stop_seen"] = time.monotonic()


def _start_watcher() -> None:
    _state.update(stop_seen=None, published=False, finished=False, together=False)
    watcher = threading.Thread(target=_watch, name="wan_tpu-job", daemon=True)
    _state["watcher"] = watcher
    watcher.start()


@contextlib.contextmanager
def stop_all_on_error():
    """Around a command's work in a job: an exception here stops the other processes too (as SIGTERM).

    An error a stopped peer caused here (a collective it left) ends this process as that peer's signal.
    Any other unexpected error prints its traceback and leaves at once with status 1: leaving the job in
    order would wait for peers that are stopping."""
    try:
        yield
    except BaseException as e:
        if not _jax_started() or _state["together"]:
            raise
        from wan_tpu.errors import NonFiniteError
        from wan_tpu.runtime import interrupt

        peer = _wait_peer_stop() if isinstance(e, Exception) and not isinstance(e, (WanInputError, NonFiniteError)) else None
        _publish_stop(getattr(e, "signum", None) or interrupt.pending() or peer or signal.SIGTERM)
        if peer is not None:
            raise interrupt.Interrupted(peer) from None
        if isinstance(e, (WanInputError, NonFiniteError, interrupt.Interrupted, KeyboardInterrupt)):
            raise
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        _state["finished"] = True
        _outlive_peers()
        os._exit(1)


def stop_together() -> None:
    """This command stops where every process of the job stops, knowing it (a server's end, `wan_tpu.serve`):
    its stop is not passed on, and the job is left in order (`finish`), so that no process outlives the
    coordinator (whose loss the others' JAX clients take for a crash, and abort)."""
    _state["together"] = True


def _outlive_peers() -> None:
    """A stopped job's end: each process says it is leaving; process 0, whose process hosts the job's coordinator,
    waits (up to `STOP_GRACE_S`) until every other one has, and `LEAVE_MARGIN_S` more for their exits: a JAX
    client that loses the coordinator takes it for a crash and aborts its process (status 134, a stack dump)
    instead of ending with its own line and status."""
    with contextlib.suppress(Exception):
        client = _client()
        client.key_value_set(f"{_END}{process_index()}", "stopped", allow_overwrite=True)
        if not is_writer() or process_count() == 1:
            return
        others = {f"{_END}{i}" for i in range(1, process_count())}
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and not others <= {key.rstrip("/") for key, _ in client.key_value_dir_get(_END)}:
            time.sleep(POLL_S)
        time.sleep(LEAVE_MARGIN_S)


def _wait_peer_stop(wait_s: float = 1.0) -> int | None:
    """The signal a peer published, waiting a moment for it: a peer publishes before it leaves, but this
    process may see the collective fail before its watcher sees the publication."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(Exception):
            peer = _peer_stop()
            if peer is not None:
                return peer
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)


def finish() -> None:
    """End of a command in a job: the others wait for process 0 (the writer) to end, then all leave the job.

    A stopped job ends without leaving it in order (its processes exit as they stop; the exit ends
    the connections): a peer that did not stop cleanly would hold the others in the leaving barrier.
    Process 0 still leaves last (`_outlive_peers`)."""
    if not _jax_started() or _state["finished"]:
        return
    if _state["published"] or _state["stop_seen"] is not None:
        _state["finished"] = True
        _outlive_peers()
        return
    import jax

    client = _client()
    with contextlib.suppress(Exception):
        client.key_value_set(f"{_END}{process_index()}", "1")
    if not is_writer():
        from wan_tpu.runtime import interrupt

        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        while time.monotonic() < deadline:
            if interrupt.pending() is not None:  # stopped while waiting: leave through the exit, as a stopped job does
                _state["finished"] = True
                return
            try:
                ended = dict((key.rstrip("/"), value) for key, value in client.key_value_dir_get(_END))
            except Exception:
                break
            if ended.get(f"{_END}0") == "stopped":  # process 0 stopped after this one's work: leave as it does
                _state["finished"] = True
                return
            if f"{_END}0" in ended:
                break
            time.sleep(POLL_S)
    _state["finished"] = True
    with contextlib.suppress(Exception):
        jax.distributed.shutdown()
