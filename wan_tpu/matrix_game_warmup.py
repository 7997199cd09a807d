"""Compiling Matrix-Game-2's programs from the components' configs, before any weight exists: what
`MatrixGamePipeline.prepare` starts beside the loads.

    pipe = wan_tpu.MatrixGamePipeline.from_pretrained("matrix-game-2-wan-tpu")
    with pipe.prepare():                        # loads and compiles start; returns at once
        session = pipe.stream("start.png")      # each call waits for its own program only
        frames = session.step(keyboard=[1, 0, 0, 0], mouse=[0, 0.1])

Every program a stream runs through its second chunk is lowered from abstract modules (`nnx.eval_shape`
of the very constructors the loaders use: `abstract_transformer`, `abstract_vae`,
`abstract_clip_vision`, or the tiny preset's) and `jax.ShapeDtypeStruct` inputs, and compiled, each group
in its own thread `wan_tpu-compile-NAME` (`Warmup.start(kind="compile")`):
  * `condition`: the VAE's first-frame encode, the condition buffer, `_gray_latents`, the normalisation;
  * `clip`: CLIP's encode of one image; `cache`: `_init_cache` for its tokens; `key`: the stream's key;
  * `chunk-0`: the first chunk's `_chunk_program`; `chunk-1`: the one every later chunk runs (its VAE
    caches' shapes are chunk-0's outputs'). Each program is traced once: a later one takes an earlier
    one's output shapes (`Lowered.out_info`).
The calls then find them in JAX's in-memory cache of compiled programs (same functions, equal static
arguments: the abstract modules' graphdefs equal the loaded ones'; same shapes, dtypes and placements),
so results are bit-identical with and without `prepare`. With the persistent compile cache warm,
"compiling" is fetching from it, which now overlaps the weights' reads instead of following them; cold,
the compiles overlap them too. Each call waits for its own program only (`Warmup.wait_compiled`); a
compile that fails (a config that does not describe the weights, …) is a warning and the call compiles
as without `prepare`. `Warmup.cancel` stops the threads at the next program.
"""

from __future__ import annotations

import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.warmup import Cancelled

COMPONENTS = ("transformer", "vae", "image_encoder")


def compile_ahead(pipe, warmup) -> None:
    """Start compiling, in `warmup`'s threads, every program a stream of `pipe` runs (module docstring).
    Nothing starts for a pipeline without abstract components (its calls compile on use)."""
    if not all(name in pipe._abstracts for name in COMPONENTS):
        return
    abstract = _Abstracts(pipe._abstracts)
    stop = warmup.cancelled
    # Each program is traced once: a later one takes an earlier one's output shapes (`Lowered.out_info`)
    # instead of tracing it again; tracing is Python, which the weights' loads wait for too (the GIL).
    visual, cache, key, first = (concurrent.futures.Future() for _ in range(4))
    warmup.start("condition", _condition, pipe, abstract, stop, kind="compile")
    warmup.start("clip", _compile, lambda: abstract("image_encoder").lower(1), visual, kind="compile")
    warmup.start("cache", _compile, lambda: _cache(pipe, abstract, _wait(visual, stop)), cache, kind="compile")
    warmup.start("key", _compile, _key_lowered, key, kind="compile")

    def chunk(vae_caches):
        return lambda: _chunk(pipe, abstract, stop, _wait(cache, stop), _wait(key, stop), vae_caches())

    warmup.start("chunk-0", _compile, chunk(lambda: None), first, kind="compile")
    warmup.start("chunk-1", _compile, chunk(lambda: _wait(first, stop)[2]), kind="compile")


def _wait(future: concurrent.futures.Future, stop: threading.Event):
    """`future`'s result; `Cancelled` once `stop` is set (its thread may never have started)."""
    while True:
        try:
            return future.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            _check(stop)


def _compile(lower, out: concurrent.futures.Future | None = None) -> None:
    """Lower, hand the output shapes to whoever waits on `out` (if given), then compile."""
    try:
        lowered = lower()
    except BaseException as e:
        if out is not None:
            out.set_exception(e)
        raise
    if out is not None:
        out.set_result(lowered.out_info)
    lowered.compile()


class _Abstracts:
    """Each component's abstract module, built once whichever thread asks first."""

    def __init__(self, builds: dict):
        self._builds = builds
        self._made: dict = {}
        self._locks = {name: threading.Lock() for name in builds}

    def __call__(self, name: str):
        with self._locks[name]:
            if name not in self._made:
                self._made[name] = self._builds[name]()
        return self._made[name]


def _check(stop: threading.Event) -> None:
    if stop.is_set():
        raise Cancelled()


def _condition(pipe, abstract, stop) -> None:
    """`ImageCondition.encode`'s programs, in the order it calls them."""
    from wan_tpu.models.matrix_game.condition import (CONDITION_FRAMES, GRAY_RUN, _gray_latents, _normalized,
                                                   _start_latents, gray_frame_shape)

    vae = abstract("vae")
    image_shape = (1, vae.config.video_channels, *pipe.size)
    mu, caches = vae.compile_encode_chunk((*image_shape[:2], 1, *image_shape[2:]))
    _check(stop)
    latents = _start_latents.lower(mu, CONDITION_FRAMES)
    latents.compile()
    _check(stop)
    graphdef, state = nnx.split(vae)
    frame = gray_frame_shape(vae.config, image_shape)
    offset = jax.ShapeDtypeStruct((), jnp.int32)
    _gray_latents.lower(graphdef, state, caches, latents.out_info, offset, GRAY_RUN, frame).compile()
    _check(stop)
    _normalized.lower(graphdef, state, latents.out_info).compile()


def _cache(pipe, abstract, visual):
    from wan_tpu.matrix_game import _init_cache

    return _init_cache.lower(*nnx.split(abstract("transformer")), visual, tuple(pipe.variant.latent_size))


def _key_lowered():
    from wan_tpu.matrix_game import _key

    return _key.lower(jax.ShapeDtypeStruct((), np.uint32))


def _chunk(pipe, abstract, stop, cache, key, vae_caches):
    """The first chunk's `_chunk_program` (`vae_caches` None), or the one every later chunk runs (the VAE
    caches the first one returns), lowered."""
    from wan_tpu.matrix_game import CONDITION_FRAMES, ImageCondition, _chunk_program, action_windows, chunk_args

    dit, vae = nnx.split(abstract("transformer")), nnx.split(abstract("vae"))
    z = abstract("vae").config.z_dim
    # `ImageCondition.encode`'s normalized float32 latents; the repeat scalars are traced.
    condition = ImageCondition(jax.ShapeDtypeStruct((1, z, CONDITION_FRAMES, *pipe.variant.latent_size), jnp.float32),
                               0, 1)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    args, kwargs = chunk_args(pipe, dit, vae, cache, vae_caches, condition, action_windows(pipe), index, key)
    _check(stop)
    return _chunk_program.lower(*args, **kwargs)
