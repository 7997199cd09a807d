"""The `(dp, sp, tp)` device mesh.

Axes: `dp` carries the CFG cond/uncond pair and the batch, `sp` the token sequence (context
parallel), `tp` attention heads and the hidden split of the weights. `(dp, sp, tp)` is the default
order (it lays `tp`, the chattiest axis, on the nearest devices; it was measured faster than
`(tp, dp, sp)` on TPU v6e).

Several hosts: `make_mesh` first calls `jax.distributed.initialize()` when the environment says the
job spans processes and it has not been initialized yet. The signals read are

- `WAN_TPU_COORDINATOR`, `JAX_COORDINATOR_ADDRESS` or `COORDINATOR_ADDRESS` (with
  `WAN_TPU_NUM_PROCESSES`/`JAX_NUM_PROCESSES`/`NUM_PROCESSES` and `WAN_TPU_PROCESS_ID`/`JAX_PROCESS_ID`/
  `PROCESS_ID` where the cluster is not auto-detected),
- a multi-host Cloud TPU slice: `TPU_WORKER_HOSTNAMES` or `TPU_PROCESS_ADDRESSES` naming more
  than one host, or `MEGASCALE_COORDINATOR_ADDRESS` (multislice),
- Slurm (`SLURM_NTASKS` > 1) or Open MPI (`OMPI_COMM_WORLD_SIZE` > 1) launches.

On one host none of these is set and nothing happens. The commands start the job earlier, from their
`--coordinator`/`--num-processes`/`--process-id` flags too (`wan_tpu.runtime.distributed`). The mesh then
spans every process's devices (`jax.devices()`); each process drives its own (`jax.local_devices()`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from wan_tpu.errors import WanInputError

AXES = ("dp", "sp", "tp")

log = logging.getLogger(__name__)


def _env_first(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _more_than_one(value: str | None, sep: str | None = None) -> bool:
    if not value:
        return False
    if sep is not None:
        return len([v for v in value.split(sep) if v.strip()]) > 1
    try:
        return int(value) > 1
    except ValueError:
        return False


def maybe_initialize_distributed() -> bool:
    """Start `jax.distributed` when the environment describes a multi-process job; True if started."""
    if jax.distributed.is_initialized():
        return False
    coordinator = _env_first("WAN_TPU_COORDINATOR", "JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
    multi_host = (
        coordinator is not None
        or _more_than_one(_env_first("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"), ",")
        or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS")
        or _more_than_one(os.environ.get("SLURM_NTASKS"))
        or _more_than_one(os.environ.get("OMPI_COMM_WORLD_SIZE"))
    )
    if not multi_host:
        return False
    kwargs = {}
    if coordinator is not None:
        kwargs["coordinator_address"] = coordinator
        num = _env_first("WAN_TPU_NUM_PROCESSES", "JAX_NUM_PROCESSES", "NUM_PROCESSES")
        pid = _env_first("WAN_TPU_PROCESS_ID", "JAX_PROCESS_ID", "PROCESS_ID")
        if num is not None and pid is not None:
            kwargs.update(num_processes=int(num), process_id=int(pid))
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        raise WanInputError(
            f"multi-host job detected but jax.distributed.initialize() failed ({e}); call wan_tpu.make_mesh before any other JAX work"
        ) from None
    log.info("jax.distributed initialized: process %d of %d", jax.process_index(), jax.process_count())
    return True


def _resolve_sizes(sizes: dict[str, int], n: int) -> dict[str, int]:
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size < 1 and size != -1):
            raise WanInputError(f"mesh size {name}={size!r} is not valid; use a positive integer, or -1 for 'the rest of the devices'")
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise WanInputError(f"mesh sizes {', '.join(f'{r}=-1' for r in rest)}: only one axis may be -1 ('the rest'); "
                            "give the others explicitly")
    known = math.prod(size for size in sizes.values() if size != -1)
    described = " ".join(f"{k}={v}" for k, v in sizes.items())
    if rest:
        if n % known:
            raise WanInputError(
                f"mesh {described} cannot fill {n} devices ({n} is not a multiple of {known}); choose sizes whose product divides {n}"
            )
        sizes = {**sizes, rest[0]: n // known}
    elif known != n:
        raise WanInputError(f"mesh {described} needs {known} devices but {n} are available; choose sizes whose product is {n}")
    return {k: int(v) for k, v in sizes.items()}


def _arrange(shape: tuple[int, ...], devices: Sequence) -> np.ndarray:
    # On TPU the physical torus matters (neighbours on the last axis); mesh_utils knows it. It
    # refuses some device subsets and shapes, and then plain id order is as good as anything.
    try:
        from jax.experimental import mesh_utils

        return mesh_utils.create_device_mesh(shape, devices=list(devices), allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError, KeyError, TypeError):
        return np.asarray(list(devices), dtype=object).reshape(shape)


def make_mesh(dp: int = 1, sp: int | None = None, tp: int = 1, order: Sequence[str] = AXES,
              devices: Sequence | None = None) -> Mesh:
    """A `jax.sharding.Mesh` over `devices` (default: all) with axes `dp`, `sp`, `tp` laid out in `order`.

    The sizes must multiply to the device count; one of them may be -1 ("the rest"). `sp` left out
    takes the rest of the devices (1 when another axis is -1), so `make_mesh()` fits any machine:
    one device → (1, 1, 1); eight → sp=8. Every call valid with `sp=1` means the same as before.
    """
    if sp is None:
        sp = 1 if -1 in (dp, tp) else -1
    order = tuple(order)
    if sorted(order) != sorted(AXES):
        raise WanInputError(f"mesh order {order} must name each of {AXES} exactly once, e.g. order=('dp', 'sp', 'tp')")
    if devices is None:
        maybe_initialize_distributed()
        devices = jax.devices()
    devices = list(devices)
    if not devices:
        raise WanInputError("make_mesh was given an empty device list; pass devices=None to use all devices")
    sizes = _resolve_sizes({"dp": dp, "sp": sp, "tp": tp}, len(devices))
    shape = tuple(sizes[a] for a in order)
    return Mesh(_arrange(shape, devices), order)


def mesh_size(mesh, axes) -> int:
    """Number of shards along `axes`: None, one axis name, or a tuple of names."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)
