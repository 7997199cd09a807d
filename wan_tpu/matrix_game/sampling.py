"""Matrix-Game-2 sampling: the distilled flow-matching schedule and one whole chunk as a pure function.

The authors (`utils/scheduler.py`, `utils/wan_wrapper.py`, `pipeline/causal_inference.py`, SkyworkAI/
Matrix-Game commit 3ceb311) use `FlowMatchScheduler(shift=5, sigma_min=0, extra_one_step=True)` with
1000 training steps: σ = linspace(1, 0, 1001)[:-1] (float32), σ' = 5σ/(1+4σ), t = 1000σ'. A step
list such as [1000, 666, 333] is warped to the float timesteps t[1000 − step] ([1000, 908.84,
713.98]). Each step: the model predicts the flow v at (x_t, t); x0 = x_t − σ_t·v; before the next
step, fresh noise: x = (1 − σ_next)·x0 + σ_next·ε. The chunk's output is the last step's x0; then the
model runs once more on x0 at t = context_noise (0), only to overwrite the chunk's cache entries
with keys and values of the clean frames.

`denoise_chunk` is that whole chunk — all steps, the re-noising, the cache-update pass — as one pure
function of everything that changes per chunk, so it compiles once per (batch, size) and serves
every chunk of every stream:

    schedule = chunk_schedule(variant.denoising_step_list)                 # static, hashable
    step = jax.jit(functools.partial(denoise_chunk, graphdef, schedule=schedule), donate_argnames="cache")
    x0, cache = step(state, cache, noise, cond_concat, keyboard, mouse, chunk_index, key)

    graphdef, state  nnx.split(model) of a `MatrixGameTransformer`
    cache            `MatrixGameCache` (`init_cache`); donated, returned updated
    noise            (B, C, F, H, W) the chunk's initial noise (x at the first step)
    cond_concat      (B, in_dim − C, F, H, W) mask + image latents of the chunk's frames
    keyboard, mouse  (B, 4F + 8, dim) raw action windows (`chunk_action_window`); None where absent
    chunk_index      int32 scalar (traced): the chunk's first latent frame is chunk_index·F
    step_noise       a PRNG key (ε after step i = normal(fold_in(key, i))), or (B,) keys, one per
                     sample (then a sample's result does not depend on its batch), or the injected ε
                     of the steps before the last, (steps − 1, B, C, F, H, W)
    → x0             (B, C, F, H, W) float32, and the cache

The attention window holds min(window, (k+1)·F) frames at chunk k: ceil(window / F) static sizes
(two for every distilled variant), chosen by the traced chunk index at each attention call
(`wan_tpu.matrix_game.cache.Window`), so the DiT is traced once, no mask is needed, no size depends
on a traced value, and each size computes bitwise what a program for it alone computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.matrix_game.cache import Window
from wan_tpu.matrix_game.model import MAX_FRAMES

NUM_TRAIN_TIMESTEPS = 1000


def _torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in float32 on the CPU, bit for bit: step = (end − start)/(steps − 1) in float32,
    the first half start + step·i, the second end − step·(steps − 1 − i), each one fused multiply-add
    (a single rounding: torch's CPU kernels are built with FMA contraction). float64 holds the
    products of a float32 step and an index < 2^29 exactly, so one cast rounds as the FMA does."""
    step = np.float64(np.float32(np.float32(end) - np.float32(start)) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    return np.where(i < steps // 2, start + step * i, end - step * (steps - 1 - i)).astype(np.float32)


def flow_match_table(shift: float = 5.0, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
    """(sigmas, timesteps), float32 (num_train_timesteps,): the authors' `FlowMatchScheduler(shift,
    sigma_min=0, extra_one_step=True).set_timesteps(num_train_timesteps)`, in their float32 arithmetic."""
    s = _torch_linspace_f32(1.0, 0.0, num_train_timesteps + 1)[:-1]
    shift32 = np.float32(shift)
    sigmas = (shift32 * s) / (np.float32(1) + np.float32(shift - 1) * s)
    return sigmas, sigmas * np.float32(num_train_timesteps)


def warp_denoising_step(step_list, shift: float = 5.0) -> np.ndarray:
    """Integer steps → the float32 timesteps the model sees: cat(timesteps, [0])[1000 − step]."""
    _, timesteps = flow_match_table(shift)
    steps = np.asarray(step_list)
    if steps.ndim != 1 or steps.size == 0 or np.any(steps < 0) or np.any(steps > NUM_TRAIN_TIMESTEPS):
        raise WanInputError(f"denoising steps {list(step_list)} must be a non-empty list of integers in 0…1000")
    return np.concatenate([timesteps, np.zeros(1, np.float32)])[NUM_TRAIN_TIMESTEPS - steps]


def sigma_for(timesteps, shift: float = 5.0) -> np.ndarray:
    """σ at each timestep: the table entry whose timestep is nearest (their argmin, in float64)."""
    sigmas, table = flow_match_table(shift)
    t = np.asarray(timesteps, np.float64)
    idx = np.argmin(np.abs(table.astype(np.float64)[None] - t[:, None]), axis=1)
    return sigmas[idx]


@dataclass(frozen=True)
class ChunkSchedule:
    """Static per-step values of one chunk's sampling (hashable: a jit static argument)."""

    timesteps: tuple[float, ...]  # what the model sees at each denoising step
    sigmas: tuple[float, ...]  # σ of each step (x0 = x − σ·v; the next step re-noises to its own σ)
    context_timestep: float = 0.0  # the cache-update pass on the clean x0

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


def chunk_schedule(denoising_step_list, shift: float = 5.0, warp: bool = True, context_noise: int = 0) -> ChunkSchedule:
    """The schedule of a variant (`warp_denoising_step`, `timestep_shift`, `context_noise` of its YAML)."""
    if denoising_step_list is None:
        raise WanInputError("this Matrix-Game variant ships no denoising step list; pass one, e.g. [1000, 666, 333]")
    t = warp_denoising_step(denoising_step_list, shift) if warp else np.asarray(denoising_step_list, np.float32)
    return ChunkSchedule(tuple(float(v) for v in t), tuple(float(v) for v in sigma_for(t, shift)), float(context_noise))


def max_chunks(frames_per_chunk: int) -> int:
    """Chunks a stream may run: the main RoPE table covers `MAX_FRAMES` latent frames (as the authors')."""
    return MAX_FRAMES // frames_per_chunk


def check_chunk_index(chunk_index: int, frames_per_chunk: int):
    if not 0 <= chunk_index < max_chunks(frames_per_chunk):
        raise WanInputError(f"chunk {chunk_index} is past the model's {MAX_FRAMES} latent frames "
                            f"({max_chunks(frames_per_chunk)} chunks of {frames_per_chunk}); start a new stream")


def denoise_chunk(graphdef, state, cache, noise, cond_concat, keyboard, mouse, chunk_index, step_noise, *,
                  schedule: ChunkSchedule, first_chunk: bool | None = None, part: str = "all"):
    """One chunk: every denoising step, the re-noising between them and the cache-update pass.
    Pure; see the module docstring for the arguments. Returns (x0 float32, cache).

    `part` splits the chunk where its clean latents are known: "denoise" runs the denoising steps alone and
    returns (x0, x, cache), x being what the cache pass takes; "context" runs the cache pass alone, on that x
    (passed as `noise`), and returns (x0 of the pass, unused, cache). The two parts compute, step for step,
    what "all" does in one loop.

    The attention window holds (k+1)·C frames at chunk k until it is full: each such size is a branch
    of every attention call, chosen by `chunk_index` (`Window`; static where `chunk_index` is a Python
    int). `first_chunk` True keeps only the first chunk's size (chunk_index must be 0), False only the
    later chunks', None all: a program for one chunk, the later chunks, or every chunk."""
    model = nnx.merge(graphdef, state)
    b, _, f = noise.shape[:3]
    n = schedule.num_steps
    window = model.config.window_frames
    if n < 1:
        raise WanInputError("a chunk needs at least one denoising step")

    # One forward per step plus the cache pass: iteration i sees timestep t_i and σ_i, and hands
    # (1 − σ'_i)·x0 + σ'_i·ε to the next; σ'_{n−1} = 0 hands the clean x0 to the cache pass exactly.
    t = np.array(schedule.timesteps + (schedule.context_timestep,), np.float32).astype(np.float64)
    temb, tproj = model.embed_time(np.broadcast_to(t[:, None, None], (n + 1, b, f)))
    sigma = jnp.asarray(schedule.sigmas + (0.0,), jnp.float32)
    sigma_next = jnp.asarray(schedule.sigmas[1:] + (0.0, 0.0), jnp.float32)
    injected = not _is_key(step_noise)
    if injected:
        if tuple(step_noise.shape) != (n - 1, *noise.shape):
            raise WanInputError(f"step_noise has shape {tuple(step_noise.shape)}; expected {(n - 1, *noise.shape)}")
        eps = jnp.concatenate([step_noise.astype(jnp.float32), jnp.zeros((2, *noise.shape), jnp.float32)])
    else:
        eps = jnp.arange(n + 1)
    frame_offset = chunk_index * f

    if part not in ("all", "denoise", "context"):
        raise ValueError(f"part must be 'all', 'denoise' or 'context', got {part!r}")
    xs = (temb, tproj, sigma, sigma_next, eps)
    steps = {"all": slice(None), "denoise": slice(0, n), "context": slice(n, n + 1)}[part]
    xs = jax.tree.map(lambda a: a[steps], xs)

    def run(valid_frames, cache):
        def body(carry, xs):
            x, cache = carry
            temb_i, tproj_i, sigma_i, sigma_next_i, eps_i = xs
            flow, cache = nnx.merge(graphdef, state).apply_embedded(
                x, cond_concat, temb_i, tproj_i, keyboard, mouse, cache, frame_offset, valid_frames)
            x0 = x - sigma_i * flow.astype(jnp.float32)
            if not injected:
                eps_i = _draw(step_noise, eps_i, x.shape)
            return (((1 - sigma_next_i) * x0 + sigma_next_i * eps_i), cache), x0

        (x, cache), x0 = jax.lax.scan(body, (noise.astype(jnp.float32), cache), xs)
        if part == "denoise":
            return x0[n - 1], x, cache
        return x0[n - 1 if part == "all" else 0], cache

    valid = Window.of(window, f, chunk_index)
    if first_chunk is not None and isinstance(valid, Window):
        if first_chunk:
            valid = valid.sizes[0]
        elif len(valid.sizes) == 2:
            valid = valid.sizes[1]
        else:
            valid = Window(valid.sizes[1:], jnp.clip(chunk_index, 1, len(valid.sizes) - 1) - 1)
    return run(valid, cache)


def _draw(key, i, shape):
    """ε after step i: from one key for the batch, or per sample from a (B,) array of keys (then a
    sample's noise does not depend on the batch it runs in)."""
    if key.ndim == 0:
        return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, i), shape[1:], jnp.float32))(key)


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype == jnp.uint32:
        raise WanInputError("step_noise is a raw uint32 key; pass a typed key, jax.random.key(seed) (or keys split from it)")
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
