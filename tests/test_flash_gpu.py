"""`kernels/flash_gpu.py` and `kernels/flash_mgpu.py` against a float64 numpy reference.

The Triton kernel runs here in Pallas interpret mode; the Hopper (Mosaic GPU) kernel and the
compiled Triton kernel need an NVIDIA GPU. Fresh random inputs each run; the seed is in every
failure message.
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from wan_tpu.layers.attention import attention
from wan_tpu.kernels.flash_gpu import flash_attention, triton_attention

from test_splash_exp2 import random_qkv, reference64

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


def check(fn, b, sq, skv, h, d, dtype):
    seed, (q, k, v) = random_qkv(b, sq, skv, h, d, dtype)
    out = np.asarray(fn(q, k, v), np.float64)
    assert out.shape == (b, sq, h, d)
    assert np.isfinite(out).all(), f"non-finite output (seed {seed})"
    ref = reference64(q, k, v)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype], f"rel. error {err:.2e} > {TOL[dtype]} (seed {seed})"


@pytest.mark.parametrize(
    "sq, skv, h, d, dtype, blocks",
    [
        (1, 1, 2, 64, jnp.float32, (128, 64)),
        (7, 1000, 1, 128, jnp.float32, (128, 64)),
        (1000, 769, 1, 64, jnp.bfloat16, (64, 128)),
        (1537, 512, 1, 128, jnp.float32, (256, 128)),
    ],
)
def test_triton_kernel_interpreted(sq, skv, h, d, dtype, blocks):
    block_q, block_kv = blocks
    check(lambda q, k, v: triton_attention(q, k, v, block_q, block_kv, interpret=True), 1, sq, skv, h, d, dtype)


def test_pallas_gpu_interpreted_through_dispatch():
    check(lambda q, k, v: attention(q, k, v, impl="pallas_gpu", interpret=True), 2, 300, 129, 2, 64, jnp.float32)


GPU_CASES = [
    (1, 1, 1, 128, jnp.bfloat16),
    (7, 7, 2, 128, jnp.float16),
    (1000, 1000, 2, 128, jnp.bfloat16),
    (1537, 769, 2, 128, jnp.bfloat16),
    (4100, 512, 3, 64, jnp.bfloat16),
    (4100, 4100, 2, 128, jnp.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("sq, skv, h, d, dtype", GPU_CASES)
def test_pallas_gpu_on_device(sq, skv, h, d, dtype):
    """The Hopper kernel on H100/H200 (the Triton kernel on other GPUs)."""
    check(flash_attention, 1, sq, skv, h, d, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("sq, skv, h, d, dtype", GPU_CASES[:4])
def test_triton_kernel_on_device(sq, skv, h, d, dtype):
    check(triton_attention, 1, sq, skv, h, d, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("sq, skv", [(4100, 4100), (2000, 1000)])
def test_gpu_default_impl_is_correct(sq, skv):
    """impl=None on a GPU: the measured table's choice (ours for self-, cuDNN for cross-attention)."""
    assert jax.default_backend() == "gpu"
    check(attention, 1, sq, skv, 2, 128, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("sq, skv", [(1, 1), (7, 769), (1000, 512)])
def test_cudnn_any_length(sq, skv):
    check(lambda q, k, v: attention(q, k, v, impl="cudnn"), 1, sq, skv, 2, 128, jnp.bfloat16)


@pytest.mark.gpu
def test_pallas_gpu_float32_takes_the_triton_path():
    check(lambda q, k, v: attention(q, k, v, impl="pallas_gpu"), 1, 300, 200, 2, 128, jnp.float32)


# Scheduling variants of the Hopper kernel (scripts/bench_attention.py sweeps them): persistent CTAs
# walking several (head, q tile) tiles with one K/V ring, and the q-major grid.
VARIANTS = [
    dict(block_q=64, block_kv=192, stages=2, q_major=True),
    dict(block_q=64, block_kv=128, stages=3, persistent=3),
    dict(block_q=64, block_kv=64, stages=4, persistent=5),
    dict(block_q=64, block_kv=128, stages=2, persistent=132),
]


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("b, sq, skv, h", [(1, 32760, 32760, 12), (2, 1000, 769, 3)])
def test_hopper_variants_lower_for_cuda(kw, b, sq, skv, h):
    """Without a GPU: every variant lowers to one Mosaic GPU kernel for CUDA (Wan's self-attention
    shape, and a ragged cross-attention one with fewer tiles than CTAs)."""
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    q = jax.ShapeDtypeStruct((b, sq, h, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, skv, h, 128), jnp.bfloat16)
    text = jax.jit(lambda q, k, v: mgpu_attention(q, k, v, **kw)).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("sq, skv, h", [(4100, 4100, 2), (1537, 769, 3), (1000, 512, 5)])
def test_hopper_variants_on_device(kw, sq, skv, h):
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    check(lambda q, k, v: mgpu_attention(q, k, v, **kw), 1, sq, skv, h, 128, jnp.bfloat16)
