"""Compiling Matrix-Game-2's programs from the components' configs, before any weight exists: what
`MatrixGamePipeline.prepare` starts beside the loads.

    pipe = wan_tpu.MatrixGamePipeline.from_pretrained("matrix-game-2-wan-tpu")
    with pipe.prepare():                        # loads and compiles start; returns at once
        session = pipe.stream("start.png")      # waits for the programs, not for the DiT's load
        frames = session.step(keyboard=[1, 0, 0, 0], mouse=[0, 0.1])

Every program a stream runs is loaded from the executable cache
(`wan_tpu.runtime.executable_cache`, keyed by `MatrixGamePipeline.program_key`: the components' configs, dtypes,
sizes), or else lowered from abstract modules (`nnx.eval_shape` of the very constructors the loaders use:
`abstract_transformer`, `abstract_vae`, `abstract_clip_vision`, or the tiny preset's) and
`jax.ShapeDtypeStruct` inputs, compiled and stored; each group in its own thread `wan_tpu-compile-NAME`
(`Warmup.start(kind="compile")`):
  * `encode-first`: the VAE's first-frame encode; `condition`: the condition buffer (`start-latents`),
    `gray_latents` (`gray-latents`), the normalisation (`normalized`);
  * `clip`: CLIP's encode of one image; `cache`: `cache_program` for its tokens; `key`: the stream's key;
  * `chunk-denoise` and `chunk-decode`: `chunk_denoise_program` and `chunk_decode_program`, which every chunk
    of a stream runs, the first included (the DiT cache's shapes are the cache program's outputs'); the
    decode, which needs no DiT, starts at once; with `prepare(live=True)`, `chunk-head` and `chunk-tail`
    instead, live play's two parts of a chunk (`chunk_head_program`, `chunk_tail_program`).
    A later program takes an earlier one's output shapes (`out_info`)
    instead of tracing it again.
The stream's programs are `wan_tpu.matrix_game.programs`' (this module does not import the pipeline's), and
every thread runs in the pipeline's compile-cache choice (`compile_cache.selected(pipe.compile_cache)`).
Each lands in `pipe._programs` by name, and the calls run it (`Programs.call`, without the jitted
functions' static arguments): the very programs compiled ahead, so results are bit-identical with and
without `prepare`. Warm, nothing is traced or lowered and no abstract module is built: a start reads its
programs from disk while the weights load, instead of spending seconds of Python (the GIL the loads need
too) re-deriving JAX's compile-cache keys. The first call that runs a program waits for all of them
(`MatrixGamePipeline._wait_compiled` says why: on a GPU a program's first run must not overlap other CUDA
work). A compile that fails (a config that does not describe the weights, …) is a warning and the call
compiles as without `prepare`.
`Warmup.cancel` stops the threads at the next program.
"""

from __future__ import annotations

import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.matrix_game.condition import CONDITION_FRAMES, ImageCondition
from wan_tpu.matrix_game.programs import (
    action_windows,
    cache_program,
    chunk_args,
    chunk_decode_program,
    chunk_denoise_program,
    chunk_head_program,
    chunk_tail_program,
    denoise_args,
    key_program,
)
from wan_tpu.runtime import executable_cache
from wan_tpu.runtime.compile_ahead import Cancelled

COMPONENTS = ("transformer", "vae", "image_encoder")


def compile_ahead(pipe, warmup, live: bool = False) -> None:
    """Start loading or compiling, in `warmup`'s threads, every program a stream of `pipe` runs (module
    docstring). Nothing starts for a pipeline without abstract components, or on a mesh (the programs
    follow the calls' shardings, which shapes alone do not give): its calls compile on use."""
    if pipe.mesh is not None or not all(name in pipe._abstracts for name in COMPONENTS):
        return
    abstract = _Abstracts(pipe._abstracts)
    stop = warmup.cancelled
    # A later program is lowered for an earlier one's output shapes, handed over as soon as they are known
    # (`out_info` of the stored or lowered program) instead of tracing the earlier one again.
    first, visual, caches, key = (concurrent.futures.Future() for _ in range(4))
    # The first-frame encode compiles in a thread of its own: the condition's later programs need only its
    # output shapes, so they lower and compile beside it instead of after it (on an H100, 7.0 and 10.4 s of
    # compile one after the other were the first frame's critical path).
    warmup.start("encode-first", _program, pipe, "encode-first", lambda: _encode_first(pipe, abstract), first,
                 kind="compile")
    warmup.start("condition", _condition, pipe, abstract, stop, first, kind="compile")
    warmup.start("clip", _program, pipe, "clip", lambda: abstract("image_encoder").lower(1), visual, kind="compile")
    warmup.start("cache", _program, pipe, "cache", lambda: _cache(pipe, abstract, _wait(visual, stop)), caches,
                 kind="compile")
    warmup.start("key", _program, pipe, "key", _key_lowered, key, kind="compile")
    if not live:
        warmup.start("chunk-decode", _program, pipe, "chunk-decode", lambda: _chunk_decode(pipe, abstract),
                     kind="compile")
        warmup.start("chunk-denoise", _program, pipe, "chunk-denoise", lambda: _chunk(
            pipe, abstract, stop, _wait(caches, stop), _wait(key, stop), chunk_denoise_program), kind="compile")
        return
    head = concurrent.futures.Future()
    warmup.start("chunk-head", _program, pipe, "chunk-head", lambda: _chunk(
        pipe, abstract, stop, _wait(caches, stop), _wait(key, stop), chunk_head_program), head, kind="compile")
    warmup.start("chunk-tail", _program, pipe, "chunk-tail", lambda: _chunk(
        pipe, abstract, stop, _wait(caches, stop), _wait(key, stop), chunk_tail_program, _wait(head, stop)[1:3]),
        kind="compile")


