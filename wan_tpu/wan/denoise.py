"""The denoising loop: one compiled step function, driven from Python.

Each step is one call of a jitted function (DiT forward with classifier-free guidance + one
scheduler step). Everything that changes between steps is an argument (the step index, the
guidance scale, the latents, the scheduler state and its tables, the DiT weights), so the function
is traced and compiled once per run shape (latent size, step count) and per DiT (the two Wan 2.2
A14B experts compile once each). On accelerators latents and scheduler state are donated, so a
step updates them in place. `compile_steps` compiles that program ahead of time from shapes alone
(what `WanPipeline.prepare` runs in a background thread), with the arguments `denoise` will pass. Given
a program key (what determines the DiTs' graphdefs: their configs and dtype), both take the program from
the executable cache instead (`wan_tpu.runtime.executable_cache`): a later process loads it whole,
tracing nothing.

Driving the loop from Python (rather than `lax.fori_loop`) gives a per-step progress bar with s/it
and a NaN/Inf check without stalling the device: the finite flag of step i is read only after step
i+1 has been dispatched.

CFG: the conditional and unconditional passes are one DiT call on a batch of 2B (cond first), the
batch axis being what the mesh's `dp` axis splits; noise = uncond + g·(cond − uncond). With
g ≤ 1 there is no unconditional pass (diffusers' `do_classifier_free_guidance = g > 1`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from wan_tpu.errors import NonFiniteError
from wan_tpu.runtime import interrupt
from wan_tpu.runtime.profiling import scope
from wan_tpu.wan import step_cache
from wan_tpu.wan.transformer import forward


class NonFiniteLatentsError(NonFiniteError):
    """The latents became NaN or Inf during denoising."""


class Conditioning(NamedTuple):
    """Everything the DiT attends to or is conditioned on besides the noisy latents.

    `prompt_embeds` / `negative_prompt_embeds`: `(B, L, text_dim)`; the negative one only with CFG.
    `image_embeds`: CLIP tokens `(B, 257, 1280)` for Wan 2.1 I2V.
    `condition`: I2V channels concatenated to the latents, `(B, 4 + z, F, h, w)`.
    `first_frame`, `first_frame_mask`: TI2V (`expand_timesteps`) image latent `(B, z, 1, h, w)` and
    mask `(1, 1, F, h, w)` (0 = conditioned); with `expand_timesteps` the mask is always given.
    """

    prompt_embeds: jax.Array
    negative_prompt_embeds: jax.Array | None = None
    image_embeds: jax.Array | None = None
    condition: jax.Array | None = None
    first_frame: jax.Array | None = None
    first_frame_mask: jax.Array | None = None


def expert_switch_index(timesteps: np.ndarray, boundary_ratio: float | None, num_train_timesteps: int = 1000) -> int:
    """Number of leading steps run by the high-noise expert: those with t >= boundary_ratio × 1000."""
    if boundary_ratio is None:
        return len(timesteps)
    return int(np.sum(np.asarray(timesteps) >= boundary_ratio * num_train_timesteps))


def model_input(latents, cond: Conditioning):
    """The DiT input for the current latents (I2V channel concat / TI2V first-frame replacement)."""
    if cond.condition is not None:
        return jnp.concatenate([latents, cond.condition.astype(latents.dtype)], axis=1)
    if cond.first_frame is not None:
        mask = cond.first_frame_mask
        return (1 - mask) * cond.first_frame + mask * latents
    return latents


def _shard_batch(x, mesh):
    if mesh is None:
        return x
    # Without CFG the batch may be smaller than dp; then the batch is replicated over dp.
    spec = PartitionSpec("dp") if x.shape[0] % mesh.shape["dp"] == 0 else PartitionSpec()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _step(sched_cls, graphdef, patch_size, mesh, params, sched_fields, sched_state, latents, i, cond, guidance,
          cache=None):
    sched = sched_cls(**sched_fields)
    b = latents.shape[0]
    x = model_input(latents, cond).astype(cond.prompt_embeds.dtype)
    t = sched.timesteps[i]
    context, image = cond.prompt_embeds, cond.image_embeds
    cfg = cond.negative_prompt_embeds is not None
    if cfg:
        x = jnp.concatenate([x, x])
        context = jnp.concatenate([context, cond.negative_prompt_embeds])
        image = None if image is None else jnp.concatenate([image, image])
    x = _shard_batch(x, mesh)
    if cond.first_frame_mask is not None:
        # One timestep per patch token, 0 on the conditioned first frame.
        _, ph, pw = patch_size
        per_token = (cond.first_frame_mask[0, 0, :, ::ph, ::pw] * t).reshape(1, -1)
        timestep = jnp.broadcast_to(per_token, (x.shape[0], per_token.shape[1]))
    else:
        timestep = jnp.full((x.shape[0],), t, jnp.float32)
    with jax.named_scope("dit_forward"):
        if cache is None:
            noise = forward(graphdef, params, x, timestep, context, image)
        else:
            noise, cache = step_cache.cached_forward(graphdef, params, cache, i, x, timestep, context, image)
        noise = noise.astype(jnp.float32)
    if cfg:
        noise_cond, noise_uncond = noise[:b], noise[b:]
        noise = noise_uncond + guidance * (noise_cond - noise_uncond)
    with jax.named_scope("scheduler_step"):
        latents, sched_state = sched.step(sched_state, noise, latents, i)
    if mesh is not None:  # placed as `denoise` places them before the first step: one program for every step
        latents, sched_state = jax.lax.with_sharding_constraint((latents, sched_state), _replicated(mesh))
    return latents, sched_state, jnp.all(jnp.isfinite(latents)), cache


def _replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@functools.lru_cache(maxsize=8)
def _placer(mesh):
    """A program that lays its arguments out whole on every device of `mesh` (also a mesh over several
    processes, where `jax.device_put` of one process's array cannot)."""
    return jax.jit(lambda tree: tree, out_shardings=_replicated(mesh))


def _placed(mesh, tree, abstract: bool = False):
    """`tree`'s arrays whole on every device of `mesh`: the step's latents, scheduler state and conditioning
    then have the same placements at every step (the text encoder's output and the seeded noise come with
    their own), so the first step runs the program the later ones run and `compile_steps` compiles ahead.
    `abstract`: their shapes with that placement instead (what `compile_steps` lowers for)."""
    if mesh is None:
        return tree
    if abstract:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_replicated(mesh)), tree)
    return _placer(mesh)(tree)


