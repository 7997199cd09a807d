"""exp2 flash attention forward for NVIDIA GPUs in Pallas: Mosaic GPU on Hopper, Triton elsewhere.

Layout (B, S, H, D) in and out; softmax scale 1/sqrt(D); non-causal; any Sq, Skv ≥ 1; bf16/fp16 in
(float32 also runs on the Triton path), float32 online softmax and accumulator.

The algorithm is the TPU kernel's (`splash_exp2.py`): probabilities are exp2(s·c − m) with
c = scale·log2(e) and m kept in those units, and the past-the-end keys of a ragged last kv block
get probability exactly 0. On a GPU the factor c is applied inside the kernel, not to q in HBM: it
folds into the FMA that subtracts the running max, so it is free, while pre-scaling q would cost a
pass over q in HBM.

`flash_attention` picks the Hopper kernel (`flash_mgpu.py`: wgmma, TMA, warp specialisation) on
compute capability 9.x for bf16/fp16 with D a multiple of 64, otherwise the Triton kernel below,
which also runs in Pallas interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from wan_tpu.errors import WanInputError
from wan_tpu.kernels.tuning import GPU_BLOCKS, GPU_FP8_BLOCKS, check_block_keys, gpu_shape_class

LOG2E = math.log2(math.e)
# Triton: block_q rows of q per program, block_kv keys per step (both powers of two).
TRITON_BLOCKS = {"block_q": 128, "block_kv": 64}


def _triton_kernel(q_ref, k_ref, v_ref, o_ref, *, kv_len: int, block_kv: int, c: float):
    q = q_ref[...]
    block_q, d = q.shape
    # float32 inputs get float32 products (not TF32): that path exists for exactness.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def step(j, carry, valid=block_kv):
        acc, m, l = carry
        rows = pl.ds(j * block_kv, block_kv)
        s = pltriton.dot(q, k_ref[rows, :], trans_b=True, precision=precision).astype(jnp.float32) * c
        if valid < block_kv:
            s = jnp.where(lax.broadcasted_iota(jnp.int32, s.shape, 1) < valid, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = v_ref[rows, :]
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision).astype(jnp.float32)
        return acc, m_new, l

    carry = (
        jnp.zeros((block_q, d), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    full, rest = divmod(kv_len, block_kv)
    carry = lax.fori_loop(0, full, step, carry)
    if rest:
        carry = step(full, carry, valid=rest)
    acc, _, l = carry
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv", "interpret"))
def triton_attention(q, k, v, block_q=128, block_kv=64, interpret=False):
    """Portable Pallas Triton kernel. Q, K, V are zero-padded to whole blocks (the padded keys are
    masked, the padded query rows dropped): this is the fallback path, simplicity over bandwidth."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    if d & (d - 1):
        raise WanInputError(f"the Triton attention kernel needs a power-of-two head dim, got {d}; use impl='cudnn' or 'reference'")
    block_q = min(block_q, max(16, pl.next_power_of_2(sq)))
    block_kv = min(block_kv, max(16, pl.next_power_of_2(skv)))
    pad = lambda x, blk: jnp.pad(x, ((0, 0), (0, -x.shape[1] % blk), (0, 0), (0, 0)))  # noqa: E731
    qp, kp, vp = pad(q, block_q), pad(k, block_kv), pad(v, block_kv)
    kv_spec = pl.BlockSpec((None, kp.shape[1], None, d), lambda i, bi, hi: (bi, 0, hi, 0))
    q_spec = pl.BlockSpec((None, block_q, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    out = pl.pallas_call(
        functools.partial(_triton_kernel, kv_len=skv, block_kv=block_kv, c=LOG2E / math.sqrt(d)),
        grid=(qp.shape[1] // block_q, b, h),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="flash_exp2_triton",
    )(qp, kp, vp)
    return out[:, :sq]


def is_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def flash_attention(q, k, v, block_sizes=None, interpret=False):
    """(B, S, H, D) → (B, Sq, H, D). `block_sizes` may set block_q and block_kv (the kv compute
    steps are TPU tiles; a GPU kernel has none)."""
    overrides = {key: val for key, val in check_block_keys(block_sizes).items() if key in ("block_q", "block_kv")}
    if interpret or q.shape[-1] % 64 or q.dtype not in (jnp.bfloat16, jnp.float16) or not is_hopper():
        return triton_attention(q, k, v, **{**TRITON_BLOCKS, **overrides}, interpret=interpret)
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    blocks = {**GPU_BLOCKS[gpu_shape_class(q.shape[1], k.shape[1])], **overrides}
    if blocks.get("persistent") == "sms":  # one persistent CTA per streaming multiprocessor
        blocks["persistent"] = getattr(jax.devices()[0], "core_count", 0) or 132
    return mgpu_attention(q, k, v, **blocks)


def flash_attention_fp8(q, k, v, block_sizes=None):
    """(B, S, H, D) bf16/fp16 → (B, Sq, H, D) bf16 on the FP8 Hopper kernel
    (`flash_mgpu.mgpu_attention_fp8`), with the tiles and the int8 Q·Kᵀ choice of
    `tuning.GPU_FP8_BLOCKS` (block_q and block_kv overridable). A clear error on other hardware:
    there is no slower FP8 fallback to hide behind."""
    if q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 128 or not is_hopper():
        raise WanInputError(f"attention 'pallas_gpu_fp8' needs a Hopper GPU (H100/H200), bf16 or fp16 inputs and a head "
                            f"dim that is a multiple of 128 (got {q.dtype}, D={q.shape[-1]} on {jax.devices()[0].device_kind}); "
                            "use 'pallas_gpu' or leave --attention unset")
    from wan_tpu.kernels.flash_mgpu import mgpu_attention_fp8

    overrides = {key: val for key, val in check_block_keys(block_sizes).items() if key in ("block_q", "block_kv")}
    return mgpu_attention_fp8(q, k, v, **{**GPU_FP8_BLOCKS, **overrides})
