"""Stage timing, named trace scopes, MFU, and the GPU's clock and power while work runs (`GpuMonitor`).

Trace hierarchy (what `--profile DIR` shows in Perfetto / TensorBoard):
  data_preparation (text encode, image encode) → pipeline → denoise/step_i → dit_forward → dit_block
  (the scanned transformer block) → vae_decode → export.
Host-side regions use `jax.profiler.TraceAnnotation` (visible on the host timeline); code traced
inside `jit` uses `jax.named_scope`, which names the HLO ops and so the device kernels.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import jax

# Peak dense bf16 FLOP/s per device used as the MFU denominator. NVIDIA Hopper: the 8192³ bf16
# matmul ceiling measured on an H200 (772 TFLOP/s, `measured_peak_flops`), applied to the H100 too
# (same SM count and clocks; the spec sheet's 989 TFLOP/s is not reached by any matmul). TPUs: the
# published dense bf16 peaks.
PEAK_BF16_FLOPS = {
    "H200": (772e12, "measured 8192^3 bf16 matmul ceiling on H200"),
    "H100": (772e12, "measured 8192^3 bf16 matmul ceiling on H200 (same SMs/clocks)"),
    "TPU v6 lite": (918e12, "TPU v6e spec"),
    "TPU v5 lite": (197e12, "TPU v5e spec"),
    "TPU v5p": (459e12, "TPU v5p spec"),
    "TPU v5": (459e12, "TPU v5p spec"),
    "TPU v4": (275e12, "TPU v4 spec"),
    "TPU7x": (2307e12, "TPU v7x spec"),
}


def peak_flops(device=None) -> tuple[float | None, str]:
    """(peak bf16 FLOP/s of one device, where the figure comes from), or (None, reason)."""
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    # Longest key first so "TPU v5 lite" wins over "TPU v5".
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key.lower() in kind.lower():
            return PEAK_BF16_FLOPS[key]
    return None, f"no peak known for device kind {kind!r}"


def measured_peak_flops(n: int = 8192, device=None) -> float:
    """bf16 FLOP/s of an n×n×n matmul on `device`: the MFU denominator measured in the same run
    (median of 5 timings of 10 back-to-back products, after one warm-up)."""
    import statistics

    import jax.numpy as jnp

    device = device or jax.devices()[0]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (n, n), jnp.bfloat16), device)
    b = jax.device_put(jax.random.normal(kb, (n, n), jnp.bfloat16), device)
    matmul = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(matmul(a, b))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready([matmul(a, b) for _ in range(10)])
        times.append((time.perf_counter() - start) / 10)
    return 2 * n**3 / statistics.median(times)


def dit_forward_flops(config, num_tokens: int, text_len: int = 512, image_len: int = 0) -> float:
    """Model FLOPs of one DiT forward for one batch element (multiply-add = 2 FLOPs).

    Per layer: self q,k,v,o projections, self attention, cross q,o, cross k,v over the text (and the
    CLIP image tokens for Wan 2.1 I2V), cross attention, the FFN; plus patch embedding and the output
    projection. Norms, modulation and RoPE are elementwise and left out, as in the usual MFU count.
    """
    s, d, f = num_tokens, config.inner_dim, config.ffn_dim
    kv = text_len + image_len
    per_layer = 8 * s * d * d + 4 * s * s * d + 4 * s * d * d + 4 * kv * d * d + 4 * s * kv * d + 4 * s * d * f
    patch = 1
    for p in config.patch_size:
        patch *= p
    embed = 2 * s * config.in_channels * patch * d + 2 * s * d * config.out_channels * patch
    text = 2 * text_len * (config.text_dim * d + d * d)
    return float(config.num_layers * per_layer + embed + text)


@contextlib.contextmanager
def trace(log_dir: str | None):
    """Record a JAX profiler trace into `log_dir` (a no-op when None).

    The Python function tracer is off: it records every Python call (imports, torch module setup)
    and fills the trace's event budget before the device work starts. The named regions remain.
    """
    if log_dir is None:
        yield
        return
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(log_dir, profiler_options=options):
        yield


def op_times(log_dir: str) -> list[tuple[str, float, int]]:
    """The XLA ops of the trace(s) under `log_dir` by total time: (op, seconds, count), largest first.

    Ops are the `hlo_op` of each kernel event, numbered instances merged (`convolution.12` and
    `convolution.3` → `convolution`; fusions keep their kind, e.g. `loop_fusion`). A `custom-call`
    that launched a GEMM kernel (XLA's int8 cuBLASLt products are bare custom calls) is
    `custom-call (gemm)`. Device planes when the trace has any (GPU/TPU kernels), else the host's
    (the CPU runtime's thunks)."""
    per_op: dict[str, list] = {}  # exact op: [seconds, events, kernel names]
    for path in glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True):
        planes = list(jax.profiler.ProfileData.from_file(path).planes)
        device = [p for p in planes if p.name.startswith("/device:")]
        for plane in device or planes:
            for line in plane.lines:
                for event in line.events:
                    op = dict(event.stats).get("hlo_op")
                    if op:
                        row = per_op.setdefault(str(op), [0.0, 0, set()])
                        row[0] += event.duration_ns * 1e-9
                        row[1] += 1
                        row[2].add(event.name)
    totals: dict[str, list] = {}
    for op, (t, n, kernels) in per_op.items():
        row = totals.setdefault(op_kind(op, kernels), [0.0, 0])
        row[0] += t
        row[1] += n
    return sorted(((op, t, n) for op, (t, n) in totals.items()), key=lambda r: -r[1])


def op_kind(op: str, kernels=()) -> str:
    """`op_times`' name for one XLA op instance that launched `kernels` (their names)."""
    name = re.sub(r"[.\d]+$", "", op)
    if name == "custom-call" and any(re.search(r"gemm|nvjet|xmma|cutlass", k, re.I) for k in kernels):
        return "custom-call (gemm)"
    return name


def op_class(op: str) -> str:
    """The `OP_CLASSES` class of an `op_times` op name."""
    return next((c for c, pattern in OP_CLASSES if re.search(pattern, op)), "other")


OP_CLASSES = (  # (class, pattern on XLA op names), first match wins: `op_class_table`
    ("matmul", r"gemm|matmul|cublas|\bdot"),
    # `mpmd_map`: a Pallas Mosaic GPU kernel (ours are the attention kernels)
    ("attention", r"mpmd_map|custom-call|fmha|mosaic|flash|splash"),
    ("weight slices (a scanned layer's weights out of the stack)", r"dynamic_slice"),
    ("fusions (norms, modulation, RoPE, GELU, residuals, quantisation)",
     r"fusion|convert|transpose|copy|reduce|broadcast|add|multiply|triton"),
)


def op_class_table(log_dir: str, title: str, top: int = 8) -> list[str]:
    """Time on the device of one traced forward, by op class, then its largest ops."""
    rows = op_times(log_dir)
    total = sum(t for _, t, _ in rows) or 1e-12
    classes: dict[str, float] = {}
    for op, t, _ in rows:
        cls = op_class(op)
        classes[cls] = classes.get(cls, 0.0) + t
    out = [f"PROFILE {title}: {1e3 * total:.1f} ms of device ops"]
    out += [f"PROFILE   class {c:52} {1e3 * t:9.2f} ms {100 * t / total:5.1f}%" for c, t in
            sorted(classes.items(), key=lambda r: -r[1])]
    out += [f"PROFILE   op    {op:52} {1e3 * t:9.2f} ms {100 * t / total:5.1f}% {n:6d} runs" for op, t, n in rows[:top]]
    return out


@contextlib.contextmanager
def scope(name: str):
    """A named region on the host timeline of a trace (cheap when no trace is running)."""
    with jax.profiler.TraceAnnotation(name):
        yield


class GpuMonitor:
    """The GPU's SM clock, board power, temperature and throttle reasons, sampled by `nvidia-smi` every
    `interval_ms` in a process of its own while the `with` block runs (nothing off NVIDIA GPUs).

    H100 and H200 cards run under a 700 W limit and under dense work they reach it: the SM clock then
    falls from 1980 MHz to whatever holds the power there, so a timing means little without the
    clock it ran at. `window(t0, t1)` (`time.time()` values) is what was sampled in between.
    """

    QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self, interval_ms: int = 50):
        self.interval_ms = interval_ms
        self.log = None
        self._proc = None

    def __enter__(self):
        if jax.default_backend() == "gpu" and shutil.which("nvidia-smi"):
            self.log = os.path.join(tempfile.mkdtemp(prefix="gpu_monitor_"), "smi.csv")
            # nvidia-smi numbers GPUs as the machine does; JAX's first is CUDA_VISIBLE_DEVICES' first.
            first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                           "-i", first if first.isdigit() else "0", "-lms", str(self.interval_ms),
                                           "-f", self.log])
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            time.sleep(2 * self.interval_ms / 1e3)  # the last window's samples
            self._proc.terminate()
            self._proc.wait()
            self._proc = None

    def samples(self) -> list[tuple]:
        """(time.time(), SM MHz, W, °C, throttle reasons) per sample so far."""
        return read_smi_samples(self.log) if self.log and os.path.exists(self.log) else []

    def window(self, t0: float, t1: float) -> list[tuple]:
        return [r for r in self.samples() if t0 <= r[0] <= t1]


