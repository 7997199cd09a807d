"""What the benchmark scripts share: the line that says what ran where, timing (in this process or a whole
command in a fresh one), the peers' imports (torch, and the authors' reference code with its stand-ins) and
markdown tables.

The scripts run as `python benchmarks/<name>.py` and import this file as `harness`; each one first puts its
own folder on `sys.path`, so the import also works when a test loads a script by its path. Only the standard
library is imported here: a script's `--help`, and a parent process whose children need the whole device,
never start JAX or torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# ---- what ran where --------------------------------------------------------------------------------

PACKAGES = ("jax", "jaxlib", "torch", "diffusers")


def versions() -> dict[str, str]:
    """The installed versions of JAX, jaxlib, torch and diffusers (from their metadata: nothing is imported)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def _gpu_names() -> list[str]:
    """The NVIDIA GPUs' names as the driver lists them, without starting JAX or CUDA."""
    names = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        with open(info) as f:
            names += [line.split(":", 1)[1].strip() for line in f if line.startswith("Model:")]
    if names or not shutil.which("nvidia-smi"):
        return names
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()]


def device_kind(devices: Sequence | None = None) -> str:
    """`devices` (JAX's, where the script has started its backend) as 'KIND' or 'N× KIND'; without them, the
    NVIDIA GPUs the driver lists (JAX's backend is left unstarted: a parent process leaves the device to its
    children), else a TPU's device files, else the host CPU."""
    if devices:
        kinds = [d.device_kind for d in devices]
    else:
        kinds = _gpu_names()
        if not kinds:
            return "TPU (backend not started)" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") else "cpu"
    kind = kinds[0] if len(set(kinds)) == 1 else ", ".join(sorted(set(kinds)))
    return kind if len(kinds) == 1 else f"{len(kinds)}× {kind}"


def env_line(devices: Sequence | None = None) -> str:
    """One line: jax, jaxlib, torch and diffusers versions and the device (see `device_kind`)."""
    return " · ".join([*(f"{name} {v}" for name, v in versions().items()), f"device {device_kind(devices)}"])


def print_env(devices: Sequence | None = None) -> None:
    """Print `env_line` (the first line of every benchmark's output)."""
    print(env_line(devices), flush=True)


# ---- timing in this process -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call of each timed sample, with the first warm-up call (compilation included) apart."""

    times: tuple[float, ...]
    first: float | None = None  # the first warm-up call, waited for; None without warm-up
    span: tuple[float, float] = (0.0, 0.0)  # wall clock (time.time()) at the timed samples' start and end
    out: Any = dataclasses.field(default=None, repr=False)  # the last call's result

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def ms(self) -> float:
        """The median in milliseconds."""
        return self.median * 1e3


def timed(fn: Callable, *args, **kwargs) -> tuple[Any, float]:
    """(fn(*args, **kwargs), the seconds it took). Waiting for device work is the caller's: wrap it in `fn`."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def measure(call: Callable[[], Any], sync: Callable[[Any], Any] | None, *, iters: int, warmup: int = 1,
            batch: int = 1, hold: bool = False) -> Timing:
    """`warmup` calls, each waited for, then `iters` timed samples of `batch` calls back to back (only the
    last one waited for) → seconds per call of each sample. `sync(out)` waits for a call's work
    (`jax.block_until_ready`, `torch_sync`); None: `call` returns only once its work is done. `hold`: each
    result stays alive while the next call runs (a loop `out = f()`: what a peak-memory reading taken after
    the loop then includes); else it is dropped first. The last result is returned (`Timing.out`)."""
    wait = sync or (lambda out: out)
    first = out = None
    for i in range(warmup):
        if not hold:
            out = None
        start = time.perf_counter()
        out = call()
        wait(out)
        if i == 0:
            first = time.perf_counter() - start
    times = []
    t0 = time.time()
    for _ in range(iters):
        if not hold:
            out = None
        start = time.perf_counter()
        for _ in range(batch - 1):
            call()
        out = call()
        wait(out)
        times.append((time.perf_counter() - start) / batch)
    return Timing(tuple(times), first, (t0, time.time()), out)


def rel_error(a, b) -> float:
    """Relative Frobenius error of `a` against the reference `b`, in float64."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- whole commands in fresh processes --------------------------------------------------------------

RESULT = "RESULT "  # a child's result: this prefix, then one line of JSON on its stdout


def emit_result(value) -> None:
    """Print `value` as a RESULT line, for the parent process (`Process.results`)."""
    print(RESULT + json.dumps(value), flush=True)


def read_results(text: str) -> list:
    """Every RESULT line's value in a child's output, in order."""
    return [json.loads(line[len(RESULT):]) for line in text.splitlines() if line.startswith(RESULT)]


def xla_flags_env(flags: str, **extra: str) -> dict[str, str]:
    """This process's environment with `flags` added to XLA_FLAGS (XLA reads them once per process)."""
    return dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(), **extra)


@dataclasses.dataclass(frozen=True)
class Process:
    """A finished child: exit status, seconds from spawn to exit, its output (empty when not captured) and the
    JSON it wrote to `--result-json` (None when asked for none, or when it wrote none)."""

    rc: int
    wall: float
    stdout: str = ""
    stderr: str = ""
    result: Any = None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def results(self) -> list:
        return read_results(self.stdout)


