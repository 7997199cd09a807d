"""Hopper exp2 flash attention forward in Pallas Mosaic GPU (wgmma, TMA, warp specialisation).

Three warpgroups per CTA: two compute warpgroups, each owning `block_q` query rows, and one memory
warpgroup that streams K and V tiles into a `stages`-deep shared-memory ring with TMA. The compute
warpgroups take turns on the tensor cores, so one's softmax runs while the other's matrix products
do (the FA3 ping-pong). Two ways to take turns: by default both warpgroups meet at one barrier
twice a step (after issuing Q·Kᵀ and after the softmax), so their softmaxes strictly alternate;
`fa3_turns` uses FA3's scheduler barriers instead, one per warpgroup: a warpgroup waits only before
issuing its products, for the other to have issued its own, and then passes the turn on.

Lengths that are multiples of 8 (all of Wan's video token counts) need no padding: TMA fills reads
past the end of an array with zeros and drops writes past it, so ragged query tiles cost nothing,
and the last kv tile's past-the-end keys are masked to probability 0 in the one (static) step that
holds them. Shared memory holds the input dtype (bf16 or fp16), and the softmax scale·log2(e)
folds into the FMA before exp2 (see flash_gpu.py).

The same kernel has an 8-bit path (`mgpu_attention_fp8`, `attention(impl="pallas_gpu_fp8")`): Q·Kᵀ
in int8 (or e4m3) and P·V in e4m3 on the tensor cores' 8-bit rate, f32 accumulators. Its scales are
applied where they cost nothing: Q's per row and K's per head inside the exp2 argument's factor,
V's in the output's 1/l. What differs from the bf16 path: e4m3 WGMMA reads both operands K-major,
so V comes in transposed; P stays in registers as the 8-bit A operand, its keys taken in the order
each thread already holds them (FA3's trick, `KEY_ORDER_16`: V's keys are stored in that order, so
no value crosses threads). At 8 bits a step takes 256 keys (P 32 registers a thread where bf16
would need 128): 64×256×2 runs at 849-855 / 893-902 TFLOP/s on an H200 at 12 h × 32,760 / 40 h ×
75,600, against 841 / 879 with P through shared memory, which Mosaic GPU's own relayout to the
8-bit operand would need.

Scheduling variants (`benchmarks/bench_attention.py` sweeps them; `wan_tpu/kernels/tuning.py` holds the pick):
- one CTA per (head, q tile, batch), heads fastest in the grid (default), or q tiles fastest
  (`q_major`): the CTAs resident together then share one head's K/V in L2 instead of streaming
  the K/V of every head;
- `persistent=N`: N CTAs (one per SM), each walking tiles c, c + N, … with q tiles fastest. The
  memory warpgroup's K/V ring runs on across tile boundaries, so the next tile's first K/V tiles
  load while the current tile finishes, and a compute warpgroup's output store and next Q load
  overlap the other warpgroup's tensor-core turn: no pipeline fill or drain per tile. That matters
  most for cross-attention, whose tiles have only 4-7 kv steps.
- `cluster=2` (either kernel; FA3 does the same for head dims ≥ 128 without a mask): CTAs in pairs
  on adjacent q tiles of one head. Each CTA's memory warpgroup loads half of every K/V tile and TMA
  multicasts it into both CTAs' rings, so the pair reads each tile from L2 once. A ring slot is
  refilled once all four compute warpgroups of the pair are done with it (cluster barriers), and
  neither CTA exits before the other is done arriving on its barriers. At 64×192 a CTA streams
  ~38 GB/s of K/V, ~5 TB/s out of L2 over 132 SMs. Pairs take self-attention from 627-631 to
  640-651 TFLOP/s on an H200; clusters of 4 are slower than single CTAs (625 / 618).
- `half_p` (bf16 inputs; on in `tuning.GPU_BLOCKS`): P in f16 instead of bf16 and P·V in f16 (V
  converted first, `v_in_half`), so that the row sums are packed f16 adds, one a pair of keys,
  where f32 adds took one a key. The softmax's instruction count per step and thread falls from
  638 to 619 in the main loop (ptxas, 64×192; the f16 pairs cost 27 register moves back), and P
  keeps 11 significant bits instead of 8: 1.7e-3 against 2.3e-3 relative error on random inputs.
  +0.3-1.6% at 12 h × 32,760 and 40 h × 75,600 on an H100 and an H200; the 14B forward 1.0% faster
  on both; the 1.3B forward 1.5-2.3% on the H100, within the noise on the H200. With the overlap
  (cross-attention's persistent walk) it is 23% slower, so "cross" leaves it off.
- `stale_max` (with `half_p`; on in `tuning.GPU_BLOCKS`): FA4's conditional rescale taken one step
  further. A step keeps the running row max and skips both the max (an FMNMX a score, shuffles) and
  the accumulator's rescale (an FMUL an output element); its packed f16 row sums, which it needs
  anyway, tell whether a score passed that max by enough to matter (`STALE_SUM_LIMIT`), and then the
  warp takes the exact step in a branch (`_stale_max_softmax`). The first step of a tile always does
  (its max is -inf). P is then ≤ 2^10 instead of ≤ 1: f16 keeps the same relative precision, and the
  normalisation by l is exact for any max. One copy of the step serves the whole tile: its ragged
  kv block is walked first (the memory warpgroup loads it first), where the exact branch always
  runs and masks it, so the fast path has no mask. With the first and last steps as copies of
  their own, 64×192 is 5% slower at 27,280-32,760 keys than at 75,600, presumably because code
  that runs once a tile is fetched from outside the instruction cache. The fast path is 316
  instructions a thread and step at 64×128 (ptxas), where `half_p` alone takes 619 at 64×192 for
  1.5 times the keys; at 64×192 the scores, P and the accumulator no longer fit beside each other
  and ptxas serialises the wgmmas (492-502 TFLOP/s), hence 64×128 tiles: 695 / 708-709 TFLOP/s on
  an H200 at 12 h × 32,760 / 40 h × 75,600 (64×128×2, pairs, `fa3_turns`) against 654-658 / 659-663
  for 64×192 tiles without `stale_max`; 1.23-1.25× jax's cuDNN at 27,280-75,600 keys.
- `overlap` (bf16; implies `fa3_turns`): FA3's intra-warpgroup overlap. One turn issues Q·Kᵀ of
  step j+1 and P·V of step j together; the softmax of step j+1 starts as soon as its scores are
  in and runs while that P·V does. Live registers: the scores, P of step j and the accumulator,
  64 + 32 + 64 a thread at 64 × 128; at 64 × 192 (96 + 48 + 64) ptxas spills and serialises the
  wgmmas at 232 registers, and at 240 it gains 1%. On an H200 it takes cross-attention (4-7 kv
  steps a tile) past cuDNN as a persistent 64×128×3 walk (the tuned "cross" choice); bf16
  self-attention gains nothing from it (64×128×2 with the overlap equals 64×192×2 without): its
  two softmaxes alternating is not what holds it back. The 8-bit path has none: the scores, P, the
  accumulator and each step's fresh P·V sum would need 288 registers a thread at 64 × 256.
- `pv_row_sums` (the 8-bit kernel; on in `tuning.GPU_FP8_BLOCKS`): the row sums taken by P·V, whose
  transposed V gets a row of ones (`mgpu_attention_fp8`). On an H100 the main loop falls from 890
  to 825 instructions a thread and step (the 136 FADDs of the row sums gone; 73 IMADs, presumably
  register moves for the wider accumulator, come back), and the kernel goes from 888 / 931 to
  942 / 984 TFLOP/s at 12 h × 32,760 / 40 h × 75,600.
The softmax is bound by its instruction count, not by the MUFU: taking work off the MUFU (part of
the exp2 as an FMA-unit polynomial) slows the kernel, and `ex2.approx.f16x2` / `ex2.approx.bf16x2`
are no packed MUFU ops on sm_90 (ptxas emits two `MUFU.EX2.F16` and repacks them), so exp2 stays
in f32. Under load every kernel here runs at the card's 700 W cap (`benchmarks/bench_power.py`): its
softmax costs 11% of what the kernel without it reaches.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from wan_tpu.errors import WanInputError

LOG2E = math.log2(math.e)
COMPUTE_WGS = 2
# Shared memory per CTA on H100/H200 (227 KiB): the ring plus the two q/out tiles must fit.
SMEM_BYTES = 227 * 1024


def _smem_bytes(block_q, block_kv, stages, d, itemsize, fp8=False):
    tiles = (COMPUTE_WGS * block_q + 2 * stages * block_kv) * d * itemsize
    if fp8:  # + the bf16 output tiles and the two per-row scale vectors
        tiles += COMPUTE_WGS * block_q * (2 * d + 2 * 4)
    return tiles


def _pad_to_8(x):
    return jnp.pad(x, ((0, 0), (0, -x.shape[1] % 8), (0, 0), (0, 0)))


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv", "stages", "persistent", "q_major", "pv_two_level",
                                             "overlap", "fa3_turns", "cluster", "half_p", "stale_max", "ceiling"))
def mgpu_attention(q, k, v, block_q=64, block_kv=192, stages=2, persistent=0, q_major=False, pv_two_level=False,
                   overlap=False, fa3_turns=False, cluster=1, half_p=False, stale_max=False, ceiling=None):
    """(B, S, H, D) → (B, Sq, H, D). TMA tiles global memory in rows of 8, so a length that is
    not a multiple of 8 (e.g. 257 + 512 cross-attention keys) is zero-padded to one first; the
    padded keys fall in the masked tail.

    Scheduling (see the module docstring): `persistent=0` launches one CTA per (head, q tile,
    batch), heads fastest (`q_major=True`: q tiles fastest); `persistent=N` launches N CTAs that
    each walk the tiles c, c + N, c + 2N, … (q tiles fastest) with one continuous K/V ring.
    `pv_two_level` (an experiment in bf16): each step's P·V into a fresh accumulator, rescaled and
    added after the product instead of before it (see `mgpu_attention_fp8`). `overlap`: FA3's
    intra-warpgroup overlap (step j+1's Q·Kᵀ issued with step j's P·V); `fa3_turns`: FA3's turn
    hand-over between the compute warpgroups; `cluster=2`: FA3's CTA pairs sharing each K/V tile
    (see the module docstring). `half_p`: P in f16, its row sums by packed f16 adds, P·V in f16
    (V converted by `v_in_half`; see the module docstring). `stale_max` (with `half_p`): after a
    tile's first kv step, a step keeps the running row max unless its row sums say a score passed
    it (`_stale_max_softmax`). `ceiling` ("no_exp2" or "no_softmax";
    wrong results on purpose, for `benchmarks/bench_power.py` only): the kernel with the softmax's exp2
    left out, or the whole softmax and rescale, to time what the rest of the kernel allows."""
    sq, skv = q.shape[1], k.shape[1]
    if half_p:
        v = v_in_half(v)
    call = functools.partial(_kernel_call, skv=skv, block_q=block_q, block_kv=block_kv, stages=stages,
                             persistent=persistent, q_major=q_major, pv_two_level=pv_two_level, overlap=overlap,
                             fa3_turns=fa3_turns, cluster=cluster, half_p=half_p, stale_max=stale_max,
                             ceiling=ceiling)
    if sq % 8 or skv % 8:
        return call(_pad_to_8(q), _pad_to_8(k), _pad_to_8(v), None)[:, :sq]
    return call(q, k, v, None)


F8 = jnp.float8_e4m3fn
F8_MAX = 448.0
# P is cast to e4m3 as 2^P_SHIFT · p (folded into the exp2's subtrahend, so free): p ∈ (0, 1] would
# lose every weight under 2^-9 to e4m3's subnormal floor; 256·p reaches 256 < 448 and keeps weights
# down to 2^-17. The row sum l carries the same factor, so acc / l is unchanged.
P_SHIFT = 8.0


# FA3's FP8 P in registers: the e4m3 WGMMA's A operand (Mosaic's WGMMA_8BIT layout) gives each thread
# keys 4t..4t+3 of every 16, where the f32 scores' layout gives it keys 2t, 2t+1, 2t+8, 2t+9 (t = lane
# mod 4). Taking P's keys in that order instead needs no data to cross threads: V's keys are stored
# in the same order (`_v_in_operand_order`, within every 16), so P·V sums the same products.
KEY_ORDER_16 = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


def _v_in_operand_order(vt8):
    """V (…, keys) with its keys in `KEY_ORDER_16` within every 16: key 8h + 2t + b moves to 4t + 2h + b."""
    return vt8.reshape(*vt8.shape[:-1], -1, 2, 4, 2).swapaxes(-3, -2).reshape(vt8.shape)


def _pair_registers(regs, concat):
    """Registers of the scores' WGMMA layout (row groups, N/8 column groups, 1, 1, 2 row halves, …)
    → those of the 8-bit A operand's (…, N/16, …): one thread's two registers of a 16-key group,
    joined by `concat`."""
    out = np.empty((regs.shape[0], regs.shape[1] // 2, *regs.shape[2:]), dtype=object)
    for m, u, *rest in np.ndindex(out.shape):
        out[(m, u, *rest)] = concat([regs[(m, 2 * u, *rest)], regs[(m, 2 * u + 1, *rest)]])
    return out


def _p_operand_8bit(p8):
    """(64·m, N) e4m3 P in the scores' WGMMA layout → the 8-bit A operand's layout, keys taken in
    `KEY_ORDER_16` within every 16 (no data moves between threads)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(p8.shape, p8.dtype, layout=plgpu.Layout.WGMMA_8BIT))
    def repack(ctx, p):
        del ctx
        regs = _pair_registers(p.registers, mgpu.utils.vector_concat)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return repack(p8)


