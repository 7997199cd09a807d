"""`benchmarks/bench_unifolm_compile.py`'s variants of the UNet's graph compute what the shipped blocks do:
on the CPU the barrier is no barrier (bit for bit), and the scanned temporal convolutions match the unrolled
ones within float32 rounding (relative 1e-6: another program, the same products), as do the convolutions as
products over their taps; `split:K` runs the shipped step programs."""

import bench_unifolm_compile
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.configs.unifolm import CONFIGS
from wan_tpu.layers import norms
from wan_tpu.loading.random_init import random_module
from wan_tpu.unifolm import blocks, heads


@pytest.fixture
def restored(monkeypatch):
    for owner, name in ((norms.GroupNorm, "__call__"), (norms, "layer_norm"), (blocks.TemporalConvBlock, "__call__"),
                        (heads.ConditionalUnet1D, "__call__")):
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


def test_taps_variant_computes_the_shipped_convolutions(restored):
    cfg = CONFIGS["unifolm-tiny"]
    block = blocks.TemporalConvBlock(32, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dims = tuple(cfg.unet.model_channels * m for m in cfg.unet.channel_mult)
    head = random_module(lambda: heads.ConditionalUnet1D(cfg.head, dims, dtype=jnp.float32, rngs=nnx.Rngs(1)), 1)
    keys = iter(jax.random.split(jax.random.key(2), 16))
    x = jax.random.normal(next(keys), (2, 5, 3, 4, 32))
    t, d = cfg.head.horizon, cfg.head.input_dim
    obs = cfg.head.n_obs_steps * (2 * cfg.head.spatial_softmax_kp + cfg.head.agent_pos_dim)
    maps = [jax.random.normal(next(keys), (t, 4, 4, c)) for c in (*dims, dims[-1], *dims[::-1])]
    args = (jax.random.normal(next(keys), (1, t, d)), jnp.array([500]), maps, jax.random.normal(next(keys), (1, obs)))
    # Built and run through one program each: op by op, the head's many small shapes compile one by one (18 s on 2 cores).
    run = lambda: (np.asarray(jax.jit(lambda x: block(x))(x)), np.asarray(jax.jit(lambda a: head(*a))(args)))  # noqa: E731
    convs = lambda: str(jax.make_jaxpr(lambda a: head(*a))(args)).count("conv_general_dilated")  # noqa: E731
    want, before = run(), convs()
    bench_unifolm_compile.apply("taps")
    assert "conv_general_dilated" not in str(jax.make_jaxpr(block)(x))  # products now, not convolutions
    assert 0 < convs() < before  # the heads' stride-1 1-D ones only: the keypoints' and the strided stay
    for got, ref in zip(run(), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)




def test_split_variant_compiles_and_runs_the_shipped_step_programs(capsys):
    """`split:K` lowers `wan_tpu.unifolm.sampling`'s step programs (checked against the authors' goldens in
    tests/unifolm/test_unifolm_sampling.py) from abstract weights, compiles them side by side, then samples
    with them: the child's RESULT line."""
    import harness

    bench_unifolm_compile.child("split:2", "unifolm-tiny", 1, 1)
    (result,) = harness.read_results(capsys.readouterr().out)
    assert result["variant"] == "split:2" and result["lower"] > 0 and result["compile"] > 0
    assert len(result["runs"]) == 1 and result["runs"][0] > 0
    with pytest.raises(SystemExit, match="K must be an integer"):
        bench_unifolm_compile.split_count("split:one")
