"""Step caches for the denoising loop: TeaCache, MagCache and First-Block Cache.

    frames = pipe(prompt, cache="teacache")                      # the model's published settings
    frames = pipe(prompt, cache=MagCache(threshold=0.12, max_skip_steps=4))
    print(pipe.cache_stats)    # "magcache (threshold 0.12): DiT blocks skipped on 19 of 50 steps (cond 19, uncond 19)"
    python -m wan_tpu.generate --prompt ... --cache fbcache --cache-threshold 0.05

On a step where the model input changed little since the last fully computed step, the DiT blocks
are skipped and the blocks' cached residual (output − input of the skipped blocks, from that last
computed step) is added to the block input instead; the embeddings and the output head always run.
Each method decides differently:
  - TeaCache (ali-vilab/TeaCache, TeaCache4Wan2.1): accumulates a published polynomial of the relative
    L1 change of the time embedding (`use_ret_steps`: of the time projection e0) since the last
    computed step; skips while the sum stays below the threshold. The first step (`use_ret_steps`:
    the first five) and the last step (not with `use_ret_steps`) always compute.
  - MagCache (Zehong-Ma/MagCache): accumulates the published magnitude ratios of consecutive block
    residuals; skips while the accumulated |1 − ratio| error stays below the threshold and at most
    K steps in a row; the first `retention_ratio` of the steps always compute (Wan 2.2 A14B: the
    per-expert rules of MagCache4Wan2.2).
  - First-Block Cache (diffusers' `FirstBlockCacheConfig`): runs block 0, then skips the other blocks
    while mean|r1 − r1'| / mean|r1'| ≤ threshold, r1 the first block's residual and r1' the one of the
    last computed step; the cached residual covers blocks 1…L−1.
The coefficients, curves and default thresholds of each Wan variant are in `wan_tpu.configs.step_cache`,
with their sources.

As in the reference implementations, the conditional and unconditional CFG branches keep their own
accumulators and residuals (the references count calls, cond on even, uncond on odd). Everything is
decided on device inside the compiled step — no host round trip per step: the state is carried from
step to step like the scheduler's, and the blocks run under `lax.cond` when any branch needs them.
Both branches share one batched DiT call, so a step saves time only when every branch skips; a branch
that would skip takes its cached residual even when the other one computes, so each branch follows
exactly the reference's rule. Wan 2.2 A14B: the state passes from one expert to the other and the
first step of the low-noise expert always computes. A threshold of 0 turns skipping off (the
references' tables list the uncached baseline as threshold 0.00; TeaCache's fitted polynomials can
go negative outside their fitting range, which would otherwise skip even then): the output is then
bit-identical to an uncached run, the cache machinery running all the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs import step_cache as tables
from wan_tpu.errors import WanInputError


@dataclasses.dataclass(frozen=True)
class TeaCache:
    """TeaCache settings; None fields take the model's published values (`wan_tpu.configs.step_cache`)."""

    threshold: float | None = None
    use_ret_steps: bool = False
    coefficients: tuple[float, ...] | None = None  # rescaling polynomial, highest power first (np.poly1d)


@dataclasses.dataclass(frozen=True)
class MagCache:
    """MagCache settings; None fields take the model's published values."""

    threshold: float | None = None
    max_skip_steps: int | None = None  # K
    retention_ratio: float | None = None
    mag_ratios: tuple[float, ...] | None = None  # per step and branch (cond, uncond), after the first step
    rule: str | None = None


@dataclasses.dataclass(frozen=True)
class FirstBlockCache:
    """First-Block Cache settings (diffusers' `FirstBlockCacheConfig`)."""

    threshold: float | None = None


CACHES = {"teacache": TeaCache, "magcache": MagCache, "fbcache": FirstBlockCache}
_NAMES = {TeaCache: "teacache", MagCache: "magcache", FirstBlockCache: "fbcache"}


