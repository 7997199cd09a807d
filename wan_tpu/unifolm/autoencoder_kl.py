"""`AutoencoderKL`: Stable Diffusion's image VAE in Flax NNX (the first stage of UnifoLM-WMA).

Computes what diffusers' `AutoencoderKL` (and the authors' `unifolm_wma.models.autoencoder.
AutoencoderKL`, the same LDM network) computes. Public I/O is diffusers' (channels-first); inside,
activations are channels-last. Video goes through frame by frame, as the authors' `perframe_ae`:

    vae = load_autoencoder_kl("ckpt/vae")                     # diffusers-format folder
    posterior = vae.encode(images)                           # (N, 3, H, W) in [-1, 1]
    z = posterior.sample(noise)                               # or posterior.mode(); (N, 4, H/8, W/8)
    images = vae.decode(z)                                    # unscaled z → (N, 3, H, W), not clamped
    latents = vae.encode_video(video, noise) ; video = vae.decode_video(latents)   # scaled, (B, C, T, H, W)

GroupNorms compute in float32 whatever the weight dtype; the mid-block attention (one head over all
h·w positions) goes through `wan_tpu.attention`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.configs.autoencoder_kl import AutoencoderKLConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers import initializers
from wan_tpu.layers.attention import attention
from wan_tpu.layers.norms import GroupNorm

NORM_EPS = 1e-6


class DiagonalGaussian(NamedTuple):
    """The encoder's posterior, channels-first (N, z, h, w); logvar clamped to [-30, 20] as in LDM/diffusers."""

    mean: jax.Array
    logvar: jax.Array

    def mode(self):
        return self.mean

    def sample(self, noise):
        """mean + std · noise; `noise` has the mean's shape (inject it to reproduce a torch run)."""
        return self.mean + jnp.exp(0.5 * self.logvar) * jnp.asarray(noise, self.mean.dtype)


