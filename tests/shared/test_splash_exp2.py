"""`wan_tpu/kernels/splash_exp2.py` in Pallas interpret mode against a float64 numpy reference, and its
lowering for TPU.

Inputs are fresh random numbers on every run (the seed is in each failure message). Interpret mode
(jax's HLO interpreter) fills every read past the end of an array, every scratch buffer and every
output buffer with NaN before the kernel runs (`test_interpret_mode_poisons_with_nan` pins that),
so an unmasked padded key, an unzeroed padded value row or an output row the kernel never writes
turns the result NaN, and every test asserts the output is finite.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from wan_tpu.kernels.splash_exp2 import _call as splash_call
from wan_tpu.kernels.splash_exp2 import effective_block_sizes, splash_exp2_attention
from wan_tpu.kernels.tuning import STEP_OVERHEAD_S, TPU_BLOCK_SIZES, TPU_CHIPS, vmem_bytes

# Relative Frobenius error vs float64: f32 end to end; bf16 inputs with bf16 probabilities in P·V.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def reference64(q, k, v):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def random_qkv(b, sq, skv, h, d, dtype):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    qkv = [jnp.asarray(rng.standard_normal((b, s, h, d)), dtype) for s in (sq, skv, skv)]
    return seed, qkv


def check(b, sq, skv, h, d, dtype, block_sizes):
    seed, (q, k, v) = random_qkv(b, sq, skv, h, d, dtype)
    out = np.asarray(splash_exp2_attention(q, k, v, block_sizes=block_sizes, interpret=True), np.float64)
    assert out.shape == (b, sq, h, d)
    assert np.isfinite(out).all(), f"non-finite output (seed {seed})"
    ref = reference64(q, k, v)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype], f"rel. error {err:.2e} > {TOL[dtype]} (seed {seed})"


def blocks(q, kv, compute, inner):
    return dict(block_q=q, block_kv=kv, block_kv_compute=compute, block_kv_compute_in=inner)


SMALL = blocks(128, 256, 128, 64)
MEDIUM = blocks(512, 512, 256, 128)
BIG = blocks(2048, 2048, 512, 256)


@pytest.mark.parametrize(
    "b, sq, skv, h, d, dtype, block_sizes",
    [
        # Default (v6e) blocks, far larger than the sequence: clipped.
        (2, 1, 1, 2, 64, jnp.float32, None),
        (1, 7, 7, 2, 128, jnp.float32, None),
        (1, 1, 1000, 1, 128, jnp.bfloat16, None),
        (1, 128, 128, 2, 64, jnp.float32, SMALL),
        (1, 128, 7, 2, 128, jnp.bfloat16, SMALL),
        # Cross-attention shapes: 512 text tokens, 257 image + 512 text tokens.
        (1, 1000, 512, 2, 64, jnp.float32, None),
        (1, 1000, 769, 1, 128, jnp.bfloat16, None),
        (1, 1537, 1000, 1, 64, jnp.float32, MEDIUM),
        (1, 7, 1537, 2, 64, jnp.float32, SMALL),
        (1, 1537, 1537, 1, 128, jnp.bfloat16, blocks(256, 768, 256, 128)),
        (1, 4100, 4100, 1, 64, jnp.float32, BIG),
    ],
)
def test_matches_float64_reference(b, sq, skv, h, d, dtype, block_sizes):
    check(b, sq, skv, h, d, dtype, block_sizes)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_length_1000_block_512_masks_padded_keys(dtype):
    """1000 keys in 512-key blocks: the last block holds 24 past-the-end keys that must get
    probability 0 (zero-padding them instead would add exp2(0 − m) per key to the denominator)."""
    check(1, 1000, 1000, 2, 128, dtype, blocks(512, 512, 256, 128))


def test_interpret_mode_poisons_with_nan():
    """The premise of the NaN checks: a ragged block read past the end, and an output block the
    kernel does not write, both come back NaN in interpret mode."""

    def kernel(x_ref, o_ref, seen_ref):
        seen_ref[...] = x_ref[...]

    x = jnp.ones((5, 128), jnp.float32)
    out, seen = pl.pallas_call(
        kernel,
        grid=(1,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((8, 128), jnp.float32)] * 2,
        interpret=True,
    )(x)
    assert np.isnan(np.asarray(out)).all()
    assert np.isnan(np.asarray(seen)[5:]).all() and (np.asarray(seen)[:5] == 1).all()


@pytest.mark.parametrize(
    "block_sizes, message",
    [(blocks(512, 1000, 256, 256), "multiple of block_kv_compute"), (blocks(100, 512, 256, 256), "multiple of 128")],
)
def test_rejects_bad_blocks(block_sizes, message):
    q = jnp.ones((1, 4096, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        splash_exp2_attention(q, q, q, block_sizes=block_sizes, interpret=True)


@pytest.mark.parametrize("heads, seq_q, seq_kv", [(12, 32760, 32760), (40, 75600, 75600), (12, 32760, 512)])
def test_lowers_for_tpu(heads, seq_q, seq_kv):
    """Wan 1.3B 480p and 14B 720p self-attention, and 1.3B cross-attention, export for TPU."""

    def spec(s):
        return jax.ShapeDtypeStruct((1, s, heads, 128), jnp.bfloat16)

    exported = jax.export.export(jax.jit(splash_exp2_attention), platforms=("tpu",))(
        spec(seq_q), spec(seq_kv), spec(seq_kv)
    )
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "XLA_TPU_FORCE_LP_LLO_SCHEDULER" in text
    assert exported.out_avals[0].shape == (1, seq_q, heads, 128)


@pytest.mark.parametrize("generation", sorted(TPU_BLOCK_SIZES))
def test_tile_table_follows_its_rules(generation):
    """wan_tpu/kernels/tuning.py's three rules, per generation: intensity ≥ 4× the chip's ridge point, a
    grid step ≥ 10× the per-step overhead, the live VMEM within the limit and the limit within 75%
    of the core's VMEM, score chunks a multiple of the MXU width."""
    blocks, chip = TPU_BLOCK_SIZES[generation], TPU_CHIPS[generation]
    assert blocks.block_q >= 4 * chip.bf16_flops / chip.hbm_bytes_per_s
    assert 4 * blocks.block_q * blocks.block_kv * 128 / chip.bf16_flops >= 10 * STEP_OVERHEAD_S
    assert vmem_bytes(blocks) <= blocks.vmem_limit_bytes <= 0.75 * chip.vmem_bytes
    assert blocks.block_kv_compute % chip.mxu == 0 and blocks.block_kv_compute_in % chip.mxu == 0
    assert blocks.block_q % 128 == 0 and blocks.block_kv % blocks.block_kv_compute == 0


@pytest.mark.parametrize("generation", sorted(TPU_BLOCK_SIZES))
def test_each_generation_lowers_for_tpu_and_matches_in_interpret_mode(generation):
    """Each generation's full tiles (with its VMEM limit) export for TPU at the Wan 14B 720p shape,
    and compute the right thing in interpret mode on keys that end in a ragged score chunk."""
    blocks = TPU_BLOCK_SIZES[generation]
    spec = jax.ShapeDtypeStruct((1, 75600, 40, 128), jnp.bfloat16)
    call = functools.partial(splash_call, blocks=effective_block_sizes(75600, 75600, blocks), interpret=False)
    text = jax.export.export(jax.jit(call), platforms=("tpu",))(spec, spec, spec).mlir_module()
    assert "tpu_custom_call" in text
    seed, (q, k, v) = random_qkv(1, 200, 2 * blocks.block_kv_compute + 40, 1, 128, jnp.float32)
    small = effective_block_sizes(200, k.shape[1], blocks)
    out = np.asarray(splash_call(q, k, v, blocks=small, interpret=True), np.float64)
    ref = reference64(q, k, v)
    assert np.isfinite(out).all(), f"non-finite output (seed {seed})"
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= TOL[jnp.float32], f"seed {seed}"
