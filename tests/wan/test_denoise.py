"""The denoising loop: compiled once, CFG, expert switch, TI2V first frame, NaN stop, mesh.

Reference for the arithmetic: a plain Python loop over the same DiT and scheduler calls (float32,
tolerance 1e-5 relative). Parity with diffusers' pipelines is in test_pipeline.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.configs.models import VARIANTS
from wan_tpu.loading.random_init import random_module
from wan_tpu.wan import denoise as denoise_lib
from wan_tpu.wan.denoise import Conditioning, NonFiniteLatentsError, denoise, expert_switch_index
from wan_tpu.wan.schedulers import make_scheduler
from wan_tpu.wan.transformer import WanTransformer

CFG = VARIANTS["tiny"].transformer
SHAPE = (1, 16, 2, 4, 6)


def dit(seed=0, config=CFG):
    return random_module(lambda: WanTransformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), seed)


def inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], SHAPE), jax.random.normal(k[1], (1, 512, CFG.text_dim)),
            jax.random.normal(k[2], (1, 512, CFG.text_dim)))


def python_loop(models, latents, pos, neg, sched, guidance, switch):
    """The loop spelled out step by step (diffusers' structure), as the reference."""
    state = sched.init_state(latents)
    for i, t in enumerate(sched.timesteps):
        e = 0 if i < switch else 1
        ts = jnp.full((1,), t)
        cond = models[e](latents, ts, pos)
        noise = cond if neg is None else models[e](latents, ts, neg) + guidance[e] * (cond - models[e](latents, ts, neg))
        latents, state = sched.step(state, noise, latents, i)
    return latents


@pytest.mark.parametrize("guidance", [5.0, None])
def test_matches_a_python_loop(guidance):
    model = dit()
    latents, pos, neg = inputs()
    sched = make_scheduler("unipc", 4, 5.0)
    neg = neg if guidance else None
    out = denoise([model], latents, Conditioning(pos, neg), sched, [guidance or 1.0], progress=False)
    ref = python_loop([model], latents, pos, neg, sched, [guidance], 4)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_two_experts_switch_at_the_boundary():
    high, low = dit(0), dit(1)
    latents, pos, neg = inputs(1)
    sched = make_scheduler("unipc", 4, 5.0)  # timesteps 999, 937, 833, 624
    switch = expert_switch_index(sched.timesteps, 0.875)
    assert switch == 2 and expert_switch_index(sched.timesteps, None) == 4
    assert expert_switch_index(np.array([900.0, 899.0]), 0.9) == 1  # t >= boundary is high-noise
    out = denoise([high, low], latents, Conditioning(pos, neg), sched, [4.0, 3.0], boundary_ratio=0.875,
                  progress=False)
    ref = python_loop([high, low], latents, pos, neg, sched, [4.0, 3.0], switch)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    with pytest.raises(ValueError, match="transformer_2"):
        denoise([high], latents, Conditioning(pos, neg), sched, [4.0], boundary_ratio=0.875, progress=False)


def test_step_compiles_once_per_shape():
    model = dit()
    latents, pos, neg = inputs(2)
    before = denoise_lib._step_jit._cache_size()
    for shift, guidance, seed in ((5.0, 5.0, 0), (3.0, 6.5, 1)):
        # Another scheduler (shift), guidance and noise: all arguments, so the same executable.
        sched = make_scheduler("unipc", 3, shift)
        denoise([model], latents + seed, Conditioning(pos, neg), sched, [guidance], progress=False)
    assert denoise_lib._step_jit._cache_size() == before + 1


def test_ti2v_first_frame_is_held():
    model = dit()
    latents, pos, neg = inputs(3)
    first = jax.random.normal(jax.random.key(9), (1, 16, 1, 4, 6))
    mask = jnp.ones((1, 1, 2, 4, 6)).at[:, :, 0].set(0.0)
    out = denoise([model], latents, Conditioning(pos, neg, first_frame=first, first_frame_mask=mask),
                  make_scheduler("unipc", 3, 5.0), [5.0], progress=False)
    np.testing.assert_array_equal(out[:, :, :1], first)
    assert float(jnp.abs(out[:, :, 1:] - latents[:, :, 1:]).max()) > 0.1


def test_i2v_condition_is_concatenated():
    cfg = VARIANTS["tiny"].transformer.__class__(**{**VARIANTS["tiny"].transformer.__dict__, "in_channels": 36})
    model = dit(config=cfg)
    latents, pos, _ = inputs(4)
    condition = jax.random.normal(jax.random.key(5), (1, 20, *SHAPE[2:]))
    sched = make_scheduler("euler", 2, 3.0)
    out = denoise([model], latents, Conditioning(pos, condition=condition), sched, [1.0], progress=False)
    state, x = sched.init_state(latents), latents
    for i, t in enumerate(sched.timesteps):
        v = model(jnp.concatenate([x, condition], axis=1), jnp.full((1,), t), pos)
        x, state = sched.step(state, v, x, i)
    np.testing.assert_allclose(out, x, rtol=1e-5, atol=1e-5)


def test_nan_stops_the_run_with_the_step():
    model = dit()
    state = nnx.state(model)
    flat = nnx.to_flat_state(state)
    path, var = next((p, v) for p, v in flat if p[-1] == "kernel" and p[0] == "proj_out")
    var.set_value(var.get_value().at[0, 0].set(jnp.nan))
    nnx.update(model, nnx.from_flat_state(flat))
    latents, pos, neg = inputs(5)
    with pytest.raises(NonFiniteLatentsError, match="step 0"):
        denoise([model], latents, Conditioning(pos, neg), make_scheduler("unipc", 3, 5.0), [5.0], progress=False)


def test_cfg_batch_over_a_dp_tp_mesh_matches_one_device():
    from wan_tpu.parallel.mesh import make_mesh
    from wan_tpu.wan.transformer import set_attention

    latents, pos, neg = inputs(6)
    sched = make_scheduler("unipc", 3, 5.0)
    ref = denoise([dit()], latents, Conditioning(pos, neg), sched, [5.0], progress=False)
    mesh = make_mesh(dp=2, sp=1, tp=2, devices=jax.devices()[:4])
    sharded = set_attention(dit(), None, mesh)
    out = denoise([sharded], latents, Conditioning(pos, neg), sched, [5.0], mesh=mesh, progress=False)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
