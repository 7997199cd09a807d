"""UniFoLM-WMA-0 (Unitree's world-model-action model) in Flax NNX: the video UNet with its action and
state heads, the Perceivers and projectors, the samplers and the loader.

    from wan_tpu.models.unifolm import UnifolmWMA, load_unifolm, sample
    model = load_unifolm("/ckpt/unifolm-wma-0")            # or random_unifolm(CONFIGS["unifolm-tiny"], seed=0)
    cond = model.prepare(text_emb, clip_tokens, cond_latent, obs_images, obs_state, actions=None, fs=7)
    latents, actions, states = sample(model, cond, num_steps=50, eta=1.0, key=jax.random.key(123))
"""

from wan_tpu.models.unifolm.loading import load_unifolm, torch_name
from wan_tpu.models.unifolm.model import Conditions, UnifolmWMA, abstract_unifolm, random_unifolm
from wan_tpu.models.unifolm.sampling import ddim_step, sample, schedule_tables
from wan_tpu.models.unifolm.unet import WMAModel

__all__ = ["Conditions", "ddim_step", "UnifolmWMA", "WMAModel", "abstract_unifolm", "load_unifolm", "random_unifolm", "sample",
           "schedule_tables", "torch_name"]
