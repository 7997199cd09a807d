"""`benchmarks/bench_unifolm_compile.py`'s variants of the UNet's graph compute what the shipped blocks do:
on the CPU the barrier is no barrier (bit for bit), and the scanned temporal convolutions match the unrolled
ones within float32 rounding (relative 1e-6: another program, the same products)."""

import bench_unifolm_compile
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.layers import norms
from wan_tpu.unifolm import blocks


@pytest.fixture
def restored(monkeypatch):
    for owner, name in ((norms.GroupNorm, "__call__"), (norms, "layer_norm"), (blocks.TemporalConvBlock, "__call__")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # undone after the test


def test_variants_compute_the_shipped_blocks(restored):
    block = blocks.TemporalConvBlock(32, dtype=jnp.float32, rngs=nnx.Rngs(0))
    norm, layer = norms.GroupNorm(8, 32), norms.FP32LayerNorm(32, 1e-5)
    x = jax.random.normal(jax.random.key(1), (2, 5, 3, 4, 32))
    want = [np.asarray(f(x)) for f in (block, norm, layer)]
    bench_unifolm_compile.apply("barrier")
    np.testing.assert_array_equal(np.asarray(norm(x)), want[1])
    np.testing.assert_array_equal(np.asarray(layer(x)), want[2])
    bench_unifolm_compile.apply("scan")
    np.testing.assert_allclose(np.asarray(block(x)), want[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(SystemExit, match="unknown variant"):
        bench_unifolm_compile.apply("fast")


def test_split_sampling_is_the_one_program_sampling():
    """`split:K` runs the step as K programs (the UNet's units cut in K runs) in a Python loop: the same
    sampling as `_sample_loop`'s scan within float32 rounding, for every cut; the cuts cover every unit once."""
    from wan_tpu.configs.unifolm import CONFIGS
    from wan_tpu.unifolm.model import random_unifolm
    from wan_tpu.unifolm.sampling import _sample_loop, schedule_tables

    cfg = CONFIGS["unifolm-tiny"]
    model = random_unifolm(cfg)
    unet = model.diffusion_model
    for k in (2, 3, 5):
        runs = bench_unifolm_compile.cut_units(unet, k)
        assert len(runs) == k and [u for run in runs for u in run] == unet.units()
    h, w = cfg.latent_size
    t, n_obs = cfg.unet.temporal_length, cfg.unet.n_obs_steps
    keys = iter(jax.random.split(jax.random.key(3), 8))
    normal = lambda *s: jax.random.normal(next(keys), s)  # noqa: E731
    cond = jax.block_until_ready(model.prepare(
        normal(1, cfg.unet.text_context_len, cfg.unet.context_dim), normal(1, 257, cfg.resampler.embedding_dim),
        normal(1, 4, h, w), normal(1, 3, n_obs, h * 8, w * 8), normal(1, n_obs, cfg.agent_state_dim)))
    tables = {name: jnp.asarray(v) for name, v in schedule_tables(cfg, 2, 1.0).items()}
    horizon = cfg.head.horizon if cfg.head else t
    shapes = ((1, cfg.unet.out_channels, t, h, w), (1, horizon, cfg.agent_action_dim), (1, horizon, cfg.agent_state_dim))
    graphdef, state = nnx.split(unet)
    want = _sample_loop(graphdef, state, cond, None, tables, jax.random.key(0), {}, jnp.float32(1), jnp.float32(0),
                        cfg.head_clip_sample, shapes, True)
    got = bench_unifolm_compile.split_sampling(graphdef, state, cond, tables, jax.random.key(0), shapes,
                                               cfg.head_clip_sample, 3)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))
    lower, compile_ = bench_unifolm_compile.split_sampling(graphdef, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state), cond, tables, jax.random.key(0), shapes,
        cfg.head_clip_sample, 3, compile_only=True)
    assert lower > 0 and compile_ > 0
