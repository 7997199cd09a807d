"""Image conditioning for I2V (Wan 2.1 / 2.2 A14B) and TI2V (Wan 2.2 5B), as diffusers builds it.

- I2V: the image followed by `num_frames - 1` black frames is VAE-encoded (posterior mean,
  normalized); a 4-channel mask marks the first latent frame (one channel per video frame the VAE
  folds into it). The DiT input is `noise (z) ‖ mask (4) ‖ encoded video (z)` on the channel axis
  (16 + 4 + 16 = 36 for Wan 2.1). Wan 2.1 I2V also attends to CLIP vision tokens (image_encoder.py).
- TI2V (`expand_timesteps`): only the image is encoded (one latent frame). Each step the first latent
  frame of the DiT input is replaced by it and its tokens get timestep 0; after the loop it is
  written into the result. Without an image the mask is all ones: plain T2V with per-token timesteps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from wan_tpu.runtime.images import load_image


def preprocess_image(image, height: int, width: int) -> np.ndarray:
    """`(1, 3, H, W)` float32 in [-1, 1], resized with Lanczos like diffusers' VaeImageProcessor."""
    from PIL import Image

    pil = load_image(image)
    if pil.size != (width, height):
        pil = pil.resize((width, height), resample=Image.LANCZOS)
    x = np.asarray(pil, dtype=np.float32) / 255.0
    return (2.0 * x - 1.0).transpose(2, 0, 1)[None]


def first_frame_mask(batch: int, num_latent_frames: int, latent_h: int, latent_w: int, temporal: int) -> np.ndarray:
    """The I2V mask channels `(B, temporal, F, h, w)`: ones on the first latent frame, zeros after.

    The first video frame is repeated `temporal` times so that every latent frame stands for
    `temporal` video frames; those are then folded into the channel axis.
    """
    num_frames = (num_latent_frames - 1) * temporal + 1
    mask = np.zeros((batch, 1, num_frames + temporal - 1, latent_h, latent_w), np.float32)
    mask[:, :, :temporal] = 1.0
    mask = mask.reshape(batch, num_latent_frames, temporal, latent_h, latent_w)
    return mask.transpose(0, 2, 1, 3, 4)


def i2v_condition(vae, image: np.ndarray, num_frames: int, dtype=jnp.float32) -> jnp.ndarray:
    """`(1, temporal + z, F, h, w)`: mask channels then the normalized latents of image + black frames."""
    _, _, h, w = image.shape
    video = np.zeros((1, 3, num_frames, h, w), np.float32)
    video[:, :, 0] = image[0]
    z = vae.normalize_latents(vae.encode(jnp.asarray(video, dtype)).astype(jnp.float32))
    _, _, f, lh, lw = z.shape
    mask = first_frame_mask(1, f, lh, lw, vae.config.scale_factor_temporal)
    return jnp.concatenate([jnp.asarray(mask), z], axis=1)


def ti2v_condition(vae, image: np.ndarray, dtype=jnp.float32) -> jnp.ndarray:
    """`(1, z, 1, h, w)`: the normalized latent of the image alone (one latent frame)."""
    z = vae.encode(jnp.asarray(image[:, :, None], dtype)).astype(jnp.float32)
    return vae.normalize_latents(z)


def ti2v_mask(latent_shape: tuple[int, ...], conditioned: bool) -> jnp.ndarray:
    """`(1, 1, F, h, w)`: 0 where the latent is the conditioning image (first frame), 1 where it is denoised."""
    _, _, f, h, w = latent_shape
    mask = np.ones((1, 1, f, h, w), np.float32)
    if conditioned:
        mask[:, :, 0] = 0.0
    return jnp.asarray(mask)
