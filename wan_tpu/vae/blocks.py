"""Building blocks of the Wan VAE (2.1 and 2.2), channels-last `(B, T, H, W, C)`.

They compute what diffusers' `AutoencoderKLWan` blocks compute. The causal time loop is explicit:
every call gets a `ChunkState` holding the feature caches of the previous chunk (None for the first
chunk) and collects the caches for the next one, in call order. Caches have a fixed shape from the
first chunk on (zero frames stand in for the causal padding), so the per-chunk step traces once and
its caches can be carried by a compiled loop and donated.

A causal 3-tap conv's cache is a three-slot ring (`RingCache`) laid out (B, H, W, 3·C): each new
frame first overwrites the oldest slot in place, then the conv reads all three slots as one 2D input
of 3·C channels (no copy), the kernel's time taps rotated to match. Writing before reading is what
lets XLA update a loop-carried buffer in place; the old shift (keep frames t-1 and t, read before
write) made it copy every cache once per frame: as much memory again as the loop's caches.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

CACHE_T = 2  # frames a causal 3-tap temporal conv needs from the past


class ChunkState:
    """Feature caches in (previous chunk; None on the first chunk) and out (this chunk), in call order."""

    def __init__(self, caches=None, constrain=None):
        self.caches = caches
        self.out: list = []
        self.constrain = constrain or (lambda x: x)

    @property
    def first(self) -> bool:
        return self.caches is None

    def take(self):
        return None if self.caches is None else self.caches[len(self.out)]

    def put(self, cache):
        self.out.append(cache)


class RingCache(NamedTuple):
    """The last three input frames of a causal 3-tap conv as channel slots, (B, H, W, 3·C); `newest` is
    the slot written last."""

    frames: jax.Array
    newest: jax.Array  # int32 scalar

    @classmethod
    def zeros(cls, b, h, w, c, dtype):
        """The causal padding before the first frame: zero frames."""
        return cls(jnp.zeros((b, h, w, 3 * c), dtype), jnp.full((), 2, jnp.int32))

    def taps(self):
        """Kernel time tap (0 = oldest, 2 = newest) of each storage slot."""
        return 2 - (self.newest - jnp.arange(3)) % 3

    def past(self):
        """The two newest frames, (B, 2, H, W, C), older first."""
        b, h, w, c3 = self.frames.shape
        slots = self.frames.reshape(b, h, w, 3, c3 // 3)
        return jnp.take(slots, (self.newest + jnp.arange(2, 4)) % 3, axis=3).transpose(0, 3, 1, 2, 4)

    def push(self, frame):
        """Overwrite the oldest slot with `frame` (B, 1, H, W, C)."""
        slot = (self.newest + 1) % 3
        frame = frame[:, 0].astype(self.frames.dtype)
        return RingCache(lax.dynamic_update_slice_in_dim(self.frames, frame, slot * frame.shape[-1], axis=3), slot)

    @classmethod
    def of(cls, frames):
        """A ring holding the last 3 of `frames` (B, T ≥ 3, H, W, C), in time order."""
        b, _, h, w, c = frames.shape
        return cls(frames[:, -3:].transpose(0, 2, 3, 1, 4).reshape(b, h, w, 3 * c), jnp.full((), 2, jnp.int32))


def _init(rngs, shape, fan_in, dtype):
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) / math.sqrt(fan_in))


class CausalConv3d(nnx.Module):
    """diffusers' WanCausalConv3d: temporal padding only on the left (2·pad_t frames), from the cache."""

    def __init__(self, in_dim, out_dim, kernel=3, stride=1, padding=0, *, dtype, rngs):
        kernel, stride, padding = (tuple(v) if isinstance(v, tuple) else (v,) * 3 for v in (kernel, stride, padding))
        self.kernel = _init(rngs, (*kernel, in_dim, out_dim), in_dim * math.prod(kernel), dtype)
        self.bias = nnx.Param(jnp.zeros((out_dim,), dtype))
        self.stride = stride
        self.time_pad = 2 * padding[0]
        self.spatial_pad = ((padding[1], padding[1]), (padding[2], padding[2]))
        self.carry_partial_sums = False

    def _partial_sums_step(self, x, st: ChunkState):
        """One frame; the cache holds partial output sums (out channels) instead of 2 input frames.

        out_t = W0·a_(t-2) + W1·a_(t-1) + W2·a_t. Carrying S1 = W0·a_(t-2) + W1·a_(t-1) and S2 = W0·a_(t-1)
        costs 2·out channels instead of 2·in: the decoder's conv_out (96 or 256 → 3 or 12 channels at full
        resolution) would otherwise keep the largest cache of all.
        """
        k = self.kernel[...]
        b, _, h, w, _ = x.shape
        o = k.shape[-1]
        y = lax.conv_general_dilated(
            x[:, 0], jnp.concatenate([k[2], k[1], k[0]], axis=-1), (1, 1), self.spatial_pad,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        prev = st.take()
        if prev is None:
            prev = jnp.zeros((b, CACHE_T, h, w, o), y.dtype)
        st.put(jnp.stack([prev[:, 1] + y[..., o : 2 * o], y[..., 2 * o :]], axis=1))
        return st.constrain((prev[:, 0] + y[..., :o] + self.bias[...])[:, None])

    def __call__(self, x, st: ChunkState):
        if self.carry_partial_sums:
            return self._partial_sums_step(x, st)
        k = self.kernel[...]
        if self.time_pad:
            cache = st.take()
            if cache is None:
                cache = RingCache.zeros(x.shape[0], *x.shape[2:], x.dtype)
            if x.shape[1] == 1:
                cache = cache.push(x)
                st.put(cache)
                return st.constrain(self._one_frame(cache, k) + self.bias[...])
            x = jnp.concatenate([cache.past(), x], axis=1)
            st.put(RingCache.of(x))
        if k.shape[:3] == (1, 1, 1) and self.stride == (1, 1, 1) and self.spatial_pad == ((0, 0), (0, 0)):
            y = jnp.einsum("bthwc,cd->bthwd", x, k[0, 0, 0])
        else:
            y = lax.conv_general_dilated(
                x, k, self.stride, ((0, 0), *self.spatial_pad), dimension_numbers=("NDHWC", "DHWIO", "NDHWC")
            )
        return st.constrain(y + self.bias[...])

    def _one_frame(self, cache: RingCache, k):
        """The output frame of the ring's newest frame: its three slots are a 2D input of 3·C channels
        (2D kernels are better tuned than 3D ones), the time taps taken in slot order."""
        k = jnp.take(k, cache.taps(), axis=0)
        y = lax.conv_general_dilated(
            cache.frames, k.transpose(1, 2, 0, 3, 4).reshape(k.shape[1], k.shape[2], -1, k.shape[4]),
            self.stride[1:], self.spatial_pad, dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        return y[:, None]


class Conv2d(nnx.Module):
    """A 2D conv applied to every frame (diffusers' nn.Conv2d inside WanResample)."""

    def __init__(self, in_dim, out_dim, stride=1, padding=((1, 1), (1, 1)), *, dtype, rngs):
        self.kernel = _init(rngs, (3, 3, in_dim, out_dim), in_dim * 9, dtype)
        self.bias = nnx.Param(jnp.zeros((out_dim,), dtype))
        self.stride = (stride, stride)
        self.padding = padding

    def __call__(self, x, st: ChunkState):
        b, t = x.shape[:2]
        y = lax.conv_general_dilated(
            x.reshape(b * t, *x.shape[2:]), self.kernel[...], self.stride, self.padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        return st.constrain(y.reshape(b, t, *y.shape[1:]) + self.bias[...])

    def after_nearest_upsample(self, x, st: ChunkState):
        """The conv of x upsampled ×2 (nearest), without materialising the upsampled input.

        Output pixel (2i+a, 2j+b) only reads input rows i-1..i (a=0) or i..i+1 (a=1), taps that see the
        same input pixel summed: each of the 4 phases is a 2x2 conv on x, 4/9 of the multiply-adds."""
        b, t, h, w, c = x.shape
        x = x.reshape(b * t, h, w, c)
        rows = [
            jnp.stack([
                lax.conv_general_dilated(x, kc.astype(x.dtype), (1, 1), (pad_h, pad_w), dimension_numbers=("NHWC", "HWIO", "NHWC"))
                for kc, pad_w in _upsampled_taps(kr, 1)
            ], axis=3)
            for kr, pad_h in _upsampled_taps(self.kernel[...].astype(jnp.float32), 0)
        ]
        y = jnp.stack(rows, axis=2).reshape(b, t, 2 * h, 2 * w, -1)
        return st.constrain(y + self.bias[...])


def _upsampled_taps(k, axis):
    """A 3-tap axis of a kernel applied after a nearest ×2 upsample, as two 2-tap kernels on the input
    (even outputs read input i-1, i; odd ones i, i+1) with their padding."""
    k0, k1, k2 = (lax.index_in_dim(k, i, axis, keepdims=False) for i in range(3))
    return [(jnp.stack([k0, k1 + k2], axis), (1, 0)), (jnp.stack([k0 + k1, k2], axis), (0, 1))]


class RMSNorm(nnx.Module):
    """diffusers' WanRMS_norm: L2-normalise over channels (eps 1e-12) times sqrt(C)·gamma, in float32."""

    def __init__(self, dim, *, dtype):
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        norm = jnp.maximum(jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True)), 1e-12)
        return (xf / norm * (math.sqrt(x.shape[-1]) * self.gamma[...].astype(jnp.float32))).astype(x.dtype)


def _norm_silu(norm, x):
    return jax.nn.silu(norm(x))


class Resample(nnx.Module):
    """diffusers' WanResample: ×2 spatial up/down sampling, plus the causal ×2 time conv for the 3d modes."""

    def __init__(self, dim, mode, upsample_out_dim=None, *, dtype, rngs):
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = Conv2d(dim, upsample_out_dim or dim // 2, dtype=dtype, rngs=rngs)
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0), dtype=dtype, rngs=rngs)
        else:
            self.resample = Conv2d(dim, dim, stride=2, padding=((0, 1), (0, 1)), dtype=dtype, rngs=rngs)
            if mode == "downsample3d":
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), dtype=dtype, rngs=rngs)

    @property
    def temporal(self) -> bool:
        return self.mode.endswith("3d")

    def __call__(self, x, st: ChunkState):
        b, t, h, w, c = x.shape
        if self.mode == "upsample3d":
            if st.first:
                # diffusers' "Rep" state: the first frame is not time-upsampled, and the next chunk's time
                # conv pads with zeros, which is a zero cache.
                st.put(RingCache.zeros(b, h, w, c, x.dtype))
            else:
                x = self.time_conv(x, st).reshape(b, t, h, w, 2, c)
                x = x.transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c)
        if self.mode.startswith("upsample"):
            return self.resample.after_nearest_upsample(x, st)
        x = self.resample(x, st)
        if self.mode == "downsample3d":
            prev = st.take()
            st.put(x[:, -1:])
            if prev is not None:
                x = self.time_conv(jnp.concatenate([prev, x], axis=1), st)
        return x