def make_cache(cache, threshold: float | None = None):
    """A cache config from a name ("teacache", "magcache", "fbcache") or a config; `threshold` overrides."""
    if cache is None:
        return None
    if isinstance(cache, str):
        if cache not in CACHES:
            raise WanInputError(f"unknown step cache {cache!r}; choose one of {', '.join(CACHES)}")
        cache = CACHES[cache]()
    if type(cache) not in _NAMES:
        raise WanInputError(f"cache must be one of {', '.join(CACHES)} or a TeaCache/MagCache/FirstBlockCache, "
                            f"got {cache!r}")
    if threshold is not None:
        cache = dataclasses.replace(cache, threshold=threshold)
    t = cache.threshold
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
        raise WanInputError(f"cache threshold must be a number >= 0, got {t!r}; pass --cache-threshold X")
    return cache


def resolve(cache, variant_name: str, with_image: bool = False):
    """`cache` with every None field filled from the published parameters of `variant_name`."""
    if isinstance(cache, FirstBlockCache):
        return FirstBlockCache(tables.FBCACHE_THRESHOLD if cache.threshold is None else cache.threshold)
    if isinstance(cache, TeaCache):
        table = tables.TEACACHE.get(variant_name)
        if table is None and (cache.coefficients is None or cache.threshold is None):
            raise WanInputError(f"TeaCache publishes no coefficients for {variant_name}; use --cache magcache or "
                                "fbcache, or pass TeaCache(coefficients=..., threshold=...)")
        ret = cache.use_ret_steps
        return TeaCache(
            threshold=(table.ret_threshold if ret else table.threshold) if cache.threshold is None else cache.threshold,
            use_ret_steps=ret,
            coefficients=(table.ret_coefficients if ret else table.coefficients) if cache.coefficients is None
            else tuple(cache.coefficients))
    key = f"{variant_name}/image" if with_image and f"{variant_name}/image" in tables.MAGCACHE else variant_name
    table = tables.MAGCACHE.get(key)
    if table is None and cache.mag_ratios is None:
        raise WanInputError(f"MagCache publishes no magnitude ratios for {variant_name}; use --cache fbcache, or "
                            "pass MagCache(mag_ratios=...)")
    fields = {f.name: getattr(cache, f.name) for f in dataclasses.fields(MagCache)}
    for name, value in fields.items():
        if value is None:
            fields[name] = getattr(table, name) if table is not None else {"rule": "wan2.1"}.get(name)
    if None in fields.values():
        missing = [k for k, v in fields.items() if v is None]
        raise WanInputError(f"MagCache for {variant_name} needs {', '.join(missing)}")
    return MagCache(**{**fields, "mag_ratios": tuple(fields["mag_ratios"])})


class CacheStats(NamedTuple):
    """How a cached run went: `skipped` counts the steps on which the DiT blocks did not run."""

    method: str
    threshold: float
    steps: int
    skipped: int
    skipped_by_branch: tuple[int, ...]  # (cond,) or (cond, uncond)
    skip_mask: np.ndarray  # (steps, branches) bool

    def __str__(self):
        branches = ", ".join(f"{n} {k}" for n, k in zip(("cond", "uncond"), self.skipped_by_branch))
        return (f"{self.method} (threshold {self.threshold:g}): DiT blocks skipped on {self.skipped} of "
                f"{self.steps} steps ({branches})")


# ---- the state carried through the compiled steps -----------------------------------------------------


@dataclasses.dataclass
class CacheCarry:
    """Plan (per run, read only) and state (updated each step) of a step cache, as device arrays.

    Rows of the DiT batch belong to branch `row // batch` (cond first, then uncond).
    """

    method: str  # static
    use_ret_steps: bool  # static
    force: jax.Array  # (N, nb) bool: the step computes whatever the indicator says
    ratio: jax.Array  # (N, nb) float32: MagCache's ratio of each step and branch
    coefficients: jax.Array  # (5,) float32: TeaCache's polynomial
    threshold: jax.Array  # () float32
    max_skip: jax.Array  # () int32: MagCache's K
    valid: jax.Array  # (nb,) bool: a residual is cached
    acc: jax.Array  # (nb,) float32: TeaCache's distance / MagCache's error since the last computed step
    acc_ratio: jax.Array  # (nb,) float32
    acc_steps: jax.Array  # (nb,) int32
    prev: jax.Array  # TeaCache: last modulated input (rows, M) f32; FBCache: last first-block residual
    residual: jax.Array  # (rows, S, dim): output − input of the skippable blocks at the last computed step
    skipped: jax.Array  # (N, nb) bool


