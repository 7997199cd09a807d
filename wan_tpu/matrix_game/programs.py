"""The compiled programs of a Matrix-Game-2 stream, beside the image condition's (`wan_tpu.matrix_game.condition`):
what `MatrixGamePipeline` and its session run and what `wan_tpu.matrix_game.compile_ahead` compiles ahead of
them, so that both import them from here (neither imports the other's).

    key = stream_key(seed)                                   # `key_program`: jax.random.key as a program
    cache, vae_caches = cache_program(*nnx.split(dit), *nnx.split(vae), visual_context, latent_size, f)
    args, kwargs = chunk_args(pipe, dit_split, vae_split, cache, vae_caches, condition, windows, np.int32(0), key)
    frames, cache, vae_caches = chunk_program(*args, **kwargs)   # one chunk: denoise + decode, uint8 frames
    frames = frames[:, -pipe.chunk_frames(0):]                   # 4·C frames out; the first chunk has 4·C − 3

Each chunk is one compiled program (`chunk_program`): the DiT's whole chunk (its denoising steps,
re-noising, the clean cache-update pass: `denoise_chunk`) and the VAE's streaming decode of the chunk,
caches carried and donated, uint8 frames out. One compilation serves every chunk of every stream, the
first included: the chunk index is traced, and where the first chunk differs it is chosen inside the
program, each choice computing bitwise what a program of its own computed: its attention window holds
only its own frames (`wan_tpu.matrix_game.cache.Window`: the window's sizes at each attention call), and
the VAE's first latent frame gives one video frame, not four (`WanVAE.decode_chunk(start=)`: that frame's
path by `lax.cond`, its frame after 3 of padding, which the caller drops). Noise: chunk k draws its
initial noise and its re-noising from `fold_in(key(seed), k)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.matrix_game.condition import ImageCondition

MASK_CHANNELS = 4  # the temporal compression: one mask channel per video frame a latent frame stands for


@functools.partial(jax.jit, static_argnums=(0, 2, 5, 6))
def cache_program(dit_graph, dit_state, vae_graph, vae_state, visual_context, latent_size, frames_per_chunk):
    """A stream's empty caches: the DiT's (`init_cache`, its cross-attention keys from `visual_context`) and
    the VAE decode's (`start_decode_caches`: zeros; only their shapes are read of the VAE's state)."""
    from wan_tpu.matrix_game.model import init_cache

    vae = nnx.merge(vae_graph, vae_state)
    shape = (visual_context.shape[0], vae.config.z_dim, frames_per_chunk, *latent_size)
    return init_cache(dit_graph, dit_state, visual_context, latent_size), vae.start_decode_caches(shape)


key_program = jax.jit(jax.random.key)


def stream_key(seed: int):
    """`jax.random.key(seed)` as a compiled program (`key_program`, compiled ahead by `prepare`)."""
    return key_program(seed_of(seed))


def seed_of(seed: int) -> np.uint32:
    """The seed mod 2³², which is what `jax.random.key` keeps of a Python int with 32-bit keys (x64 off)."""
    return np.uint32(seed % 2**32)


def chunk_args(pipe, dit, vae, cache, vae_caches, condition: ImageCondition, windows, chunk_index, key):
    """The arguments of `chunk_program` for one chunk: (positional, keyword). With abstract values
    (`jax.ShapeDtypeStruct`), what `prepare` compiles it for."""
    repeat = (np.int32(condition.repeat_start), np.int32(condition.repeat_len))
    return ((*dit, *vae, cache, vae_caches, condition.latents, *windows, chunk_index, key, repeat),
            dict(schedule=pipe.schedule, frames_per_chunk=pipe.frames_per_chunk))


def action_windows(pipe) -> list:
    """Abstract (keyboard, mouse) action windows of a chunk (`chunk_action_window`; None without mouse)."""
    from wan_tpu.matrix_game.action_module import chunk_action_window

    f = pipe.frames_per_chunk
    frames = pipe.chunk_frames(0) + pipe.chunk_frames(1)
    space = pipe.action_space
    dims = (space.keyboard_dim, 2 if space.mouse else None)
    return [None if d is None else jax.ShapeDtypeStruct(
        (1, *chunk_action_window(np.zeros((frames, d), np.float32), 1, f).shape), jnp.float32) for d in dims]


def _chunk_inputs(latents, chunk_index, key, repeat, f):
    """A chunk's initial noise, its condition (mask ‖ image latents) and the key of its re-noising."""
    b, z, _, h, w = latents.shape
    k_noise, k_steps = jax.random.split(jax.random.fold_in(key, chunk_index))
    noise = jax.random.normal(k_noise, (b, z, f, h, w), jnp.float32)
    frame = chunk_index * f + jnp.arange(f)
    condition = ImageCondition(latents, *repeat)
    image = jnp.take(latents, condition.index(frame), axis=2)
    mask = jnp.broadcast_to((frame == 0).astype(jnp.float32)[None, None, :, None, None], (b, MASK_CHANNELS, f, h, w))
    return noise, jnp.concatenate([mask, image], axis=1), k_steps