F16_MAX = 65504.0
# `half_p`: exp2 in f32 as before, each pair of weights packed into one f16x2 register (as the bf16
# path packs them for P·V), and the row sums taken with packed adds, one a pair of keys.
# (`ex2.approx.f16x2` instead is no packed MUFU op on sm_90: ptxas splits it in two and repacks, 3-4%
# slower on an H100.)
_EXP2_HALF = "{ .reg .f32 a, b; ex2.approx.ftz.f32 a, $1; ex2.approx.ftz.f32 b, $2; cvt.rn.f16x2.f32 $0, b, a; }"


def v_in_half(v):
    """V for `half_p`'s f16 P·V. bf16 values beyond f16's range saturate at ±65504 instead of
    becoming inf; below it bf16's 8 significant bits fit f16's 11 exactly (down to 2^-14, f16's
    smallest normal). One elementwise pass; with it paid, the 1.3B DiT forward still gained 7-11 ms
    on an H100 (within the noise on an H200) and the 14B one 1% on both."""
    if v.dtype == jnp.float16:
        return v
    return jnp.clip(v.astype(jnp.float32), -F16_MAX, F16_MAX).astype(jnp.float16)


def _exp2_half_registers(x):
    """Register level (inside `plgpu.inline_mgpu`): an f32 WGMMA-layout FragmentedArray of exp2
    arguments → (P = exp2(x) in f16, the WGMMA layout; (64·m, 8) f32 partial row sums)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, vector

    i32, f16x2 = ir.IntegerType.get_signless(32), ir.VectorType.get((2,), ir.F16Type.get())
    f32x2 = ir.VectorType.get((2,), ir.F32Type.get())

    def pair(reg):
        lo, hi = (vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                  for i in (0, 1))
        return mgpu.utils.bitcast(llvm.inline_asm(i32, [lo, hi], _EXP2_HALF, "=r,f,f"), f16x2)

    p = np.empty(x.registers.shape, dtype=object)
    for idx in np.ndindex(p.shape):
        p[idx] = pair(x.registers[idx])
    sums = np.empty((p.shape[0], 1, *p.shape[2:]), dtype=object)
    for idx in np.ndindex(sums.shape):
        level = [p[(idx[0], u, *idx[2:])] for u in range(p.shape[1])]
        while len(level) > 1:
            level = [arith.addf(a, b) for a, b in zip(level[::2], level[1::2])] + level[len(level) - len(level) % 2:]
        sums[idx] = arith.extf(f32x2, level[0])
    return (mgpu.FragmentedArray(_registers=p, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None),
            mgpu.FragmentedArray(_registers=sums, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None))


def _exp2_half_with_row_sums(x):
    """(64·m, N) f32 exp2 arguments in the WGMMA layout → (P = exp2(x) in f16, the WGMMA layout;
    (64·m, 8) f32 partial row sums). The row sum is taken in packed f16 adds (one a pair of keys,
    a pairwise tree over each thread's N/8 registers of a row), then widened: P's own rounding is
    2^-11, the tree's at most ~5 · 2^-11, and the sum across threads (`.sum(axis=1)` of the
    second result) and across steps stays f32."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=(plgpu.ShapeDtypeStruct(x.shape, jnp.float16, layout=plgpu.Layout.WGMMA),
                                    plgpu.ShapeDtypeStruct((x.shape[0], 8), jnp.float32, layout=plgpu.Layout.WGMMA)))
    def exp2(ctx, x):
        del ctx
        return _exp2_half_registers(x)

    return exp2(x)