jax.tree_util.register_dataclass(CacheCarry, meta_fields=["method", "use_ret_steps"],
                                 data_fields=[f.name for f in dataclasses.fields(CacheCarry)][2:])


def _nearest_interp(src: np.ndarray, n: int) -> np.ndarray:
    """MagCache's `nearest_interp`: a curve resampled to n points."""
    if n == 1:
        return src[-1:]
    return src[np.round(np.arange(n) * (len(src) - 1) / (n - 1)).astype(int)]


def _call_count(n: int, nb: int) -> np.ndarray:
    """The references' call counter `cnt` of each (step, branch): cond on even, uncond on odd calls."""
    return 2 * np.arange(n)[:, None] + np.arange(nb)[None, :]


def plan(cache, steps: int, branches: int, switch: int) -> dict:
    """Host arrays of a run: which (step, branch) must compute, and MagCache's ratios."""
    cnt, total = _call_count(steps, branches), 2 * steps
    force = np.zeros((steps, branches), bool)
    ratio = np.ones((steps, branches), np.float32)
    if isinstance(cache, TeaCache):
        ret_calls, cutoff = (10, total) if cache.use_ret_steps else (2, total - 2)
        force |= (cnt < ret_calls) | (cnt >= cutoff)
    elif isinstance(cache, MagCache):
        mags = np.concatenate([[1.0, 1.0], np.asarray(cache.mag_ratios, np.float64)])
        if len(mags) != total:
            mags = np.stack([_nearest_interp(mags[0::2], steps), _nearest_interp(mags[1::2], steps)], 1).reshape(-1)
        ratio = mags.reshape(steps, 2)[:, :branches].astype(np.float32)
        r, split = cache.retention_ratio, 2 * switch
        if cache.rule == "t2v-a14b":
            force |= (cnt < int(split * r)) | ((cnt >= split) & (cnt <= (total - split) * r + split))
        elif cache.rule == "i2v-a14b":
            force |= cnt < int(split + (total - split) * r)
        else:
            force |= cnt < int(total * r)
    force[0] = True
    if 0 < switch < steps:
        force[switch] = True  # a residual of the high-noise expert does not stand for the low-noise one
    return {"force": force, "ratio": ratio}


def start(cache, steps: int, branches: int, switch: int, batch: int, tokens: int, dim: int, dtype,
          per_token_time: bool) -> CacheCarry:
    """The carry of a run (`cache` resolved): its plan, and empty state."""
    p = plan(cache, steps, branches, switch)
    rows = branches * batch
    if isinstance(cache, TeaCache):
        prev = jnp.zeros((rows, (tokens if per_token_time else 1) * (6 if cache.use_ret_steps else 1) * dim),
                         jnp.float32)
    elif isinstance(cache, FirstBlockCache):
        prev = jnp.zeros((rows, tokens, dim), dtype)
    else:
        prev = jnp.zeros((rows, 0), jnp.float32)
    coefficients = cache.coefficients if isinstance(cache, TeaCache) else (0.0,) * 5
    return CacheCarry(
        method=_NAMES[type(cache)], use_ret_steps=isinstance(cache, TeaCache) and cache.use_ret_steps,
        force=jnp.asarray(p["force"]), ratio=jnp.asarray(p["ratio"]),
        coefficients=jnp.asarray(coefficients, jnp.float32), threshold=jnp.float32(cache.threshold),
        max_skip=jnp.int32(getattr(cache, "max_skip_steps", 0) or 0),
        valid=jnp.zeros((branches,), bool), acc=jnp.zeros((branches,), jnp.float32),
        acc_ratio=jnp.ones((branches,), jnp.float32), acc_steps=jnp.zeros((branches,), jnp.int32),
        prev=prev, residual=jnp.zeros((rows, tokens, dim), dtype), skipped=jnp.zeros((steps, branches), bool))


