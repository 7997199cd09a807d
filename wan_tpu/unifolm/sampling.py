"""UniFoLM sampling: the video DDIM (v-prediction, zero-terminal-SNR betas, dynamic x0 rescale) and the
heads' own DDIM (diffusers `DDIMScheduler`, squaredcos_cap_v2, ε-prediction, clipped x0), stepped
together in **one compiled loop** (`lax.scan` over the steps), or with `programs=K` each step as K programs
(the UNet's blocks cut in K), run by a loop over the steps.

    latents, actions, states = sample(model, cond, num_steps=50, eta=1.0, key=jax.random.key(123))

Reference: `models/samplers/ddim.py` (+ `utils/diffusion.py`, `ddpms.py` register_schedule) of the
authors' code. Their details, kept: `uniform_trailing` spacing (50 steps → 999, 979, …, 19); the last
step's "previous" ᾱ is ᾱ₀ (not 1); x0 is multiplied by scale[t_next]/scale[t] (dynamic rescale);
the heads' scheduler is stepped at the *video* timestep t with previous step t − 1000//n; guidance
(when `guidance_scale != 1` and `uncond` is given) mixes video, action and state outputs alike and
`guidance_rescale` rescales each (their `rescale_noise_cfg`, unbiased std).

Randomness: `key` draws the initial latents/actions/states and the per-step DDIM noise (eta > 0);
`noise` injects them instead (parity with the authors' torch RNG): a dict with `x_T` (B, 4, T, h, w),
`action_T`, `state_T` (B, T, 16) and, for eta > 0, `steps` (num_steps, B, 4, T, h, w).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.unifolm import UnifolmConfig
from wan_tpu.errors import WanInputError
from wan_tpu.runtime import executable_cache, xla_defaults
from wan_tpu.unifolm.model import Conditions

# XLA options of the step's pieces (`programs=K`): no Triton softmax rewriter. Its Triton fusions of the UNet's
# GroupNorms and LayerNorms were most of a piece's compile: the first piece's HLO passes took 8.1-9.6 s with them
# (priority fusion tiling them 4.7-5.4 s, the rewriter 2.7-3.5 s), 1.3-1.4 s without (each with its shipped
# tuning). UnifoLM-WMA-0 decision, 16 steps, H200, in turns (2026-11-30, `benchmarks/profile_compile.py unifolm
# --device --runs 1`): first sampling cold 22.79 / 23.37 s vs 29.33 / 30.30 s; the 16 steps, over two calls,
# 2.25-2.51 s (mean 2.35) vs 2.10-2.40 (2.31). The one-program loop keeps the rewriter: it ran 18% slower without it.
PIECES = xla_defaults.NO_SOFTMAX_REWRITER


def video_alphas_cumprod(cfg: UnifolmConfig) -> np.ndarray:
    """ᾱ of the video model in float64 (their buffers are its float32 cast; √ᾱ and √(1−ᾱ) are taken
    in float64 first): linear betas in √ space, rescaled to zero terminal SNR (ᾱ₉₉₉ = 0 exactly)."""
    betas = np.linspace(cfg.linear_start**0.5, cfg.linear_end**0.5, cfg.num_train_timesteps, dtype=np.float64) ** 2
    if cfg.rescale_betas_zero_snr:
        sqrt_ac = np.sqrt(np.cumprod(1.0 - betas))
        first, last = sqrt_ac[0].copy(), sqrt_ac[-1].copy()
        sqrt_ac = (sqrt_ac - last) * first / (first - last)
        ac = sqrt_ac**2
        betas = 1.0 - np.concatenate([ac[:1], ac[1:] / ac[:-1]])
    return np.cumprod(1.0 - betas)


def head_alphas_cumprod(cfg: UnifolmConfig) -> np.ndarray:
    """ᾱ of diffusers' DDIMScheduler with `squaredcos_cap_v2` (betas_for_alpha_bar, max β 0.999), float32."""
    if cfg.head_beta_schedule != "squaredcos_cap_v2":
        raise WanInputError(f"head_beta_schedule {cfg.head_beta_schedule!r} is not supported; use 'squaredcos_cap_v2'")
    n = cfg.num_train_timesteps
    f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = np.array([min(1 - f((i + 1) / n) / f(i / n), 0.999) for i in range(n)], np.float32)
    # float32 betas, product accumulated in float64 then rounded: what torch.cumprod gives on them.
    return np.cumprod((1.0 - betas).astype(np.float64)).astype(np.float32)


