"""Building blocks of the UniFoLM video UNet (DynamiCrafter's): ResBlock with its temporal conv,
spatial and temporal transformers, and the per-modality cross-attention.

Activations are channels-last: frames `(B·T, H, W, C)` and clips `(B, T, H, W, C)`. Attention goes
through the hooks the UNet passes down (`self_attn(q, k, v)`, `cross_attn(q, k, v)`, default
`wan_tpu.attention`), layout (B, S, heads, head_dim). Reference: the authors'
`modules/networks/wma_model.py` and `modules/attention.py` (unitreerobotics/unifolm-world-model-action).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.layers.attention import attention
from wan_tpu.layers.conv import Conv
from wan_tpu.layers.embeddings import FeedForward, linear
from wan_tpu.layers.norms import FP32LayerNorm, GroupNorm


def conv(cin: int, cout: int, kernel, *, stride=1, padding=None, use_bias=True, dtype, rngs) -> Conv:
    """torch Conv{1,2,3}d with symmetric padding `kernel // 2` per axis unless given; channels-last, the
    kernel in the backend's layout (`wan_tpu.layers.conv`)."""
    kernel = (kernel,) if isinstance(kernel, int) else tuple(kernel)
    if padding is None:
        padding = tuple((k // 2, k // 2) for k in kernel)
    return Conv(cin, cout, kernel, strides=stride, padding=padding, use_bias=use_bias, dtype=dtype, rngs=rngs)


def heads(x, n: int):
    b, s, d = x.shape
    return x.reshape(b, s, n, d // n)


def merge_heads(x):
    b, s, h, d = x.shape
    return x.reshape(b, s, h * d)


class TemporalConvBlock(nnx.Module):
    """Four [GroupNorm32, SiLU, Conv3d (3,1,1)] over time, plus the input (ModelScope's temporal conv)."""

    def __init__(self, ch: int, *, dtype, rngs):
        for i in range(1, 5):
            setattr(self, f"norm{i}", GroupNorm(32, ch))
            setattr(self, f"conv{i}", conv(ch, ch, (3, 1), dtype=dtype, rngs=rngs))

    def __call__(self, x):
        """x (B, T, H, W, C): the convs run over T (as the H axis of a 2-D conv over (T, H·W))."""
        b, t, hh, ww, c = x.shape
        h = x
        for i in range(1, 5):
            h = jax.nn.silu(getattr(self, f"norm{i}")(h))
            h = getattr(self, f"conv{i}")(h.reshape(b, t, hh * ww, c)).reshape(b, t, hh, ww, c)
        return x + h


class ResBlock(nnx.Module):
    """GroupNorm32 (float32) → SiLU → conv, + time embedding, GroupNorm32 → SiLU → conv, skip; then
    the temporal conv block on the clip."""

    def __init__(self, cin: int, emb_dim: int, cout: int, *, temporal: bool = True, dtype, rngs):
        self.in_norm = GroupNorm(32, cin)
        self.in_conv = conv(cin, cout, (3, 3), dtype=dtype, rngs=rngs)
        self.emb_proj = linear(emb_dim, cout, dtype, rngs)
        self.out_norm = GroupNorm(32, cout)
        self.out_conv = conv(cout, cout, (3, 3), dtype=dtype, rngs=rngs)
        self.skip = conv(cin, cout, (1, 1), dtype=dtype, rngs=rngs) if cin != cout else None
        self.temporal_conv = TemporalConvBlock(cout, dtype=dtype, rngs=rngs) if temporal else None

    def __call__(self, x, emb, num_frames: int):
        h = self.in_conv(jax.nn.silu(self.in_norm(x)))
        h = h + self.emb_proj(jax.nn.silu(emb)).astype(h.dtype)[:, None, None, :]
        h = self.out_conv(jax.nn.silu(self.out_norm(h)))
        h = (x if self.skip is None else self.skip(x)) + h
        if self.temporal_conv is not None:
            n, hh, ww, c = h.shape
            h = self.temporal_conv(h.reshape(n // num_frames, num_frames, hh, ww, c)).reshape(h.shape)
        return h


class Downsample(nnx.Module):
    def __init__(self, ch: int, *, dtype, rngs):
        self.op = conv(ch, ch, (3, 3), stride=2, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.op(x)


class Upsample(nnx.Module):
    def __init__(self, ch: int, *, dtype, rngs):
        self.conv = conv(ch, ch, (3, 3), dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))


class ContextLayout:
    """Where each modality sits in a frame's context, decided (as the authors do) by its length L:

    - L = text + image: the base model; the *text* branch attends to the whole context (their
      `to_k(context)` there), the image branch to the image tokens;
    - L = state + text + image: state, text, image branches (no action tokens);
    - otherwise: state | action | text | image, the action branch block-causal over frames.

    `action_len` is the layer's own idea of the action span: the output blocks were built with the
    default 16, so there they slice [state: 0:2 | "action": 2:18 | "text": 18:95 | "image": rest] of
    the real layout; the checkpoints were trained that way and we reproduce it.
    """

    def __init__(self, length: int, state_len: int, action_len: int, text_len: int, image_len: int):
        s, a, t = state_len, action_len, text_len
        self.state = self.action = None
        if length == text_len + image_len:
            self.text, self.image = (0, length), (text_len, length)
        elif length == state_len + text_len + image_len:
            self.state, self.text, self.image = (0, s), (s, s + t), (s + t, length)
        else:
            self.state, self.action = (0, s), (s, s + a)
            self.text, self.image = (s + a, s + a + t), (s + a + t, length)


class CrossAttention(nnx.Module):
    """Self-attention (`context=None`) or the per-modality cross-attention of the spatial transformers:
    one query and one output projection, separate K/V for text (`to_k`), image (`to_k_ip`), state
    (`to_k_as`) and action (`to_k_aa`), four softmaxes summed with scale 1."""

    def __init__(self, query_dim: int, n_heads: int, d_head: int, context_dim: int | None = None, *,
                 multimodal: bool = False, agent_state_context_len: int = 2, agent_action_context_len: int = 16,
                 text_context_len: int = 77, video_length: int = 16, dtype, rngs):
        inner, ctx = n_heads * d_head, context_dim or query_dim
        self.n_heads = n_heads
        self.lengths = (agent_state_context_len, agent_action_context_len, text_context_len, video_length)
        self.to_q = linear(query_dim, inner, dtype, rngs, use_bias=False)
        self.to_k = linear(ctx, inner, dtype, rngs, use_bias=False)
        self.to_v = linear(ctx, inner, dtype, rngs, use_bias=False)
        self.to_out = linear(inner, query_dim, dtype, rngs)
        self.multimodal = multimodal
        if multimodal:
            for tag in ("ip", "as", "aa"):
                setattr(self, f"to_k_{tag}", linear(ctx, inner, dtype, rngs, use_bias=False))
                setattr(self, f"to_v_{tag}", linear(ctx, inner, dtype, rngs, use_bias=False))

    def _branch(self, q, context, span, to_k, to_v, attn_fn):
        c = context[:, span[0]:span[1]]
        return attn_fn(q, heads(to_k(c), self.n_heads), heads(to_v(c), self.n_heads))

    def __call__(self, x, context, self_attn, cross_attn, num_frames: int = 16):
        q = heads(self.to_q(x), self.n_heads)
        if context is None:
            out = self_attn(q, heads(self.to_k(x), self.n_heads), heads(self.to_v(x), self.n_heads))
            return self.to_out(merge_heads(out))
        layout = ContextLayout(context.shape[1], *self.lengths)
        out = self._branch(q, context, layout.text, self.to_k, self.to_v, cross_attn)
        out = out + self._branch(q, context, layout.image, self.to_k_ip, self.to_v_ip, cross_attn)
        if layout.state is not None:
            out = out + self._branch(q, context, layout.state, self.to_k_as, self.to_v_as, cross_attn)
        if layout.action is not None:
            # Frame f (row index mod 16 in their code: rows are (batch, frame)) sees the first
            # (f + 1)·(L_action / 16) action tokens: actions 0..f in the true layout.
            a0, a1 = layout.action
            per_frame = (a1 - a0) // 16
            frame = jnp.arange(q.shape[0]) % 16
            masked = lambda q, k, v: attention(q, k, v, kv_len=(frame + 1) * per_frame)
            out = out + self._branch(q, context, layout.action, self.to_k_aa, self.to_v_aa, masked)
        return self.to_out(merge_heads(out))


class BasicTransformerBlock(nnx.Module):
    """LayerNorm → self-attention → LayerNorm → attn2 (cross, or self when no context) → LayerNorm →
    GEGLU feed-forward (×4); LayerNorm eps 1e-5 (torch default)."""

    def __init__(self, dim: int, n_heads: int, d_head: int, context_dim: int | None = None, *, dtype, rngs,
                 **cross_kwargs):
        self.attn1 = CrossAttention(dim, n_heads, d_head, dtype=dtype, rngs=rngs)
        self.attn2 = CrossAttention(dim, n_heads, d_head, context_dim, dtype=dtype, rngs=rngs, **cross_kwargs)
        self.ff = FeedForward(dim, 4 * dim, dim, approximate=False, glu=True, dtype=dtype, rngs=rngs)
        self.norm1, self.norm2, self.norm3 = (FP32LayerNorm(dim, 1e-5) for _ in range(3))

    def __call__(self, x, context, self_attn, cross_attn):
        x = x + self.attn1(self.norm1(x), None, self_attn, cross_attn)
        x = x + self.attn2(self.norm2(x), context, self_attn, cross_attn)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nnx.Module):
    """Per frame: GroupNorm32 (eps 1e-6) → linear proj_in → transformer blocks → proj_out, + input."""

    def __init__(self, ch: int, n_heads: int, d_head: int, *, depth: int, context_dim: int, dtype, rngs,
                 **cross_kwargs):
        inner = n_heads * d_head
        self.norm = GroupNorm(32, ch, eps=1e-6)
        self.proj_in = linear(ch, inner, dtype, rngs)
        self.transformer_blocks = nnx.List([
            BasicTransformerBlock(inner, n_heads, d_head, context_dim, multimodal=True, dtype=dtype, rngs=rngs,
                                  **cross_kwargs)
            for _ in range(depth)
        ])
        self.proj_out = linear(inner, ch, dtype, rngs)

    def __call__(self, x, context, self_attn, cross_attn):
        n, hh, ww, c = x.shape
        h = self.proj_in(self.norm(x).reshape(n, hh * ww, c))
        for block in self.transformer_blocks:
            h = block(h, context, self_attn, cross_attn)
        return x + self.proj_out(h).reshape(n, hh, ww, c)


class TemporalTransformer(nnx.Module):
    """Per pixel, over the T frames of a clip: GroupNorm32 (eps 1e-6, statistics over T, H, W) →
    proj_in → blocks whose two attentions are both self-attention (no context, no mask, no relative
    position in the shipped configs) → proj_out, + input. `init_attn` uses Conv1d(k=1) projections,
    stored here as the equal linear layers."""

    def __init__(self, ch: int, n_heads: int, d_head: int, *, depth: int, dtype, rngs):
        inner = n_heads * d_head
        self.norm = GroupNorm(32, ch, eps=1e-6)
        self.proj_in = linear(ch, inner, dtype, rngs)
        self.transformer_blocks = nnx.List([
            BasicTransformerBlock(inner, n_heads, d_head, dtype=dtype, rngs=rngs) for _ in range(depth)
        ])
        self.proj_out = linear(inner, ch, dtype, rngs)

    def __call__(self, x, num_frames: int, self_attn, cross_attn):
        """x (B·T, H, W, C) frames of whole clips."""
        n, hh, ww, c = x.shape
        b = n // num_frames
        clip = x.reshape(b, num_frames, hh, ww, c)
        h = self.norm(clip).transpose(0, 2, 3, 1, 4).reshape(b * hh * ww, num_frames, c)
        h = self.proj_in(h)
        for block in self.transformer_blocks:
            h = block(h, None, self_attn, cross_attn)
        h = self.proj_out(h).reshape(b, hh, ww, num_frames, c).transpose(0, 3, 1, 2, 4)
        return x + h.reshape(n, hh, ww, c)
