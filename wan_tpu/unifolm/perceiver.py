"""Perceiver resamplers of UniFoLM: the image `Resampler` (CLIP tokens → 16 tokens per frame) and the
action-token projector `SATokenProjector` (each action embedding → 16 tokens per frame).

Reference: `modules/encoders/resampler.py` and `modules/encoders/condition.py` of the authors' code.
Their attention scales q and k by d^-1/4 each before the product, which is q·k/√d: we use
`wan_tpu.attention` (scale 1/√d, softmax in float32, as theirs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.configs.unifolm import PerceiverConfig
from wan_tpu.layers import attention as attention_lib
from wan_tpu.layers import initializers
from wan_tpu.layers.embeddings import linear
from wan_tpu.layers.norms import FP32LayerNorm
from wan_tpu.unifolm.blocks import heads, merge_heads


class PerceiverAttention(nnx.Module):
    """Queries from the (normed) latents; keys and values from [inputs ‖ latents]."""

    def __init__(self, dim: int, dim_head: int, n_heads: int, *, dtype, rngs):
        inner = dim_head * n_heads
        self.n_heads = n_heads
        self.norm1, self.norm2 = FP32LayerNorm(dim, 1e-5), FP32LayerNorm(dim, 1e-5)
        self.to_q = linear(dim, inner, dtype, rngs, use_bias=False)
        self.to_kv = linear(dim, 2 * inner, dtype, rngs, use_bias=False)
        self.to_out = linear(inner, dim, dtype, rngs, use_bias=False)

    def __call__(self, x, latents, attn_fn):
        x, latents = self.norm1(x), self.norm2(latents)
        k, v = jnp.split(self.to_kv(jnp.concatenate([x, latents], axis=1)), 2, axis=-1)
        out = attn_fn(heads(self.to_q(latents), self.n_heads), heads(k, self.n_heads), heads(v, self.n_heads))
        return self.to_out(merge_heads(out))


class PerceiverFeedForward(nnx.Module):
    """LayerNorm → bias-free linear → GELU (exact, or tanh) → bias-free linear."""

    def __init__(self, dim: int, mult: int, gelu_tanh: bool, *, dtype, rngs):
        self.gelu_tanh = gelu_tanh
        self.norm = FP32LayerNorm(dim, 1e-5)
        self.proj_in = linear(dim, dim * mult, dtype, rngs, use_bias=False)
        self.proj_out = linear(dim * mult, dim, dtype, rngs, use_bias=False)

    def __call__(self, x):
        return self.proj_out(jax.nn.gelu(self.proj_in(self.norm(x)), approximate=self.gelu_tanh))


class PerceiverLayer(nnx.Module):
    def __init__(self, cfg: PerceiverConfig, *, dtype, rngs):
        self.attn = PerceiverAttention(cfg.dim, cfg.dim_head, cfg.heads, dtype=dtype, rngs=rngs)
        self.ff = PerceiverFeedForward(cfg.dim, cfg.ff_mult, cfg.gelu_tanh, dtype=dtype, rngs=rngs)


class Perceiver(nnx.Module):
    """`Resampler` (with `embedding_dim`: proj_in, norm_out over output_dim) or `SATokenProjector`
    (no proj_in; norm_out over dim, which equals output_dim in every config)."""

    def __init__(self, cfg: PerceiverConfig, *, dtype, rngs, attention_impl=None):
        self.latents = nnx.Param(initializers.normal(rngs.params(), (1, cfg.num_latents, cfg.dim), dtype) / cfg.dim**0.5)
        self.proj_in = linear(cfg.embedding_dim, cfg.dim, dtype, rngs) if cfg.embedding_dim else None
        self.layers = nnx.List([PerceiverLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.depth)])
        self.proj_out = linear(cfg.dim, cfg.output_dim, dtype, rngs)
        self.norm_out = FP32LayerNorm(cfg.output_dim, 1e-5)
        self.attention = functools.partial(attention_lib.attention, impl=attention_impl)

    def __call__(self, x):
        """x (N, L, embedding_dim or dim) → (N, num_latents, output_dim)."""
        latents = jnp.broadcast_to(self.latents[...], (x.shape[0],) + self.latents.shape[1:]).astype(x.dtype)
        if self.proj_in is not None:
            x = self.proj_in(x)
        for layer in self.layers:
            latents = latents + layer.attn(x, latents, self.attention)
            latents = latents + layer.ff(latents)
        return self.norm_out(self.proj_out(latents))
