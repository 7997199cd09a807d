"""Normalization layers (Wan DiT, UniFoLM UNet), computed in float32 whatever the activation dtype.

Parameter names follow diffusers (`weight`, `bias`) so checkpoint names map one to one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.layers.fusion import own_pass_on_gpu


def layer_norm(x, eps: float, weight=None, bias=None):
    """LayerNorm over the last axis in float32, returned in float32 (callers cast where diffusers does)."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y


def _rms_normalize(x, eps: float, weight=None, statistic_apart=False):
    xf = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    if statistic_apart:
        # On GPUs XLA otherwise fuses the row reduction with the elementwise work after it into one
        # normalisation kernel that stops where that work reshapes (RoPE's pair swap): it writes its
        # float32 result (twice the bytes of the bf16 rows) for another pass to read. Apart, the
        # statistic is one read of the rows, and the rest one read and one bf16 write.
        inv_rms = own_pass_on_gpu(inv_rms)
    y = xf * inv_rms
    return y if weight is None else y * weight.astype(jnp.float32)


def rms_norm(x, eps: float, weight=None):
    """x·rsqrt(mean(x²) + eps) over the last axis, statistics in float32, output in x's dtype."""
    return _rms_normalize(x, eps, weight).astype(x.dtype)


def t5_layer_norm(x, weight, eps: float):
    """T5/UMT5's RMSNorm (transformers' `T5LayerNorm`): mean(x²) in float32, x·rsqrt(·) in float32, cast
    to a half-precision `weight`'s dtype *before* the weight multiplies (in that dtype)."""
    variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(variance + eps)
    if weight.dtype in (jnp.bfloat16, jnp.float16):
        y = y.astype(weight.dtype)
    return weight * y


def modulated_layer_norm(x, eps: float, scale, shift, out_dtype):
    """LayerNorm (no affine) then ·(1 + scale) + shift, as one float32 expression rounded once.

    Both statistics come from one read of x (E[x] and E[x²], f32 accumulation), and the
    normalisation folds into the modulation's multiply, so the compiler can emit one reduction
    pass and one elementwise pass that writes the projections' input directly. E[x²] − E[x]² loses
    digits only when |mean| ≫ std over the channels, which the DiT's tokens are not.
    """
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) - jnp.square(mean), 0.0)
    return ((xf - mean) * (jax.lax.rsqrt(var + eps) * (1 + scale)) + shift).astype(out_dtype)


class FP32LayerNorm(nnx.Module):
    """diffusers' FP32LayerNorm: float32 statistics and (optional) float32 affine, output in input dtype."""

    def __init__(self, dim: int, eps: float, elementwise_affine: bool = True):
        self.eps = eps
        if elementwise_affine:
            self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
            self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
        else:
            self.weight = self.bias = None

    def __call__(self, x):
        w = None if self.weight is None else self.weight[...]
        b = None if self.bias is None else self.bias[...]
        return layer_norm(x, self.eps, w, b).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale (`torch.nn.RMSNorm`); statistics in float32, output in input dtype.

    On the DiT's q/k it normalizes across all heads at once (`rms_norm_across_heads`), so it runs on
    the (…, heads·head_dim) projection before the head split.
    """

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def normalize(self, x):
        """The normalised, scaled x in float32 (for a caller that continues in float32, e.g. RoPE,
        fused with it into one pass after the statistic's on GPUs)."""
        return _rms_normalize(x, self.eps, self.weight[...], statistic_apart=True)

    def __call__(self, x):
        return rms_norm(x, self.eps, self.weight[...])


class GroupNorm(nnx.Module):
    """`torch.nn.GroupNorm` on channels-last input (N, ..., C): statistics over every axis but the
    batch within each group of C/num_groups channels, in float32; output in the input dtype."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5):
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: {num_channels} channels do not split into {num_groups} groups")
        self.num_groups, self.eps = num_groups, eps
        self.weight = nnx.Param(jnp.ones((num_channels,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((num_channels,), jnp.float32))

    def __call__(self, x):
        shape = x.shape
        g = x.astype(jnp.float32).reshape(shape[0], -1, self.num_groups, shape[-1] // self.num_groups)
        mean = jnp.mean(g, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(g - mean), axis=(1, 3), keepdims=True)
        y = ((g - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
        return (y * self.weight[...] + self.bias[...]).astype(x.dtype)