# `stale_max`: a step keeps the row max it was given unless a thread's partial row sum passes this
# (then its warp rescales to the exact max). Under it every weight is ≤ 2^10, so P, its packed f16
# row sums and P·V stay far inside f16's and f32's range; the normalisation by l at the end is exact
# for any max.
STALE_SUM_LIMIT = 1024.0
# vote.any over the warp, so that the rescale branch (and its shuffles) is warp-uniform.
_WARP_ANY = "{ .reg .pred p; setp.ne.b32 p, $1, 0; vote.sync.any.pred p, p, 0xffffffff; selp.b32 $0, 1, 0, p; }"


def _stale_max_softmax(s, m, l8, acc, c, valid):
    """One kv step's softmax without the row max (`stale_max`; FA4's conditional rescale, decided
    from the row sums instead of the max). s (64·m, N) f32 scores, m (64·m,) the running max in log2
    units (-inf before the first step), l8 (64·m, 8) f32 partial row sums, acc the output
    accumulator → (P in f16, m, l8, acc). Each thread computes P = exp2(s·c − m) and its packed row
    sums as `half_p` does, but neither the max (one FMNMX a score and the shuffles) nor the
    accumulator's rescale (one FMUL an output element). If any partial sum in the warp passes
    `STALE_SUM_LIMIT` (at 64×128, a score 6-10 above m in log2 units; or inf / NaN: the first
    step, whose m is -inf), the warp takes the exact online-softmax step instead: the rows' new
    max, P again, acc and l8 rescaled. The result is the same softmax: a kept max differs from the
    exact one only by a factor 2^(m_exact − m) ≤ 2^10 on P, acc and l alike.
    `valid` (static) < N: the tile's ragged kv block comes first (the kernel walks it first), so only
    the exact branch masks, and only in the rows whose m is still -inf: keys from `valid` on → -inf
    (the registers wholly before `valid` are left alone)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, scf, vector

    layout, rows = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(layout, rows, layout, layout),
                       return_type=(plgpu.ShapeDtypeStruct(s.shape, jnp.float16, layout=layout),
                                    plgpu.ShapeDtypeStruct(m.shape, jnp.float32, layout=rows),
                                    plgpu.ShapeDtypeStruct(l8.shape, jnp.float32, layout=layout),
                                    plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=layout)))
    def softmax(ctx, s, m, l8, acc):
        del ctx
        i1, i32 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32)
        f32 = ir.F32Type.get()
        by_row = lambda r, like: r.broadcast_in_dim(like.shape, (0,), like.layout)  # noqa: E731
        p, sums = _exp2_half_registers(s * c - by_row(m, s))
        limit = arith.constant(f32, ir.FloatAttr.get(f32, STALE_SUM_LIMIT))
        over = arith.constant(i1, ir.IntegerAttr.get(i1, 0))
        for reg in sums.registers.flat:
            for i in (0, 1):
                elem = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                over = arith.ori(over, arith.cmpf(arith.CmpFPredicate.UGT, elem, limit))  # inf and NaN too
        vote = llvm.inline_asm(i32, [arith.extui(i32, over)], _WARP_ANY, "=r,r", has_side_effects=True)
        rescale = arith.cmpi(arith.CmpIPredicate.ne, vote, arith.constant(i32, 0))

        outs = (p, m, l8, acc, sums)
        flat = lambda arrays: [r for a in arrays for r in a.registers.flat]  # noqa: E731
        branch = scf.IfOp(rescale, [r.type for r in flat(outs)], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            if valid < s.shape[1]:
                first, regs = by_row(m, s), s.registers.copy()
                cols = mgpu.FragmentedArray.broadcasted_iota(f32, s.shape, 1, s.layout)
                vec = regs.flat[0].type
                ninf = arith.constant(vec, ir.DenseElementsAttr.get_splat(vec, ir.FloatAttr.get(f32, -math.inf)))
                bound = arith.constant(vec, ir.DenseElementsAttr.get_splat(vec, ir.FloatAttr.get(f32, float(valid))))
                for idx in np.ndindex(regs.shape):
                    if idx[1] >= valid // 8:  # axis 1: the registers' 8-key column groups
                        past = arith.cmpf(arith.CmpFPredicate.OGE, cols.registers[idx], bound)
                        unseen = arith.cmpf(arith.CmpFPredicate.OEQ, first.registers[idx], ninf)
                        regs[idx] = arith.select(arith.andi(past, unseen), ninf, regs[idx])
                s = mgpu.FragmentedArray(_registers=regs, _layout=s.layout, _is_signed=None)
            m_new = m.max(s.reduce("max", 1) * c)
            p2, sums2 = _exp2_half_registers(s * c - by_row(m_new, s))
            alpha = (m - m_new).exp2(approx=True)  # 0 in the first step (m = -inf; acc and l8 are 0)
            scf.YieldOp(flat((p2, m_new, l8 * by_row(alpha, l8), acc * by_row(alpha, acc), sums2)))
        with ir.InsertionPoint(branch.else_block):
            scf.YieldOp(flat(outs))
        results, new = list(branch.results), []
        for a in outs:
            regs = np.empty(a.registers.shape, dtype=object)
            for idx in np.ndindex(regs.shape):
                regs[idx] = results.pop(0)
            new.append(mgpu.FragmentedArray(_registers=regs, _layout=a.layout, _is_signed=None))
        p, m, l8, acc, sums = new
        return p, m, l8 + sums, acc

    return softmax(s, m, l8, acc)


def _amax_scale(x, axes, top=F8_MAX):
    """The scale that maps the amax over `axes` to `top` (the format's largest value)."""
    return jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True), 1e-12) / top