class ResidualBlock(nnx.Module):
    """diffusers' WanResidualBlock (dropout is inference-only identity)."""

    def __init__(self, in_dim, out_dim, *, dtype, rngs):
        self.norm1 = RMSNorm(in_dim, dtype=dtype)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(out_dim, dtype=dtype)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1, dtype=dtype, rngs=rngs) if in_dim != out_dim else None

    temporal = False

    def __call__(self, x, st: ChunkState):
        h = x if self.conv_shortcut is None else self.conv_shortcut(x, st)
        x = self.conv1(_norm_silu(self.norm1, x), st)
        x = self.conv2(_norm_silu(self.norm2, x), st)
        return x + h


def _spatial_attention(q, k, v, block=4096):
    """Single-head softmax attention over the H·W tokens of each frame, queries in blocks to bound memory."""
    scale = 1.0 / math.sqrt(q.shape[-1])

    def attend(qb):
        logits = jnp.einsum("nqc,nkc->nqk", qb, k, preferred_element_type=jnp.float32) * scale
        p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("nqk,nkc->nqc", p, v, preferred_element_type=jnp.float32).astype(q.dtype)

    s = q.shape[1]
    if s <= block:
        return attend(q)
    n = -(-s // block)
    qp = jnp.pad(q, ((0, 0), (0, n * block - s), (0, 0))).reshape(q.shape[0], n, block, q.shape[-1])
    out = lax.map(attend, qp.transpose(1, 0, 2, 3))
    return out.transpose(1, 0, 2, 3).reshape(q.shape[0], n * block, -1)[:, :s]


class AttentionBlock(nnx.Module):
    """diffusers' WanAttentionBlock: per-frame single-head self-attention with 1x1 conv projections."""

    def __init__(self, dim, *, dtype, rngs):
        self.norm = RMSNorm(dim, dtype=dtype)
        self.to_qkv = _Dense(dim, dim * 3, dtype=dtype, rngs=rngs)
        self.proj = _Dense(dim, dim, dtype=dtype, rngs=rngs)

    temporal = False

    def __call__(self, x, st: ChunkState):
        b, t, h, w, c = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b * t, h * w, 3 * c)
        y = _spatial_attention(qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :])
        return x + self.proj(y.reshape(b, t, h, w, c))


