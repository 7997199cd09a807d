"""`Conv`: torch's Conv{1,2,3}d, channels-last, with its kernel stored in the layout the backend reads.

    conv = Conv(320, 640, (3, 3), padding=((1, 1), (1, 1)), dtype=jnp.bfloat16, rngs=rngs)
    y = conv(x)                                   # x (N, H, W, 320) → (N, H, W, 640)

Two kernel layouts, chosen when the module is built:
  * spatial-first, (*k, in, out) — XLA's HWIO, what `flax.nnx.Conv` stores: CPU and TPU;
  * out-first, (out, *k, in) — OHWI, what cuDNN's channels-last convolutions read on NVIDIA GPUs.
With the other layout on a GPU, XLA copies every kernel into OHWI before its convolution, and inside a
loop (a sampler's `lax.scan` over steps) it makes those copies once, before the loop, and keeps them
for all of it: UnifoLM's DDIM loop held 3.2 GB of copied kernels (2.95 of its 3.58 GiB of temporaries,
H100, `benchmarks/profile_unifolm_memory.py`) beside the 5 GB of weights they copy.

The default follows the backend (`jax.default_backend()`, out-first on "gpu"); `kernel_layout(...)`
sets it for the modules built inside it (a sharded load builds spatial-first, the layout the sharding
rules name), and `WAN_TPU_CONV_KERNEL=out_first|spatial_first` overrides both. The parameter is
`kernel` in either layout; `out_first` on the module says which (loaders read it to place torch's
(out, in, *k) weights).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.layers import initializers

_LAYOUT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("wan_tpu_conv_out_first", default=None)
_SPATIAL = ("W", "HW", "DHW")


def default_out_first() -> bool:
    """Whether a `Conv` built now stores its kernel out-first (module docstring)."""
    setting = os.environ.get("WAN_TPU_CONV_KERNEL")
    if setting:
        if setting not in ("out_first", "spatial_first"):
            raise WanInputError(f"WAN_TPU_CONV_KERNEL={setting!r}; use out_first or spatial_first")
        return setting == "out_first"
    chosen = _LAYOUT.get()
    return jax.default_backend() == "gpu" if chosen is None else chosen


@contextlib.contextmanager
def kernel_layout(out_first: bool | None):
    """`Conv`s built inside store their kernels out-first (True), spatial-first (False) or by backend (None)."""
    token = _LAYOUT.set(out_first)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def torch_to_kernel(weight, out_first: bool):
    """torch's (out, in, *k) conv weight (numpy or jax) → `Conv.kernel` in the given layout."""
    n = weight.ndim
    perm = (0, *range(2, n), 1) if out_first else (*range(2, n), 1, 0)
    return weight.transpose(perm)


class Conv(nnx.Module):
    """A convolution over channels-last input; `padding` as `lax.conv_general_dilated` takes it."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, ...], *, strides=1, padding="SAME",
                 use_bias: bool = True, dtype=jnp.float32, rngs: nnx.Rngs, out_first: bool | None = None):
        self.out_first = default_out_first() if out_first is None else out_first
        self.strides = (strides,) * len(kernel) if isinstance(strides, int) else tuple(strides)
        self.padding = padding
        self.dtype = dtype
        fan_in = cin
        for k in kernel:
            fan_in *= k
        shape = (cout, *kernel, cin) if self.out_first else (*kernel, cin, cout)
        self.kernel = nnx.Param(initializers.normal(rngs.params(), shape, dtype) / fan_in**0.5)
        self.bias = nnx.Param(jnp.zeros((cout,), dtype)) if use_bias else None

    def __call__(self, x):
        spatial = _SPATIAL[self.kernel.ndim - 3]
        rhs = f"O{spatial}I" if self.out_first else f"{spatial}IO"
        y = jax.lax.conv_general_dilated(x.astype(self.dtype), self.kernel[...], self.strides, self.padding,
                                         dimension_numbers=(f"N{spatial}C", rhs, f"N{spatial}C"))
        return y if self.bias is None else y + self.bias[...]


def out_first_kernels(module) -> set[str]:
    """Dotted paths (`a.0.b.kernel`, as `nnx.to_flat_state` keys joined) of the out-first `Conv` kernels
    in `module`: what a loader or a random initialiser places in that layout."""
    return {".".join(str(p) for p in (*path, "kernel")) for path, node in nnx.iter_graph(module)
            if isinstance(node, Conv) and node.out_first}


def spatial_first_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The spatial-first shape (*k, in, out) of an out-first kernel's (out, *k, in)."""
    return (*shape[1:-1], shape[-1], shape[0])


def spatial_to_out_first(kernel):
    """A spatial-first (*k, in, out) kernel, numpy or jax, → out-first (out, *k, in)."""
    n = kernel.ndim
    return kernel.transpose(n - 1, *range(n - 2), n - 2)