_STATIC = (0, 1, 2, 3)
_step_jit = jax.jit(_step, static_argnums=_STATIC)
# CPU cannot reuse donated buffers (and warns about it), so only accelerators donate.
_step_jit_donated = jax.jit(_step, static_argnums=_STATIC, donate_argnums=(6, 7, 11))


def denoise(
    transformers,
    latents,
    cond: Conditioning,
    scheduler,
    guidance_scales,
    boundary_ratio: float | None = None,
    mesh=None,
    progress: bool = True,
    step_seconds: list | None = None,
    cache=None,
    cache_stats: list | None = None,
    on_step=None,
    program_key=None,
) -> jax.Array:
    """Run the whole schedule from the initial noise `latents` (B, z, F, h, w); returns the final latents.

    `transformers`: the DiT, or the (high-noise, low-noise) experts of Wan 2.2 A14B with their
    `guidance_scales` and `boundary_ratio`. `step_seconds`, if given, receives each step's wall time
    (the first includes compilation). `cache`: a resolved step cache (`wan_tpu.wan.step_cache.resolve`);
    `cache_stats`, if given, receives its `CacheStats`. `on_step(done, total)`, if given, is called after
    each step is finished (a server's progress and cancel point: an exception it raises stops the loop).
    `program_key`: what determines the DiTs' graphdefs (their configs and dtype, where the caller knows
    them to be the modules those describe), so that the step program is the one kept whole in the
    executable cache (`_run_step`); None: jit's.
    """
    from tqdm.auto import tqdm

    timesteps = np.asarray(scheduler.timesteps)
    n = len(timesteps)
    switch, experts, cond, fields, step_fn = _loop_setup(transformers, cond, scheduler, boundary_ratio)
    # A private copy: the step donates its latents buffer, and the caller may still hold this one.
    latents = jnp.array(latents, dtype=jnp.float32, copy=True)
    # Copies, so that no two donated state leaves share a buffer.
    state = jax.tree.map(lambda a: jnp.array(a, copy=True), scheduler.init_state(latents))
    latents, state, cond = _placed(mesh, (latents, state, cond))
    carry = _start_carry(cache, transformers, cond, n, switch, latents.shape)
    pending = None
    last = time.perf_counter()
    with tqdm(total=n, unit="step", desc="denoise", disable=not progress) as bar:

        def finish(index, finite):
            nonlocal last
            if not bool(finite):
                raise NonFiniteLatentsError(
                    f"latents became NaN/Inf at step {index} (t={timesteps[index]:.0f}); the weights or the dtype "
                    "overflow: check the checkpoint, or run in float32 (--dtype float32)"
                )
            now = time.perf_counter()
            if step_seconds is not None:
                step_seconds.append(now - last)
            last = now
            bar.update()
            if on_step is not None:
                on_step(index + 1, n)

        for i in range(n):
            e = 0 if i < switch else 1
            graphdef, params = experts[e]
            with scope(f"step_{i}"):
                latents, state, finite, carry = _run_step(step_fn, (
                    type(scheduler), graphdef, transformers[e].config.patch_size, mesh, params, fields, state,
                    latents, jnp.int32(i), cond, jnp.float32(guidance_scales[e]), carry,
                ), program_key)
            if pending is not None:
                finish(*pending)
            pending = (i, finite)
            interrupt.check("denoise")
        finish(*pending)
    if cache_stats is not None and carry is not None:
        cache_stats.append(step_cache.stats(cache, carry))
    if cond.first_frame is not None:
        latents = model_input(latents, cond)
    return latents


