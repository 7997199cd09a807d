"""`WMAModel`: UniFoLM's video UNet (DynamiCrafter's, 320 ch, mult 1-2-4-4) with its action and state
heads and the action-token Perceiver — a Flax NNX port of `modules/networks/wma_model.py`.

    unet = WMAModel(config, dtype=jnp.float32, rngs=nnx.Rngs(0))     # config: configs.unifolm.UnifolmConfig
    frames_ctx = unet.expand_context(context)                        # once per sampling
    obs = unet.encode_observations(obs_images, obs_state)            # once per sampling
    v, eps_action, eps_state = unet(x, timesteps, frames_ctx, fs, x_action, x_state, obs)

Public I/O keeps the authors' layouts: `x` (B, 8, T, H, W) = noisy latent ‖ repeated condition latent,
v-prediction (B, 4, T, H, W); actions/states (B, T, 16). Inside, activations are channels-last frames
(B·T, H, W, C). Blocks mirror the authors' `input_blocks` / `middle_block` / `output_blocks` lists
(block i, layer j ↔ their `input_blocks.i.j`), so their nine head feature maps are taken at the same
places.

Hooks (plain attributes, replaceable after construction; `shard_unifolm` sets mesh-aware ones):
`self_attention(q, k, v)` and `cross_attention(q, k, v)`, (B, S, H, D) attention functions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.configs.unifolm import UnifolmConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers import attention as attention_lib
from wan_tpu.layers.embeddings import TimestepEmbedding, timestep_embedding
from wan_tpu.layers.norms import GroupNorm
from wan_tpu.unifolm.blocks import Downsample, ResBlock, SpatialTransformer, TemporalTransformer, Upsample, conv
from wan_tpu.unifolm.heads import ConditionalUnet1D
from wan_tpu.unifolm.perceiver import Perceiver


def unit_count(u) -> int:
    """How many `WMAModel.units()` a UNet config (`UnifolmConfig.unet`) gives: the input convolution, each level's
    res blocks and downsample, the middle, each level's output blocks."""
    levels = len(u.channel_mult)
    return 1 + levels * u.num_res_blocks + levels - 1 + 1 + levels * (u.num_res_blocks + 1)


@functools.cache
def default_attention(impl):
    return functools.partial(attention_lib.attention, impl=impl)