def _to_f8(x, scale):
    return jnp.clip(x.astype(jnp.float32) / scale, -F8_MAX, F8_MAX).astype(F8)


def _to_i8(x, scale):
    return jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)


def fp8_operands(q, k, v, qk_int8=False, v_operand_order=False):
    """bf16 (B, S, H, D) q, k, v → the FP8 kernel's operands: q8, k8 e4m3 (B, S8, H, D) (lengths
    padded to 8), vt8 e4m3 (B, H, D, Skv128) (V transposed, its length padded to 128; with
    `v_operand_order`, its keys in `KEY_ORDER_16` as the kernel takes them) and `scales`
    (B, H, 2, Sq8) f32: per query row, the exp2 argument's factor log2(e)/√D · s_q · s_k and the
    output's factor s_v. Scales: Q one per token and head, K and V one per (batch, head); each maps
    its amax to the format's largest value (e4m3 448, int8 127).
    `qk_int8`: Q and K in int8 instead (SageAttention's recipe: 7 bits where e4m3 has 3, for the
    logits the softmax amplifies), K first smoothed by its mean over the keys: q·(k_j − k̄) differs
    from q·k_j by a constant per query row, which the softmax cancels, and K's range shrinks."""
    sq, skv = q.shape[1], k.shape[1]
    if qk_int8:
        k = k.astype(jnp.float32) - jnp.mean(k.astype(jnp.float32), axis=1, keepdims=True)
    top = 127.0 if qk_int8 else F8_MAX
    q_scale = _amax_scale(q, (3,), top)                                      # (B, Sq, H, 1)
    k_scale, v_scale = _amax_scale(k, (1, 3), top), _amax_scale(v, (1, 3))  # (B, 1, H, 1)
    quant = _to_i8 if qk_int8 else _to_f8
    q8 = _pad_to_8(quant(q, q_scale))
    k8 = _pad_to_8(quant(k, k_scale))
    # V transposed in bf16, in a pass of its own, then quantised (and its keys put in order) in the
    # next: fused, XLA emits the whole as one many-dimensional transpose of 1-byte elements at ~0.4
    # TB/s (on an H200: 2.96 ms a 14B layer, against 1.20 ms as two passes).
    vt = lax.optimization_barrier(jnp.pad(v, ((0, 0), (0, -skv % 128), (0, 0), (0, 0))).transpose(0, 2, 3, 1))
    vt8 = _to_f8(vt, v_scale.transpose(0, 2, 3, 1))
    if v_operand_order:
        vt8 = _v_in_operand_order(vt8)
    rows = lambda x: jnp.pad(x[..., 0].transpose(0, 2, 1), ((0, 0), (0, 0), (0, -sq % 8)))  # noqa: E731  (B, H, Sq8)
    logit = rows(LOG2E / math.sqrt(q.shape[-1]) * q_scale * k_scale)
    out = rows(jnp.broadcast_to(v_scale, q_scale.shape))
    return q8, k8, vt8, jnp.stack([logit, out], axis=2)


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv", "stages", "persistent", "q_major", "qk_int8",
                                             "pv_two_level", "fa3_turns", "cluster", "pv_row_sums", "ceiling"))
