"""Splash-style exp2 flash attention forward for TPU (Pallas, Mosaic TPU).

Layout (B, S, H, D) in and out; softmax scale 1/sqrt(D); non-causal; any Sq, Skv ≥ 1.

Why it looks like this:
- `q` is multiplied by `scale · log2(e)` once, outside the kernel, so the kernel computes
  probabilities as `exp2(s - m)`: one VPU/EUP op fewer per score than `exp(scale·s - m)`.
- Scores are computed K·Qᵀ, shape (kv, q): the running max and sum are reductions over sublanes
  (cheap) and the accumulator is (D, Sq), so the q block sits on the 128 lanes of every vector op.
- The kv grid step (`block_kv`) is walked in `block_kv_compute` chunks (one K·Qᵀ product and one
  max update each), and each chunk's exp2 and P·V work in `block_kv_compute_in` steps, which bounds
  the live f32 probabilities.
- Ragged lengths are not padded in HBM: the grid covers ceil(S / block) blocks and the last one
  reads past the end. Past-the-end queries only produce output rows that are dropped. Past-the-end
  keys are masked EXACTLY (score -inf, so probability 0, and their V rows zeroed so that garbage
  cannot turn 0·x into NaN). Chunks wholly past the end are skipped; the sizes are static, so the
  mask costs nothing outside the one chunk that straddles the end.
- When D is a multiple of 128 the heads stay in place: (B, S, H·D) is a free reshape and each
  block picks its head's D lanes, so no transposes are paid in HBM. Other head sizes go through a
  (B·H, S, D) transpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from wan_tpu.errors import WanInputError
from wan_tpu.kernels.tuning import BlockSizes, tpu_block_sizes

_LANES = 128
_LOG2E = math.log2(math.e)
# Dimension numbers: K·Qᵀ contracts D of both; Vᵀ·P contracts the kv rows of both.
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def effective_block_sizes(sq: int, skv: int, blocks: BlockSizes) -> BlockSizes:
    """Clip blocks to the (lane-rounded) sequence and check that the kv tiles nest."""
    block_q = min(blocks.block_q, _round_up(sq, _LANES))
    kv_in = min(blocks.block_kv_compute_in, _round_up(skv, 8))
    kv_compute = min(blocks.block_kv_compute, _round_up(skv, kv_in))
    block_kv = min(blocks.block_kv, _round_up(skv, kv_compute))
    # block_q is the lane axis of the scores and the accumulator; kv steps are sublane slices.
    if block_q % _LANES or kv_in % 8:
        raise WanInputError(f"block_q ({block_q}) must be a multiple of 128 and block_kv_compute_in ({kv_in}) of 8")
    if kv_compute % kv_in or block_kv % kv_compute:
        raise WanInputError(
            f"block_kv ({block_kv}) must be a multiple of block_kv_compute ({kv_compute}), which must "
            f"be a multiple of block_kv_compute_in ({kv_in})"
        )
    return BlockSizes(block_q, block_kv, kv_compute, kv_in, blocks.vmem_limit_bytes, blocks.low_latency_scheduler)


def _attend_chunk(q, k_ref, v_ref, m_ref, l_ref, acc_ref, start, valid, kv_compute, kv_in):
    """One online-softmax update with keys [start, start + kv_compute) of this kv block.

    `valid` (static) is how many of those keys exist; the rest are masked exactly.
    """
    k = k_ref[pl.ds(start, kv_compute), :]
    # float32 inputs get float32 products (the MXU default would be one bf16 pass).
    precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    s = lax.dot_general(k, q, _NT, precision=precision, preferred_element_type=jnp.float32)
    if valid < kv_compute:
        rows = lax.broadcasted_iota(jnp.int32, s.shape, 0)
        s = jnp.where(rows < valid, s, -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
    alpha = jnp.exp2(m_prev - m_new)
    l_new = l_ref[...] * alpha
    acc = acc_ref[...] * alpha
    for step in range(_round_up(min(valid, kv_compute), kv_in) // kv_in):
        lo = step * kv_in
        p = jnp.exp2(s[lo : lo + kv_in] - m_new)
        l_new = l_new + jnp.sum(p, axis=0, keepdims=True)
        v = v_ref[pl.ds(start + lo, kv_in), :]
        if valid < lo + kv_in:
            rows = lax.broadcasted_iota(jnp.int32, v.shape, 0)
            v = jnp.where(rows < valid - lo, v, jnp.zeros_like(v))
        acc = acc + lax.dot_general(v, p.astype(v.dtype), _TN, precision=precision,
                                    preferred_element_type=jnp.float32)
    m_ref[...] = m_new
    l_ref[...] = l_new
    acc_ref[...] = acc


def _attend_block(q, k_ref, v_ref, m_ref, l_ref, acc_ref, valid, kv_compute, kv_in):
    """All chunks of one kv block that hold at least one of its `valid` (static) keys."""
    full = valid // kv_compute

    def body(c, carry):
        start = pl.multiple_of(c * kv_compute, kv_compute)
        _attend_chunk(q, k_ref, v_ref, m_ref, l_ref, acc_ref, start, kv_compute, kv_compute, kv_in)
        return carry

    if full:
        lax.fori_loop(0, full, body, None)
    if valid % kv_compute:
        _attend_chunk(q, k_ref, v_ref, m_ref, l_ref, acc_ref, full * kv_compute, valid % kv_compute,
                      kv_compute, kv_in)


def _kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, kv_len, blocks: BlockSizes):
    kv_step = pl.program_id(2)
    last = pl.num_programs(2) - 1
    chunk = dict(kv_compute=blocks.block_kv_compute, kv_in=blocks.block_kv_compute_in)

    @pl.when(kv_step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[...]
    last_valid = kv_len - (pl.cdiv(kv_len, blocks.block_kv) - 1) * blocks.block_kv
    if last_valid < blocks.block_kv:
        @pl.when(kv_step < last)
        def _full_block():
            _attend_block(q, k_ref, v_ref, m_ref, l_ref, acc_ref, blocks.block_kv, **chunk)

        @pl.when(kv_step == last)
        def _ragged_block():
            _attend_block(q, k_ref, v_ref, m_ref, l_ref, acc_ref, last_valid, **chunk)
    else:
        _attend_block(q, k_ref, v_ref, m_ref, l_ref, acc_ref, blocks.block_kv, **chunk)

    @pl.when(kv_step == last)
    def _finalize():
        # Every column saw its own maximum (probability 1), so l ≥ 1: no division by zero.
        o_ref[...] = (acc_ref[...] / l_ref[...]).T.astype(o_ref.dtype)


def splash_exp2_attention(q, k, v, block_sizes=None, interpret=False):
    """exp2 flash attention, (B, S, H, D) → (B, Sq, H, D). `block_sizes`: mapping of overrides."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    if k.shape != (b, skv, h, d) or v.shape != k.shape:
        raise WanInputError(f"q {q.shape}, k {k.shape}, v {v.shape} must be (B, S, H, D) with equal B, H, D")
    return _call(q, k, v, effective_block_sizes(sq, skv, tpu_block_sizes(block_sizes)), interpret)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _call(q, k, v, blocks: BlockSizes, interpret: bool):
    b, sq, h, d = q.shape
    skv = k.shape[1]
    q = (q.astype(jnp.float32) * (_LOG2E / math.sqrt(d))).astype(k.dtype)
    if d % _LANES == 0:
        heads_in_lanes = h
        to_kernel = lambda x: x.reshape(x.shape[0], x.shape[1], h * d)  # noqa: E731
        from_kernel = lambda o: o.reshape(b, sq, h, d)  # noqa: E731
    else:
        heads_in_lanes = 1
        to_kernel = lambda x: x.transpose(0, 2, 1, 3).reshape(b * h, x.shape[1], d)  # noqa: E731
        from_kernel = lambda o: o.reshape(b, h, sq, d).transpose(0, 2, 1, 3)  # noqa: E731

    def index(rows):
        # lax.div/rem, not // and %: floor division lowers through `sign`, which needs a live TPU.
        return lambda g, i, j: (lax.div(g, heads_in_lanes), rows(i, j), lax.rem(g, heads_in_lanes))

    q_spec = pl.BlockSpec((None, blocks.block_q, d), index(lambda i, j: i))
    kv_spec = pl.BlockSpec((None, blocks.block_kv, d), index(lambda i, j: j))
    grid = (b * h, pl.cdiv(sq, blocks.block_q), pl.cdiv(skv, blocks.block_kv))
    flags = {"XLA_TPU_FORCE_LP_LLO_SCHEDULER": True} if blocks.low_latency_scheduler else None
    out = pl.pallas_call(
        functools.partial(_kernel, kv_len=skv, blocks=blocks),
        grid=grid,
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(to_kernel(q).shape, q.dtype),
        scratch_shapes=[
            pltpu.VMEM((1, blocks.block_q), jnp.float32),
            pltpu.VMEM((1, blocks.block_q), jnp.float32),
            pltpu.VMEM((d, blocks.block_q), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=blocks.vmem_limit_bytes,
            flags=flags,
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=4 * b * h * sq * skv * d,
            transcendentals=b * h * sq * skv,
            bytes_accessed=(2 * q.size + k.size * grid[1] + v.size * grid[1]) * q.dtype.itemsize,
        ),
        name="splash_exp2",
    )(to_kernel(q), to_kernel(k), to_kernel(v))
    return from_kernel(out)
