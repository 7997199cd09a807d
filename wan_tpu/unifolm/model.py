"""`UnifolmWMA`: everything of UniFoLM-WMA-0 that is not an encoder or the VAE — the video UNet with its
heads (`diffusion_model`), the image Resampler (`image_proj_model`), the state/action MLP projectors and
their position embeddings — and `prepare`, the step-invariant half of a sampling.

    model = random_unifolm(CONFIGS["unifolm-tiny"], dtype=jnp.float32, seed=0)        # or load_unifolm(path)
    cond = model.prepare(text_emb, clip_tokens, cond_latent, obs_images, obs_state, actions=None, fs=7)
    latents, actions, states = sample(model, cond, num_steps=50, key=jax.random.key(123))

Inputs come from the encoders (helper-side of the pipeline): `text_emb` (B, 77, 1024) OpenCLIP text
tokens, `clip_tokens` (B, 257, 1280) OpenCLIP image tokens of the last observed frame, `cond_latent`
(B, 4, h, w) its VAE latent × scale_factor; `obs_images` (B, 3, n_obs, H, W) in [-1, 1] and
`obs_state` (B, n_obs, 16) min-max normalised states; `actions` (B, 16, 16) normalised (world-model
mode) or None (decision-making: the action embeddings are zeroed, as in `world_model_interaction.py`).
Names of parameters follow the authors' modules (`ddpms.py` LatentVisualDiffusion).
"""

from __future__ import annotations

import functools
import itertools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.unifolm import UnifolmConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers import initializers
from wan_tpu.layers.embeddings import TextProjection
from wan_tpu.unifolm.perceiver import Perceiver
from wan_tpu.unifolm.unet import WMAModel


class Conditions(NamedTuple):
    """Everything a denoising step reads that does not change from step to step (a pytree)."""

    context: jax.Array  # (B·T, L, D) per-frame context
    concat: jax.Array  # (B, 4, T, h, w) condition latent repeated over frames
    fs: jax.Array  # (B,) int32
    obs: tuple | None  # (action head, state head) observation features, each (B, n_obs·obs_dim); None: no heads


class KeyCounter:
    """Stands in for `nnx.Rngs` while building an abstract module (`nnx.eval_shape`): `params()` gives
    `SHAPES_ONLY`, so the initialisers trace zeros, not random draws (`wan_tpu.layers.initializers`); with
    `shapes_only=False`, key(seed) folded with a Python counter.

    nnx.Rngs counts in a traced variable, and every count update under `eval_shape`/`jit` costs time
    linear in the trace so far (flax probes the tracer's sharding, which builds an error message over
    all equations): quadratic for the UNet's ~2,200 parameters (minutes). A host-side counter keeps
    tracing linear (seconds)."""

    def __init__(self, seed: int = 0, *, shapes_only: bool = True):
        self.seed, self._count, self.shapes_only = seed, itertools.count(), shapes_only

    def params(self):
        if self.shapes_only:
            return initializers.SHAPES_ONLY
        return jax.random.fold_in(jax.random.key(self.seed), next(self._count))


def abstract_unifolm(config: UnifolmConfig, dtype=jnp.float32, attention_impl=None, *, split: bool = False):
    """The model with `ShapeDtypeStruct` leaves (no memory): for loaders, sharding plans, `jax.export`.
    Read back from the executable cache when built before with the same config and settings. `split`: its
    (graphdef, state) instead (`executable_cache.cached_abstract`)."""
    from wan_tpu.runtime import executable_cache

    return executable_cache.cached_abstract(
        "unifolm", (config, jnp.dtype(dtype).name, attention_impl),
        lambda: UnifolmWMA(config, dtype=dtype, rngs=KeyCounter(0), attention_impl=attention_impl), split=split)


