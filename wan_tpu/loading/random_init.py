"""Seeded random weights drawn on the host, for the built-in presets of every family, tests and benchmarks."""

from __future__ import annotations

# The seed of every built-in preset's weights: the same weights on every machine.
TINY_SEED = 0


def random_module(build, seed: int, draw=None, abstract=None, key=None):
    """`build()` (an nnx module constructor) with seeded random weights drawn on the host.

    The module is only traced abstractly; each parameter is then drawn with numpy's PCG64 from
    `seed`, so a preset is the same on every machine and takes no compilation or per-op dispatch
    (building the tiny VAE eagerly costs tens of seconds on a small CPU). Scales are the usual
    ones: kernels N(0, 1/fan_in), biases N(0, 0.02²), norm weights 1, modulation tables N(0, 1/dim).
    `draw(names, shape, rng)` (optional) gives a parameter's value (a numpy array), or None for the
    usual one: for modules whose parameter names these rules do not fit (UMT5's torch-layout `weight`s).
    `abstract`: `build`'s module without weights, when the caller has it (read back from the executable
    cache, `executable_cache.cached_abstract`); else `build` is traced here. `key`: what determines the
    module (its config, dtype, settings; the presets give it): the drawn values are then kept in the
    executable cache and read back by a later process (`executable_cache.cached_arrays`) instead of drawn.
    """
    import jax
    from flax import nnx

    from wan_tpu.runtime.executable_cache import cached_arrays, span

    abstract = nnx.eval_shape(build) if abstract is None else abstract
    name = type(abstract).__name__
    with span("random weights", name):
        graphdef, state = nnx.split(abstract)
        flat = nnx.to_flat_state(state)
        make = lambda: _draw_all(abstract, flat, seed, draw)  # noqa: E731
        values = make() if key is None else cached_arrays(f"random-{name}", (key, seed), make)
        # One transfer call for all: per parameter, the call's own overhead was most of a preset's load.
        for (_, var), value in zip(flat, jax.device_put(values)):
            var.set_value(value)
        return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _draw_all(abstract, flat, seed: int, draw) -> list:
    """Every parameter's value (host numpy arrays in the parameter's dtype), in `flat`'s order."""
    import math

    import numpy as np

    from wan_tpu.layers.conv import out_first_kernels, spatial_first_shape, spatial_to_out_first

    out_first = out_first_kernels(abstract)  # drawn spatial-first then moved: the same values either way
    rng = np.random.default_rng(seed)
    values = []
    for path, var in flat:
        names = [str(p) for p in path]
        shape, dtype = var.get_value().shape, var.get_value().dtype
        leaf = names[-1]
        moved = ".".join(names) in out_first
        if moved:
            shape = spatial_first_shape(shape)
        value = None if draw is None else draw(names, shape, rng)
        if value is None and leaf == "kernel":
            # Stacked transformer blocks carry the layer axis first; it is not part of fan-in.
            fan_in = math.prod(shape[1:-1] if names[0] == "blocks" else shape[:-1])
            value = rng.standard_normal(shape) / math.sqrt(fan_in)
        elif value is None and leaf in ("weight", "gamma", "scale") and len(shape) <= 2:
            value = np.ones(shape)
        elif value is None and leaf == "scale_shift_table":
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        elif value is None:
            value = 0.02 * rng.standard_normal(shape)
        if moved:
            value = spatial_to_out_first(np.asarray(value))
        # Cast on the host (round to nearest even, as XLA does): loaders in parallel threads then compile no
        # conversion programs, which they would race to compile and to read from the compilation cache.
        values.append(np.asarray(value, np.float32).astype(dtype))
    return values
