"""Building blocks shared by the Wan-style DiTs (`wan_tpu.wan.transformer.WanTransformer`,
`wan_tpu.matrix_game.model.MatrixGameTransformer`): the attention projections (`WanAttention`), the
CLIP image embedding (`WanImageEmbedding`), `patchify` / `unpatchify`, and the models' default hooks
(`default_attention(impl)` for `self_attention` / `cross_attention`, `identity` for `shard_activation`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from wan_tpu.layers import attention as attention_lib
from wan_tpu.layers.embeddings import FeedForward, linear
from wan_tpu.layers.norms import FP32LayerNorm, RMSNorm
from wan_tpu.layers.rope import apply_rope, rotate


def _heads(x, num_heads):
    b, s, d = x.shape
    return x.reshape(b, s, num_heads, d // num_heads)


class WanAttention(nnx.Module):
    """Projections of one attention layer; the attention function itself is passed in."""

    def __init__(self, dim: int, num_heads: int, eps: float, *, added_kv_proj_dim=None, dtype, rngs):
        self.num_heads = num_heads
        self.to_q = linear(dim, dim, dtype, rngs)
        self.to_k = linear(dim, dim, dtype, rngs)
        self.to_v = linear(dim, dim, dtype, rngs)
        self.to_out = linear(dim, dim, dtype, rngs)
        self.norm_q = RMSNorm(dim, eps, dtype=dtype)
        self.norm_k = RMSNorm(dim, eps, dtype=dtype)
        if added_kv_proj_dim is not None:
            self.add_k_proj = linear(added_kv_proj_dim, dim, dtype, rngs)
            self.add_v_proj = linear(added_kv_proj_dim, dim, dtype, rngs)
            self.norm_added_k = RMSNorm(dim, eps, dtype=dtype)
        else:
            self.add_k_proj = self.add_v_proj = self.norm_added_k = None

    def query(self, x):
        """Normalised queries (B, S, H, D)."""
        return _heads(self.norm_q(self.to_q(x)), self.num_heads)

    def key_value(self, x):
        """Normalised keys and values (B, S, H, D) of `x`; a cross-attention's K/V depend only on its context."""
        return _heads(self.norm_k(self.to_k(x)), self.num_heads), _heads(self.to_v(x), self.num_heads)

    def qkv(self, x, rope, fused=True):
        """Self-attention inputs: q and k rotated by `rope`, v; separate from attending so a causal
        model can cache k and v. `fused`: RMSNorm and RoPE as one float32 expression per
        projection, rounded once (False: norm, round, rotate, round — diffusers' order)."""
        v = _heads(self.to_v(x), self.num_heads)
        if fused:
            q = rotate(_heads(self.norm_q.normalize(self.to_q(x)), self.num_heads), *rope).astype(x.dtype)
            k = rotate(_heads(self.norm_k.normalize(self.to_k(x)), self.num_heads), *rope).astype(x.dtype)
            return q, k, v
        k, _ = self.key_value(x)
        return apply_rope(self.query(x), *rope), apply_rope(k, *rope), v

    def self_attention(self, x, rope, attn_fn, fused=True):
        out = attn_fn(*self.qkv(x, rope, fused))
        return self.to_out(out.reshape(x.shape[0], x.shape[1], -1))

    def cross_attention(self, x, context, context_image, attn_fn):
        q = self.query(x)
        out = attn_fn(q, *self.key_value(context))
        if context_image is not None:
            k_img = _heads(self.norm_added_k(self.add_k_proj(context_image)), self.num_heads)
            v_img = _heads(self.add_v_proj(context_image), self.num_heads)
            out = out + attn_fn(q, k_img, v_img)
        return self.to_out(out.reshape(x.shape[0], x.shape[1], -1))


class WanImageEmbedding(nnx.Module):
    """CLIP image tokens → model width: FP32LayerNorm → FF(GELU) → FP32LayerNorm (+ optional pos_embed)."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len, *, dtype, rngs: nnx.Rngs):
        self.norm1 = FP32LayerNorm(image_dim, 1e-5)
        self.ff = FeedForward(image_dim, image_dim, dim, approximate=False, dtype=dtype, rngs=rngs)
        self.norm2 = FP32LayerNorm(dim, 1e-5)
        self.pos_embed = (
            nnx.Param(jnp.zeros((1, pos_embed_seq_len, image_dim), dtype)) if pos_embed_seq_len is not None else None
        )

    def __call__(self, x):
        if self.pos_embed is not None:
            # FLF2V: first- and last-frame tokens (2 × 257) of one sample share one position table.
            n = self.pos_embed.shape[1]
            x = x.reshape(-1, n, x.shape[-1]) + self.pos_embed[...]
        return self.norm2(self.ff(self.norm1(x)))


def patchify(x, patch_size):
    """(B, C, F, H, W) → tokens (B, S, C·pt·ph·pw) in (f, h, w) order, features (c, pt, ph, pw) — the
    Conv3d patch embedding as a matmul — and the token grid (F/pt, H/ph, W/pw)."""
    b, c, f, h, w = x.shape
    pt, ph, pw = patch_size
    grid = (f // pt, h // ph, w // pw)
    x = x.reshape(b, c, grid[0], pt, grid[1], ph, grid[2], pw).transpose(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, grid[0] * grid[1] * grid[2], c * pt * ph * pw), grid


def unpatchify(x, grid, patch_size):
    """Tokens (B, S, pt·ph·pw·C) → (B, C, F, H, W): the original "bfhwpqrc->bcfphqwr"."""
    b = x.shape[0]
    pt, ph, pw = patch_size
    x = x.reshape(b, *grid, pt, ph, pw, -1).transpose(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, x.shape[1], grid[0] * pt, grid[1] * ph, grid[2] * pw)


def identity(x, name):
    """The default `shard_activation` hook: activations unconstrained (no mesh)."""
    return x


@functools.cache
def default_attention(impl):
    """The default `self_attention` / `cross_attention` hook for kernel `impl` (None: the backend's fastest)."""
    # One hook object per impl: models of one config then have equal graphdefs and share compiled
    # code (the two A14B experts compile once).
    return functools.partial(attention_lib.attention, impl=impl)
