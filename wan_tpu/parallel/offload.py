"""Stacked layers streamed from host memory: a model larger than the device runs layer by layer.

    resident = offload_stack(model.blocks, resident=10)     # in place: the stack now lives in host memory
    x = scan_layers(body, x, resident_state, host_state)    # inside jit: layers 0..9 resident, the rest streamed

A stack of layers (every parameter with a leading layer axis, run with `jax.lax.scan`: the Wan DiT's
blocks, the UMT5 encoder's) moves into the host memory of its devices (`pinned_host` where the backend has it: a GPU copies
from page-locked memory by DMA at the bus's rate; `unpinned_host` otherwise), keeping its sharding, so
that with a mesh each device's FSDP shard sits in its own host's memory and streams to that device alone.
The first `resident` layers are also kept on the device, where they run as before. A loader reads such a
stack straight into host memory (`wan_tpu.loading.params.load_params(streamed=)`): it never occupies
device memory, so a model larger than the device loads too.

Inside the compiled program the streamed layers run in a scan whose carry holds the next layer's
device copy: step i starts the host → device copy of layer i+1 (a dynamic slice of the host stack moved
with `jax.device_put(..., jax.memory.Space.Device)`, which XLA's host offloading turns into an
asynchronous copy) and computes layer i with the copy the previous step brought, so the copy of one
layer overlaps the compute of the other and the device holds two layers of the stack, not all of them.
The first streamed layer's copy depends on nothing the resident layers compute, so it can overlap them;
the last step fetches its own layer again (one extra layer's copy per pass) rather than tracing the layer
body a second time outside the loop. The same program is what a resident stack runs, but for
where the weights live: results are bit-identical.

On the CPU backend every memory kind is host RAM and XLA lowers the in-program `device_put` to
nothing, so there the streamed program is the same scan with the same double-buffered carry and
dynamic slices, and the copy itself is what an export for TPU or GPU shows (`annotate_device_placement`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.errors import WanInputError

HOST_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(device=None) -> str | None:
    """The host memory kind `device` (default: the first) can address, pinned first; None if it has none."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_KINDS if k in kinds), None)


def host_kind(device=None) -> str:
    """The host memory kind weights stream from to `device` (default: the first); a `WanInputError` where
    the backend has none."""
    device = device or jax.devices()[0]
    kind = host_memory_kind(device)
    if kind is None:
        raise WanInputError(f"{device.device_kind} has no host memory space to stream weights from; "
                            "run with --offload none (and a smaller size, or more devices with --mesh)")
    return kind


def on_host(x) -> bool:
    """Whether `x` lives in host memory: an array, a tracer inside jit or a `jax.ShapeDtypeStruct`."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.sharding is not None and x.sharding.memory_kind in HOST_KINDS
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def to_host(x: jax.Array) -> jax.Array:
    """`x` with its sharding, in its devices' host memory."""
    if on_host(x):
        return x
    return jax.device_put(x, x.sharding.with_memory_kind(host_kind(next(iter(x.sharding.device_set)))))


def to_device(x: jax.Array) -> jax.Array:
    """`x` with its sharding, in device memory."""
    return jax.device_put(x, x.sharding.with_memory_kind("device")) if on_host(x) else x


def _prefix(stack: jax.Array, n: int) -> jax.Array:
    """Layers [0, n) of a stacked array, in device memory (of a host stack: only those layers are copied)."""
    if not on_host(stack):
        return stack[:n]
    sharding = stack.sharding.with_memory_kind("device")
    # A dynamic slice, as the streamed scan reads the stack: the pattern XLA's host offloading moves by DMA.
    take = jax.jit(lambda a: jax.device_put(jax.lax.dynamic_slice_in_dim(a, 0, n), jax.memory.Space.Device),
                   out_shardings=sharding)
    return take(stack)


def offload_stack(stack: nnx.Module, resident: int = 0) -> nnx.Module | None:
    """Move every parameter of the stacked module `stack` into host memory, in place, one parameter at a
    time (each device copy goes as soon as its host copy exists); returns a module of its first `resident`
    layers in device memory (None for 0), which `scan_layers` runs before streaming the others. A stack
    already in host memory stays there; only the resident layers are copied."""
    flat = nnx.to_flat_state(nnx.state(stack))
    layers = flat[0][1].get_value().shape[0] if flat else 0
    if not 0 <= resident <= layers:
        raise WanInputError(f"--offload blocks:{resident} keeps more blocks resident than the model's {layers}; "
                            f"pass a count from 0 to {layers}")
    prefix = []
    for path, var in flat:
        value = var.get_value()
        if resident:
            prefix.append((path, var.replace(_prefix(value, resident))))
        var.set_value(to_host(value))
        del value  # the device copy goes now, not with the last parameter
    return nnx.merge(nnx.graphdef(stack), nnx.from_flat_state(prefix)) if resident else None


