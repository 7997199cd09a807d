"""Matrix-Game-2's image condition: the VAE latents of the start image followed by gray frames, as the
authors' `inference.py` builds them (the image, then 4·(N-1) zero frames, encoded), computed only until
they repeat and held at one shape (`CONDITION_FRAMES` latent frames) whatever the image.

    condition = ImageCondition.encode(vae, nnx.split(vae), pixels, max_latent_frames)   # pixels (1, 3, H, W)
    frames = jnp.take(condition.latents, condition.index(latent_frames), axis=2)

`MatrixGamePipeline.encode_image` makes it; the chunk's denoise program reads it (`index`, traced), so it can be
compiled before any image is encoded (`wan_tpu.matrix_game.compile_ahead`, which also compiles the programs
here from the VAE's config).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from wan_tpu.runtime.xla_defaults import NO_SOFTMAX_REWRITER, PER_RUN


class ImageCondition:
    """The normalized VAE latents of an image followed by gray frames, computed until they repeat.

    `latents` (1, z, CONDITION_FRAMES, h, w) holds latent frames 0 … K-1 (zeros after them); frames from
    `repeat_start` on repeat with period `repeat_len` (`index`): the encoder's state (its causal caches)
    after a run of `repeat_len` gray latent frames was bitwise the state before it, so every later run
    computes the same latents. A run is 3 latent frames: the caches' 3-slot rings turn by 1, 2 or 4 slots
    per latent frame, so their layout, and with it the exact arithmetic, repeats every 3. The fixed
    shape, with `repeat_start`/`repeat_len` as traced scalars in the chunk's denoise program, lets that program be
    compiled before any image is encoded (`MatrixGamePipeline.prepare`).

    The gray runs are encoded as the video reaches them (`cover`): the first chunk waits for the image
    and one run, not for the ~11 runs (and as many host reads of the repeat check) before the repeat.
    Until the repeat is found, `repeat_start` is the count of frames encoded (`repeat_len` 1): frames
    below it are final, whatever comes later, since each run only appends."""

    def __init__(self, latents, repeat_start: int, repeat_len: int):
        self.latents = latents
        self.repeat_start = repeat_start
        self.repeat_len = repeat_len
        self._runs: _GrayRuns | None = None  # the encoder's state while the repeat is not found

    @classmethod
    def encode(cls, vae, split, image: np.ndarray, max_latent_frames: int, programs=None,
               frames: int | None = None) -> ImageCondition:
        """The image's latent frame and the gray runs that the first `frames` latent frames need (all of
        them up to the repeat when None). `programs` (an `executable_cache.Programs`): the compiled
        programs `MatrixGamePipeline.prepare` loaded or compiled (`encode-first`, `start-latents`,
        `gray-latents`, `normalized`); without one, or without a program, the jitted path."""
        runs = _GrayRuns(vae, split, image, max_latent_frames, programs)
        condition = cls(None, 1, 1)
        condition._runs = runs
        condition.cover(max_latent_frames if frames is None else frames)
        return condition

    def cover(self, frames: int) -> None:
        """Make latent frames [0, `frames`) final: encode the gray runs they still need (none once the
        repeat is found)."""
        runs = self._runs
        if runs is None:
            return
        if runs.extend(frames) or self.latents is None:
            self.latents = runs.normalized()
        self.repeat_start, self.repeat_len = runs.repeat or (runs.count, 1)
        if runs.repeat is not None or runs.count >= runs.max_latent_frames:
            self._runs = None  # complete: the encoder's caches can go

    def index(self, latent_frames):
        """Where latent frames (traced ints) read from `latents`."""
        i = jnp.asarray(latent_frames)
        return jnp.where(i < self.repeat_start, i, self.repeat_start + (i - self.repeat_start) % self.repeat_len)


class _GrayRuns:
    """The VAE encoder's causal state after the image and the gray runs so far, and their raw latents."""

    def __init__(self, vae, split, image, max_latent_frames, programs):
        self.graphdef, self.state = split
        self.programs, self.max_latent_frames = programs, max_latent_frames
        self.frame = gray_frame_shape(vae.config, image.shape)
        # Cast on the host and put on the device as it is: a cast or `jnp.asarray` there would be one more
        # program to compile before the first frame.
        pixels = jax.device_put(np.asarray(image[:, :, None], vae.dtype))
        self.caches, mu = self.run("encode-first", (self.state, pixels, None), lambda: vae.encode_chunk(pixels, per_run=True)[::-1])
        self.latents = self.run("start-latents", (mu,), lambda: start_latents(mu, CONDITION_FRAMES))
        self.count, self.repeat, self.same = 1, None, None

    def run(self, name, dynamic, fallback):
        return fallback() if self.programs is None else self.programs.call(name, dynamic, fallback)

    def extend(self, frames: int) -> bool:
        """Encode runs until `frames` latent frames are final or the repeat is found → whether any ran.
        A run's repeat check (a host read) is made when the next run is wanted, by then long done, or
        once all `max_latent_frames` are encoded."""
        ran = False
        while self.repeat is None and self.count < min(frames, self.max_latent_frames) and not self._repeated():
            if self.count + GRAY_RUN > self.latents.shape[2]:  # no repeat within the bound (not seen): grow
                grow = 1 + GRAY_RUN * -(-(self.max_latent_frames - 1) // GRAY_RUN) - self.latents.shape[2]
                self.latents = jnp.pad(self.latents, ((0, 0), (0, 0), (0, grow), (0, 0), (0, 0)))
            offset = np.int32(self.count)
            self.caches, self.latents, self.same = self.run(
                "gray-latents", (self.state, self.caches, self.latents, offset),
                lambda: gray_latents(self.graphdef, self.state, self.caches, self.latents, offset, GRAY_RUN,  # noqa: B023
                                      self.frame))
            self.count += GRAY_RUN
            ran = True
        if self.repeat is None and self.count >= self.max_latent_frames:
            self._repeated()
        return ran

    def _repeated(self) -> bool:
        """Whether the last run left the encoder's state as it found it (then the repeat is set)."""
        if self.same is not None and bool(self.same):
            self.repeat = (self.count - GRAY_RUN, GRAY_RUN)
        return self.repeat is not None

    def normalized(self):
        return self.run("normalized", (self.state, self.latents), lambda: normalized_latents(self.graphdef, self.state, self.latents))


# Latent frames the condition holds (padded). The gray frames' latents of Wan 2.1's VAE repeat from
# latent frame 31 with period 3 (34 frames encoded), measured on a random full-size VAE at 32×64 in float32
# and bfloat16; the tiny preset's from 22 (25 encoded; the same at 64×112 and 352×640). Where they repeat
# is set by the encoder's causal receptive field in time (the image leaves it after a fixed count of
# frames), not by its weights or the frame size. 48 leaves margin; beyond it `encode` carries on.
CONDITION_FRAMES = 48
GRAY_RUN = 3  # gray latent frames per `gray_latents` call: the period of the caches' ring layout


def gray_frame_shape(vae_config, image_shape) -> tuple[int, ...]:
    """The (B, C, 4, H, W) gray video one encoder step of `gray_latents` takes, for images of `image_shape`."""
    return (image_shape[0], vae_config.video_channels, 4, *image_shape[-2:])


@functools.partial(jax.jit, static_argnums=1)
def start_latents(mu, frames: int):
    """The condition buffer: the image's latent frame `mu` then zeros, `frames` latent frames in all."""
    return jnp.zeros((*mu.shape[:2], frames, *mu.shape[3:]), mu.dtype).at[:, :, :1].set(mu)


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=3,
                   compiler_options={**PER_RUN, **NO_SOFTMAX_REWRITER})
def gray_latents(graphdef, state, caches, latents, offset, count, frame_shape):
    """`count` latent frames of gray video (chunks of 4 zero frames, `frame_shape`) after `caches`, written
    into `latents` from frame `offset` → (caches, latents, whether the caches after equal those before,
    bitwise). The encoder's step is scanned, not unrolled: one copy of it to compile."""
    vae = nnx.merge(graphdef, state)

    def step(carry, _):
        mu, carry = vae.encode_chunk(jnp.zeros(frame_shape, vae.dtype), carry)
        return carry, mu

    new, mus = lax.scan(step, caches, None, length=count)  # mus (count, B, z, 1, h, w)
    mus = jnp.moveaxis(mus, 0, 2).reshape(*mus.shape[1:3], count, *mus.shape[4:])
    same = jnp.stack([jnp.array_equal(a, c) for a, c in zip(jax.tree.leaves(caches), jax.tree.leaves(new))]).all()
    return new, lax.dynamic_update_slice_in_dim(latents, mus, offset, axis=2), same


@functools.partial(jax.jit, static_argnums=0)
def normalized_latents(graphdef, state, latents):
    return nnx.merge(graphdef, state).normalize_latents(latents.astype(jnp.float32))
