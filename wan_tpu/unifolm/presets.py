"""The `unifolm-tiny` presets: whole UnifoLM pipelines with random weights from a fixed seed.

`unifolm-tiny` (with action/state heads) and `unifolm-tiny-base` (generation only) use
`wan_tpu.configs.unifolm.CONFIGS[...]` for the model, the 4-level few-channel SD VAE
(`AUTOENCODER_KL_CONFIGS["tiny"]`: 16×16 latents → 128×128 frames) and one-block OpenCLIP towers whose
widths are what the model reads (text: `unet.context_dim`; image: `resampler.embedding_dim`, 257
tokens at 224 px), with the in-process byte-level CLIP tokenizer. Nothing is downloaded:

    python -m wan_tpu.unifolm --model unifolm-tiny --mode interact --instruction "stack the cups" \
        --observation obs.npz --output episode.mp4
"""

from __future__ import annotations

import jax.numpy as jnp

TINY_SEED = 0


def tiny_towers(text_width: int, image_width: int, seed: int = TINY_SEED):
    """Random one-block OpenCLIP towers (float32, drawn by `random_clip`) + the tiny CLIP tokenizer."""
    from wan_tpu.encoders.clip_tokenizer import tiny_clip_tokenizer
    from wan_tpu.encoders.clip import CLIPTextTransformer, CLIPVisionTransformer, random_clip
    from wan_tpu.encoders.openclip import OpenCLIPImageEncoder, OpenCLIPTextEncoder, text_config, vision_config

    tokenizer = tiny_clip_tokenizer()
    vision = vision_config(image_width, 1, max(image_width // 16, 1), 14)
    text = text_config(text_width, 1, max(text_width // 16, 1), len(tokenizer))
    return (
        OpenCLIPImageEncoder(random_clip(lambda: CLIPVisionTransformer(vision), seed)),
        OpenCLIPTextEncoder(random_clip(lambda: CLIPTextTransformer(text), seed + 1), tokenizer),
    )


def tiny_pipeline(name: str, dtype=jnp.float32, attention_impl=None, stats=None, seed: int = TINY_SEED):

    from wan_tpu.configs.autoencoder_kl import AUTOENCODER_KL_CONFIGS
    from wan_tpu.configs.unifolm import CONFIGS
    from wan_tpu.runtime.executable_cache import cached_abstract
    from wan_tpu.unifolm.autoencoder_kl import AutoencoderKL
    from wan_tpu.unifolm.model import KeyCounter, abstract_unifolm
    from wan_tpu.loading.random_init import random_module
    from wan_tpu.unifolm.pipeline import UnifolmPipeline

    cfg = CONFIGS[name]
    model = random_module(None, seed, abstract=abstract_unifolm(cfg, dtype, attention_impl))
    vae_config = AUTOENCODER_KL_CONFIGS["tiny"]
    vae = random_module(None, seed + 1, abstract=cached_abstract(
        "autoencoder-kl", (vae_config,), lambda: AutoencoderKL(vae_config, rngs=KeyCounter(0))))
    image_encoder, text_encoder = tiny_towers(cfg.unet.context_dim, cfg.resampler.embedding_dim, seed + 2)
    return UnifolmPipeline(model, vae, image_encoder, text_encoder, stats, name=name)