class _Dense(nnx.Module):
    """A 1x1 Conv2d as a matmul; kernel (in, out) like nnx.Linear."""

    def __init__(self, in_dim, out_dim, *, dtype, rngs):
        self.kernel = _init(rngs, (in_dim, out_dim), in_dim, dtype)
        self.bias = nnx.Param(jnp.zeros((out_dim,), dtype))

    def __call__(self, x):
        return x @ self.kernel[...] + self.bias[...]


class MidBlock(nnx.Module):
    def __init__(self, dim, *, dtype, rngs):
        self.resnets = nnx.List([ResidualBlock(dim, dim, dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([AttentionBlock(dim, dtype=dtype, rngs=rngs)])

    def __call__(self, x, st: ChunkState):
        x = self.resnets[0](x, st)
        return self.resnets[1](self.attentions[0](x, st), st)


def avg_down_3d(x, out_dim, factor_t, factor_s):
    """diffusers' AvgDown3D: space/time-to-channel, then the mean over channel groups (Wan 2.2 shortcut)."""
    pad_t = (-x.shape[1]) % factor_t
    if pad_t:
        x = jnp.pad(x, ((0, 0), (pad_t, 0), (0, 0), (0, 0), (0, 0)))
    b, t, h, w, c = x.shape
    x = x.reshape(b, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s, c)
    x = x.transpose(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(b, t // factor_t, h // factor_s, w // factor_s, out_dim, -1)
    return jnp.mean(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def dup_up_3d(x, out_dim, factor_t, factor_s, first_chunk):
    """diffusers' DupUp3D: channel repeat, then channel-to-space/time (Wan 2.2 shortcut)."""
    b, t, h, w, c = x.shape
    x = jnp.repeat(x, out_dim * factor_t * factor_s * factor_s // c, axis=-1)
    x = x.reshape(b, t, h, w, out_dim, factor_t, factor_s, factor_s)
    x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, t * factor_t, h * factor_s, w * factor_s, out_dim)
    return x[:, factor_t - 1 :] if first_chunk else x


class ResidualDownBlock(nnx.Module):
    """diffusers' WanResidualDownBlock (Wan 2.2 encoder)."""

    def __init__(self, in_dim, out_dim, num_res_blocks, temporal, down, *, dtype, rngs):
        self.out_dim, self.factor_t, self.factor_s = out_dim, 2 if temporal else 1, 2 if down else 1
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nnx.List([ResidualBlock(a, b, dtype=dtype, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])])
        mode = "downsample3d" if temporal else "downsample2d"
        self.downsampler = Resample(out_dim, mode, dtype=dtype, rngs=rngs) if down else None
        self.temporal = temporal

    def __call__(self, x, st: ChunkState):
        shortcut = avg_down_3d(x, self.out_dim, self.factor_t, self.factor_s)
        for resnet in self.resnets:
            x = resnet(x, st)
        if self.downsampler is not None:
            x = self.downsampler(x, st)
        return x + shortcut


class UpBlock(nnx.Module):
    """diffusers' WanUpBlock (2.1) and WanResidualUpBlock (2.2, `residual=True`: DupUp3D shortcut)."""

    def __init__(self, in_dim, out_dim, num_res_blocks, mode, residual, *, dtype, rngs):
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nnx.List([ResidualBlock(a, b, dtype=dtype, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])])
        out = out_dim if residual else None
        self.upsampler = Resample(out_dim, mode, out, dtype=dtype, rngs=rngs) if mode else None
        self.residual = residual and mode is not None
        self.out_dim, self.factor_t = out_dim, 2 if mode == "upsample3d" else 1
        self.temporal = mode == "upsample3d"

    def __call__(self, x, st: ChunkState):
        x_in = x
        for resnet in self.resnets:
            x = resnet(x, st)
        if self.upsampler is not None:
            x = self.upsampler(x, st)
        if self.residual:
            x = x + dup_up_3d(x_in, self.out_dim, self.factor_t, 2, st.first)
        return x


class Encoder3d(nnx.Module):
    """diffusers' WanEncoder3d. `down_blocks[:split]` keep the frame count, so a chunk can run them frame by frame."""

    def __init__(self, cfg, *, dtype, rngs):
        dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
        last = len(cfg.dim_mult) - 1
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1, dtype=dtype, rngs=rngs)
        blocks, scale = [], 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            temporal = cfg.temperal_downsample[i] if i != last else False
            if cfg.is_residual:
                blocks.append(ResidualDownBlock(in_dim, out_dim, cfg.num_res_blocks, temporal, i != last, dtype=dtype, rngs=rngs))
                continue
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, dtype=dtype, rngs=rngs))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(out_dim, dtype=dtype, rngs=rngs))
                in_dim = out_dim
            if i != last:
                blocks.append(Resample(out_dim, "downsample3d" if temporal else "downsample2d", dtype=dtype, rngs=rngs))
                scale /= 2.0
        self.down_blocks = nnx.List(blocks)
        self.split = next((i for i, b in enumerate(blocks) if b.temporal), len(blocks))
        self.mid_block = MidBlock(dims[-1], dtype=dtype, rngs=rngs)
        self.norm_out = RMSNorm(dims[-1], dtype=dtype)
        self.conv_out = CausalConv3d(dims[-1], cfg.z_dim * 2, 3, padding=1, dtype=dtype, rngs=rngs)

    def per_frame(self, x, st: ChunkState):
        x = self.conv_in(x, st)
        for block in self.down_blocks[: self.split]:
            x = block(x, st)
        return x

    def rest(self, x, st: ChunkState):
        for block in self.down_blocks[self.split :]:
            x = block(x, st)
        x = self.mid_block(x, st)
        return self.conv_out(_norm_silu(self.norm_out, x), st)