def read_smi_samples(path: str) -> list[tuple]:
    """`GpuMonitor`'s log: (time.time(), SM MHz, W, °C, throttle reasons) rows."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
            except (ValueError, IndexError):
                continue  # a header, "[N/A]", or a line cut by the sampler's exit
    return rows


def clock_summary(samples: list[tuple], min_seconds: float = 1.0) -> str:
    """"SM 1500 MHz, 697 W" (medians) for a `GpuMonitor.window`; "" for a window under `min_seconds`:
    nvidia-smi's power.draw is a one-second average on Hopper cards, so a short window's reading is
    mostly the work before it, and the power limiter needs a moment to pull the clock down."""
    if not samples or samples[-1][0] - samples[0][0] < min_seconds:
        return ""
    return (f"SM {statistics.median(r[1] for r in samples):.0f} MHz, "
            f"{statistics.median(r[2] for r in samples):.0f} W")


_IMPORTED = time.perf_counter()


def process_start() -> float:
    """This process's start as a `time.perf_counter()` value: from the kernel's process table on Linux
    (10 ms resolution), else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.perf_counter() - max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


class _Elapsed:
    """`name: 3s` on stderr from the first second of a stage on, refreshed every second, cleared at its end."""

    def __init__(self, name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._show, args=(name,), name="wan_tpu-progress", daemon=True)
        self._thread.start()

    def _show(self, name: str) -> None:
        from tqdm import tqdm

        # A stage that shows a bar of its own (denoise steps, stream chunks) is left to it.
        if self._stop.wait(1.0) or getattr(tqdm, "_instances", None):
            return
        bar = tqdm(desc=name, total=None, bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False,
                   initial=0, mininterval=0.5)
        while not self._stop.wait(1.0):
            bar.refresh()
        bar.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _memory_stats(device) -> dict:
    return device.memory_stats() or {}


