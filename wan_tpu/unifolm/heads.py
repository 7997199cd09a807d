"""The action and state heads of UniFoLM: Diffusion Policy's `ConditionalUnet1D`, conditioned by FiLM on
the step embedding, the observation features and spatial-softmax keypoints of the video UNet's nine
feature maps, plus its ResNet18-GroupNorm observation encoder.

Reference: `models/diffusion_head/conditional_unet1d.py`, `conv1d_components.py`, `base_nets.py`
(`SpatialSoftmax`) and `vision/multi_image_obs_encoder.py` of the authors' code. The sample (B, T, D)
goes through Linear(1 → act_proj_dim) + LayerNorm; the 1-D convolutions then run along that
act_proj_dim axis with the D action dimensions as channels and batch B·T, and every (b, t) gets its
own FiLM condition. Layout here: channels-last, (B·T, act_proj_dim, C).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.unifolm import UnifolmHeadConfig
from wan_tpu.layers import initializers
from wan_tpu.layers.embeddings import linear, timestep_embedding
from wan_tpu.layers.norms import FP32LayerNorm, GroupNorm
from wan_tpu.unifolm.blocks import conv

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


class SpatialSoftmax(nnx.Module):
    """1×1 conv to K keypoint maps, softmax over pixels, expected (x, y) on a [-1, 1] grid → (N, K, 2)."""

    def __init__(self, cin: int, num_kp: int, *, dtype, rngs):
        self.nets = conv(cin, num_kp, (1, 1), dtype=dtype, rngs=rngs)
        self.temperature = nnx.Param(jnp.ones((1,), jnp.float32))

    def __call__(self, x):
        n, h, w, _ = x.shape
        f = self.nets(x).astype(jnp.float32).reshape(n, h * w, -1)
        attention = jax.nn.softmax(f / self.temperature[...], axis=1)
        # meshgrid(linspace(-1, 1, W), linspace(-1, 1, H)) flattened row-major, as theirs.
        pos_x = jnp.asarray(np.tile(np.linspace(-1.0, 1.0, w), h), jnp.float32)
        pos_y = jnp.asarray(np.repeat(np.linspace(-1.0, 1.0, h), w), jnp.float32)
        ex = jnp.einsum("npk,p->nk", attention, pos_x, precision=jax.lax.Precision.HIGHEST)
        ey = jnp.einsum("npk,p->nk", attention, pos_y, precision=jax.lax.Precision.HIGHEST)
        return jnp.stack([ex, ey], axis=-1)


class BasicBlock(nnx.Module):
    """torchvision ResNet BasicBlock with its BatchNorms replaced by GroupNorm(C/16)."""

    def __init__(self, cin: int, cout: int, stride: int, *, dtype, rngs):
        self.conv1 = conv(cin, cout, (3, 3), stride=stride, use_bias=False, dtype=dtype, rngs=rngs)
        self.norm1 = GroupNorm(cout // 16, cout)
        self.conv2 = conv(cout, cout, (3, 3), use_bias=False, dtype=dtype, rngs=rngs)
        self.norm2 = GroupNorm(cout // 16, cout)
        if stride != 1 or cin != cout:
            self.downsample_conv = conv(cin, cout, (1, 1), stride=stride, use_bias=False, dtype=dtype, rngs=rngs)
            self.downsample_norm = GroupNorm(cout // 16, cout)
        else:
            self.downsample_conv = self.downsample_norm = None

    def __call__(self, x):
        h = jax.nn.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        skip = x if self.downsample_conv is None else self.downsample_norm(self.downsample_conv(x))
        return jax.nn.relu(h + skip)


class ResNet18(nnx.Module):
    """conv1 (7×7/2, no bias) → GroupNorm → ReLU → max-pool 3×3/2 → layer1..layer4 (fc removed)."""

    def __init__(self, *, dtype, rngs):
        self.conv1 = conv(3, 64, (7, 7), stride=2, use_bias=False, dtype=dtype, rngs=rngs)
        self.norm1 = GroupNorm(4, 64)
        widths, cin = (64, 128, 256, 512), 64
        for i, w in enumerate(widths, start=1):
            stride = 1 if i == 1 else 2
            setattr(self, f"layer{i}", nnx.List([BasicBlock(cin, w, stride, dtype=dtype, rngs=rngs),
                                                  BasicBlock(w, w, 1, dtype=dtype, rngs=rngs)]))
            cin = w
        self.out_channels = cin

    def __call__(self, x):
        x = jax.nn.relu(self.norm1(self.conv1(x)))
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                  ((0, 0), (1, 1), (1, 1), (0, 0)))
        for i in range(1, 5):
            for block in getattr(self, f"layer{i}"):
                x = block(x)
        return x


class ObsEncoder(nnx.Module):
    """`MultiImageObsEncoder` as configured: ImageNet-normalise the image (applied to [-1, 1] input, as
    theirs), ResNet18-GroupNorm, spatial-softmax keypoints, flattened [x0, y0, x1, y1, ...], then the
    low-dimensional `agent_pos` → (N, 2·kp + agent_pos_dim)."""

    def __init__(self, cfg: UnifolmHeadConfig, *, dtype, rngs):
        self.resnet = ResNet18(dtype=dtype, rngs=rngs)
        self.spatial_softmax = SpatialSoftmax(self.resnet.out_channels, cfg.spatial_softmax_kp, dtype=dtype, rngs=rngs)

    def __call__(self, image, agent_pos):
        """image (N, H, W, 3) channels-last in [-1, 1]; agent_pos (N, d)."""
        x = (image.astype(jnp.float32) - jnp.asarray(_IMAGENET_MEAN)) / jnp.asarray(_IMAGENET_STD)
        kp = self.spatial_softmax(self.resnet(x.astype(self.resnet.conv1.kernel.dtype)))
        return jnp.concatenate([kp.reshape(kp.shape[0], -1), agent_pos.astype(jnp.float32)], axis=-1)


class Conv1dBlock(nnx.Module):
    """Conv1d → GroupNorm(n_groups) → Mish."""

    def __init__(self, cin: int, cout: int, kernel: int, n_groups: int, *, dtype, rngs):
        self.conv = conv(cin, cout, (kernel,), dtype=dtype, rngs=rngs)
        self.norm = GroupNorm(n_groups, cout)

    def __call__(self, x):
        return mish(self.norm(self.conv(x)))


class ConditionalResidualBlock1D(nnx.Module):
    """Two Conv1dBlocks; FiLM (scale, bias per channel from Mish → Linear of the condition) between."""

    def __init__(self, cin: int, cout: int, cond_dim: int, kernel: int, n_groups: int, *, dtype, rngs):
        self.blocks = nnx.List([Conv1dBlock(cin, cout, kernel, n_groups, dtype=dtype, rngs=rngs),
                                Conv1dBlock(cout, cout, kernel, n_groups, dtype=dtype, rngs=rngs)])
        self.cond_encoder = linear(cond_dim, 2 * cout, dtype, rngs)
        self.residual_conv = conv(cin, cout, (1,), dtype=dtype, rngs=rngs) if cin != cout else None

    def __call__(self, x, cond):
        """x (B·T, L, cin); cond (B·T, cond_dim)."""
        out = self.blocks[0](x)
        scale, bias = jnp.split(self.cond_encoder(mish(cond)).astype(out.dtype), 2, axis=-1)
        out = self.blocks[1](scale[:, None, :] * out + bias[:, None, :])
        return out + (x if self.residual_conv is None else self.residual_conv(x))


class ConvTranspose1d(nnx.Module):
    """torch ConvTranspose1d(C, C, 4, stride 2, padding 1): doubles the length. `kernel` is (K, out, in)
    (torch's (in, out, K) with the kernel axis first)."""

    def __init__(self, ch: int, *, dtype, rngs):
        self.kernel = nnx.Param(initializers.normal(rngs.params(), (4, ch, ch), dtype) / (4 * ch) ** 0.5)
        self.bias = nnx.Param(jnp.zeros((ch,), dtype))

    def __call__(self, x):
        # = a stride-1 conv of the 2×-dilated input with the flipped kernel, padded K − 1 − p = 2.
        rhs = self.kernel[...][::-1].transpose(0, 2, 1)
        y = jax.lax.conv_general_dilated(x, rhs.astype(x.dtype), (1,), ((2, 2),), lhs_dilation=(2,),
                                         dimension_numbers=("NWC", "WIO", "NWC"))
        return y + self.bias[...].astype(y.dtype)


class ConditionalUnet1D(nnx.Module):
    def __init__(self, cfg: UnifolmHeadConfig, context_dims: tuple[int, ...], *, dtype, rngs):
        """`context_dims`: channels of the video UNet's levels (model_channels · channel_mult)."""
        self.cfg = cfg
        dsed, dims = cfg.diffusion_step_embed_dim, cfg.down_dims
        self.obs_encoder = ObsEncoder(cfg, dtype=dtype, rngs=rngs)
        obs_dim = 2 * cfg.spatial_softmax_kp + cfg.agent_pos_dim
        cond_dim = dsed + obs_dim * cfg.n_obs_steps
        self.diffusion_step_linear_1 = linear(dsed, 4 * dsed, dtype, rngs)
        self.diffusion_step_linear_2 = linear(4 * dsed, dsed, dtype, rngs)
        k, g = cfg.kernel_size, cfg.n_groups
        all_dims = (cfg.input_dim,) + tuple(dims)
        in_out = list(zip(all_dims[:-1], all_dims[1:]))
        self.down_modules = nnx.List()
        for i, (din, dout) in enumerate(in_out):
            c = cond_dim + 2 * context_dims[i]
            last = i == len(in_out) - 1
            self.down_modules.append(nnx.List([
                ConditionalResidualBlock1D(din, dout, c, k, g, dtype=dtype, rngs=rngs),
                ConditionalResidualBlock1D(dout, dout, c, k, g, dtype=dtype, rngs=rngs),
                None,
                None if last else conv(dout, dout, (3,), stride=2, dtype=dtype, rngs=rngs),
            ]))
        c = cond_dim + 2 * context_dims[-1]
        self.mid_modules = nnx.List([ConditionalResidualBlock1D(dims[-1], dims[-1], c, k, g, dtype=dtype, rngs=rngs)
                                     for _ in range(2)])
        # Four up stages (their `in_out[1:] + [(last, last)]`, reversed): one more than Diffusion Policy's.
        ups = list(reversed(in_out[1:] + [(dims[-1], dims[-1])]))
        self.up_modules = nnx.List()
        for i, (din, dout) in enumerate(ups):
            c = cond_dim + 2 * context_dims[::-1][i]
            last = i >= len(in_out) - 1
            self.up_modules.append(nnx.List([
                ConditionalResidualBlock1D(dout + din, din, c, k, g, dtype=dtype, rngs=rngs),
                ConditionalResidualBlock1D(din, din, c, k, g, dtype=dtype, rngs=rngs),
                None,
                None if last else ConvTranspose1d(din, dtype=dtype, rngs=rngs),
            ]))
        self.final_block = Conv1dBlock(dims[0], dims[0], k, g, dtype=dtype, rngs=rngs)
        self.final_conv = conv(dims[0], cfg.input_dim, (1,), dtype=dtype, rngs=rngs)
        # Keypoints of the 9 feature maps: four modules, used as [0, 1, 2, 3, 3, 3, 2, 1, 0] (theirs
        # share weights so: the ModuleList holds the same objects at the mirrored indices).
        self.spatial_softmax_blocks = nnx.List([SpatialSoftmax(c, c, dtype=dtype, rngs=rngs) for c in context_dims])
        self.proj_in_action = linear(1, cfg.act_proj_dim, dtype, rngs)
        self.proj_in_action_norm = FP32LayerNorm(cfg.act_proj_dim, 1e-5)
        self.proj_out_action_norm = FP32LayerNorm(cfg.act_proj_dim, 1e-5)
        self.proj_out_action = linear(cfg.act_proj_dim, 1, dtype, rngs)

    def encode_observations(self, images, agent_pos):
        """images (B, n_obs, H, W, 3) in [-1, 1], agent_pos (B, n_obs, d) → global condition (B, n_obs·(2kp + d)).

        Step-invariant: computed once per sampling (the authors rerun it at every step)."""
        b, n = images.shape[:2]
        f = self.obs_encoder(images.reshape((b * n,) + images.shape[2:]), agent_pos.reshape(b * n, -1))
        return f.reshape(b, -1)

    def __call__(self, sample, timestep, feature_maps, global_cond):
        """sample (B, T, D); timestep (B,); feature_maps: the UNet's 9 maps, each (B·T, h, w, C);
        global_cond (B, n_obs·obs_dim) from `encode_observations` → (B, T, D) ε-prediction."""
        b, t, d = sample.shape
        x = self.proj_in_action_norm(self.proj_in_action(sample[..., None].astype(self.proj_in_action.kernel.dtype)))
        x = x.astype(self.proj_in_action.kernel.dtype).reshape(b * t, d, -1).transpose(0, 2, 1)  # (B·T, L, D)
        step = timestep_embedding(timestep, self.cfg.diffusion_step_embed_dim, flip_sin_to_cos=False,
                                  downscale_freq_shift=1.0)
        step = self.diffusion_step_linear_2(mish(self.diffusion_step_linear_1(step.astype(x.dtype))))
        base = jnp.concatenate([jnp.broadcast_to(step[:, None], (b, t, step.shape[-1])).astype(jnp.float32),
                                jnp.broadcast_to(global_cond[:, None].astype(jnp.float32),
                                                 (b, t, global_cond.shape[-1]))], axis=-1)
        order = (0, 1, 2, 3, 3, 3, 2, 1, 0)

        def cond(i):
            kp = self.spatial_softmax_blocks[order[i]](feature_maps[i])  # (B·T, C, 2)
            return jnp.concatenate([base, kp.reshape(b, t, -1)], axis=-1).reshape(b * t, -1).astype(x.dtype)

        skips = []
        for i, (res1, res2, _, down) in enumerate(self.down_modules):
            c = cond(i)
            x = res2(res1(x, c), c)
            skips.append(x)
            x = x if down is None else down(x)
        c = cond(4)
        x = self.mid_modules[1](self.mid_modules[0](x, c), c)
        for i, (res1, res2, _, up) in enumerate(self.up_modules):
            c = cond(5 + i)
            x = jnp.concatenate([x, skips.pop()], axis=-1)
            x = res2(res1(x, c), c)
            x = x if up is None else up(x)
        x = self.final_conv(self.final_block(x))  # (B·T, L, D)
        x = self.proj_out_action(self.proj_out_action_norm(x.transpose(0, 2, 1)).astype(x.dtype))
        return x.reshape(b, t, d)