def mgpu_attention_fp8(q, k, v, block_q=64, block_kv=256, stages=2, persistent=0, q_major=False, qk_int8=False,
                       pv_two_level=True, fa3_turns=False, cluster=1, pv_row_sums=None, ceiling=None):
    """(B, S, H, D) bf16 → (B, Sq, H, D) bf16, both matrix products on the FP8 tensor cores (FA3's
    FP8 path), operands from `fp8_operands` (one XLA pass per tensor). The per-row factors fold into
    the softmax's exp2 argument and the output's 1/l, so the kernel adds no multiply per score. e4m3
    WGMMA reads both operands K-major, hence V transposed; P stays in registers as 2^P_SHIFT · p in
    `KEY_ORDER_16` (module docstring).

    `pv_two_level` (SageAttention2's two-level accumulation; on in `tuning.GPU_FP8_BLOCKS`): Hopper's
    FP8 MMA keeps about 14 bits when it adds products into its accumulator (DeepSeek-V3's report).
    Accumulating every step into the running output, a product under 2^-14 of that sum is cut away;
    with V's rows sharing a mean (as in a DiT, not in random tests) the sum grows with the keys and
    the loss with it (`benchmarks/fp8_error.py --accumulation` emulates that rule). Each step's P·V in a
    fresh accumulator, added in float32, took the 1.3B forward's error against bf16 from 1.12e-1 to
    8.5e-3 on an H200, and the kernel 3% faster (the rescale became the add's multiply).
    `fa3_turns` (on in `tuning.GPU_FP8_BLOCKS`): FA3's turn hand-over (module docstring); with P in
    registers as fast as the alternation (a tie, kept on).
    `cluster=2` (on there too): CTA pairs sharing each K/V tile (module docstring), 0.6-1.6% faster.
    `pv_row_sums` (default: with `pv_two_level`; on in `tuning.GPU_FP8_BLOCKS`): the row sums l come
    from P·V itself. V's transposed tile gets 8 more rows in shared memory, loaded once: ones, then
    zeros (`_ones_rows`). The product's column D is then Σ P, rescaled and carried with the output,
    and the softmax's one FADD a weight is gone. It sums the e4m3 P that the output sums, where the
    FADDs summed P before rounding. The accumulator is 8 columns wider (P·V +6%). With one running
    FP8 accumulator the growing sums would lose bits, hence two-level only. `ceiling` as in
    `mgpu_attention`."""
    if pv_row_sums is None:
        pv_row_sums = pv_two_level
    q8, k8, vt8, scales = fp8_operands(q, k, v, qk_int8, v_operand_order=True)
    out = _kernel_call(q8, k8, vt8, scales, skv=k.shape[1], block_q=block_q, block_kv=block_kv,
                       stages=stages, persistent=persistent, q_major=q_major, pv_two_level=pv_two_level,
                       fa3_turns=fa3_turns, cluster=cluster, pv_row_sums=pv_row_sums, ceiling=ceiling)
    return out[:, :q.shape[1]]


def _ones_rows(block_kv):
    """`pv_row_sums`' 8 extra rows of transposed V: ones, then seven rows of zeros (e4m3)."""
    return jnp.zeros((8, block_kv), F8).at[0].set(1.0)


