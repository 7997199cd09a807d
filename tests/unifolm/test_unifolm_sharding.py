"""UniFoLM on a device mesh (`wan_tpu.unifolm.sharding`, "unifolm" rules of `wan_tpu/configs/sharding.py`).

- One whole sampling step (`ddim_step`: the UNet with both heads and the two DDIM updates) exports for
  platform "tpu" with `jax.export`, sharded on a (dp, sp, tp) = (2, 1, 4) mesh of the 8 simulated CPU
  devices, attention through the splash exp2 Pallas kernel (lowered for Mosaic TPU) in `shard_map`.
- The same step, with the presets' lighter UNet, runs sharded on those 8 devices (batch over dp, weights by
  the rules) and equals the unsharded step (float32, ≤ 1e-5 relative L2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from unifolm_golden import assert_close
from unifolm_weights import det

import wan_tpu
from wan_tpu.configs.unifolm import CONFIGS
from wan_tpu.parallel.sharding import describe_sharding
from wan_tpu.unifolm.model import Conditions, abstract_unifolm, random_unifolm
from wan_tpu.unifolm.presets import preset_config
from wan_tpu.unifolm.sampling import ddim_step, schedule_tables
from wan_tpu.unifolm.sharding import shard_unifolm

CFG = CONFIGS["unifolm-tiny"]
B, T, H = 2, 16, 16
L = CFG.unet.n_obs_steps + CFG.unet.action_context_len + 77 + 16
OBS = CFG.head.n_obs_steps * (2 * CFG.head.spatial_softmax_kp + CFG.head.agent_pos_dim)


def step_inputs():
    """(cond, x, action, state, inp) of one step, as numpy."""
    cond = Conditions(context=det("sh:ctx", (B * T, L, 64)), concat=det("sh:concat", (B, 4, T, H, H)),
                      fs=np.array([7, 5], np.int32), obs=(det("sh:obs_a", (B, OBS)), det("sh:obs_s", (B, OBS))))
    tables = schedule_tables(CFG, 4, eta=1.0)
    inp = {k: v[1] for k, v in tables.items()}
    inp["noise"] = det("sh:noise", (B, 4, T, H, H))
    return cond, det("sh:x", (B, 4, T, H, H)), det("sh:a", (B, T, 16)), det("sh:s", (B, T, 16)), inp


def batch_spec(x):
    return P("dp") if np.ndim(x) and np.shape(x)[0] in (B, B * T) else P()


def test_every_weight_has_a_rule():
    model = abstract_unifolm(CONFIGS["unifolm-wma-0"])
    rows = describe_sharding(model, jax.sharding.AbstractMesh((2, 1, 4), ("dp", "sp", "tp")), "unifolm")
    assert [r.path for r in rows if r.rule is None] == []
    replicated = sum(int(np.prod(r.shape)) for r in rows if r.replicated)
    assert replicated < 2e6  # latents, position embeddings, norms, biases


def test_sampling_step_exports_for_tpu_with_splash_kernel():
    mesh = wan_tpu.make_mesh(2, 1, 4)
    model = abstract_unifolm(CFG, dtype=jnp.bfloat16, attention_impl="splash_exp2")
    shard_unifolm(model, mesh, impl="splash_exp2")
    graphdef, state = nnx.split(model.diffusion_model)
    args = step_inputs()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                                           sharding=NamedSharding(mesh, batch_spec(a))), args)
    fn = jax.jit(lambda st, *a: ddim_step(nnx.merge(graphdef, st), *a))
    exported = jax.export.export(fn, platforms=("tpu",))(state, *abstract)
    assert exported.platforms == ("tpu",)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text  # the splash kernel, lowered for Mosaic TPU
    assert exported.nr_devices == 8


def test_sharded_step_equals_unsharded():
    # The presets' lighter UNet (one ResBlock a level; spatial and temporal transformers at the first level and
    # in the middle): every kind of block the rules shard, in half the program of `CFG`'s, whose compile for 8
    # devices took most of this test's time on a 2-core CPU.
    model = random_unifolm(preset_config("unifolm-tiny"), seed=3)
    args = step_inputs()
    graphdef, state = nnx.split(model.diffusion_model)
    fn = jax.jit(lambda st, *a: ddim_step(nnx.merge(graphdef, st), *a))
    ref = fn(state, *args)

    mesh = wan_tpu.make_mesh(2, 1, 4)
    shard_unifolm(model, mesh)
    graphdef, state = nnx.split(model.diffusion_model)
    placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, batch_spec(a))), args)
    fn = jax.jit(lambda st, *a: ddim_step(nnx.merge(graphdef, st), *a))
    out = fn(state, *placed)
    assert out[0].sharding.spec[0] == "dp"
    for o, r, name in zip(out, ref, ("x", "action", "state")):
        assert_close(o, r, 1e-5, name)


def test_mesh_load_places_the_same_weights(tiny_folder):
    """`load_unifolm(mesh=)` puts each parameter slice by slice with the "unifolm" rules; the values are
    those of the single-device load, bit for bit (the layout change and the cast are the same)."""
    from wan_tpu.unifolm.loading import load_unifolm

    ref = nnx.to_flat_state(nnx.state(load_unifolm(tiny_folder, dtype=jnp.bfloat16)))
    mesh = wan_tpu.make_mesh(2, 1, 4)
    sharded = dict(nnx.to_flat_state(nnx.state(load_unifolm(tiny_folder, dtype=jnp.bfloat16, mesh=mesh))))
    assert len(ref) == len(sharded)
    spread = 0
    for key, var in ref:
        got = sharded[key].get_value()
        spread += len(got.sharding.device_set) > 1
        assert got.dtype == var.get_value().dtype, key
        np.testing.assert_array_equal(np.asarray(got), np.asarray(var.get_value()), err_msg=str(key))
    assert spread > 0
