"""Timestep and conditioning embeddings (diffusers' Timesteps, TimestepEmbedding,
PixArtAlphaTextProjection) and the feed-forward block, shared by the Wan DiT and the UniFoLM models."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.layers import initializers


def timestep_embedding(t, dim: int, flip_sin_to_cos: bool = True, downscale_freq_shift: float = 0.0,
                       max_period: float = 10000.0):
    """Sinusoidal embedding of timesteps t (any shape) → t.shape + (dim,), float32.

    A device array is embedded in float32, as diffusers does. Timesteps given as a numpy array are
    known on the host and embedded there in float64 (as the original Wan code does), then rounded
    once: at t ≈ 1000 float32 angles are off by up to ~6e-5 rad, float64 ones are exact.
    """
    xp = np if isinstance(t, np.ndarray) else jnp
    ftype = np.float64 if xp is np else jnp.float32
    half = dim // 2
    exponent = -math.log(max_period) * xp.arange(half, dtype=ftype) / (half - downscale_freq_shift)
    args = t.astype(ftype)[..., None] * xp.exp(exponent)
    sin, cos = xp.sin(args), xp.cos(args)
    emb = xp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = xp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, 1)])
    return jnp.asarray(emb, jnp.float32)


def linear(din: int, dout: int, dtype, rngs: nnx.Rngs, use_bias: bool = True) -> nnx.Linear:
    """A linear layer (biased unless `use_bias=False`) whose parameters and matmul run in `dtype`."""
    return nnx.Linear(din, dout, use_bias=use_bias, dtype=dtype, param_dtype=dtype, kernel_init=initializers.lecun_normal,
                      rngs=rngs)


class TimestepEmbedding(nnx.Module):
    """linear_1 → SiLU → linear_2."""

    def __init__(self, in_channels: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.linear_1 = linear(in_channels, dim, dtype, rngs)
        self.linear_2 = linear(dim, dim, dtype, rngs)

    def __call__(self, x):
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class TextProjection(nnx.Module):
    """diffusers' PixArtAlphaTextProjection with GELU(tanh): linear_1 → GELU → linear_2."""

    def __init__(self, in_features: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.linear_1 = linear(in_features, dim, dtype, rngs)
        self.linear_2 = linear(dim, dim, dtype, rngs)

    def __call__(self, x):
        return self.linear_2(jax.nn.gelu(self.linear_1(x), approximate=True))


class FeedForward(nnx.Module):
    """proj_in → GELU → proj_out (diffusers' FeedForward `net.0.proj` / `net.2`).

    `glu=True` is GEGLU (LDM/diffusers `GEGLU`): proj_in makes 2·inner_dim features, the first half
    times GELU of the second half.
    """

    def __init__(self, dim: int, inner_dim: int, dim_out: int, *, approximate: bool, dtype, rngs: nnx.Rngs,
                 glu: bool = False):
        self.approximate, self.glu = approximate, glu
        self.proj_in = linear(dim, inner_dim * (2 if glu else 1), dtype, rngs)
        self.proj_out = linear(inner_dim, dim_out, dtype, rngs)

    def __call__(self, x):
        h = self.proj_in(x)
        if self.glu:
            h, gate = jnp.split(h, 2, axis=-1)
            return self.proj_out(h * jax.nn.gelu(gate, approximate=self.approximate))
        return self.proj_out(jax.nn.gelu(h, approximate=self.approximate))