def captures_graphs() -> bool:
    """Whether XLA records first runs as CUDA graphs here (NVIDIA GPUs)."""
    return jax.devices()[0].platform == "gpu"


def _wait(future: concurrent.futures.Future, stop: threading.Event):
    """`future`'s result; `Cancelled` once `stop` is set (its thread may never have started)."""
    while True:
        try:
            return future.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            _check(stop)


def _program(pipe, name: str, lower, out: concurrent.futures.Future | None = None):
    """Program `name` from the executable cache, or lowered by `lower()`, compiled and stored; registered on
    `pipe` (`pipe._programs`) and its output shapes handed to whoever waits on `out` → its output shapes."""
    try:
        key = pipe.program_key()
        compiled = executable_cache.load(name, key)
        if compiled is None:
            lowered = lower()
            if out is not None:
                out.set_result(_shapes(lowered.out_info))  # the next program lowers while this one compiles
            compiled = executable_cache.store(name, key, lowered)
    except BaseException as e:
        if out is not None and not out.done():
            out.set_exception(e)
        raise
    if out is not None and not out.done():
        out.set_result(_shapes(compiled.out_info))
    pipe._programs.put(name, compiled)
    return _shapes(compiled.out_info)


def _shapes(tree):
    """Shapes and dtypes only: a compiled program's `out_info` also pins shardings and layouts, which would
    make a program lowered from it differ from the one a call traces."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type), tree)


class _Abstracts:
    """Each component's abstract module, built once whichever thread asks first (only on a miss)."""

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


def _vae_config(pipe, abstract):
    return pipe.configs["vae"] if pipe.configs else abstract("vae").config


def _encode_first(pipe, abstract):
    """The VAE's encode of the image (its first frame alone), lowered."""
    config = _vae_config(pipe, abstract)
    return abstract("vae").lower_encode_chunk((1, config.video_channels, 1, *pipe.size), per_run=True)


def _condition(pipe, abstract, stop, first: concurrent.futures.Future) -> None:
    """`ImageCondition.encode`'s programs after the first-frame encode (whose output shapes `first` hands
    over), in the order it calls them."""
    from wan_tpu.matrix_game.condition import GRAY_RUN, gray_frame_shape, gray_latents, normalized_latents, start_latents

    def vae():
        return abstract("vae")

    config = _vae_config(pipe, abstract)
    h, w = pipe.size
    caches, mu = _wait(first, stop)
    latents = _program(pipe, "start-latents", lambda: start_latents.lower(mu, CONDITION_FRAMES))
    _check(stop)
    offset = jax.ShapeDtypeStruct((), jnp.int32)
    frame = gray_frame_shape(config, (1, config.video_channels, h, w))
    _program(pipe, "gray-latents",
             lambda: gray_latents.lower(*nnx.split(vae()), caches, latents, offset, GRAY_RUN, frame))
    _check(stop)
    _program(pipe, "normalized", lambda: normalized_latents.lower(*nnx.split(vae()), latents))


def _cache(pipe, abstract, visual):
    return cache_program.lower(*nnx.split(abstract("transformer")), *nnx.split(abstract("vae")), visual,
                               tuple(pipe.variant.latent_size), pipe.frames_per_chunk)


def _key_lowered():
    return key_program.lower(jax.ShapeDtypeStruct((), np.uint32))


def _chunk(pipe, abstract, stop, caches, key, program, latents=()):
    """`program` (`chunk_denoise_program`, or live play's head or tail) for the caches `cache_program` makes,
    lowered; `latents`: the tail's (x0, x), the head's output shapes."""
    dit, vae = nnx.split(abstract("transformer")), nnx.split(abstract("vae"))
    z = abstract("vae").config.z_dim
    # `ImageCondition.encode`'s normalized float32 latents; the repeat scalars are traced.
    condition = ImageCondition(jax.ShapeDtypeStruct((1, z, CONDITION_FRAMES, *pipe.variant.latent_size), jnp.float32),
                               0, 1)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    args, kwargs = chunk_args(pipe, dit, vae, *caches, condition, action_windows(pipe), index, key)
    _check(stop)
    if program is chunk_denoise_program:
        return program.lower(*denoise_args(args), **kwargs)
    return program.lower(*args, *latents, **kwargs)


def _chunk_decode(pipe, abstract):
    """`chunk_decode_program` for a chunk's float32 clean latents and the VAE caches `cache_program` makes
    (their shapes from the VAE alone: no wait for the DiT's programs), lowered."""
    vae = abstract("vae")
    x0 = jax.ShapeDtypeStruct((1, vae.config.z_dim, pipe.frames_per_chunk, *pipe.variant.latent_size), jnp.float32)
    caches = jax.eval_shape(lambda: vae.start_decode_caches(x0.shape))
    return chunk_decode_program.lower(*nnx.split(vae), caches, x0, jax.ShapeDtypeStruct((), jnp.int32))