def compile_steps(transformers, latent_shape, cond: Conditioning, scheduler, boundary_ratio: float | None = None,
                  mesh=None, cache=None, program_key=None) -> None:
    """Compile, without running, the step program(s) `denoise` runs for these arguments, so that a later
    `denoise` with the same shapes starts at once (e.g. from a background thread while the prompt is
    encoded). `cond`'s arrays may be `jax.ShapeDtypeStruct`s, and the transformers abstract modules
    (`nnx.eval_shape`): no weight is needed. Each expert that runs a step is lowered with the arguments
    `denoise` passes it (the Wan 2.2 experts share one program). With `program_key` (as `denoise` will get
    it) the program is loaded from the executable cache where a process stored it before (nothing traced),
    else compiled and stored (`executable_cache.ahead`)."""
    from wan_tpu.runtime import executable_cache

    n = len(scheduler.timesteps)
    switch, experts, cond, fields, step_fn = _loop_setup(transformers, cond, scheduler, boundary_ratio)
    latents = jax.ShapeDtypeStruct(tuple(latent_shape), jnp.float32)
    state = jax.eval_shape(scheduler.init_state, latents)
    latents, state, cond = _placed(mesh, (latents, state, cond), abstract=True)
    carry = _start_carry(cache, transformers, cond, n, switch, latents.shape)
    for e in sorted({0 if i < switch else 1 for i in range(n)}):
        graphdef, params = experts[e]
        args = (type(scheduler), graphdef, transformers[e].config.patch_size, mesh, params, fields, state, latents,
                jax.ShapeDtypeStruct((), jnp.int32), cond, jax.ShapeDtypeStruct((), jnp.float32), carry)
        if program_key is None or mesh is not None:
            step_fn.lower(*args).compile()
        else:
            with executable_cache.ahead():
                _run_step(step_fn, args, program_key)


STEP_PROGRAM = "wan-step"  # the step's name in the executable cache


def _run_step(step_fn, args: tuple, program_key=None):
    """`step_fn(*args)` (the jitted `_step`), or with `program_key` (and no mesh) that program as the
    executable cache keeps it (`executable_cache.cached_call`): found by the key, the scheduler's class and
    the arguments' shapes without tracing, loaded whole by a later process. The key stands for the DiT's
    graphdef, whose text (hooks' addresses) cannot key a file."""
    sched_cls, _, patch_size, mesh = args[:len(_STATIC)]
    if program_key is None or mesh is not None:
        return step_fn(*args)
    from wan_tpu.runtime import executable_cache

    key = (program_key, f"{sched_cls.__module__}.{sched_cls.__qualname__}", patch_size)
    return executable_cache.cached_call(STEP_PROGRAM, key, step_fn, args, static_argnums=_STATIC,
                                        key_names_statics=True)


def _start_carry(cache, transformers, cond: Conditioning, steps: int, switch: int, latent_shape):
    """The step cache's carry at the first step (None without a step cache)."""
    if cache is None:
        return None
    cfg = transformers[0].config
    tokens = math.prod(d // p for d, p in zip(latent_shape[2:], cfg.patch_size))
    return step_cache.start(cache, steps, 1 + (cond.negative_prompt_embeds is not None), switch, latent_shape[0],
                            tokens, cfg.inner_dim, transformers[0].dtype, per_token_time=cond.first_frame_mask is not None)


def _loop_setup(transformers, cond: Conditioning, scheduler, boundary_ratio: float | None):
    """What every step call shares: the expert switch index, (graphdef, params) per expert, the
    conditioning in the DiT's dtype, the scheduler's tables and the step function; the one place
    `denoise` and `compile_steps` agree on it."""
    n = len(scheduler.timesteps)
    switch = expert_switch_index(np.asarray(scheduler.timesteps), boundary_ratio)
    if switch < n and len(transformers) < 2:
        raise ValueError(f"boundary_ratio={boundary_ratio} needs a low-noise transformer_2 for steps {switch}..{n - 1}")
    dtype = transformers[0].dtype

    def cast(x):
        if x is None:
            return None
        return jax.ShapeDtypeStruct(x.shape, dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype)

    cond = cond._replace(prompt_embeds=cast(cond.prompt_embeds), negative_prompt_embeds=cast(cond.negative_prompt_embeds),
                         image_embeds=cast(cond.image_embeds))
    fields = {f.name: jnp.asarray(getattr(scheduler, f.name)) for f in dataclasses.fields(scheduler)}
    step_fn = _step_jit if jax.default_backend() == "cpu" else _step_jit_donated
    return switch, [nnx.split(t) for t in transformers], cond, fields, step_fn