def _decode(vae_graph, vae_state, x0, vae_caches, start):
    """The VAE's streaming decode of clean latents → (uint8 frames (B, T, H, W, 3), the VAE caches)."""
    with jax.named_scope("2.3_VAE_Decode"):
        vae = nnx.merge(vae_graph, vae_state)
        video, vae_caches = vae.decode_chunk(vae.denormalize_latents(x0.astype(vae.dtype)), vae_caches, start=start)
        with jax.named_scope("VAE_Decode_Postprocessing"):
            frames = jnp.clip((video.astype(jnp.float32) + 1) * 127.5, 0, 255).astype(jnp.uint8)
    return frames.transpose(0, 2, 3, 4, 1), vae_caches


_CHUNK_JIT = dict(static_argnums=(0, 2), static_argnames=("schedule", "frames_per_chunk"), donate_argnums=(4, 5))


@functools.partial(jax.jit, **_CHUNK_JIT)
def chunk_program(dit_graph, dit_state, vae_graph, vae_state, cache, vae_caches, latents, keyboard, mouse,
                  chunk_index, key, repeat, *, schedule, frames_per_chunk):
    """One chunk: noise, condition, the DiT's denoising (`denoise_chunk`), the VAE's streaming decode and
    uint8 frames (the authors' `((x + 1) · 127.5).clip(0, 255)`, truncated) → (frames (1, 4·C, H, W, 3),
    the DiT cache, the VAE caches). `repeat`: the condition's (repeat_start, repeat_len), int32 scalars.
    `chunk_index` (traced) 0 is the stream's first chunk (its caches `cache_program`'s): its frames are
    the last 4·C − 3."""
    from wan_tpu.matrix_game.sampling import denoise_chunk

    noise, cond, k_steps = _chunk_inputs(latents, chunk_index, key, repeat, frames_per_chunk)
    with jax.named_scope("2.3_Denoise"):
        x0, cache = denoise_chunk(dit_graph, dit_state, cache, noise, cond, keyboard, mouse, chunk_index, k_steps,
                                  schedule=schedule)
    frames, vae_caches = _decode(vae_graph, vae_state, x0, vae_caches, chunk_index == 0)
    return frames, cache, vae_caches


@functools.partial(jax.jit, **_CHUNK_JIT)
def chunk_head_program(dit_graph, dit_state, vae_graph, vae_state, cache, vae_caches, latents, keyboard, mouse,
                       chunk_index, key, repeat, *, schedule, frames_per_chunk):
    """A chunk's first part, for live play: its denoising steps and the decode of its first latent frame
    → (frames (1, 4, H, W, 3), x0, x, the DiT cache, the VAE caches); `chunk_tail_program` finishes the
    chunk from x0 and x. The two together make bitwise `chunk_program`'s frames and caches, and the first
    frames come a cache pass and two latent frames' decode sooner. The arguments are `chunk_program`'s."""
    from wan_tpu.matrix_game.sampling import denoise_chunk

    noise, cond, k_steps = _chunk_inputs(latents, chunk_index, key, repeat, frames_per_chunk)
    with jax.named_scope("2.3_Denoise"):
        x0, x, cache = denoise_chunk(dit_graph, dit_state, cache, noise, cond, keyboard, mouse, chunk_index, k_steps,
                                     schedule=schedule, part="denoise")
    frames, vae_caches = _decode(vae_graph, vae_state, x0[:, :, :1], vae_caches, chunk_index == 0)
    return frames, x0, x, cache, vae_caches


@functools.partial(jax.jit, **_CHUNK_JIT)
def chunk_tail_program(dit_graph, dit_state, vae_graph, vae_state, cache, vae_caches, latents, keyboard, mouse,
                       chunk_index, key, repeat, x0, x, *, schedule, frames_per_chunk):
    """A chunk's second part: the decode of its other latent frames and the DiT's cache pass on x
    (`chunk_head_program`'s outputs) → (frames (1, 4·C − 4, H, W, 3), the DiT cache, the VAE caches)."""
    from wan_tpu.matrix_game.sampling import denoise_chunk

    _, cond, k_steps = _chunk_inputs(latents, chunk_index, key, repeat, frames_per_chunk)
    frames, vae_caches = _decode(vae_graph, vae_state, x0[:, :, 1:], vae_caches, False)
    with jax.named_scope("2.3_Denoise"):
        _, cache = denoise_chunk(dit_graph, dit_state, cache, x, cond, keyboard, mouse, chunk_index, k_steps,
                                 schedule=schedule, part="context")
    return frames, cache, vae_caches