class _StagePeak:
    """The peak device memory of one stage, on the first local device, where the backend reports
    `memory_stats()` (GPU, TPU; not CPU). XLA's `peak_bytes_in_use` is the process's peak so far and cannot
    be reset: where it rose during the stage it is the stage's own peak, exactly; where the stage stayed
    below an earlier stage's peak, the largest `bytes_in_use` seen by a thread sampling every
    `interval` seconds is (a compiled program holds its temporaries for its whole run, so a program that
    runs longer than that is seen at its peak)."""

    def __init__(self, interval: float = 0.01):
        self.device = jax.local_devices()[0]
        stats = _memory_stats(self.device)
        self.before = stats.get("peak_bytes_in_use")
        self.seen = stats.get("bytes_in_use", 0)
        self._stop = threading.Event()
        self._thread = None
        if self.before is not None:
            self._thread = threading.Thread(target=self._sample, args=(interval,), name="wan_tpu-memory", daemon=True)
            self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.seen = max(self.seen, _memory_stats(self.device).get("bytes_in_use", 0))

    def close(self) -> tuple[int, bool] | None:
        """(peak bytes, whether exact) or None where the backend reports no memory."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        stats = _memory_stats(self.device)
        after = stats.get("peak_bytes_in_use", self.before)
        if after > self.before:
            return after, True
        return max(self.seen, stats.get("bytes_in_use", 0)), False


@dataclass
class StageTimer:
    """Wall-clock seconds per named stage, in the order the stages ran, and each stage's peak device
    memory where the backend reports it (`_StagePeak`; a stage run several times: its largest).

    With `since` (a `time.perf_counter()` value, e.g. `process_start()`), the time from `since` to the
    start of the first stage is the first row, `startup`: imports, argument checks, device set-up.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    since: float | None = None
    # A command line's stages show `name: 12s` on stderr, refreshed every second, once they pass a second
    # (loading, compiling, sampling: a user sees the command working); off for --quiet and from Python.
    progress: bool = False
    peaks: dict[str, tuple[int, bool]] = field(default_factory=dict)  # stage → (bytes, exact), first device

    @contextlib.contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        if self.since is not None and "startup" not in self.seconds:
            self.seconds["startup"] = start - self.since
        shown = _Elapsed(name) if self.progress else None
        peak = _StagePeak()
        with scope(name):
            try:
                yield
            finally:
                if shown is not None:
                    shown.close()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                measured = peak.close()
                if measured is not None:
                    self.peaks[name] = max(self.peaks.get(name, measured), measured)

    def table(self, extra: list[tuple[str, str]] = ()) -> str:
        """One row per stage (seconds), the total, the `extra` rows; then, where measured, each stage's
        peak device memory in GiB (`≥`: sampled, below an earlier stage's peak; `_StagePeak`)."""
        rows = [(name, f"{sec:9.2f} s") for name, sec in self.seconds.items()]
        rows.append(("total", f"{sum(self.seconds.values()):9.2f} s"))
        rows.extend(extra)
        peaks = [(f"  {name}", f"{'' if exact else '≥'}{peak / 2**30:.2f}".rjust(9))
                 for name, (peak, exact) in self.peaks.items()]
        width = max(len(r[0]) for r in rows + peaks)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        if peaks:
            lines += [PEAK_HEADER] + [f"{k:<{width}}  {v}" for k, v in peaks]
        return "\n".join(lines)


PEAK_HEADER = "peak device memory, GiB (first device)"


def mfu(flops_per_step: float, seconds_per_step: float, num_devices: int, device=None) -> tuple[str, str]:
    """Formatted (MFU, basis) for a measured step time; "n/a" when the device peak is unknown."""
    peak, basis = peak_flops(device)
    if peak is None or seconds_per_step <= 0:
        return "n/a", basis
    value = flops_per_step / seconds_per_step / (peak * num_devices)
    return f"{100 * value:.1f}%", f"{peak / 1e12:.0f} TFLOP/s per device x {num_devices} ({basis})"