class WMAModel(nnx.Module):
    def __init__(self, config: UnifolmConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, attention_impl=None):
        self.config = config
        self.dtype = dtype
        u = config.unet
        mc, emb = u.model_channels, u.time_embed_dim
        self.time_embed = TimestepEmbedding(mc, emb, dtype=dtype, rngs=rngs)
        self.fps_embedding = TimestepEmbedding(mc, emb, dtype=dtype, rngs=rngs)
        kw = dict(dtype=dtype, rngs=rngs)

        def spatial(ch, **extra):
            return SpatialTransformer(ch, ch // u.num_head_channels, u.num_head_channels, depth=u.transformer_depth,
                                      context_dim=u.context_dim, agent_state_context_len=u.n_obs_steps,
                                      text_context_len=u.text_context_len, video_length=u.image_tokens_per_frame,
                                      **extra, **kw)

        def temporal(ch):
            return TemporalTransformer(ch, ch // u.num_head_channels, u.num_head_channels, depth=u.transformer_depth,
                                       **kw)

        self.input_blocks = nnx.List([nnx.List([conv(u.in_channels, mc, (3, 3), **kw)])])
        self.init_attn = TemporalTransformer(mc, u.init_attn_heads, u.num_head_channels, depth=u.transformer_depth,
                                             **kw)
        chans, ch, ds = [mc], mc, 1
        for level, mult in enumerate(u.channel_mult):
            for _ in range(u.num_res_blocks):
                layers = [ResBlock(ch, emb, mult * mc, **kw)]
                ch = mult * mc
                if ds in u.attention_resolutions:
                    layers += [spatial(ch, agent_action_context_len=u.action_context_len), temporal(ch)]
                self.input_blocks.append(nnx.List(layers))
                chans.append(ch)
            if level != len(u.channel_mult) - 1:
                self.input_blocks.append(nnx.List([Downsample(ch, **kw)]))
                chans.append(ch)
                ds *= 2
        self.middle_block = nnx.List([ResBlock(ch, emb, ch, **kw),
                                      spatial(ch, agent_action_context_len=u.action_context_len),
                                      temporal(ch), ResBlock(ch, emb, ch, **kw)])
        self.output_blocks = nnx.List()
        for level, mult in list(enumerate(u.channel_mult))[::-1]:
            for i in range(u.num_res_blocks + 1):
                layers = [ResBlock(ch + chans.pop(), emb, mult * mc, **kw)]
                ch = mult * mc
                if ds in u.attention_resolutions:
                    # Built without agent_action_context_len in theirs: the default 16 (see ContextLayout).
                    layers += [spatial(ch), temporal(ch)]
                if level and i == u.num_res_blocks:
                    layers.append(Upsample(ch, **kw))
                    ds //= 2
                self.output_blocks.append(nnx.List(layers))
        self.out_norm = GroupNorm(32, ch)
        self.out_conv = conv(mc, u.out_channels, (3, 3), **kw)
        if config.has_heads:
            levels = tuple(m * mc for m in u.channel_mult)
            self.action_unet = ConditionalUnet1D(config.head, levels, **kw)
            self.state_unet = ConditionalUnet1D(config.head, levels, **kw)
            self.action_token_projector = Perceiver(config.action_tokens, attention_impl=attention_impl, **kw)
        else:
            self.action_unet = self.state_unet = self.action_token_projector = None
        self.self_attention = default_attention(attention_impl)
        self.cross_attention = default_attention(attention_impl)

    # -- step-invariant conditioning ---------------------------------------------------------------
    def expand_context(self, context):
        """The raw context (B, L, D) → per-frame context (B·T, L_frame, D), as the top of their forward.

        [state (n_obs), action (16), text (77), image (T·16)] → per frame [state, action tokens
        (16 actions × num_stem_token), text, image (16)]; without the 16 action embeddings the action
        part is absent; a base model takes its per-frame context as is.
        """
        u = self.config.unet
        t, s, txt = u.temporal_length, u.n_obs_steps, u.text_context_len
        b, length, d = context.shape
        if u.base_model_gen_only:
            if length != txt + u.image_tokens_per_frame:
                raise WanInputError(f"base-model context has {length} tokens per frame; expected "
                                    f"{txt} text + {u.image_tokens_per_frame} image tokens")
            return context
        img = context[:, length - t * u.image_tokens_per_frame:].reshape(b * t, u.image_tokens_per_frame, d)
        rep = lambda c: jnp.repeat(c, t, axis=0)
        if length == s + txt + t * u.image_tokens_per_frame:
            return jnp.concatenate([rep(context[:, :s]), rep(context[:, s:s + txt]), img], axis=1)
        if length != s + 16 + txt + t * u.image_tokens_per_frame:
            raise WanInputError(
                f"context has {length} tokens; expected {s} state + 16 action + {txt} text + "
                f"{t * u.image_tokens_per_frame} image tokens (or the same without the 16 action tokens)"
            )
        tokens = self.action_token_projector(context[:, s:s + 16].reshape(b * 16, 1, d))  # (B·16, 16·n, D)
        n = tokens.shape[1] // t
        # (b, action o, frame, n) → (b, frame, action o, n): each frame gets n tokens of every action.
        tokens = tokens.reshape(b, 16, t, n, d).transpose(0, 2, 1, 3, 4).reshape(b * t, 16 * n, d)
        return jnp.concatenate([rep(context[:, :s]), tokens.astype(context.dtype), rep(context[:, s + 16:s + 16 + txt]),
                                img], axis=1)

    def encode_observations(self, obs_images, obs_state):
        """obs_images (B, 3, n_obs, H, W) in [-1, 1], obs_state (B, n_obs, 16) → (action, state) head
        conditions, each (B, n_obs·(2·kp + 16)). Step-invariant: computed once per sampling."""
        imgs = jnp.transpose(obs_images, (0, 2, 3, 4, 1))
        return (self.action_unet.encode_observations(imgs, obs_state),
                self.state_unet.encode_observations(imgs, obs_state))

    # -- the denoiser --------------------------------------------------------------------------------
    def __call__(self, x, timesteps, context, fs=None, x_action=None, x_state=None, obs=None):
        """x (B, 8, T, H, W); timesteps (B,); context (B·T, L, D) from `expand_context`; fs (B,) or None
        (default_fs); x_action, x_state (B, T, 16) and obs from `encode_observations` for the heads.
        → (v (B, 4, T, H, W), action ε (B, T, 16), state ε (B, T, 16)); the heads' outputs are zeros
        for a base model, as theirs."""
        carry = self.begin(x, timesteps, context, fs)
        for unit in self.units():
            carry = self.run_unit(unit, carry)
        return self.end(carry, x_action, x_state, obs)

    # The forward in pieces (`begin`, then each of `units()` through `run_unit`, then `end`), each taking and
    # giving a carry of arrays only: what `__call__` runs in one program, and what a caller may run as
    # several programs (compiled side by side) by cutting the units' list anywhere.
    def units(self) -> list[tuple[str, int]]:
        """The UNet's blocks in order: ("in", i), ("mid", 0), ("out", i)."""
        return ([("in", i) for i in range(len(self.input_blocks))] + [("mid", 0)]
                + [("out", i) for i in range(len(self.output_blocks))])

    def begin(self, x, timesteps, context, fs=None) -> dict:
        """The embeddings and the frames as channels-last activations: the carry the first unit takes."""
        u = self.config.unet
        b, _, t, hh, ww = x.shape
        if fs is None:
            fs = jnp.full((b,), u.default_fs, jnp.int32)
        emb = self.time_embed(timestep_embedding(timesteps, u.model_channels).astype(self.dtype))
        emb = emb + self.fps_embedding(timestep_embedding(fs, u.model_channels).astype(self.dtype))
        h = jnp.transpose(x, (0, 2, 3, 4, 1)).reshape(b * t, hh, ww, -1).astype(self.dtype)
        # `prev`: the previous output block's activations (a head feature map where an Upsample follows).
        return dict(h=h, hs=[], maps=[], prev=None, emb=jnp.repeat(emb, t, axis=0), context=context.astype(self.dtype),
                    timesteps=timesteps)

    def run_unit(self, unit: tuple[str, int], carry: dict) -> dict:
        """One of `units()` on the carry → the next carry (the skip activations and head maps in it)."""
        kind, i = unit
        h, hs, maps, prev = carry["h"], list(carry["hs"]), list(carry["maps"]), carry["prev"]
        emb, context = carry["emb"], carry["context"]
        t = emb.shape[0] // carry["timesteps"].shape[0]
        attn = dict(self_attn=self.self_attention, cross_attn=self.cross_attention)

        def run(block, h):
            for layer in block:
                if isinstance(layer, ResBlock):
                    h = layer(h, emb, t)
                elif isinstance(layer, SpatialTransformer):
                    h = layer(h, context, **attn)
                elif isinstance(layer, TemporalTransformer):
                    h = layer(h, t, **attn)
                else:
                    h = layer(h)
            return h

        if kind == "in":
            block = self.input_blocks[i]
            h = run(block, h)
            if i == 0:
                h = self.init_attn(h, t, **attn)
            if i and isinstance(block[0], Downsample):
                maps.append(hs[-1])
            hs.append(h)
        elif kind == "mid":
            maps.append(h)
            h = run(self.middle_block, h)
            maps.append(h)
        else:
            block = self.output_blocks[i]
            h = run(block, jnp.concatenate([h, hs.pop()], axis=-1))
            if isinstance(block[-1], Upsample):
                maps.append(prev)
            prev = h
        return dict(carry, h=h, hs=hs, maps=maps, prev=prev)

    def end_video(self, carry: dict):
        """The output convolution on the carry: v (B, 4, T, H, W) in the authors' layout."""
        h, timesteps = carry["h"], carry["timesteps"]
        b = timesteps.shape[0]
        t = h.shape[0] // b
        y = self.out_conv(jax.nn.silu(self.out_norm(h))).astype(jnp.float32)
        return y.reshape(b, t, h.shape[1], h.shape[2], -1).transpose(0, 4, 1, 2, 3)

    def end(self, carry: dict, x_action=None, x_state=None, obs=None):
        """The output convolution (v in the authors' layout) and the heads on the carry's maps."""
        maps, timesteps = [*carry["maps"], carry["h"]], carry["timesteps"]
        y = self.end_video(carry)
        if self.action_unet is None:
            zeros = lambda a: None if a is None else jnp.zeros(a.shape, jnp.float32)
            return y, zeros(x_action), zeros(x_state)
        a = self.action_unet(x_action, timesteps, maps, obs[0]).astype(jnp.float32)
        s = self.state_unet(x_state, timesteps, maps, obs[1]).astype(jnp.float32)
        return y, a, s
