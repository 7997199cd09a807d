"""Memory the process can use: host RAM (cgroup-aware), free device memory, and how much of a GPU a
command line claims. The per-stage working-set estimates of a family live with it
(`wan_tpu.wan.memory` for Wan)."""

from __future__ import annotations

import os

GiB = 2**30


def host_available_bytes() -> int | None:
    """RAM this process can still take: /proc/meminfo's MemAvailable, capped by the cgroup's limit."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = f.read().strip(), int(g.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            available = min(available, int(limit) - usage)
        break
    return max(0, available)


def available_bytes() -> tuple[int | None, str]:
    """(free bytes per device, what they are): host RAM on CPU, device memory on GPU/TPU."""
    import jax

    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return host_available_bytes(), "host RAM"
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None, f"{device.device_kind} memory"
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.device_kind} memory per device"


# JAX takes 75% of a GPU's memory by default; a command line takes at most 90% (the rest: CUDA's context and
# the cuBLAS/cuDNN workspaces outside XLA's allocator), so a 14B 720p run has room on an 80 GB GPU.
GPU_MEMORY_FRACTION = "0.9"
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jaxlib refuses both set


def gpu_total_bytes() -> int | None:
    """The smallest total memory of the visible NVIDIA GPUs, asked of the CUDA driver before JAX starts its
    backend (XLA's own `cuInit` then finds the driver started); None without a driver or with JAX told to
    use other platforms."""
    import ctypes

    from wan_tpu.runtime.xla_defaults import nvidia_gpu_allowed

    if not nvidia_gpu_allowed():
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    totals = []
    for i in range(count.value):
        device, size = ctypes.c_int(), ctypes.c_size_t()
        if cuda.cuDeviceGet(ctypes.byref(device), i) != 0 or cuda.cuDeviceTotalMem_v2(ctypes.byref(size), device) != 0:
            return None
        totals.append(size.value)
    return min(totals)


def claim_device_memory(need_bytes: int | None = None) -> str | None:
    """For a command line, before the first device use: how much of each GPU XLA reserves at start (→ the
    fraction set, or None where the user chose: `XLA_CLIENT_MEM_FRACTION`, `XLA_PYTHON_CLIENT_MEM_FRACTION`,
    or preallocation off).

    `need_bytes`: what the run needs on a device at most (a world model's command: its weights plus a
    working set, `world_model_need`); the reservation is that much, up to `GPU_MEMORY_FRACTION`. Without it
    (Wan, whose 14B 720p run fills an 80 GB card) or where the card's size is unknown: that fraction.
    Reserving costs start time in proportion (an H200, jax 0.11.2, a fresh process's first transfer: 2.07–3.47 s
    with 90% reserved, 0.76–0.88 s with 25%, 0.29–0.40 s growing on demand). Sized by `world_model_need`,
    Matrix-Game-2's whole warm command took 5.30–5.68 s instead of 6.73–7.53 s, UnifoLM's 10.27–10.70 s instead of
    11.61–11.66 s, in turns; their cold commands were no slower (docs/PERFORMANCE.md)."""
    if any(os.environ.get(name) for name in FRACTION_VARIABLES):
        return None
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return None
    fraction = GPU_MEMORY_FRACTION
    if need_bytes:
        total = gpu_total_bytes()
        if total:
            # Rounded up to the percent: never below the need.
            fraction = str(min(float(GPU_MEMORY_FRACTION), -(-100 * need_bytes // total) / 100))
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
    return fraction


WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".npz")


def weights_on_disk(path) -> int:
    """Bytes of the weight files at `path` (a file, or a folder searched through): what a model folder
    will place on the devices at most when loaded in its stored dtypes; 0 for a preset's name."""
    def size(file):
        try:
            return os.path.getsize(file)
        except OSError:  # a broken link (a half-downloaded cache): the load names it, not this estimate
            return 0

    if not path or not os.path.exists(path):
        return 0
    if os.path.isfile(path):
        return size(path)
    return sum(size(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
               if f.endswith(WEIGHT_SUFFIXES))


WORLD_MODEL_WORKING_SET = 16 * GiB  # a world model's run beside its weights (`world_model_need`)


def world_model_need(args) -> int:
    """What a world model's command (`wan_tpu.matrix_game`, `wan_tpu.unifolm`) reserves on a GPU: its weights
    twice over (a folder stored in bfloat16 run in float32) plus 16 GiB of working set. Measured peaks on an
    H200 (jax 0.11.2): Matrix-Game-2 universal 14.0 GiB with 4.7 GB of weights (→ 25.3 GiB reserved), UnifoLM-WMA
    decision 20.9 GiB with 13.5 GB (→ 42.9 GiB): each about twice its peak, room for a cold run's autotuning
    buffers; a card smaller than that keeps `GPU_MEMORY_FRACTION`."""
    return 2 * weights_on_disk(getattr(args, "model", None)) + WORLD_MODEL_WORKING_SET
