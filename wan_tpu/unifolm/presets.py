"""The `unifolm-tiny` presets: whole UnifoLM pipelines with random weights from a fixed seed.

`unifolm-tiny` (with action/state heads) and `unifolm-tiny-base` (generation only) use
`wan_tpu.configs.unifolm.CONFIGS[...]` for the model with a lighter UNet (`preset_config`: one ResBlock
per level, transformers at the first level and in the middle block only), the 4-level few-channel SD VAE
(`AUTOENCODER_KL_CONFIGS["tiny"]`: 16×16 latents → 128×128 frames) and one-block OpenCLIP towers whose
widths are what the model reads (text: `unet.context_dim`; image: `resampler.embedding_dim`, 257
tokens at 224 px), with the in-process byte-level CLIP tokenizer, and `TINY_STEPS` DDIM steps by default. Nothing is downloaded:

    python -m wan_tpu.unifolm --model unifolm-tiny --mode interact --instruction "stack the cups" \
        --observation obs.npz --output episode.mp4
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

TINY_SEED = 0
# DDIM steps of every mode: random weights show nothing more at the authors' 50, and two keep a run to
# seconds on a CPU (`--steps` / `num_steps=` still choose any count).
TINY_STEPS = 2


def tiny_image_tower(image_width: int, seed: int = TINY_SEED):
    """A random one-block OpenCLIP image tower (float32, drawn by `random_clip`)."""
    from wan_tpu.encoders.clip import CLIPVisionTransformer, random_clip
    from wan_tpu.encoders.openclip import OpenCLIPImageEncoder, program_key, vision_config

    vision = vision_config(image_width, 1, max(image_width // 16, 1), 14)
    model = random_clip(lambda: CLIPVisionTransformer(vision), seed)
    return OpenCLIPImageEncoder(model, program_key(model, jnp.float32))


def tiny_text_tower(text_width: int, seed: int = TINY_SEED):
    """A random one-block OpenCLIP text tower (float32, drawn by `random_clip` from `seed`) + the tiny CLIP
    tokenizer."""
    from wan_tpu.encoders.clip import CLIPTextTransformer, random_clip
    from wan_tpu.encoders.clip_tokenizer import tiny_clip_tokenizer
    from wan_tpu.encoders.openclip import OpenCLIPTextEncoder, program_key, text_config

    tokenizer = tiny_clip_tokenizer()
    text = text_config(text_width, 1, max(text_width // 16, 1), len(tokenizer))
    model = random_clip(lambda: CLIPTextTransformer(text), seed)
    return OpenCLIPTextEncoder(model, tokenizer, program_key(model, jnp.float32))


def tiny_towers(text_width: int, image_width: int, seed: int = TINY_SEED):
    """Random one-block OpenCLIP towers (float32, drawn by `random_clip`) + the tiny CLIP tokenizer."""
    return tiny_image_tower(image_width, seed), tiny_text_tower(text_width, seed + 1)


def preset_config(name: str):
    """The preset `name`'s model config: `CONFIGS[name]` (the config the golden tests run against the
    authors' code) with one ResBlock per level and spatial/temporal transformers at the first level (and in
    the middle block) only. Every kind of layer still runs — the heads still read their nine feature maps —
    while the sampling program compiles in 60% of the time (on a 2-core CPU: 13.3 s instead of 21.7 s),
    which is what a preset's first run waits for."""
    from wan_tpu.configs.unifolm import CONFIGS

    cfg = CONFIGS[name]
    return dataclasses.replace(cfg, unet=dataclasses.replace(cfg.unet, num_res_blocks=1, attention_resolutions=(1,)))


def tiny_pipeline(pipeline_class, name: str, dtype=jnp.float32, mesh=None, attention=None, stats=None,
                  compile_cache: bool | None = None, seed: int = TINY_SEED):
    """The preset `name` (see the module docstring), an instance of `pipeline_class` (`UnifolmPipeline`,
    which passes itself: this module does not import the pipeline's). Its components load on first use
    (or in `prepare`'s threads), on one device: a `mesh` is not used by the presets."""
    from wan_tpu.configs.autoencoder_kl import AUTOENCODER_KL_CONFIGS

    cfg = preset_config(name)
    vae_config = AUTOENCODER_KL_CONFIGS["tiny"]

    def model():
        from wan_tpu.loading.random_init import random_module
        from wan_tpu.unifolm.model import abstract_unifolm

        return random_module(None, seed, abstract=abstract_unifolm(cfg, dtype, attention),
                             key=("unifolm", cfg, jnp.dtype(dtype).name, attention))

    def vae():
        from wan_tpu.loading.random_init import random_module
        from wan_tpu.runtime.executable_cache import cached_abstract
        from wan_tpu.unifolm.autoencoder_kl import AutoencoderKL
        from wan_tpu.unifolm.model import KeyCounter

        return random_module(None, seed + 1, abstract=cached_abstract(
            "autoencoder-kl", (vae_config,), lambda: AutoencoderKL(vae_config, rngs=KeyCounter(0))),
            key=("autoencoder-kl", vae_config))

    loaders = {
        "model": model,
        "vae": vae,
        "image_encoder": lambda: tiny_image_tower(cfg.resampler.embedding_dim, seed + 2),
        "text_encoder": lambda: tiny_text_tower(cfg.unet.context_dim, seed + 3),
    }
    # The pipeline builds its own abstract model and VAE for `prepare`: the same constructors as here.
    return pipeline_class(cfg, vae_config, loaders, stats=stats, name=name, dtype=dtype, attention=attention,
                          compile_cache=compile_cache, default_steps=dict.fromkeys(
                              ("decision", "world", "interact", "generate"), TINY_STEPS))


PRESETS = {name: (lambda cls, name=name, **kwargs: tiny_pipeline(cls, name, **kwargs))
           for name in ("unifolm-tiny", "unifolm-tiny-base")}
