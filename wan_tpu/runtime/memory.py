"""Memory the process can use: host RAM (cgroup-aware), free device memory, and how much of a GPU a
command line claims. The per-stage working-set estimates of a family live with it
(`wan_tpu.wan.memory` for Wan)."""

from __future__ import annotations

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


# JAX takes 75% of a GPU's memory by default; a command line takes 90% (the rest: CUDA's context and
# the cuBLAS/cuDNN workspaces outside XLA's allocator), so a 14B 720p run has room on an 80 GB GPU.
GPU_MEMORY_FRACTION = "0.9"


def claim_device_memory() -> None:
    """For a command line, before the first device use: let XLA take `GPU_MEMORY_FRACTION` of each GPU
    unless the user set `XLA_PYTHON_CLIENT_MEM_FRACTION` (or turned preallocation off) themselves."""
    import os

    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() not in ("false", "0"):
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