def _split_row_sums(acc, d):
    """(64·m, d + 8) f32 accumulator whose column d holds the row sums (`pv_row_sums`; the other 7
    extra columns are 0) → (the (64·m, d) output, the (64·m, 8) extra columns: `.sum(axis=1)` is l)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=(plgpu.ShapeDtypeStruct((acc.shape[0], d), jnp.float32, layout=plgpu.Layout.WGMMA),
                                    plgpu.ShapeDtypeStruct((acc.shape[0], 8), jnp.float32, layout=plgpu.Layout.WGMMA)))
    def split(ctx, acc):
        del ctx
        regs = acc.registers  # axis 1: 8-column groups
        return (mgpu.FragmentedArray(_registers=regs[:, :d // 8], _layout=mgpu.WGMMA_LAYOUT, _is_signed=None),
                mgpu.FragmentedArray(_registers=regs[:, d // 8:], _layout=mgpu.WGMMA_LAYOUT, _is_signed=None))

    return split(acc)


def _kernel_call(q, k, v, scales, skv, block_q, block_kv, stages, persistent, q_major, pv_two_level=False,
                 overlap=False, fa3_turns=False, cluster=1, half_p=False, stale_max=False, pv_row_sums=False,
                 ceiling=None):
    """`scales` None: q, k, v in bf16 / fp16, (B, S, H, D). Else FP8 (`mgpu_attention_fp8`): q, k
    e4m3 (B, S, H, D), v e4m3 transposed (B, H, D, S) with its keys in `KEY_ORDER_16` within every 16
    (`_v_in_operand_order`), and `scales` (B, H, 2, Sq) f32 holding per query row the exp2 argument's
    factor and the output's factor. `pv_two_level` (see `mgpu_attention_fp8`): each step's P·V summed
    in a fresh accumulator, then added in float32."""
    b, sq, h, d = q.shape
    fp8 = scales is not None
    qk_int8 = q.dtype == jnp.int8
    dtype = jnp.bfloat16 if fp8 else q.dtype  # the output's
    if fp8:
        if q.dtype not in (F8, jnp.int8) or k.dtype != q.dtype or v.dtype != F8:
            raise WanInputError("the FP8 Hopper attention kernel needs e4m3 (or int8) q and k, e4m3 v; "
                                f"got {q.dtype}, {k.dtype}, {v.dtype}")
        if block_kv % 128:
            raise WanInputError(f"the FP8 kernel's block_kv ({block_kv}) must be a multiple of 128 (one 128-byte swizzle of V's keys)")
    elif dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != dtype or v.dtype != (jnp.float16 if half_p else dtype):
        raise WanInputError("the Hopper attention kernel needs bf16 or fp16 q, k, v (v fp16 with half_p); "
                            f"got {q.dtype}, {k.dtype}, {v.dtype}")
    pv_dtype = v.dtype  # P's, for P·V
    if d % 64 or block_q % 64 or block_kv % 64:
        raise WanInputError(f"head dim ({d}), block_q ({block_q}) and block_kv ({block_kv}) must be multiples of 64")
    if ceiling not in (None, "no_exp2", "no_softmax") or (ceiling and (half_p or overlap or (pv_two_level and not fp8))):
        raise WanInputError("ceiling must be None, 'no_exp2' or 'no_softmax' (the 8-bit kernel, or the bf16 one without "
                            f"half_p, overlap or pv_two_level), got {ceiling!r}")
    if stale_max and (not half_p or overlap or pv_two_level):
        raise WanInputError("stale_max is a half_p option, without overlap or pv_two_level")
    if pv_row_sums and not (fp8 and pv_two_level):
        raise WanInputError("pv_row_sums is an option of the 8-bit kernel with pv_two_level (a running FP8 "
                            "accumulator would cut the growing row sums to its ~14 bits)")
    if overlap and (fp8 or pv_two_level):
        raise WanInputError("overlap (FA3's intra-warpgroup overlap) is a bf16 / fp16 option without pv_two_level")
    if persistent < 0:
        raise WanInputError(f"persistent must be 0 (one CTA per tile) or a CTA count, got {persistent}")
    if cluster not in (1, 2, 4) or (cluster > 1 and persistent):
        raise WanInputError(f"cluster must be 1, or 2 or 4 without persistent CTAs; got cluster={cluster}, persistent={persistent}")
    kv_steps = pl.cdiv(skv, block_kv)
    q_tiles = pl.cdiv(sq, COMPUTE_WGS * block_q)
    num_tiles = b * h * q_tiles
    ctas = min(persistent, num_tiles)
    # One CTA walks its tiles with one K/V ring: the ring may be deeper than one tile's kv steps.
    stages = min(stages, kv_steps * (pl.cdiv(num_tiles, ctas) if ctas else 1))
    ones_rows = pv_row_sums * stages * 8 * block_kv  # bytes of `pv_row_sums`' extra V rows
    if _smem_bytes(block_q, block_kv, stages, d, q.dtype.itemsize, fp8) + ones_rows > SMEM_BYTES:
        raise WanInputError(f"block_q {block_q}, block_kv {block_kv}, {stages} stages exceed {SMEM_BYTES} bytes of shared memory")
    last_valid = skv - (kv_steps - 1) * block_kv
    ragged_first = stale_max and last_valid < block_kv  # see `_stale_max_softmax`
    fa3_turns = fa3_turns or overlap
    c = LOG2E / math.sqrt(d)
    dv = d + 8 if pv_row_sums else d  # V's rows (transposed) and the output accumulator's columns

    def kernel(q_ref, k_ref, v_ref, s_ref, ones_ref, o_ref, smem, loaded, consumed, turn):
        qo_tiles, k_ring, v_ring, *fp8_smem = smem  # FP8: + output and row-scale tiles
        o_tiles, sc_tiles = fp8_smem or (None,) * 2
        q_loaded, k_loaded, v_loaded, *fp8_loaded = loaded
        sc_loaded = fp8_loaded[0] if fp8 else None
        ones_loaded = fp8_loaded[1] if pv_row_sums else None
        k_consumed, v_consumed, *done = consumed
        wg = lax.axis_index("wg")

        if ctas:
            cta = lax.axis_index("cta")
            my_tiles = lax.div(num_tiles - cta + ctas - 1, jnp.int32(ctas))

            def tile_coords(i):
                t = cta + i * ctas
                head_batch = lax.div(t, jnp.int32(q_tiles))
                return lax.div(head_batch, jnp.int32(h)), lax.rem(head_batch, jnp.int32(h)), lax.rem(t, jnp.int32(q_tiles))
        else:
            my_tiles = 1

            def tile_coords(i):
                qt = lax.axis_index("q_tiles")
                if cluster > 1:  # a cluster's q tiles are adjacent; the last cluster's may run past the end
                    qt = qt * cluster + lax.axis_index("cluster")
                return lax.axis_index("batch"), lax.axis_index("heads"), qt

        total_steps = my_tiles * kv_steps

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        def slot_of(g):
            return lax.rem(g, jnp.int32(stages))

        def leave_together():
            """A cluster's CTAs leave together: none exits while another may still arrive on its barriers."""
            if done:
                plgpu.barrier_arrive(done[0])
                plgpu.barrier_wait(done[0])

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            if pv_row_sums:
                for slot in range(stages):
                    plgpu.barrier_wait(ones_loaded.at[slot])
            qo = qo_tiles.at[wg]
            row_layout = plgpu.Layout.WGMMA.reduce(1)

            def online_softmax(s, m, l, valid, cs=None):
                """One step's scores → (new row max, the old sums' rescale, exp2 weights, new row sums),
                in log2 units. `valid` (static) < block_kv masks the past-the-end keys."""
                if valid < block_kv:
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(cols < valid, s, -jnp.inf)
                if fp8 and ceiling == "no_softmax":  # the scaled scores go to P·V (the multiply keeps
                    return m, None, s * lax.broadcast_in_dim(cs, s.shape, [0]), l  # int8's I2F unfolded)
                if fp8:  # the per-row factor (scales > 0, so the row max commutes with it)
                    m_new = jnp.maximum(m, s.max(axis=1) * cs)
                    p = (s * lax.broadcast_in_dim(cs, s.shape, [0])
                         - lax.broadcast_in_dim(m_new - P_SHIFT, s.shape, [0]))
                    if ceiling == "no_exp2":  # neither P's exp2 nor the rescale's
                        alpha = m - m_new
                    else:
                        alpha, p = jnp.exp2(m - m_new), jnp.exp2(p)
                    # `pv_row_sums`: P·V sums the rows (V's row of ones), l stays unused until then
                    return m_new, alpha, p, l if pv_row_sums else l * alpha + p.sum(axis=1)
                elif ceiling == "no_softmax":  # the scores go straight to P·V; no rescale either
                    return m, None, s, l
                elif ceiling == "no_exp2":
                    m_new = jnp.maximum(m, s.max(axis=1) * c)
                    p = s * c - lax.broadcast_in_dim(m_new, s.shape, [0])
                    return m_new, m - m_new, p, l * (m - m_new) + p.sum(axis=1)
                else:
                    m_new = jnp.maximum(m, s.max(axis=1) * c)
                    alpha = jnp.exp2(m - m_new)
                    if half_p:
                        p, sums = _exp2_half_with_row_sums(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                        return m_new, alpha, p, l * alpha + sums.sum(axis=1)
                    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                return m_new, alpha, p, l * alpha + p.sum(axis=1)

            def step(j, carry, base, valid=block_kv, cs=None):
                """kv step j of the tile whose first global ring step is `base`: Q·Kᵀ, online
                softmax, P·V. `valid` (static) < block_kv masks the past-the-end keys of the last step.
                `cs` (FP8): the rows' exp2-argument factors. `stale_max`: the carry's row sums are
                (block_q, 8) partials."""
                acc, m, l = carry
                slot = slot_of(base + j)

                def scores(s_ref):
                    plgpu.wgmma(s_ref, qo, plgpu.transpose_ref(k_ring.at[slot], (1, 0)))
                    pass_turn() if fa3_turns else take_turn()
                    return s_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.int32 if qk_int8 else jnp.float32))
                if qk_int8:
                    s = s.astype(jnp.float32)
                plgpu.barrier_arrive(k_consumed.at[slot])
                if stale_max:
                    # One copy of the step for the whole tile (code that runs once a tile seems to
                    # come from outside the instruction cache). The ragged kv block is walked first,
                    # so only the exact branch masks.
                    p, m_new, l, acc = _stale_max_softmax(s, m, l, acc, c, last_valid)
                    alpha = None
                else:
                    m_new, alpha, p, l = online_softmax(s, m, l, valid, cs)
                if not pv_two_level and alpha is not None:  # else rescaled as this step's P·V is added (below)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p = _p_operand_8bit(p.astype(F8)) if fp8 else p.astype(pv_dtype)
                # Keep the softmax ahead of the hand-over: the compiler must not sink it past the
                # barriers into the other warpgroup's tensor-core turn.
                acc, l, m_new, alpha, p = lax.optimization_barrier((acc, l, m_new, alpha if pv_two_level else None, p))
                if fa3_turns:
                    plgpu.barrier_wait(v_loaded.at[slot])
                    my_turn()
                else:
                    plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(v_loaded.at[slot])
                    plgpu.barrier_wait(turn)

                def update(acc_ref):
                    # FP8: V is stored transposed (e4m3 WGMMA reads B K-major only).
                    plgpu.wgmma(acc_ref, p, plgpu.transpose_ref(v_ring.at[slot], (1, 0)) if fp8 else v_ring.at[slot])

                    @pl.when(j + 1 < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_loaded.at[slot_of(base + j + 1)])

                if pv_two_level:
                    # This step's P·V in a fresh accumulator, added to the running one in float32
                    # registers (the rescale becomes that FMA's multiply).
                    def fresh(pv_ref):
                        update(pv_ref)
                        return pv_ref[...]

                    pv = pl.run_scoped(fresh, plgpu.ACC((block_q, dv), jnp.float32))
                    acc = acc + pv if alpha is None else acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
                else:
                    acc = pl.run_state(update)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_new, l

            def my_turn():  # fa3_turns: wait until the other warpgroup has issued its products
                plgpu.barrier_wait(turn.at[wg])

            def pass_turn():  # fa3_turns: let the other warpgroup issue its products
                plgpu.barrier_arrive(turn.at[1 - wg])

            def overlapped_steps(base, m, l):
                """The kv steps of one tile with FA3's intra-warpgroup overlap (bf16): in each turn on
                the tensor cores a warpgroup issues Q·Kᵀ of step j+1 and P·V of step j together, hands
                the turn over, waits for the scores only and runs step j+1's softmax while its P·V (and
                the other warpgroup's products) run; the output accumulator is rescaled once that P·V
                is done. Turns (FA3's scheduler barriers): a warpgroup waits only before issuing, for
                the other to have issued, so the two softmaxes are not forced to alternate. Live
                registers: the scores, P of step j and the accumulator (at 64 × 128: 64 + 32 + 64 a
                thread). Returns the unnormalised output and the row sums."""
                def ragged(j):  # the step whose softmax sees the past-the-end keys
                    return last_valid if j == kv_steps - 1 else block_kv

                def with_output(o_ref):
                    def first_scores(s_ref):
                        my_turn()
                        plgpu.wgmma(s_ref, qo, plgpu.transpose_ref(k_ring.at[slot_of(base)], (1, 0)))
                        pass_turn()
                        return s_ref[...]

                    s = pl.run_scoped(first_scores, plgpu.ACC((block_q, block_kv), jnp.float32))
                    plgpu.barrier_arrive(k_consumed.at[slot_of(base)])
                    m0, _, p, l0 = online_softmax(s, m, l, ragged(0))
                    carry = lax.optimization_barrier((p.astype(pv_dtype), m0, l0))

                    def body(j, carry, valid=block_kv):
                        p, m, l = carry
                        slot, nxt = slot_of(base + j), slot_of(base + j + 1)
                        plgpu.barrier_wait(k_loaded.at[nxt])
                        plgpu.barrier_wait(v_loaded.at[slot])

                        def scores_and_update(s_ref):
                            my_turn()
                            plgpu.wgmma(s_ref, qo, plgpu.transpose_ref(k_ring.at[nxt], (1, 0)))
                            plgpu.wgmma(o_ref, p, v_ring.at[slot])
                            pass_turn()
                            return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # P·V may still run

                        s = pl.run_scoped(scores_and_update, plgpu.ACC((block_q, block_kv), jnp.float32))
                        plgpu.barrier_arrive(k_consumed.at[nxt])
                        m_new, alpha, p, l = online_softmax(s, m, l, valid)
                        acc = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
                        plgpu.barrier_arrive(v_consumed.at[slot])
                        o_ref[...] = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                        # As in `step`: the softmax stays ahead of the next turn.
                        return lax.optimization_barrier((p.astype(pv_dtype), m_new, l))

                    # Step j's loop trip issues the products of steps j+1 (Q·Kᵀ) and j (P·V).
                    full = kv_steps - 1 - (kv_steps > 1 and last_valid < block_kv)
                    carry = lax.fori_loop(0, full, body, carry)
                    if full < kv_steps - 1:
                        carry = lax.fori_loop(kv_steps - 2, kv_steps - 1,
                                              functools.partial(body, valid=ragged(kv_steps - 1)), carry)
                    p, _, l_out = carry
                    last = slot_of(base + kv_steps - 1)
                    plgpu.barrier_wait(v_loaded.at[last])
                    my_turn()
                    plgpu.wgmma(o_ref, p, v_ring.at[last])
                    pass_turn()
                    acc = o_ref[...]
                    plgpu.barrier_arrive(v_consumed.at[last])
                    return acc, l_out

                return pl.run_scoped(with_output, plgpu.ACC((block_q, d), jnp.float32))

            def tile(i):
                bi, hi, qt = tile_coords(i)
                rows = pl.ds(qt * (COMPUTE_WGS * block_q) + wg * block_q, block_q)
                if ctas:
                    # The previous tile's output store must have read `qo` before Q overwrites it.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi], qo, q_loaded.at[wg])
                if fp8:
                    plgpu.copy_gmem_to_smem(s_ref.at[bi, hi, :, rows], sc_tiles.at[wg], sc_loaded.at[wg])
                    plgpu.barrier_wait(sc_loaded.at[wg])
                    cs = plgpu.load(sc_tiles.at[wg, 0], (), layout=row_layout)
                    os_ = plgpu.load(sc_tiles.at[wg, 1], (), layout=row_layout)
                plgpu.barrier_wait(q_loaded.at[wg])
                m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
                l = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32), row_layout)
                acc = plgpu.layout_cast(jnp.full((block_q, dv), 0, jnp.float32), plgpu.Layout.WGMMA)
                base = i * kv_steps
                plgpu.barrier_wait(k_loaded.at[slot_of(base)])
                # The ragged step runs as a one-trip loop so that its index stays a loop variable:
                # Mosaic GPU wants barrier and ring indices as values, not folded constants.
                if overlap:
                    acc, l = overlapped_steps(base, m, l)
                else:
                    if fa3_turns:  # the turn spans P·V of step j and Q·Kᵀ of step j + 1
                        my_turn()
                    body = functools.partial(step, base=base, cs=cs if fp8 else None)
                    if stale_max:  # row sums as (block_q, 8) partials; one loop (the ragged block first)
                        l = plgpu.layout_cast(jnp.full((block_q, 8), 0, jnp.float32), plgpu.Layout.WGMMA)
                        carry = lax.fori_loop(0, kv_steps, body, (acc, m, l))
                    else:
                        carry = lax.fori_loop(0, kv_steps - (last_valid < block_kv), body, (acc, m, l))
                        if last_valid < block_kv:
                            carry = lax.fori_loop(kv_steps - 1, kv_steps, functools.partial(body, valid=last_valid), carry)
                    if fa3_turns:
                        pass_turn()
                    acc, _, l = carry
                    if stale_max:
                        l = l.sum(axis=1)
                    if pv_row_sums:
                        acc, l8 = _split_row_sums(acc, d)
                        l = l8.sum(axis=1)
                acc = acc * lax.broadcast_in_dim((os_ / l) if fp8 else (1.0 / l), acc.shape, [0])
                out = o_tiles.at[wg] if fp8 else qo
                out[...] = acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out, o_ref.at[bi, rows, hi])

            if fa3_turns:  # warpgroup 0 issues first
                pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))
            else:
                pl.when(wg == 1)(take_turn)
            if ctas:
                @pl.loop(0, my_tiles)
                def _(i):
                    tile(i)
            else:
                tile(jnp.int32(0))
            if not fa3_turns:
                pl.when(wg == 0)(take_turn)
            plgpu.wait_smem_to_gmem(0)
            leave_together()

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            # In a cluster each CTA loads its share of every tile, multicast into all the cluster's rings.
            pair = "cluster" if cluster > 1 else None

            def fetch(g, slot):
                i = lax.div(g, jnp.int32(kv_steps))
                bi, hi, _ = tile_coords(i)
                t = g - i * kv_steps
                if ragged_first:  # step 0 takes the last (ragged) kv block, step t the block t - 1
                    t = lax.rem(t + (kv_steps - 1), jnp.int32(kv_steps))
                rows = pl.ds(t * block_kv, block_kv)
                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, hi], k_ring.at[slot], k_loaded.at[slot], collective_axes=pair)
                return bi, hi, rows

            def fetch_v(where, slot):
                bi, hi, rows = where
                src = v_ref.at[bi, hi, :, rows] if fp8 else v_ref.at[bi, rows, hi]
                dst = v_ring.at[slot, pl.ds(0, d)] if pv_row_sums else v_ring.at[slot]
                plgpu.copy_gmem_to_smem(src, dst, v_loaded.at[slot], collective_axes=pair)

            if pv_row_sums:  # the row of ones (and 7 of zeros) under every slot's V, once
                for slot in range(stages):
                    plgpu.copy_gmem_to_smem(ones_ref, v_ring.at[slot, pl.ds(d, 8)], ones_loaded.at[slot])

            for slot in range(stages):
                if ctas:
                    # A CTA may own fewer ring steps than the ring has slots (its last tiles).
                    @pl.when(slot < total_steps)
                    def _():
                        fetch_v(fetch(jnp.int32(slot), slot), slot)
                else:
                    fetch_v(fetch(jnp.int32(slot), slot), slot)

            # K and V slots are released separately (K after Q·Kᵀ, V after P·V): waiting for both
            # before refilling either would tie the next K tile to the slower warpgroup's P·V.
            @pl.loop(stages, total_steps)
            def _(g):
                slot = slot_of(g)
                plgpu.barrier_wait(k_consumed.at[slot])
                where = fetch(g, slot)
                plgpu.barrier_wait(v_consumed.at[slot])
                fetch_v(where, slot)

            leave_together()

    def entry(q_ref, k_ref, v_ref, *refs):
        s_ref, *ones, o_ref = refs if fp8 else (None, *refs)  # `pv_row_sums`: + the ones rows
        ones_ref = ones[0] if ones else None
        # 128-byte swizzled rows: 64 bf16 or 128 e4m3 elements per tile column.
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        in_transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128)) if fp8 else transforms
        smem = (
            plgpu.SMEM((COMPUTE_WGS, block_q, d), q.dtype, transforms=in_transforms),
            plgpu.SMEM((stages, block_kv, d), q.dtype, transforms=in_transforms),
            plgpu.SMEM((stages, dv, block_kv) if fp8 else (stages, block_kv, d), v.dtype, transforms=in_transforms),
        )
        loaded = (
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        )
        if fp8:  # the bf16 output tiles, the per-row scales
            smem += (
                plgpu.SMEM((COMPUTE_WGS, block_q, d), dtype, transforms=transforms),
                plgpu.SMEM((COMPUTE_WGS, 2, block_q), jnp.float32),
            )
            loaded += (plgpu.Barrier(num_barriers=COMPUTE_WGS),)
            if pv_row_sums:
                loaded += (plgpu.Barrier(num_barriers=stages),)
        if cluster > 1:  # a slot is free once every compute warpgroup of the cluster is done with it
            consumed = (plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=COMPUTE_WGS,
                                             num_barriers=stages),) * 2
            consumed += (plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=COMPUTE_WGS + 1),)
        else:
            consumed = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2
        # The tensor-core turn: one barrier both warpgroups meet at, or (fa3_turns) one per warpgroup
        # that the other arrives at once it has issued its products.
        turn = plgpu.Barrier(num_barriers=COMPUTE_WGS) if fa3_turns else plgpu.Barrier(num_arrivals=COMPUTE_WGS)
        pl.run_scoped(
            lambda *scratch: kernel(q_ref, k_ref, v_ref, s_ref, ones_ref, o_ref, *scratch),
            smem, loaded, consumed, turn,
            collective_axes="wg",
        )

    q_groups = pl.cdiv(q_tiles, cluster)  # grid entries along q: one per cluster of q tiles
    if ctas:
        grid, names = (ctas,), ("cta",)
    elif q_major:
        grid, names = (q_groups, h, b), ("q_tiles", "heads", "batch")
    else:
        grid, names = (h, q_groups, b), ("heads", "q_tiles", "batch")
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=grid,
        grid_names=names,
        cluster=(cluster,) if cluster > 1 else (),
        cluster_names=("cluster",) if cluster > 1 else (),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, *(() if scales is None else (scales,)), *((_ones_rows(block_kv),) if pv_row_sums else ()))
