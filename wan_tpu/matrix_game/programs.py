"""The compiled programs of a Matrix-Game-2 stream, beside the image condition's (`wan_tpu.matrix_game.condition`):
what `MatrixGamePipeline` and its session run and what `wan_tpu.matrix_game.compile_ahead` compiles ahead of
them, so that both import them from here (neither imports the other's).

    key = stream_key(seed)                                   # `key_program`: jax.random.key as a program
    cache, vae_caches = cache_program(*nnx.split(dit), *nnx.split(vae), visual_context, latent_size, f)
    args, kwargs = chunk_args(pipe, dit_split, vae_split, cache, vae_caches, condition, windows, np.int32(0), key)
    x0, cache = chunk_denoise_program(*denoise_args(args), **kwargs)      # the DiT's whole chunk
    frames, vae_caches = chunk_decode_program(*decode_args(args, x0))     # the VAE's decode, uint8 frames
    frames = frames[:, -pipe.chunk_frames(0):]                   # 4·C frames out; the first chunk has 4·C − 3

Each chunk is two compiled programs: `chunk_denoise_program`, the DiT's whole chunk (its denoising steps,
re-noising, the clean cache-update pass: `denoise_chunk`), then `chunk_decode_program`, the VAE's streaming
decode of its clean latents, caches carried and donated, uint8 frames out. Two programs, not one, so that
they compile side by side (the decode needs no DiT: `prepare` starts it at once): as one program the
decode's 3-D convolutions and the DiT compiled one after the other, the first frame's longest wait in a
cold start (an H200's first chunk 23.4 s after the start, 20.7 s as two). One compilation of each serves
every chunk of every stream, the first included: the chunk index is traced, and where the first chunk
differs it is chosen inside the program, each choice computing bitwise what a program of its own computed:
its attention window holds only its own frames (`wan_tpu.matrix_game.cache.Window`: the window's sizes at each attention call), and
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
from wan_tpu.runtime.xla_defaults import NO_SOFTMAX_REWRITER, PER_RUN

MASK_CHANNELS = 4  # the temporal compression: one mask channel per video frame a latent frame stands for


@functools.partial(jax.jit, static_argnums=(0, 2, 5, 6), compiler_options={**PER_RUN, **NO_SOFTMAX_REWRITER})
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
    """One chunk's arguments, (positional, keyword): live play's `chunk_head_program`'s and `chunk_tail_program`'s
    (less the tail's x0 and x), and through `denoise_args` / `decode_args` a stream's two programs'. With
    abstract values (`jax.ShapeDtypeStruct`), what `prepare` compiles them for."""
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


_CHUNK_JIT = dict(static_argnums=(0, 2), static_argnames=("schedule", "frames_per_chunk"), donate_argnums=(4, 5),
                  compiler_options=NO_SOFTMAX_REWRITER)


def denoise_args(args: tuple) -> tuple:
    """`chunk_args`' positional arguments → `chunk_denoise_program`'s (the DiT's, the cache, the chunk's inputs)."""
    return (*args[:2], args[4], *args[6:])


def decode_args(args: tuple, x0) -> tuple:
    """`chunk_args`' positional arguments and the chunk's clean latents → `chunk_decode_program`'s."""
    return (*args[2:4], args[5], x0, args[-3])


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("schedule", "frames_per_chunk"), donate_argnums=(2,),
                   compiler_options=NO_SOFTMAX_REWRITER)
def chunk_denoise_program(dit_graph, dit_state, cache, latents, keyboard, mouse, chunk_index, key, repeat, *, schedule,
                          frames_per_chunk):
    """One chunk's DiT part: noise, condition, the denoising (`denoise_chunk`) → (clean latents x0, the DiT
    cache). `repeat`: the condition's (repeat_start, repeat_len), int32 scalars. `chunk_index` (traced) 0 is the
    stream's first chunk (its cache `cache_program`'s)."""
    from wan_tpu.matrix_game.sampling import denoise_chunk

    noise, cond, k_steps = _chunk_inputs(latents, chunk_index, key, repeat, frames_per_chunk)
    with jax.named_scope("2.3_Denoise"):
        return denoise_chunk(dit_graph, dit_state, cache, noise, cond, keyboard, mouse, chunk_index, k_steps,
                             schedule=schedule)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,), compiler_options=NO_SOFTMAX_REWRITER)
def chunk_decode_program(vae_graph, vae_state, vae_caches, x0, chunk_index):
    """One chunk's VAE part: the streaming decode of `chunk_denoise_program`'s x0 and uint8 frames (the
    authors' `((x + 1) · 127.5).clip(0, 255)`, truncated) → (frames (1, 4·C, H, W, 3), the VAE caches). The
    first chunk's (`chunk_index` 0) frames are the last 4·C − 3."""
    return _decode(vae_graph, vae_state, x0, vae_caches, chunk_index == 0)


@functools.partial(jax.jit, **_CHUNK_JIT)
def chunk_head_program(dit_graph, dit_state, vae_graph, vae_state, cache, vae_caches, latents, keyboard, mouse,
                       chunk_index, key, repeat, *, schedule, frames_per_chunk):
    """A chunk's first part, for live play: its denoising steps and the decode of its first latent frame
    → (frames (1, 4, H, W, 3), x0, x, the DiT cache, the VAE caches); `chunk_tail_program` finishes the
    chunk from x0 and x. The two together make bitwise a stream's frames and caches (`chunk_denoise_program`
    then `chunk_decode_program`), and the first frames come a cache pass and two latent frames' decode
    sooner. The arguments are `chunk_args`'."""
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