class Decoder3d(nnx.Module):
    """diffusers' WanDecoder3d, as `stem` (up to the mid block) and `levels` (up blocks and head).

    After the mid block (whose attention sees the whole frame) every layer is local in space, so the
    rest can run on a vertical strip of the frame exactly: each up block's input is cropped to the
    strip plus a halo that covers what the remaining 3x3 convs read, and SAME padding at a cut only
    damages the halo (see `strip_plan`).
    """

    def __init__(self, cfg, *, dtype, rngs):
        dim = cfg.decoder_dim
        mult = cfg.dim_mult
        dims = [dim * u for u in (mult[-1], *mult[::-1])]
        up_t = cfg.temperal_downsample[::-1]
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = MidBlock(dims[0], dtype=dtype, rngs=rngs)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0 and not cfg.is_residual:
                in_dim //= 2  # Wan 2.1's upsamplers halve the channels
            mode = None if i == len(mult) - 1 else ("upsample3d" if up_t[i] else "upsample2d")
            blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks, mode, cfg.is_residual, dtype=dtype, rngs=rngs))
        self.up_blocks = nnx.List(blocks)
        self.norm_out = RMSNorm(dims[-1], dtype=dtype)
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_out.carry_partial_sums = True  # it only ever sees one frame at a time (the last level)
        # Halo (pixels at that block's input) the layers from each up block on read beyond an output column.
        halo, halos = 1, []  # conv_out's 3x3
        for block in reversed(blocks):
            if block.upsampler is not None:
                halo = -(-(halo + 1) // 2)  # the 3x3 conv after the ×2 upsample, back to input pixels
            halos.append(halo + 2 * len(block.resnets))
            halo = halos[-1]
        self.halos = tuple(reversed(halos))

    def strip_plan(self, width, start, stop):
        """Latent columns [start, stop) of a `width`-wide latent → (input columns, crop widths, crop offsets).

        The strip's input is its columns plus `halos[0]`, clipped to the frame; each up block crops its
        input to the strip's columns plus its own halo at its resolution, and the head's output is cropped
        to exactly the strip: `widths[i]` columns from `offsets[i]` (an offset into what that block
        receives; block 0 takes its input whole: width None), the head's crop last. The widths are static
        and the offsets are arguments of the compiled strip step, so strips of one width (the two halves
        of a 2-strip decode, the middle strips of more) share one program."""
        columns = (max(0, start - self.halos[0]), min(width, stop + self.halos[0]))
        received, scale, crops = columns[0], 1, []  # received: first column of what the block gets
        for block, halo in zip(self.up_blocks, self.halos):
            lo, hi = max(0, scale * start - halo), min(scale * width, scale * stop + halo)
            crops.append(None if not crops else (lo - received, hi - received))
            received = lo
            if block.upsampler is not None:
                received, scale = 2 * lo, 2 * scale
        crops.append((scale * start - received, scale * stop - received))
        return (columns, tuple(None if c is None else c[1] - c[0] for c in crops),
                tuple(0 if c is None else c[0] for c in crops))

    def stem(self, x, st: ChunkState):
        return self.mid_block(self.conv_in(x, st), st)

    def levels(self, widths, offsets):
        """The up blocks and head as functions of one frame, split after each temporal upsample: level k+1
        runs on each frame level k outputs (see vae._nested). Level 0 takes the mid block's output.
        `widths`, `offsets`: the crops of `strip_plan` (the offsets may be traced)."""
        bounds = [0] + [i + 1 for i, b in enumerate(self.up_blocks) if b.temporal] + [len(self.up_blocks)]

        def level(lo, hi, head):
            def fn(x, st: ChunkState):
                for i in range(lo, hi):
                    x = self.up_blocks[i](_crop(x, offsets[i], widths[i]), st)
                return _crop(self.conv_out(_norm_silu(self.norm_out, x), st), offsets[-1], widths[-1]) if head else x

            return fn

        return [level(lo, hi, hi == len(self.up_blocks)) for lo, hi in zip(bounds[:-1], bounds[1:]) if lo < hi]


def _crop(x, start, width):
    """`width` columns from `start` of a (B, T, H, W, C) activation; width None keeps all."""
    return x if width is None or width == x.shape[3] else lax.dynamic_slice_in_dim(x, start, width, axis=3)
