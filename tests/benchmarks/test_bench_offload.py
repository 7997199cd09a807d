"""`benchmarks/bench_offload.py`'s parts that decide what it reports, on CPU: the streamed step it compiles
from shapes alone (before any weight exists) is the program a DiT with its blocks in host memory runs, and
the whole command's timing table is read back as the command printed it."""

import dataclasses
import re

import bench_offload
import jax
import jax.numpy as jnp
from flax import nnx


def _main(lowered) -> str:
    """The entry function of a lowering, mesh names left out (the abstract one names its one-device mesh)."""
    text = lowered.as_text()
    text = text[text.index("func.func public @main"):]
    return re.sub(r"sdy\.sharding = #sdy\.sharding<[^>]*>", "", text)


def test_the_step_compiled_from_shapes_streams_as_the_loaded_one():
    """A host stack given as `ShapeDtypeStruct`s with a `SingleDeviceSharding` traced as resident weights read
    in place (jax keeps the memory kind of a `NamedSharding` only): the program a GPU refused (XLA E1200),
    its resident blocks unused. The abstract step now lowers to the loaded DiT's program."""
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.loading.random_init import random_module
    from wan_tpu.wan.transformer import WanTransformer, forward, set_attention

    cfg = dataclasses.replace(VARIANTS["tiny"].transformer, num_layers=3)
    x = jnp.zeros((2, cfg.in_channels, 1, 4, 4), jnp.bfloat16)
    t, context = jnp.zeros((2,)), jnp.zeros((2, 8, cfg.text_dim), jnp.bfloat16)
    step = jax.jit(forward, static_argnums=0)
    graphdef, state = bench_offload.abstract_dit(cfg, None, 1, "reference")
    abstract = step.trace(graphdef, state, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, t, context)))
    dit = random_module(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), 0)
    set_attention(dit.offload_blocks(1), "reference", None)
    loaded = step.trace(*nnx.split(dit), x, t, context)
    a, b = (_main(p.lower(lowering_platforms=("cuda",))) for p in (abstract, loaded))
    params = len(jax.tree.leaves(nnx.state(dit.blocks)))
    assert a.count('mhlo.memory_kind = "pinned_host"') == params  # the host stack, every parameter an argument
    assert a.count("annotate_device_placement") == b.count("annotate_device_placement") == 2 * params
    assert a.split("{\n", 1)[1] == b.split("{\n", 1)[1]  # the same body: the resident block runs from the device


def test_the_command_timing_table_is_read_back():
    from wan_tpu.runtime.profiling import StageTimer

    timer = StageTimer()
    for name in ("load text encoder", "text encode", "denoise"):
        with timer.stage(name):
            pass
    timer.peaks = {"text encode": (6 * 2**30, True), "denoise": (5 * 2**30, False)}
    seconds, peaks = bench_offload.parse_timing_table(timer.table([("s/step (median)", "    0.123 s")]))
    assert set(seconds) == {"load text encoder", "text encode", "denoise", "total", "s/step (median)"}
    assert seconds["s/step (median)"] == 0.123 and peaks == {"text encode": "6.00", "denoise": "≥5.00"}
