"""TPU readiness without a TPU: one whole sharded denoise step (the DiT on the CFG pair, guidance,
a UniPC update) with the splash exp2 Pallas kernel (`impl="splash_exp2"`, lowered for Mosaic TPU,
not interpret mode) inside `shard_map` on a (dp, sp, tp) = (2, 1, 4) mesh of the 8 simulated CPU
devices exports for platform "tpu" with `jax.export`.

Small DiT (2 layers) with the real head size 128 and a token count (3·5·7 = 105) that is no
multiple of any kernel block. Both attention layouts are exported: 8 heads (heads over tp) and
6 heads (tp does not divide them: sequence over tp, 105 tokens padded to 108).
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import wan_tpu
from wan_tpu.configs.models import WanTransformerConfig
from wan_tpu.parallel.sharding import shard_transformer
from wan_tpu.wan.schedulers import FlowUniPCMultistep
from wan_tpu.wan.transformer import WanTransformer, forward

LATENT = (3, 10, 14)  # patch (1, 2, 2) → 3·5·7 = 105 tokens
TEXT_LEN = 512


def _export(heads: int):
    cfg = WanTransformerConfig(num_attention_heads=heads, attention_head_dim=128, text_dim=64, freq_dim=32,
                               ffn_dim=512, num_layers=2)
    dit = nnx.eval_shape(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention_impl="splash_exp2"))
    mesh = wan_tpu.make_mesh(2, 1, 4)
    shard_transformer(dit, mesh)  # abstract weights: shapes with their shardings
    graphdef, state = nnx.split(dit)

    sched = FlowUniPCMultistep.create(num_inference_steps=50, shift=5.0)

    def denoise_step(state, latents, sched_state, i, prompt_embeds, guidance_scale):
        pair = jnp.concatenate([latents, latents])  # (cond, uncond): the batch that dp splits
        t = jnp.broadcast_to(jnp.asarray(sched.timesteps)[i], (2,))
        cond, uncond = forward(graphdef, state, pair, t, prompt_embeds).astype(jnp.float32)
        v = uncond + guidance_scale * (cond - uncond)
        return sched.step(sched_state, v[None], latents, i)

    def arg(shape, dtype=jnp.float32, spec=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    latents = arg((1, cfg.in_channels, *LATENT))
    sched_state = jax.tree.map(lambda _: latents, sched.init_state(jnp.zeros(latents.shape)))
    return jax.export.export(jax.jit(denoise_step), platforms=("tpu",))(
        state, latents, sched_state, arg((), jnp.int32), arg((2, TEXT_LEN, cfg.text_dim), spec=P("dp")), arg(())
    )


@pytest.mark.parametrize("heads, local_q", [(8, "1x105x2x128"), (6, "1x27x6x128")])
def test_sharded_step_with_splash_kernel_exports_for_tpu(heads, local_q):
    exported = _export(heads)
    assert exported.platforms == ("tpu",)
    assert exported.nr_devices == 8
    assert exported.out_avals[0].shape == (1, 16, *LATENT)  # the next latents, then the UniPC state
    module = exported.mlir_module()
    # The kernel is lowered for Mosaic TPU (not interpreted): one custom call per attention site in
    # the layer scan (self and cross).
    assert module.count("@tpu_custom_call") == 2
    # It runs on per-device blocks inside shard_map: the self-attention's local q is this shape.
    manual = [line for line in module.splitlines() if "sdy.manual_computation" in line]
    assert len(manual) == 2
    assert re.search(rf"tensor<{local_q}xbf16>", manual[0])