def random_unifolm(config: UnifolmConfig, dtype=jnp.float32, seed: int = 0, attention_impl=None) -> "UnifolmWMA":
    """Random weights (presets, tests, benchmarks), drawn on the host per parameter: fan-in scaled
    normal weights, unit norm scales, zero biases — no per-shape device compile. The same values in
    either convolution kernel layout (drawn spatial-first, then moved)."""
    from wan_tpu.layers.conv import out_first_kernels, spatial_first_shape, spatial_to_out_first

    model = abstract_unifolm(config, dtype, attention_impl)
    out_first = out_first_kernels(model)
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    for key, var in flat:
        path = ".".join(str(k) for k in key)
        target = var.get_value()
        rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
        leaf, shape = path.rsplit(".", 1)[-1], tuple(target.shape)
        if leaf == "kernel":
            drawn = spatial_first_shape(shape) if path in out_first else shape
            value = rng.standard_normal(drawn) / np.sqrt(max(int(np.prod(drawn[:-1])), 1))
            value = spatial_to_out_first(value) if path in out_first else value
        elif leaf in ("weight", "temperature"):
            value = np.ones(shape)
        elif leaf == "bias":
            value = np.zeros(shape)
        else:
            value = rng.standard_normal(shape) * 0.5
        var.set_value(jnp.asarray(value.astype(np.dtype(target.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


class UnifolmWMA(nnx.Module):
    def __init__(self, config: UnifolmConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, attention_impl=None):
        self.config = config
        self.dtype = dtype
        d, n_obs = config.unet.context_dim, config.unet.n_obs_steps
        self.diffusion_model = WMAModel(config, dtype=dtype, rngs=rngs, attention_impl=attention_impl)
        self.image_proj_model = Perceiver(config.resampler, dtype=dtype, rngs=rngs, attention_impl=attention_impl)
        # MLPProjector("gelu-mlp") = Linear → GELU(tanh) → Linear; built for every config (the base
        # checkpoint carries them too).
        self.state_projector = TextProjection(config.agent_state_dim, d, dtype=dtype, rngs=rngs)
        self.action_projector = TextProjection(config.agent_action_dim, d, dtype=dtype, rngs=rngs)
        self.agent_action_pos_emb = nnx.Param(initializers.normal(rngs.params(), (1, 16, d), dtype))
        self.agent_state_pos_emb = nnx.Param(initializers.normal(rngs.params(), (1, n_obs, d), dtype))

    def build_context(self, text_emb, clip_tokens, obs_state=None, actions=None, keep_action_tokens=True):
        """The cross-attention context of their sampling scripts (B, L, D) — per frame already for a
        base model ([text ‖ 16 image tokens], (B·T, 93, D)).

        With heads: [state (n_obs), action (16), text (77), image (T·16)]; `actions=None` zeroes the
        action embeddings (decision-making in the interaction loop); `keep_action_tokens=False` drops
        them (the authors' `real_eval_server.py`)."""
        cfg = self.config
        img = self.image_proj_model(clip_tokens.astype(self.dtype))
        text = text_emb.astype(img.dtype)
        if cfg.unet.base_model_gen_only:
            t, n = cfg.unet.temporal_length, cfg.unet.image_tokens_per_frame
            b = img.shape[0]
            return jnp.concatenate([jnp.repeat(text, t, axis=0), img.reshape(b * t, n, -1)], axis=1)
        if obs_state is None:
            raise WanInputError("this model has action/state heads: pass obs_state (B, n_obs, 16)")
        state = self.state_projector(obs_state.astype(img.dtype)) + self.agent_state_pos_emb[...]
        parts = [state]
        if keep_action_tokens:
            if actions is None:
                parts.append(jnp.zeros((img.shape[0], 16, img.shape[-1]), img.dtype))
            else:
                parts.append(self.action_projector(actions.astype(img.dtype)) + self.agent_action_pos_emb[...])
        elif actions is not None:
            raise WanInputError("actions were given but keep_action_tokens=False drops them; keep the tokens")
        return jnp.concatenate(parts + [text, img], axis=1)

    def prepare(self, text_emb, clip_tokens, cond_latent, obs_images=None, obs_state=None, actions=None, fs=None,
                keep_action_tokens=True) -> Conditions:
        """All step-invariant work of one sampling, compiled: projectors, Resampler, action tokens,
        per-frame context, observation encoders (ResNet18 ×2). `fs` int or (B,) (default: the config's)."""
        fs = jnp.broadcast_to(jnp.asarray(self.config.unet.default_fs if fs is None else fs, jnp.int32),
                              (cond_latent.shape[0],))
        graphdef, state = nnx.split(self)
        return _prepare_jit(graphdef, state, text_emb, clip_tokens, cond_latent, obs_images, obs_state, actions, fs,
                            keep_action_tokens=keep_action_tokens)

    def apply_prepare(self, text_emb, clip_tokens, cond_latent, obs_images, obs_state, actions, fs,
                      keep_action_tokens) -> Conditions:
        """`prepare` traced op by op (call it under jit)."""
        cfg = self.config
        b, t = cond_latent.shape[0], cfg.unet.temporal_length
        unet = self.diffusion_model
        context = unet.expand_context(self.build_context(text_emb, clip_tokens, obs_state, actions,
                                                         keep_action_tokens))
        concat = jnp.broadcast_to(cond_latent[:, :, None], (b, cond_latent.shape[1], t) + cond_latent.shape[2:])
        obs = None
        if unet.action_unet is not None:
            if obs_images is None:
                raise WanInputError("this model has action/state heads: pass obs_images (B, 3, n_obs, H, W)")
            obs = unet.encode_observations(obs_images.astype(self.dtype), obs_state)
        return Conditions(context, concat.astype(jnp.float32), fs, obs)


@functools.partial(jax.jit, static_argnames=("graphdef", "keep_action_tokens"))
def _prepare_jit(graphdef, state, *args, keep_action_tokens):
    return nnx.merge(graphdef, state).apply_prepare(*args, keep_action_tokens)