def stats(cache, carry: CacheCarry) -> CacheStats:
    mask = np.asarray(carry.skipped)
    return CacheStats(carry.method, float(cache.threshold), mask.shape[0], int(mask.all(axis=1).sum()),
                      tuple(int(k) for k in mask.sum(axis=0)), mask)


# ---- the decisions (vectorized over branches; traced) ---------------------------------------------------


def _per_branch(x, branches: int):
    """(rows, ...) → (branches, elements of the branch) in float32."""
    return x.reshape(branches, -1).astype(jnp.float32)


def _rel_l1(now, before):
    """mean|now − before| / mean|before| per branch (both (branches, n), float32)."""
    return jnp.mean(jnp.abs(now - before), axis=1) / jnp.mean(jnp.abs(before), axis=1)


def teacache_decide(c: CacheCarry, force, modulated):
    """(compute (nb,), c): TeaCache4Wan2.1's rule on the modulated input of this step."""
    now = modulated.reshape(c.prev.shape).astype(jnp.float32)
    nb = c.acc.shape[0]
    dist = c.acc + jnp.polyval(c.coefficients, _rel_l1(_per_branch(now, nb), _per_branch(c.prev, nb)))
    compute = force | ~c.valid | (dist >= c.threshold)
    return compute, dataclasses.replace(c, acc=jnp.where(compute, 0.0, dist), prev=now)


def magcache_decide(c: CacheCarry, force, ratio):
    """(compute (nb,), c): MagCache's rule with this step's magnitude ratio per branch."""
    acc_ratio = c.acc_ratio * ratio
    acc_steps = c.acc_steps + 1
    acc_err = c.acc + jnp.abs(1.0 - acc_ratio)
    skip = ~force & c.valid & (acc_err < c.threshold) & (acc_steps <= c.max_skip)
    # A forced step leaves the accumulators alone (the reference's "not use_magcache"); a computed
    # eligible step resets them.
    return ~skip, dataclasses.replace(
        c, acc_ratio=jnp.where(force, c.acc_ratio, jnp.where(skip, acc_ratio, 1.0)),
        acc_steps=jnp.where(force, c.acc_steps, jnp.where(skip, acc_steps, 0)),
        acc=jnp.where(force, c.acc, jnp.where(skip, acc_err, 0.0)))


def fbcache_decide(c: CacheCarry, force, first_residual):
    """(compute (nb,), c): diffusers' First-Block Cache rule on the first block's residual."""
    nb = c.acc.shape[0]
    diff = _rel_l1(_per_branch(first_residual, nb), _per_branch(c.prev, nb))
    compute = force | ~c.valid | (diff > c.threshold)
    rows = jnp.repeat(compute, first_residual.shape[0] // nb)[:, None, None]
    return compute, dataclasses.replace(c, prev=jnp.where(rows, first_residual, c.prev))


def cached_forward(graphdef, params, carry: CacheCarry, i, hidden_states, timestep, context, image=None):
    """The DiT forward with the step cache: (noise prediction, carry). `i` is the (traced) step index."""
    dit = nnx.merge(graphdef, params)
    inputs = dit.embed(hidden_states, timestep, context, image)
    force, nb = carry.force[i] | (carry.threshold <= 0), carry.acc.shape[0]
    h = inputs.tokens
    first = 0
    if carry.method == "teacache":
        modulated = inputs.tproj if carry.use_ret_steps else inputs.temb
        compute, carry = teacache_decide(carry, force, modulated)
    elif carry.method == "magcache":
        compute, carry = magcache_decide(carry, force, carry.ratio[i])
    else:
        first = 1
        h0, h = h, dit.run_blocks(inputs, h, 0, 1)
        compute, carry = fbcache_decide(carry, force, h - h0)

    rows = jnp.repeat(compute, h.shape[0] // nb)[:, None, None]
    reused = h + carry.residual
    out = jax.lax.cond(jnp.any(compute), lambda: dit.run_blocks(inputs, h, first), lambda: reused)
    out = jnp.where(rows, out, reused)
    carry = dataclasses.replace(carry, residual=jnp.where(rows, out - h, carry.residual),
                                valid=carry.valid | compute, skipped=carry.skipped.at[i].set(~compute))
    return dit.head(inputs, out), carry
