"""Attention tiles: per TPU generation for `splash_exp2`, and the measured GPU choices.

TPU: the v6e row is the published Wan 2.1 exp2 splash tuning (block_q 3328, block_kv 2816,
block_kv_compute 256, inner step 256, low-latency LLO scheduler). The other rows are NOT measured
on their chips: they are derived from each chip's public figures (`TPU_CHIPS`) by three
rules, which `tests/shared/test_splash_exp2.py` checks row by row:
1. block_q ≥ 4 × (bf16 peak ÷ HBM bandwidth). Each K/V row (2·D·2 bytes) fetched from HBM feeds
   4·block_q·D FLOPs, so block_q FLOP/byte is the kernel's arithmetic intensity; 4× the ridge point
   keeps the K/V stream (re-read once per q block) far from the bandwidth roof.
2. One grid step (4·block_q·block_kv·D FLOPs) lasts ≥ 10× the ~0.35 µs per-step pipeline overhead
   at the chip's peak, so the overhead stays under 10%: the fast chips (v6e, v7x) need big tiles.
3. Everything the kernel keeps in VMEM (`vmem_bytes`: double-buffered q, k, v and out blocks, the
   f32 accumulator, running max and sum, one f32 score chunk and one probability step) fits in
   `vmem_limit_bytes`, which leaves ≥ 25% of the core's VMEM to the compiler. block_kv_compute
   and block_kv_compute_in are multiples of the MXU width (128 before v6e, 256 from v6e on): the
   score chunk is one K·Qᵀ product, and the running max (hence the rescaling of the accumulator)
   is updated once per chunk, so a wider chunk also rescales less often.

GPU: `GPU_BLOCKS` holds the Hopper kernel's tiles and `GPU_FASTEST` which of our Pallas kernel and
cuDNN was faster, per shape class, in `benchmarks/bench_attention.py`; `impl=None` on a Hopper GPU
reads it (other GPUs get cuDNN: our kernel there is the Triton fallback). The environment variable
`WAN_TPU_ATTENTION` overrides every automatic choice.
"""

from __future__ import annotations

import dataclasses

import jax

from wan_tpu.errors import WanInputError

BLOCK_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_kv_compute_in")
_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int
    block_kv: int
    block_kv_compute: int
    block_kv_compute_in: int
    vmem_limit_bytes: int
    low_latency_scheduler: bool = True

    def __post_init__(self):
        for field in BLOCK_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise WanInputError(f"{field} must be a positive int, got {value!r}")


def check_block_keys(block_sizes) -> dict:
    """`block_sizes` as a dict; unknown keys are an error (a typo must not silently fall back)."""
    block_sizes = dict(block_sizes or {})
    unknown = sorted(set(block_sizes) - set(BLOCK_FIELDS))
    if unknown:
        raise WanInputError(f"unknown block_sizes keys {unknown}; valid keys are {list(BLOCK_FIELDS)}")
    return block_sizes


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """Public per-TensorCore figures of one TPU generation."""

    vmem_bytes: int
    mxu: int  # systolic array width
    bf16_flops: float  # per chip
    hbm_bytes_per_s: float  # per chip


TPU_CHIPS = {
    "v4": TpuChip(16 * _MIB, 128, 275e12, 1.2e12),
    "v5e": TpuChip(128 * _MIB, 128, 197e12, 0.82e12),
    "v5p": TpuChip(64 * _MIB, 128, 459e12, 2.77e12),
    "v6e": TpuChip(128 * _MIB, 256, 918e12, 1.64e12),
    "v7x": TpuChip(64 * _MIB, 256, 2307e12, 7.37e12),
}
STEP_OVERHEAD_S = 0.35e-6