def _conv(cin, cout, k, *, dtype, rngs, stride=1, padding=None):
    pad = ((k // 2, k // 2),) * 2 if padding is None else padding
    return nnx.Conv(cin, cout, (k, k), strides=stride, padding=pad, dtype=dtype, param_dtype=dtype,
                    kernel_init=initializers.lecun_normal, rngs=rngs)


class ResnetBlock2D(nnx.Module):
    def __init__(self, cin, cout, groups, *, dtype, rngs):
        self.norm1 = GroupNorm(groups, cin, NORM_EPS)
        self.conv1 = _conv(cin, cout, 3, dtype=dtype, rngs=rngs)
        self.norm2 = GroupNorm(groups, cout, NORM_EPS)
        self.conv2 = _conv(cout, cout, 3, dtype=dtype, rngs=rngs)
        self.conv_shortcut = _conv(cin, cout, 1, dtype=dtype, rngs=rngs) if cin != cout else None

    def __call__(self, x):
        h = self.conv1(nnx.silu(self.norm1(x)))
        h = self.conv2(nnx.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class AttentionBlock(nnx.Module):
    """diffusers' VAE `Attention` (LDM's `AttnBlock`): GroupNorm, one head of width C, residual."""

    def __init__(self, c, groups, *, dtype, rngs):
        self.group_norm = GroupNorm(groups, c, NORM_EPS)
        linear = lambda: nnx.Linear(c, c, dtype=dtype, param_dtype=dtype,  # noqa: E731
                                    kernel_init=initializers.lecun_normal, rngs=rngs)
        self.to_q, self.to_k, self.to_v, self.to_out = linear(), linear(), linear(), linear()

    def __call__(self, x):
        n, h, w, c = x.shape
        t = self.group_norm(x).reshape(n, h * w, 1, c)
        out = attention(self.to_q(t), self.to_k(t), self.to_v(t))
        return x + self.to_out(out).reshape(n, h, w, c)


class MidBlock(nnx.Module):
    def __init__(self, c, groups, add_attention, *, dtype, rngs):
        self.resnets = nnx.List([ResnetBlock2D(c, c, groups, dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attention = AttentionBlock(c, groups, dtype=dtype, rngs=rngs) if add_attention else None

    def __call__(self, x):
        x = self.resnets[0](x)
        if self.attention is not None:
            x = self.attention(x)
        return self.resnets[1](x)


class Downsample2D(nnx.Module):
    def __init__(self, c, *, dtype, rngs):
        # LDM pads right and bottom by one, then a 3x3 stride-2 conv without padding.
        self.conv = _conv(c, c, 3, stride=2, padding=((0, 1), (0, 1)), dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.conv(x)


class Upsample2D(nnx.Module):
    def __init__(self, c, *, dtype, rngs):
        self.conv = _conv(c, c, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))  # nearest, ×2


class EncoderBlock(nnx.Module):
    def __init__(self, cin, cout, layers, groups, downsample, *, dtype, rngs):
        chans = [cin] + [cout] * layers
        self.resnets = nnx.List([ResnetBlock2D(a, b, groups, dtype=dtype, rngs=rngs) for a, b in zip(chans[:-1], chans[1:])])
        self.downsampler = Downsample2D(cout, dtype=dtype, rngs=rngs) if downsample else None

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.downsampler is None else self.downsampler(x)


class DecoderBlock(nnx.Module):
    def __init__(self, cin, cout, layers, groups, upsample, *, dtype, rngs):
        chans = [cin] + [cout] * (layers + 1)
        self.resnets = nnx.List([ResnetBlock2D(a, b, groups, dtype=dtype, rngs=rngs) for a, b in zip(chans[:-1], chans[1:])])
        self.upsampler = Upsample2D(cout, dtype=dtype, rngs=rngs) if upsample else None

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.upsampler is None else self.upsampler(x)


class Encoder(nnx.Module):
    def __init__(self, cfg: AutoencoderKLConfig, *, dtype, rngs):
        chans, g, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = _conv(cfg.in_channels, chans[0], 3, dtype=dtype, rngs=rngs)
        self.down_blocks = nnx.List(
            [
                EncoderBlock(chans[max(i - 1, 0)], chans[i], cfg.layers_per_block, g, i < n - 1, dtype=dtype, rngs=rngs)
                for i in range(n)
            ]
        )
        self.mid_block = MidBlock(chans[-1], g, cfg.mid_block_add_attention, dtype=dtype, rngs=rngs)
        self.conv_norm_out = GroupNorm(g, chans[-1], NORM_EPS)
        self.conv_out = _conv(chans[-1], 2 * cfg.latent_channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(nnx.silu(self.conv_norm_out(x)))


class Decoder(nnx.Module):
    def __init__(self, cfg: AutoencoderKLConfig, *, dtype, rngs):
        chans, g, n = cfg.block_out_channels[::-1], cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = _conv(cfg.latent_channels, chans[0], 3, dtype=dtype, rngs=rngs)
        self.mid_block = MidBlock(chans[0], g, cfg.mid_block_add_attention, dtype=dtype, rngs=rngs)
        self.up_blocks = nnx.List(
            [
                DecoderBlock(chans[max(i - 1, 0)], chans[i], cfg.layers_per_block, g, i < n - 1, dtype=dtype, rngs=rngs)
                for i in range(n)
            ]
        )
        self.conv_norm_out = GroupNorm(g, chans[-1], NORM_EPS)
        self.conv_out = _conv(chans[-1], cfg.out_channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, z):
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(nnx.silu(self.conv_norm_out(x)))


def _nhwc(x):
    return jnp.transpose(x, (0, 2, 3, 1))


def _nchw(x):
    return jnp.transpose(x, (0, 3, 1, 2))


class AutoencoderKL(nnx.Module):
    def __init__(self, config: AutoencoderKLConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        z = config.latent_channels
        self.encoder = Encoder(config, dtype=dtype, rngs=rngs)
        self.quant_conv = _conv(2 * z, 2 * z, 1, dtype=dtype, rngs=rngs)
        self.post_quant_conv = _conv(z, z, 1, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)

    def _check(self, x, channels, what, multiple):
        if x.ndim != 4 or x.shape[1] != channels:
            raise WanInputError(f"{what} expects (N, {channels}, H, W), got shape {tuple(x.shape)}")
        if x.shape[2] % multiple or x.shape[3] % multiple:
            raise WanInputError(f"{what} needs height and width divisible by {multiple}, got {x.shape[2]}x{x.shape[3]}")

    def encode(self, images) -> DiagonalGaussian:
        """Images (N, 3, H, W) in [-1, 1] → posterior over unscaled latents (N, z, H/8, W/8), float32."""
        images = jnp.asarray(images)
        self._check(images, self.config.in_channels, "encode", self.config.downscale)
        moments = self.quant_conv(self.encoder(_nhwc(images).astype(self.dtype))).astype(jnp.float32)
        mean, logvar = jnp.split(_nchw(moments), 2, axis=1)
        return DiagonalGaussian(mean, jnp.clip(logvar, -30.0, 20.0))

    def decode(self, z):
        """Unscaled latents (N, z, h, w) → images (N, 3, 8h, 8w), float32, not clamped (as diffusers' `.sample`)."""
        z = jnp.asarray(z)
        self._check(z, self.config.latent_channels, "decode", 1)
        out = self.decoder(self.post_quant_conv(_nhwc(z).astype(self.dtype)))
        return _nchw(out).astype(jnp.float32)

    def encode_video(self, video, noise=None):
        """Video (B, 3, T, H, W) → scaled latents (B, z, T, h, w): `scaling_factor` · posterior sample
        with `noise` (B, z, T, h, w), or the mean when `noise` is None. Frame by frame (`lax.map`)."""
        frames, b = _frames_first(video)
        noise = frames if noise is None else _frames_first(noise)[0]
        sample = noise is not frames

        def one(args):
            posterior = self.encode(args[0][None])
            return (posterior.sample(args[1][None]) if sample else posterior.mode())[0]

        return self.config.scaling_factor * _frames_back(jax.lax.map(one, (frames, noise)), b)

    def decode_video(self, latents):
        """Scaled latents (B, z, T, h, w) → video (B, 3, T, H, W), frame by frame, not clamped."""
        z, b = _frames_first(latents)
        return _frames_back(jax.lax.map(lambda f: self.decode(f[None])[0], z / self.config.scaling_factor), b)


def _frames_first(video):
    """(B, C, T, H, W) → ((B·T, C, H, W), B): the authors' `'b c t h w -> (b t) c h w'`."""
    video = jnp.asarray(video)
    if video.ndim != 5:
        raise WanInputError(f"expected a video (B, C, T, H, W), got shape {tuple(video.shape)}")
    b, c, t, h, w = video.shape
    return jnp.transpose(video, (0, 2, 1, 3, 4)).reshape(b * t, c, h, w), b


def _frames_back(frames, b):
    n, c, h, w = frames.shape
    return jnp.transpose(frames.reshape(b, n // b, c, h, w), (0, 2, 1, 3, 4))