def park(module: nnx.Module) -> None:
    """Every parameter of `module` into its devices' host memory, in place, one at a time (each device copy
    goes as soon as its host copy exists): a component leaves the device between its uses without being
    read from disk again. `unpark` brings it back; both are no-ops where the weights already are."""
    for _, var in nnx.to_flat_state(nnx.state(module)):
        var.set_value(to_host(var.get_value()))


def unpark(module: nnx.Module) -> None:
    """Undo `park` or `offload_stack`: every parameter of `module` back in device memory, in place."""
    for _, var in nnx.to_flat_state(nnx.state(module)):
        var.set_value(to_device(var.get_value()))


def is_streamed(state) -> bool:
    """Whether a stacked state (concrete or traced) lives in host memory."""
    leaves = jax.tree.leaves(state)
    return bool(leaves) and on_host(leaves[0])


def _fetch(host_state, i):
    return jax.tree.map(
        lambda a: jax.device_put(jax.lax.dynamic_index_in_dim(a, i, keepdims=False), jax.memory.Space.Device),
        host_state)


def _scan_resident(body, carry, state, start: int, stop: int):
    layers = jax.tree.leaves(state)[0].shape[0]
    if (start, stop) == (0, layers):
        return jax.lax.scan(lambda c, s: (body(c, s), None), carry, state)[0]

    # Part of the stack: index the stacked weights inside the loop rather than slicing them (a slice
    # would copy the weights).
    def indexed(c, i):
        return body(c, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), state)), None

    return jax.lax.scan(indexed, carry, jnp.arange(start, stop))[0]


def _scan_streamed(body, carry, host_state, start: int, stop: int):
    def step(c, i):
        c, current = c
        # Issued before the layer's compute and independent of it: the copy overlaps the compute.
        following = _fetch(host_state, jnp.minimum(i + 1, stop - 1))
        return (body(c, current), following), None

    first = _fetch(host_state, start)
    return jax.lax.scan(step, (carry, first), jnp.arange(start, stop))[0][0]


def scan_layers(body: Callable, carry, resident_state, host_state=None, start: int = 0, stop: int | None = None):
    """`carry = body(carry, layer_state)` for layers `start`..`stop` (default: all) of a stack, inside jit.

    `resident_state`: the stacked state in device memory, of every layer (`host_state` None) or of the
    first layers `offload_stack` kept resident (None for none); `host_state`: the whole stack in host
    memory, whose layers past the resident ones stream in one layer ahead (module docstring).
    """
    resident = 0 if resident_state is None else jax.tree.leaves(resident_state)[0].shape[0]
    total = resident if host_state is None else jax.tree.leaves(host_state)[0].shape[0]
    stop = total if stop is None else stop
    if not 0 <= start <= stop <= total:
        raise ValueError(f"layers {start}..{stop} are not within the stack's {total}")
    if start < min(stop, resident):
        carry = _scan_resident(body, carry, resident_state, start, min(stop, resident))
    if max(start, resident) < stop:
        carry = _scan_streamed(body, carry, host_state, max(start, resident), stop)
    return carry


__all__ = ["HOST_KINDS", "host_kind", "host_memory_kind", "is_streamed", "offload_stack", "on_host", "park",
           "scan_layers", "to_device", "to_host", "unpark"]


class StreamedBlocks:
    """`offload_blocks` / `restore_blocks` for a module whose layers are one stack `self.blocks` (with
    `self.resident_blocks`, None until offloaded, and `self.config.num_layers`): the Wan DiT and UMT5 share it."""

    def offload_blocks(self, resident: int = 0):
        """Keep the first `resident` blocks on the device and the whole stack in host memory, each streamed
        block copied to the device one block ahead of its use inside the compiled forward (`scan_layers`);
        in place, and again with another count (the stack stays in host memory). Outputs are bit-identical
        to the resident module's; `restore_blocks` undoes it."""
        self.resident_blocks = nnx.data(None)  # the old resident copies go before the new ones come
        self.resident_blocks = nnx.data(offload_stack(self.blocks, resident))
        return self

    def restore_blocks(self) -> None:
        """Undo `offload_blocks`: the whole stack back on the device."""
        unpark(self.blocks)
        self.resident_blocks = nnx.data(None)

    @property
    def offloaded(self) -> bool:
        """Whether the block stack lives in host memory (`offload_blocks`)."""
        return is_streamed(nnx.state(self.blocks))

    @property
    def resident_block_count(self) -> int:
        """Blocks whose weights stay on the device: all of them unless offloaded."""
        if not self.offloaded:
            return self.config.num_layers
        return 0 if self.resident_blocks is None else jax.tree.leaves(nnx.state(self.resident_blocks))[0].shape[0]