TPU_BLOCK_SIZES = {
    # Published; intensity 3328 (ridge 560), 5.2 µs per grid step, ~15 MB of VMEM.
    "v6e": BlockSizes(3328, 2816, 256, 256, vmem_limit_bytes=64 * _MIB),
    # Ridge 240: block_q 2048 is 8×; a step is 11 µs at 197 TFLOP/s.
    "v5e": BlockSizes(2048, 2048, 256, 256, vmem_limit_bytes=64 * _MIB),
    # Ridge 166; 4.7 µs per step.
    "v5p": BlockSizes(2048, 2048, 256, 256, vmem_limit_bytes=48 * _MIB),
    # 2.5× v6e's FLOP rate: v6e's tiles would spend 3.6 µs per step, so both grow (8.6 GFLOP, 3.7 µs
    # per step); ridge 313. 512-key score chunks (two MXU widths) halve the accumulator rescales.
    "v7x": BlockSizes(4096, 4096, 512, 256, vmem_limit_bytes=48 * _MIB),
    # Ridge 229; 3.9 µs per step; 16 MiB of VMEM: ~6 MB used.
    "v4": BlockSizes(1024, 2048, 256, 256, vmem_limit_bytes=12 * _MIB),
}
# `jax.Device.device_kind` → generation. Unknown kinds, and exporting for TPU from a host without
# one, get the published v6e tuning.
_GENERATION = {
    "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
    "TPU v5": "v5p", "TPU v5p": "v5p", "TPU7x": "v7x", "TPU7": "v7x", "TPU v4": "v4",
}


def vmem_bytes(blocks: BlockSizes, head_dim: int = 128, itemsize: int = 2) -> int:
    """VMEM the splash kernel keeps live with these (unclipped) tiles: double-buffered q, k, v and
    out blocks, the f32 accumulator and running max/sum (8 sublanes each), one f32 score chunk
    and one f32 probability step."""
    io = 2 * (2 * blocks.block_q + 2 * blocks.block_kv) * head_dim * itemsize
    scratch = (head_dim + 2 * 8) * blocks.block_q * 4
    live = (blocks.block_kv_compute + blocks.block_kv_compute_in) * blocks.block_q * 4
    return io + scratch + live


def tpu_block_sizes(overrides=None) -> BlockSizes:
    """The table row for the local TPU (v6e when there is none), with `overrides` applied."""
    kind = jax.devices()[0].device_kind if jax.default_backend() == "tpu" else None
    base = TPU_BLOCK_SIZES[_GENERATION.get(kind, "v6e")]
    return dataclasses.replace(base, **check_block_keys(overrides))