def ddim_timesteps(num_steps: int, num_train: int = 1000, spacing: str = "uniform_trailing") -> np.ndarray:
    """Their `make_ddim_timesteps`, ascending (sampling walks it backwards)."""
    if spacing == "uniform_trailing":
        c = num_train / num_steps
        return np.flip(np.round(np.arange(num_train, 0, -c))).astype(np.int64) - 1
    if spacing == "uniform":
        return np.arange(0, num_train, num_train // num_steps) + 1
    raise WanInputError(f"timestep_spacing {spacing!r} is not supported; use 'uniform_trailing' or 'uniform'")


def schedule_tables(cfg: UnifolmConfig, num_steps: int, eta: float, spacing: str = "uniform_trailing") -> dict:
    """Per-step constants in sampling order (float32 numpy), as their DDIMSampler.make_schedule."""
    if num_steps < 1:
        raise WanInputError(f"num_steps must be ≥ 1, got {num_steps}")
    ac64 = video_alphas_cumprod(cfg)
    ac = ac64.astype(np.float32)
    ts = ddim_timesteps(num_steps, cfg.num_train_timesteps, spacing)
    if ts[-1] >= cfg.num_train_timesteps or ts[0] < 0:
        raise WanInputError(f"{num_steps} steps with {spacing!r} spacing give timesteps outside [0, 1000)")
    a = ac[ts].astype(np.float64)
    a_prev = np.concatenate([[ac[0]], ac[ts[:-1]]]).astype(np.float64)
    sigma = eta * np.sqrt((1 - a_prev) / np.maximum(1 - a, 1e-30) * (1 - a / a_prev))
    if cfg.use_dynamic_rescale:
        scale = np.concatenate([np.linspace(1.0, cfg.base_scale, cfg.turning_step),
                                np.full(cfg.num_train_timesteps, cfg.base_scale)]).astype(np.float32)[ts]
        rescale = np.concatenate([scale[:1], scale[:-1]]) / scale
    else:
        rescale = np.ones(len(ts))
    hac = head_alphas_cumprod(cfg)
    h_prev_t = ts - cfg.num_train_timesteps // num_steps
    final = 1.0 if cfg.head_set_alpha_to_one else hac[0]
    h_prev = np.where(h_prev_t >= 0, hac[np.maximum(h_prev_t, 0)], final)
    order = slice(None, None, -1)
    f32 = lambda v: np.asarray(v, np.float32)[order]
    return dict(t=ts[order].astype(np.int32), sqrt_a=f32(np.sqrt(ac64[ts])), sqrt_1ma=f32(np.sqrt(1.0 - ac64[ts])),
                a_prev=f32(a_prev), sigma=f32(sigma), rescale=f32(rescale), h_a=f32(hac[ts]), h_a_prev=f32(h_prev))


def rescale_noise_cfg(cfg_out, cond_out, guidance_rescale: float):
    """Rescale guided output to the conditional output's std (unbiased, per sample): their helper."""
    axes = tuple(range(1, cfg_out.ndim))
    std_c = jnp.std(cond_out, axis=axes, keepdims=True, ddof=1)
    std_g = jnp.std(cfg_out, axis=axes, keepdims=True, ddof=1)
    return guidance_rescale * cfg_out * (std_c / std_g) + (1 - guidance_rescale) * cfg_out


def _head_step(eps, sample, a, a_prev, clip: bool):
    """diffusers DDIMScheduler.step, eta 0, ε-prediction, optional clip to [-1, 1]."""
    x0 = (sample - jnp.sqrt(1 - a) * eps) / jnp.sqrt(a)
    if clip:
        x0 = jnp.clip(x0, -1.0, 1.0)
    return jnp.sqrt(a_prev) * x0 + jnp.sqrt(1 - a_prev) * eps


def _concat_cond(c: Conditions, u: Conditions) -> Conditions:
    cat = lambda a, b: jnp.concatenate([a, b], axis=0)
    return jax.tree.map(cat, c, u)


def ddim_step(unet, cond: Conditions, x, action, state, inp: dict, guidance_scale=1.0, guidance_rescale=0.0,
              clip: bool = True, uncond: Conditions | None = None):
    """One step of both samplers: the UNet (+ heads) once — on [cond ‖ uncond] when guided — then the
    video DDIM update and the heads' DDIM updates. `inp`: one step of `schedule_tables` plus `noise`
    (the video's DDIM noise, used when sigma > 0). Returns (x, action, state) at the previous step."""
    outs = unet(*step_inputs(cond, x, action, state, inp, uncond))
    return step_update(outs, x, action, state, inp, guidance_scale, guidance_rescale, clip, uncond is not None)


def step_inputs(cond: Conditions, x, action, state, inp: dict, uncond: Conditions | None = None) -> tuple:
    """The UNet's arguments for one step of `ddim_step` (the batch doubled to [cond ‖ uncond] when guided):
    (x ‖ condition latent, timesteps, context, fs, actions, states, observations)."""
    b = x.shape[0]
    full = _concat_cond(cond, uncond) if uncond is not None else cond
    dup = (lambda a: jnp.concatenate([a, a], axis=0)) if uncond is not None else (lambda a: a)
    t = jnp.full((b,), inp["t"], jnp.int32)
    xin = jnp.concatenate([dup(x), full.concat.astype(x.dtype)], axis=1)
    return xin, dup(t), full.context, full.fs, dup(action), dup(state), full.obs


def step_update(outs, x, action, state, inp: dict, guidance_scale=1.0, guidance_rescale=0.0, clip: bool = True,
                guided: bool = False):
    """`ddim_step` after the UNet: guidance on its outputs `outs` (v, action ε, state ε), then the updates."""
    v, ea, es = outs
    if guided:
        v, ea, es = (_guide(o, x.shape[0], guidance_scale, guidance_rescale) for o in (v, ea, es))
    x = _video_step(v, x, inp)
    action = _head_step(ea, action, inp["h_a"], inp["h_a_prev"], clip)
    state = _head_step(es, state, inp["h_a"], inp["h_a_prev"], clip)
    return x, action, state


def _guide(o, b: int, guidance_scale, guidance_rescale):
    """Guidance on one output of the doubled batch [cond ‖ uncond] (`b` each) → (b, ...)."""
    oc, ou = o[:b], o[b:]
    g = ou + guidance_scale * (oc - ou)
    return jnp.where(guidance_rescale > 0, rescale_noise_cfg(g, oc, guidance_rescale), g)


def _video_step(v, x, inp: dict):
    """The video DDIM update from the model's v."""
    # v-parameterisation: ε = √ᾱ·v + √(1−ᾱ)·x, x0 = √ᾱ·x − √(1−ᾱ)·v; x0 dynamically rescaled.
    e_t = inp["sqrt_a"] * v + inp["sqrt_1ma"] * x
    x0 = (inp["sqrt_a"] * x - inp["sqrt_1ma"] * v) * inp["rescale"]
    # At t = 999 (ᾱ = 0) with eta 1 the direction's weight is 0 in exact arithmetic: clamp rounding.
    dir_xt = jnp.sqrt(jnp.maximum(1.0 - inp["a_prev"] - inp["sigma"] ** 2, 0.0)) * e_t
    return jnp.sqrt(inp["a_prev"]) * x0 + dir_xt + inp["sigma"] * inp["noise"]


def _initial_noise(shapes: tuple, key, noise: dict, num_steps: int, stochastic: bool):
    """(x_T, action_T, state_T, per-step noise): `noise`'s where injected, else drawn from `key` (split in 4,
    one per draw, in this order); without `stochastic` (eta 0) the per-step noise is a broadcast zero."""
    shape, act_shape, st_shape = shapes
    keys = jax.random.split(key, 4) if key is not None else [None] * 4
    draw = lambda name, k, s: noise[name] if name in noise else jax.random.normal(k, s)  # noqa: E731
    x = draw("x_T", keys[0], shape)
    action = draw("action_T", keys[1], act_shape)
    st = draw("state_T", keys[2], st_shape)
    if not stochastic:
        return x, action, st, jnp.zeros((num_steps, 1, 1, 1, 1, 1), jnp.float32)
    return x, action, st, draw("steps", keys[3], (num_steps,) + shape)


@functools.partial(jax.jit, static_argnames=("graphdef", "clip", "shapes", "stochastic"))
def _sample_loop(graphdef, state, cond, uncond, tables, key, noise, guidance_scale, guidance_rescale, clip, shapes,
                 stochastic):
    unet = nnx.merge(graphdef, state)
    # The starting and per-step noise is drawn here, in the program: drawn op by op before it, each draw of
    # another shape compiled a program of its own (0.5–5 s each on a busy 2-core CPU).
    x, action, st, step_noise = _initial_noise(shapes, key, noise, tables["t"].shape[0], stochastic)

    def step(carry, inp):
        return ddim_step(unet, cond, *carry, inp, guidance_scale, guidance_rescale, clip, uncond), None

    (x, action, st), _ = jax.lax.scan(step, (x, action, st), dict(tables, noise=step_noise))
    return x, action, st


def cut_units(unet, programs: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """`unet.units()` in `programs` consecutive runs whose largest layer count is the least it can be (the
    output convolution counted as one layer, in the last run; the heads compile as a program of their own,
    `_head_program`): the pieces of a step run as several programs, which compile side by side, so the largest
    one's compile is what a cold start waits for."""
    units = unet.units()
    if programs < 1 or programs > len(units):
        raise WanInputError(f"sampling programs must be 1 to {len(units)} (the UNet's blocks), got {programs}")
    weights = unit_layers(unet)
    edges = [0]
    for weight in weights:
        edges.append(edges[-1] + weight)
    end = END_LAYERS
    # most[k][i]: the least largest run weight of units[:i] in k runs; cut[k][i]: where its last run begins.
    n, inf = len(units), float("inf")
    most = [[inf] * (n + 1) for _ in range(programs)]
    cut = [[0] * (n + 1) for _ in range(programs)]
    most[0] = [float(edges[i]) for i in range(n + 1)]
    for k in range(1, programs):
        for i in range(k + 1, n + 1):
            for j in range(k, i):
                largest = max(most[k - 1][j], edges[i] - edges[j] + (end if i == n else 0))
                if largest < most[k][i]:
                    most[k][i], cut[k][i] = largest, j
    runs, i = [], n
    for k in range(programs - 1, 0, -1):
        runs.append(tuple(units[cut[k][i]:i]))
        i = cut[k][i]
    return (tuple(units[:i]),) + tuple(reversed(runs))


def unit_layers(unet) -> list[int]:
    """`cut_units`' weight of each of `unet.units()`: its layers (ResBlocks, spatial and temporal transformers;
    the first unit's input convolution one more), a resampling convolution none (one operation beside a
    layer's hundreds)."""
    from wan_tpu.unifolm.blocks import Downsample, Upsample

    blocks = {"in": unet.input_blocks, "out": unet.output_blocks}
    return [sum(not isinstance(layer, (Downsample, Upsample)) for layer in
                (unet.middle_block if kind == "mid" else blocks[kind][i])) + (kind == "in" and i == 0)
            for kind, i in unet.units()]


# `cut_units`' weight of the output convolution, which ends the last run. The heads are not in it: UnifoLM-WMA-0's two
# compile as about 8 layers (their 36 residual blocks 6.7 s, a layer 0.8 s: H200, the pieces in compile workers,
# `profile_compile.py unifolm --device`), and as `_head_program` one of them compiles once, beside the pieces.
END_LAYERS = 1


def _run_units(unet, units, carry):
    for unit in units:
        carry = unet.run_unit(unit, carry)
    return carry


def _merge(graphdef, treedef, leaves):
    """The UNet from its weights as a flat tuple (`_sample_programs`)."""
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "units"))
def _first_program(graphdef, treedef, leaves, cond, uncond, x, action, st, inp, *, units):
    """A step's first program: the UNet's inputs, its embeddings and the first run of blocks → the carry."""
    unet = _merge(graphdef, treedef, leaves)
    return _run_units(unet, units, unet.begin(*step_inputs(cond, x, action, st, inp, uncond)[:4]))


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "units"))
def _middle_program(graphdef, treedef, leaves, carry, *, units):
    return _run_units(_merge(graphdef, treedef, leaves), units, carry)


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "units", "clip"))
def _last_program(graphdef, treedef, leaves, carry, cond, uncond, x, action, st, inp, guidance_scale,
                  guidance_rescale, *, units, clip):
    """A step's last program for a model without heads: the last run of blocks, guidance and both DDIM updates
    (the heads' ε zero, as `WMAModel.end` gives)."""
    unet = _merge(graphdef, treedef, leaves)
    heads = step_inputs(cond, x, action, st, inp, uncond)[4:]
    outs = unet.end(_run_units(unet, units, carry), *heads)
    return step_update(outs, x, action, st, inp, guidance_scale, guidance_rescale, clip, uncond is not None)


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "units", "guided"))
def _last_video_program(graphdef, treedef, leaves, carry, x, inp, guidance_scale, guidance_rescale, *, units, guided):
    """A step's last program for a model with heads: the last run of blocks, the output convolution, guidance
    and the video's DDIM update → (x, the feature maps this program added for the heads)."""
    unet = _merge(graphdef, treedef, leaves)
    given = len(carry["maps"])
    carry = _run_units(unet, units, carry)
    v = unet.end_video(carry)
    if guided:
        v = _guide(v, x.shape[0], guidance_scale, guidance_rescale)
    return _video_step(v, x, inp), (*carry["maps"][given:], carry["h"])


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "clip"))
def _head_program(graphdef, treedef, leaves, sample_, maps, obs, uncond_obs, inp, guidance_scale, guidance_rescale,
                  *, clip):
    """One head (`ConditionalUnet1D`) of a step on the UNet's feature maps `maps`, its guidance and its DDIM
    update → its sample at the previous step. The action and the state head are built alike, so this one
    program serves both (their weights `leaves` are arguments): compiled once, not twice within the last piece."""
    head = _merge(graphdef, treedef, leaves)
    b = sample_.shape[0]
    guided = uncond_obs is not None
    dup = (lambda a: jnp.concatenate([a, a], axis=0)) if guided else (lambda a: a)
    t = jnp.full((b,), inp["t"], jnp.int32)
    eps = head(dup(sample_), dup(t), list(maps), jnp.concatenate([obs, uncond_obs], axis=0) if guided else obs)
    eps = eps.astype(jnp.float32)
    if guided:
        eps = _guide(eps, b, guidance_scale, guidance_rescale)
    return _head_step(eps, sample_, inp["h_a"], inp["h_a_prev"], clip)


