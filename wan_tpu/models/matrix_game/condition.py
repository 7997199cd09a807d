"""Matrix-Game-2's image condition: the VAE latents of the start image followed by gray frames, as the
authors' `inference.py` builds them (the image, then 4·(N-1) zero frames, encoded), computed only until
they repeat and held at one shape (`CONDITION_FRAMES` latent frames) whatever the image.

    condition = ImageCondition.encode(vae, nnx.split(vae), pixels, max_latent_frames)   # pixels (1, 3, H, W)
    frames = jnp.take(condition.latents, condition.index(latent_frames), axis=2)

`MatrixGamePipeline.encode_image` makes it; the chunk program reads it (`index`, traced), so it can be
compiled before any image is encoded (`wan_tpu.matrix_game_warmup`, which also compiles the programs
here from the VAE's config).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax


class ImageCondition:
    """The normalized VAE latents of an image followed by gray frames, computed until they repeat.

    `latents` (1, z, CONDITION_FRAMES, h, w) holds latent frames 0 … K-1 (zeros after them); frames from
    `repeat_start` on repeat with period `repeat_len` (`index`): the encoder's state (its causal caches)
    after a run of `repeat_len` gray latent frames was bitwise the state before it, so every later run
    computes the same latents. A run is 3 latent frames: the caches' 3-slot rings turn by 1, 2 or 4 slots
    per latent frame, so their layout, and with it the exact arithmetic, repeats every 3. The fixed
    shape, with `repeat_start`/`repeat_len` as traced scalars in the chunk program, lets that program be
    compiled before any image is encoded (`MatrixGamePipeline.prepare`)."""

    def __init__(self, latents, repeat_start: int, repeat_len: int):
        self.latents = latents
        self.repeat_start = repeat_start
        self.repeat_len = repeat_len

    @classmethod
    def encode(cls, vae, split, image: np.ndarray, max_latent_frames: int, programs=None) -> ImageCondition:
        """`programs` (an `executable_cache.Programs`): the compiled programs `MatrixGamePipeline.prepare`
        loaded or compiled (`encode-first`, `start-latents`, `gray-latents`, `normalized`); without one, or without a program, the jitted path."""
        graphdef, state = split

        def run(name, dynamic, fallback):
            return fallback() if programs is None else programs.call(name, dynamic, fallback)

        # Cast on the host and put on the device as it is: a cast or `jnp.asarray` there would be one more
        # program to compile before the first frame.
        pixels = jax.device_put(np.asarray(image[:, :, None], vae.dtype))
        caches, mu = run("encode-first", (state, pixels, None), lambda: vae.encode_chunk(pixels)[::-1])
        latents = run("start-latents", (mu,), lambda: _start_latents(mu, CONDITION_FRAMES))
        count, repeat, run_len = 1, None, GRAY_RUN
        frame = gray_frame_shape(vae.config, image.shape)
        while count < max_latent_frames:
            if count + run_len > latents.shape[2]:  # no repeat within the bound (not seen): encode on, as far as needed
                grow = 1 + run_len * -(-(max_latent_frames - 1) // run_len) - latents.shape[2]
                latents = jnp.pad(latents, ((0, 0), (0, 0), (0, grow), (0, 0), (0, 0)))
            offset = np.int32(count)
            caches, latents, same = run(
                "gray-latents", (state, caches, latents, offset),
                lambda: _gray_latents(graphdef, state, caches, latents, offset, run_len, frame))  # noqa: B023 - called at once
            count += run_len
            if bool(same):
                repeat = (count - run_len, run_len)
                break
        normalized = run("normalized", (state, latents), lambda: _normalized(graphdef, state, latents))
        return cls(normalized, *(repeat or (count, 1)))

    def index(self, latent_frames):
        """Where latent frames (traced ints) read from `latents`."""
        i = jnp.asarray(latent_frames)
        return jnp.where(i < self.repeat_start, i, self.repeat_start + (i - self.repeat_start) % self.repeat_len)


# Latent frames the condition holds (padded). The gray frames' latents of Wan 2.1's VAE repeat from
# latent frame 31 with period 3 (34 frames encoded), measured on a random full-size VAE at 32×64 in float32
# and bfloat16; the tiny preset's from 22 (25 encoded; the same at 64×112 and 352×640). Where they repeat
# is set by the encoder's causal receptive field in time (the image leaves it after a fixed count of
# frames), not by its weights or the frame size. 48 leaves margin; beyond it `encode` carries on.
CONDITION_FRAMES = 48
GRAY_RUN = 3  # gray latent frames per `_gray_latents` call: the period of the caches' ring layout


def gray_frame_shape(vae_config, image_shape) -> tuple[int, ...]:
    """The (B, C, 4, H, W) gray video one encoder step of `_gray_latents` takes, for images of `image_shape`."""
    return (image_shape[0], vae_config.video_channels, 4, *image_shape[-2:])


@functools.partial(jax.jit, static_argnums=1)
def _start_latents(mu, frames: int):
    """The condition buffer: the image's latent frame `mu` then zeros, `frames` latent frames in all."""
    return jnp.zeros((*mu.shape[:2], frames, *mu.shape[3:]), mu.dtype).at[:, :, :1].set(mu)


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=3)
def _gray_latents(graphdef, state, caches, latents, offset, count, frame_shape):
    """`count` latent frames of gray video (chunks of 4 zero frames, `frame_shape`) after `caches`, written
    into `latents` from frame `offset` → (caches, latents, whether the caches after equal those before,
    bitwise)."""
    vae = nnx.merge(graphdef, state)
    new, mus = caches, []
    for _ in range(count):
        mu, new = vae.encode_chunk(jnp.zeros(frame_shape, vae.dtype), new)
        mus.append(mu)
    same = jnp.stack([jnp.array_equal(a, c) for a, c in zip(jax.tree.leaves(caches), jax.tree.leaves(new))]).all()
    return new, lax.dynamic_update_slice_in_dim(latents, jnp.concatenate(mus, axis=2), offset, axis=2), same


@functools.partial(jax.jit, static_argnums=0)
def _normalized(graphdef, state, latents):
    return nnx.merge(graphdef, state).normalize_latents(latents.astype(jnp.float32))