# Keys of a row: `flash_mgpu.mgpu_attention`'s block_q, block_kv, stages, and optionally
# persistent (a CTA count, or "sms": one per streaming multiprocessor), q_major, overlap, fa3_turns,
# cluster, half_p and stale_max.
# Figures from `benchmarks/bench_attention.py` (jax 0.11.2, bf16, D=128, B=1), TFLOP/s at 12 h ×
# 32,760 / 40 h × 75,600 self-attention unless stated; forward times in alternating fresh processes.
# "self", on an H200: 64×128×2 with CTA pairs (cluster=2), half_p, stale_max and fa3_turns, the ragged
# kv block walked first: 695 / 708-709 TFLOP/s (699-701 at 24 × 27,280, TI2V 5B), 1.22-1.24× jax's
# cuDNN, against 654-658 / 659-663 for 64×192×2, the best tiles without stale_max (at 64×192 stale_max
# keeps the scores live across its branch and ptxas spills: 492-502). The pieces: pairs (each K/V
# tile loaded once, multicast to two q tiles' CTAs) 631 → 640-651, the 1.3B forward 465.4 → 460.9 ms;
# half_p +0.3-1.6% on H100 and H200, the 14B forward 1% faster on both; stale_max the 1.3B forward
# 446.1 / 449.4 → 424.7 / 425.0 ms and the 14B 9,727 → 9,477 (9,362 with the ragged block first);
# fa3_turns 1% (stale_max without it is 1% slower). Without stale_max, 64×192×2 is 1.12-1.13× cuDNN
# on an H100 and beats 64×128×2 on an H200 (654 / 665 against 627 / 626; cuDNN 574 / 577).
# "cross" (32,760 queries × 512 or 769 keys): the persistent 64×128×3 walk with FA3's intra-warpgroup
# overlap, 1.015-1.029× cuDNN at 512 keys and 1.060-1.070× at 769, where plain 64×128×2 tiles reach
# 0.90-0.93× and 1.015×. No half_p there: with the overlap it is 0.77×.
# "short" (both sides under 4,096 tokens; `bench_attention.py --shapes mg2640,wma_spatial,wma_temporal`,
# H200): no kernel of ours wins them all, so cuDNN keeps them. Ours at D=128, Matrix-Game-2's first
# chunk (12 h × 2,640²): 1.18× cuDNN at 64×128×2 (1.22× with the overlap). At D=64, UnifoLM-WMA's
# spatial attention (16 × 5 h × 2,560²): 0.94×. Its temporal attention (2,560 × 5 h × 16²): 0.83×,
# or 1.08× as the persistent walk with the overlap. An explicit impl="pallas_gpu" gets the plain
# 64×128×2 tiles there.
GPU_BLOCKS = {
    "self": {"block_q": 64, "block_kv": 128, "stages": 2, "cluster": 2, "half_p": True, "stale_max": True,
             "fa3_turns": True},
    "cross": {"block_q": 64, "block_kv": 128, "stages": 3, "persistent": "sms", "overlap": True},
    "short": {"block_q": 64, "block_kv": 128, "stages": 2},
}
GPU_FASTEST = {"self": "pallas_gpu", "cross": "pallas_gpu", "short": "cudnn"}
# The FP8 kernel (`attention(impl="pallas_gpu_fp8")`, self-attention only), TFLOP/s at 12 h × 32,760 /
# 40 h × 75,600 on an H200 unless stated (the bf16 kernel then: 631 / 629). block_kv must be a
# multiple of 128 (P's 128-byte swizzle), and 256 beats 128 by 16%. int8 Q·Kᵀ (qk_int8): a quarter
# less error than e4m3 for 2% of the speed (4.0e-2 against 5.3e-2 relative error on random inputs;
# 785 / 816 against 803 / 828 at 64×256×2). pv_two_level: the running FP8 accumulator's ~14 bits
# took the 1.3B forward's error against bf16 to 1.12e-1, a fresh accumulator a step to 8.5e-3, and
# the kernel from 780 / 811 to 806 / 829. fa3_turns: a tie with P in registers (849-852 / 893-902
# with it, 851-855 / 902 without). cluster=2 (CTA pairs sharing each K/V tile): 834 → 847 / 836 → 849 and
# 877 → 882 / 877 → 883. P in registers as the 8-bit operand (FA3's key order): 841 → 849 / 879 →
# 893. pv_row_sums (the row sums taken by P·V, V's transposed tile with a row of ones; H100): 888 →
# 942 / 931 → 984 TFLOP/s; at the 700 W cap (`bench_power.py`) 843.8 → 896.7 / 902.6 → 961.4; the
# 1.3B forward with FP8 attention 381.7 → 369.1 ms.
GPU_FP8_BLOCKS = {"block_q": 64, "block_kv": 256, "stages": 2, "qk_int8": True, "pv_two_level": True,
                  "fa3_turns": True, "cluster": 2, "pv_row_sums": True}


def gpu_shape_class(sq: int, skv: int) -> str:
    """Self-attention over video tokens ("self": ≥ 4,096 keys), a video's cross-attention to a short
    text/image context ("cross": ≥ 4,096 queries, fewer keys), or short sequences on both sides
    ("short": e.g. UnifoLM-WMA's spatial and temporal attention, Matrix-Game-2's first chunks)."""
    if skv >= 4096:
        return "self"
    return "cross" if sq >= 4096 else "short"