def run_fresh(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
              capture: bool = True, start_var: str | None = None, result_json: bool = False) -> Process:
    """`argv` in a fresh process, timed from spawn to exit. `env`: variables over this process's; `capture`:
    keep its stdout and stderr (else they stream through); `start_var`: a variable set to the spawn time
    (`time.time()`), from which the child times itself (`process_start`); `result_json`: `--result-json FILE`
    appended, and the JSON the child wrote there read back. A child past `timeout` seconds is stopped and
    `subprocess.TimeoutExpired` raised, as `subprocess.run` does."""
    with tempfile.TemporaryDirectory() if result_json else contextlib.nullcontext() as tmp:
        path = os.path.join(tmp, "result.json") if result_json else None
        argv = [*argv, "--result-json", path] if path else list(argv)
        full = {**os.environ, **(env or {})}
        if start_var:
            full[start_var] = repr(time.time())
        start = time.perf_counter()
        done = subprocess.run(argv, env=full, capture_output=capture, text=True, timeout=timeout)
        wall = time.perf_counter() - start
        result = None
        if path and os.path.isfile(path):
            with open(path) as f:
                result = json.load(f)
    return Process(done.returncode, wall, done.stdout or "", done.stderr or "", result)


def process_start(var: str) -> float:
    """When this process was spawned (`run_fresh(start_var=var)`), else now."""
    return float(os.environ.get(var, time.time()))


def run_part(argv: Sequence[str], deadline: float | None = None, limit: float | None = None) -> tuple[Any, str | None]:
    """One part of a benchmark in a fresh process (its output streams through) that writes its result to
    `--result-json`, stopped at `deadline` (a `time.perf_counter()` time; `limit`: the `--time-limit` seconds it
    comes from) → (its result, None), or (None, why there is none)."""
    timeout = None if deadline is None else deadline - time.perf_counter()
    if timeout is not None and timeout <= 0:
        return None, f"not run (--time-limit {limit:g} s reached)"
    try:
        proc = run_fresh(argv, timeout=timeout, capture=False, result_json=True)
    except subprocess.TimeoutExpired:
        return None, f"stopped at --time-limit {limit:g} s"
    if proc.result is None:
        return None, f"failed (exit status {proc.rc}; see its output above)"
    return proc.result, None


# ---- the peers: torch, and the authors' reference code ------------------------------------------------


def has_cuda() -> bool:
    """Whether torch is installed and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_sync(out=None):
    """Wait for torch's queued CUDA work (on the CPU torch runs synchronously); returns `out`."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def sdpa_flash_attn(q, k, v, *args, **kwargs):
    """flash-attn's `flash_attn_func` contract, (B, S, H, D) with an optional `causal=`, on torch SDPA."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                         is_causal=kwargs.get("causal", False))
    return out.transpose(1, 2)


def sdpa_xformers(q, k, v, attn_bias=None, op=None):
    """xformers' `memory_efficient_attention` with an additive bias, on torch SDPA."""
    import torch.nn.functional as F

    mask = None if attn_bias is None else attn_bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def stub_module(name: str, attrs: dict | None = None, path: str | None = None) -> types.ModuleType:
    """A module registered as `name` in `sys.modules`, holding `attrs` (`path`: a package's folder, whose
    `__init__` is not run), set on its parent where that is imported, with a `__spec__` (what
    `importlib.util.find_spec` probes)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=path is not None)
    if path is not None:
        module.__path__ = [path]
    for key, value in (attrs or {}).items():
        setattr(module, key, value)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def import_torchvision() -> bool:
    """Import torchvision if it is installed (False if not). A PyPI torchvision beside a CPU build of torch
    fails registering its fake kernels; it is imported again with those registrations skipped."""
    if not _installed("torchvision"):
        return False
    import torch

    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        register_fake = torch.library.register_fake
        torch.library.register_fake = lambda *a, **k: (lambda f: f)
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        try:
            import torchvision  # noqa: F401
        finally:
            torch.library.register_fake = register_fake
    return True


def import_reference(root: str, modules: Iterable[str] = (), *, first: Iterable[str] = (),
                     stubs: dict[str, dict] | None = None, missing: dict[str, dict] | None = None,
                     packages: Iterable[str] = ()) -> types.SimpleNamespace:
    """The authors' code in the checkout folder `root`, importable beside ours, with runtime stand-ins only
    where it cannot run here:

    - torchvision, where installed, imported first (`import_torchvision`);
    - `first`: modules imported before any stand-in exists (libraries such as diffusers and transformers
      probe for flash-attn or torchvision while importing and must see what is really installed);
    - `root` put first on `sys.path`;
    - `packages`: packages of the checkout made importable without running their `__init__`;
    - `stubs`: name → attributes of modules put in place whether installed or not (flash-attn, xformers:
      their kernels routed to torch SDPA, `sdpa_flash_attn`, `sdpa_xformers`);
    - `missing`: the same, only where the top-level package is not installed (cv2, decord, ...);
    - `modules`: then imported from the checkout; returned as a namespace by their last name, with `root`.
    """
    import_torchvision()
    for name in first:
        importlib.import_module(name)
    root = os.path.abspath(root)
    sys.path.insert(0, root)
    absent = {name for name in (missing or {}) if not _installed(name)}
    for name in packages:
        stub_module(name, path=os.path.join(root, *name.split(".")))
    for name, attrs in (stubs or {}).items():
        stub_module(name, attrs)
    for name, attrs in (missing or {}).items():
        if name in absent:
            stub_module(name, attrs)
    found = {name.rsplit(".", 1)[-1]: importlib.import_module(name) for name in modules}
    return types.SimpleNamespace(root=root, **found)


# ---- tables -------------------------------------------------------------------------------------------


def row(*cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def header(*names: str) -> str:
    """A markdown table's header row and its rule."""
    return row(*names) + "\n|" + "---|" * len(names)


def table(head: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table; a row shorter than `head` (a skipped or failed entry: its name and why) is filled with
    empty cells."""
    return "\n".join([header(*head), *(row(*r, *[""] * (len(head) - len(r))) for r in rows)])
