"""UnifoLM-WMA-0 (Unitree's world-model-action model): the video UNet with its action and state heads, the
Perceivers and projectors, the samplers, the loader, `UnifolmPipeline`, its CLI and server.

    pipe = wan_tpu.UnifolmPipeline.from_pretrained("unifolm-tiny")

    from wan_tpu.unifolm.model import UnifolmWMA
    from wan_tpu.unifolm.loading import load_unifolm
    from wan_tpu.unifolm.sampling import sample
    model = load_unifolm("/ckpt/unifolm-wma-0")            # or random_unifolm(CONFIGS["unifolm-tiny"], seed=0)
    cond = model.prepare(text_emb, clip_tokens, cond_latent, obs_images, obs_state, actions=None, fs=7)
    latents, actions, states = sample(model, cond, num_steps=50, eta=1.0, key=jax.random.key(123))
"""

from wan_tpu.lazy import exports

_EXPORTS = {
    "UnifolmPipeline": "wan_tpu.unifolm.pipeline",
    "UnifolmWMA": "wan_tpu.unifolm.model",
    "Conditions": "wan_tpu.unifolm.model",
    "abstract_unifolm": "wan_tpu.unifolm.model",
    "random_unifolm": "wan_tpu.unifolm.model",
    "WMAModel": "wan_tpu.unifolm.unet",
    "load_unifolm": "wan_tpu.unifolm.loading",
    "torch_name": "wan_tpu.unifolm.loading",
    "ddim_step": "wan_tpu.unifolm.sampling",
    "sample": "wan_tpu.unifolm.sampling",
    "schedule_tables": "wan_tpu.unifolm.sampling",
}

__all__ = sorted(_EXPORTS)
__getattr__ = exports(__name__, _EXPORTS)