@functools.partial(jax.jit, static_argnames=("shapes", "num_steps", "stochastic"))
def _noise_program(key, noise, shapes, num_steps, stochastic):
    """`_initial_noise` with the per-step noise as one array per step (the step programs take one step's)."""
    x, action, st, steps = _initial_noise(shapes, key, noise, num_steps, stochastic)
    return x, action, st, tuple(steps[i] for i in range(num_steps))


def _step_constants(tables: dict, step_noise: tuple, i: int) -> dict:
    """Step `i`'s schedule constants (device scalars) and DDIM noise: what the step programs take as `inp`. Put on
    the device in one call: `jnp.asarray` of each scalar ran an op per constant that waited for the device's queue
    (UnifoLM-tiny, 2-core CPU: 14 ms each, half of the steps' host time)."""
    inp = jax.device_put({name: np.float32(v[i]) if name != "t" else np.int32(v[i]) for name, v in tables.items()})
    inp["noise"] = step_noise[i]
    return inp


def _sample_programs(graphdef, state, cond, uncond, tables, key, noise, guidance_scale, guidance_rescale, clip,
                     shapes, stochastic, runs, program_key, heads=()):
    """`_sample_loop`'s sampling with each step as `len(runs)` programs (`runs` from `cut_units`), then, for a model
    with heads, `_head_program` once per head (`heads`: the action and the state head's graphdef, treedef and
    weights), run by a Python loop over the steps. The programs take one step's constants, not the schedule, so
    any step count runs them; compiled ahead (`executable_cache.ahead`) they compile side by side, a thread each,
    with XLA's options `PIECES`. The same noise as `_sample_loop`; results within float32 rounding of it (other
    fusions)."""
    num_steps = len(tables["t"])
    key_of = lambda *extra: None if program_key is None else (*program_key, *extra)  # noqa: E731
    x, action, st, step_noise = executable_cache.cached_call(
        "unifolm-sample-noise", key_of(shapes, num_steps, stochastic), _noise_program,
        (key, noise, shapes, num_steps, stochastic), static_argnums=(2, 3, 4))
    programs: dict = {}  # (name, units) → the program, found once (`cached_program`), then called every step
    # The weights go to the programs as one flat tuple, flattened once: a call given the UNet's state flattens
    # its 2,198 leaves through nnx's nodes every time (2.4–2.5 ms a call vs 0.41 ms, 2-core CPU host).
    leaves, treedef = jax.tree.flatten(state)
    leaves = tuple(leaves)

    def run(name, units, jitted, args, kwargs, static_argnames):
        if (name, units) not in programs:
            programs[name, units] = executable_cache.cached_program(
                name, key_of(*kwargs.values()), jitted, args, kwargs, static_argnums=(0, 1),
                static_argnames=static_argnames, compiler_options=PIECES, key_names_statics=True)
        return programs[name, units](*args, **kwargs)

    # Ahead of time (`prepare`) the first step meets every program; the other steps would only trace the same
    # calls again, seconds of Python under the GIL that the weights' loads need (UnifoLM-WMA-0, 16 steps, 4
    # programs: 3.1 s, and the model's load 1.7 s longer, on an H200 host).
    for i in range(1 if executable_cache.ahead_active() else num_steps):
        inp = _step_constants(tables, step_noise, i)
        carry = run("unifolm-sample-first", runs[0], _first_program,
                    (graphdef, treedef, leaves, cond, uncond, x, action, st, inp), dict(units=runs[0]), ("units",))
        for units in runs[1:-1]:
            carry = run("unifolm-sample-middle", units, _middle_program, (graphdef, treedef, leaves, carry),
                        dict(units=units), ("units",))
        if not heads:
            x, action, st = run("unifolm-sample-last", runs[-1], _last_program,
                                (graphdef, treedef, leaves, carry, cond, uncond, x, action, st, inp, guidance_scale,
                                 guidance_rescale), dict(units=runs[-1], clip=clip), ("units", "clip"))
            continue
        x, added = run("unifolm-sample-last", runs[-1], _last_video_program,
                       (graphdef, treedef, leaves, carry, x, inp, guidance_scale, guidance_rescale),
                       dict(units=runs[-1], guided=uncond is not None), ("units", "guided"))
        maps = (*carry["maps"], *added)
        samples = []
        for i, (sample_, (head_graphdef, head_treedef, head_leaves)) in enumerate(zip((action, st), heads)):
            samples.append(run("unifolm-sample-head", (), _head_program,
                               (head_graphdef, head_treedef, head_leaves, sample_, maps, cond.obs[i],
                                None if uncond is None else uncond.obs[i], inp, guidance_scale, guidance_rescale),
                               dict(clip=clip), ("clip",)))
        action, st = samples
    return x, action, st


