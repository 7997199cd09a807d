"""Attention tiles: per TPU generation for `splash_exp2`, and the measured GPU choices.

TPU: the v6e row is the published Wan 2.1 exp2 splash tuning (block_q 3328, block_kv 2816,
block_kv_compute 256, inner step 256, low-latency LLO scheduler). The other rows are NOT measured
here: they keep that shape and shrink the tiles to the generation's VMEM per core (v5e 128 MiB,
v5p and v7x 64 MiB, v4 16 MiB). Override with `block_sizes=` until they are measured.

GPU: `GPU_BLOCKS` holds the Hopper kernel's tiles and `GPU_FASTEST` which of our Pallas kernel and
cuDNN was faster, per shape class, in `scripts/bench_attention.py`; `impl=None` on a Hopper GPU
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


TPU_BLOCK_SIZES = {
    "v6e": BlockSizes(3328, 2816, 256, 256, vmem_limit_bytes=64 * _MIB),
    "v5e": BlockSizes(2048, 2048, 256, 256, vmem_limit_bytes=64 * _MIB),
    "v5p": BlockSizes(2048, 1024, 256, 256, vmem_limit_bytes=48 * _MIB),
    "v7x": BlockSizes(2048, 1024, 256, 256, vmem_limit_bytes=48 * _MIB),
    "v4": BlockSizes(1024, 1024, 256, 256, vmem_limit_bytes=14 * _MIB),
}
# `jax.Device.device_kind` → generation. Unknown kinds, and exporting for TPU from a host without
# one, get the published v6e tuning.
_GENERATION = {
    "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
    "TPU v5": "v5p", "TPU v5p": "v5p", "TPU7x": "v7x", "TPU7": "v7x", "TPU v4": "v4",
}


def tpu_block_sizes(overrides=None) -> BlockSizes:
    """The table row for the local TPU (v6e when there is none), with `overrides` applied."""
    kind = jax.devices()[0].device_kind if jax.default_backend() == "tpu" else None
    base = TPU_BLOCK_SIZES[_GENERATION.get(kind, "v6e")]
    return dataclasses.replace(base, **check_block_keys(overrides))


# Measured on one H200 (scripts/bench_attention.py, 2026-11-21, jax 0.11.2, bf16, D=128, B=1):
# self-attention 12 × 32,760: block_kv 192 654 TFLOP/s, block_kv 128 627, cuDNN 574; 40 × 75,600:
# 665 / 626 / 577. Cross-attention 32,760 × 512 keys: ours 444, cuDNN 476, so cuDNN keeps it.
GPU_BLOCKS = {
    "self": {"block_q": 64, "block_kv": 192, "stages": 2},
    "cross": {"block_q": 64, "block_kv": 128, "stages": 2},
}
GPU_FASTEST = {"self": "pallas_gpu", "cross": "cudnn"}


def gpu_shape_class(skv: int) -> str:
    """Self-attention over video tokens, or cross-attention to a short text/image context."""
    return "self" if skv >= 4096 else "cross"