def sample(model, cond: Conditions, *, num_steps: int = 50, eta: float = 1.0, key=None, noise: dict | None = None,
           guidance_scale: float = 1.0, guidance_rescale: float = 0.0, uncond: Conditions | None = None,
           timestep_spacing: str = "uniform_trailing", program_key: tuple | None = None, programs: int = 1):
    """DDIM sampling of video latents (B, 4, T, h, w), actions and states (B, T, 16), all float32.

    `model`: a `UnifolmWMA`; `cond` (and `uncond` for guidance) from `model.prepare`. Guidance runs only
    when `guidance_scale != 1` and `uncond` is given (the authors' scripts pass neither). `program_key`
    (`UnifolmPipeline.program_key`): what determines the model's program; with it the compiled loop is
    kept whole on disk and a later process loads it without tracing (`wan_tpu.runtime.executable_cache`).
    `programs` > 1: each step runs as that many programs (`_sample_programs`), which compile side by side and
    serve every step count, instead of one program holding the whole loop.
    """
    cfg = model.config
    b, c, t, h, w = cond.concat.shape
    shape = (b, cfg.unet.out_channels, t, h, w)
    act_shape = (b, cfg.head.horizon if cfg.head else t, cfg.agent_action_dim)
    st_shape = (b, act_shape[1], cfg.agent_state_dim)
    noise = dict(noise or {})
    stochastic = eta != 0
    if key is None and not {"x_T", "action_T", "state_T"} | ({"steps"} if stochastic else set()) <= set(noise):
        raise WanInputError("pass key=jax.random.key(seed) or inject noise={'x_T', 'action_T', 'state_T'}"
                            + (" and 'steps' (eta > 0)" if stochastic else ""))
    wants = {"x_T": shape, "action_T": act_shape, "state_T": st_shape, "steps": (num_steps,) + shape}
    injected = {}
    for name, want in wants.items():
        if name in noise and (stochastic or name != "steps"):
            injected[name] = jnp.asarray(noise[name], jnp.float32)
            if injected[name].shape != want:
                raise WanInputError(f"noise[{name!r}] has shape {injected[name].shape}; expected {want}")
    tables = schedule_tables(cfg, num_steps, eta, timestep_spacing)
    guided = uncond is not None and guidance_scale != 1.0
    graphdef, state = nnx.split(model.diffusion_model)
    if programs != 1:
        unet = model.diffusion_model
        runs = cut_units(unet, programs)
        heads = []
        for head in () if unet.action_unet is None else (unet.action_unet, unet.state_unet):
            head_graphdef, head_state = nnx.split(head)
            head_leaves, head_treedef = jax.tree.flatten(head_state)
            heads.append((head_graphdef, head_treedef, tuple(head_leaves)))
        return _sample_programs(graphdef, state, cond, uncond if guided else None, tables, key, injected,
                                np.float32(guidance_scale), np.float32(guidance_rescale), cfg.head_clip_sample,
                                (shape, act_shape, st_shape), stochastic, runs, program_key, tuple(heads))
    # Host values, put as they are: a device array made from each compiled a program of its own before the loop.
    tables = jax.device_put(tables)
    args = (graphdef, state, cond, uncond if guided else None, tables, key, injected, np.float32(guidance_scale),
            np.float32(guidance_rescale), cfg.head_clip_sample, (shape, act_shape, st_shape), stochastic)
    key = None if program_key is None else (*program_key, cfg.head_clip_sample, stochastic)
    return executable_cache.cached_call("unifolm-sample", key, _sample_loop, args, static_argnums=(0, 9, 10, 11),
                                        key_names_statics=True)
