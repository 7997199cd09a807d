"""`wan_tpu/kernels/flash_gpu.py` and `wan_tpu/kernels/flash_mgpu.py` against a float64 numpy reference.

The Triton kernel runs here in Pallas interpret mode; the Hopper (Mosaic GPU) kernel and the
compiled Triton kernel need an NVIDIA GPU. Fresh random inputs each run; the seed is in every
failure message.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_splash_exp2 import random_qkv, reference64

from wan_tpu.kernels.flash_gpu import flash_attention, triton_attention
from wan_tpu.layers.attention import attention

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
    (4100, 4100, 2, 64, jnp.bfloat16),
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


# Scheduling variants of the Hopper kernel (benchmarks/bench_attention.py sweeps them): persistent CTAs
# walking several (head, q tile) tiles with one K/V ring, the q-major grid, two-level P·V sums, FA3's
# overlap and turn hand-over, CTA clusters sharing each K/V tile (the last cluster partly past the end).
VARIANTS = [
    dict(block_q=64, block_kv=192, stages=2, q_major=True),
    dict(block_q=64, block_kv=128, stages=3, persistent=3),
    dict(block_q=64, block_kv=64, stages=4, persistent=5),
    dict(block_q=64, block_kv=128, stages=2, persistent=132),
    dict(block_q=64, block_kv=192, stages=2, pv_two_level=True),  # the tuned self-attention tiles, two-level
    dict(block_q=64, block_kv=128, stages=2, persistent=132, pv_two_level=True),
    dict(block_q=64, block_kv=128, stages=2, overlap=True),  # FA3's intra-warpgroup overlap
    dict(block_q=64, block_kv=192, stages=2, overlap=True),
    dict(block_q=64, block_kv=128, stages=3, persistent=132, overlap=True),
    dict(block_q=64, block_kv=192, stages=2, fa3_turns=True),  # FA3's turn hand-over alone
    dict(block_q=64, block_kv=128, stages=3, persistent=5, fa3_turns=True),
    dict(block_q=64, block_kv=192, stages=2, cluster=2),  # FA3's CTA pairs sharing each K/V tile
    dict(block_q=64, block_kv=128, stages=2, cluster=2, overlap=True),
    dict(block_q=64, block_kv=192, stages=2, cluster=2, q_major=True),
    dict(block_q=64, block_kv=128, stages=3, cluster=4),
    dict(block_q=64, block_kv=192, stages=2, cluster=2, half_p=True),  # P in f16 (the tuned self-attention kernel)
    dict(block_q=64, block_kv=128, stages=3, persistent=5, overlap=True, half_p=True),
    dict(block_q=64, block_kv=128, stages=2, cluster=2, half_p=True, stale_max=True, fa3_turns=True),  # the row max kept
    dict(block_q=64, block_kv=128, stages=3, persistent=5, half_p=True, stale_max=True),
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
@pytest.mark.parametrize("sq, skv, h", [(4100, 4100, 2), (1537, 769, 3), (1000, 512, 5), (520, 120, 2)])
def test_hopper_variants_on_device(kw, sq, skv, h):
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    check(lambda q, k, v: mgpu_attention(q, k, v, **kw), 1, sq, skv, h, 128, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("ramp", [0.0, 0.5, 3.0, 80.0])
@pytest.mark.parametrize("sq, skv", [(1000, 4100), (520, 769)])
def test_stale_max_rescales_when_scores_grow(ramp, sq, skv):
    """`stale_max` against float64 where the scores grow along the keys: K gets `ramp` · j/skv times a
    direction that every query shares (half the rows' scores rise by about 4·ramp over the keys, the
    other half's fall), except its last 256 keys, which hold the ragged kv block that the kernel walks
    first. Ramp 3 passes the kept row max now and then, ramp 80 in every step (by ~14 log2 units a
    128-key step at 4,100 keys, ~77 at 769), so the warps take the rescaling branch (which also
    masks the ragged block in the tile's first step) sometimes or always; ramp 0 and 0.5 rarely or
    never. At ramp 80 a kept max would put P past f16's range within a step, so a finite, accurate
    output shows the branch ran. The same kernel without `stale_max` sets the error bar."""
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    seed, (q, k, v) = random_qkv(1, sq, skv, 2, 128, jnp.bfloat16)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(128) / np.sqrt(128)
    sign = rng.choice([-1.0, 1.0], size=(1, sq, 2, 1))
    q = (np.asarray(q, np.float32) + sign * 4.0 * u).astype(jnp.bfloat16)
    profile = np.where(np.arange(skv) < skv - 256, np.arange(skv) / skv, 0.0)
    k = np.asarray(k, np.float32) + ramp * np.sqrt(128) * profile[None, :, None, None] * u
    q, k = jnp.asarray(q), jnp.asarray(k, jnp.bfloat16)
    kw = dict(block_q=64, block_kv=128, stages=2, cluster=2, half_p=True, fa3_turns=True)
    out = np.asarray(mgpu_attention(q, k, v, stale_max=True, **kw), np.float64)
    ref = reference64(q, k, v)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    exact = np.linalg.norm(np.asarray(mgpu_attention(q, k, v, **kw), np.float64) - ref) / np.linalg.norm(ref)
    assert np.isfinite(out).all() and err <= max(1e-2, 1.5 * exact), f"rel. error {err:.2e}, exact max {exact:.2e} (seed {seed})"


def test_v_in_half_saturates_and_keeps_bf16_values():
    """`half_p`'s V: every bf16 value in f16's normal range converts exactly, larger ones saturate
    at ±65504 (never inf), and f16 input passes through unchanged."""
    from wan_tpu.kernels.flash_mgpu import F16_MAX, v_in_half

    seed = np.random.randint(2**31)
    rng = np.random.default_rng(seed)
    v = jnp.asarray(rng.standard_normal((2, 64, 3, 128)) * 10.0 ** rng.uniform(-4, 4, (2, 64, 3, 128)), jnp.bfloat16)
    v = v.at[0, 0, 0, :4].set(jnp.asarray([1e5, -1e5, 3e38, -65504.0], jnp.bfloat16))
    out = v_in_half(v)
    assert out.dtype == jnp.float16 and np.isfinite(np.asarray(out, np.float32)).all(), f"seed {seed}"
    ref = np.clip(np.asarray(v, np.float64), -F16_MAX, F16_MAX)
    normal = np.abs(ref) >= 2.0**-14
    np.testing.assert_array_equal(np.asarray(out, np.float64)[normal], ref[normal], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(out[0, 0, 0, :4], np.float64), [F16_MAX, -F16_MAX, F16_MAX, -F16_MAX])  # bf16(-65504) = -65536
    assert v_in_half(out) is out


# The FP8 kernel (`attention(impl="pallas_gpu_fp8")`): e4m3 (or int8) Q, K; e4m3 V and P. Its yardstick is the same
# scaled arithmetic in float64 (`fp8_reference64`: the kernel's own operands, P rounded to e4m3 against
# the row's final max where the kernel uses the running one); against exact attention it carries
# e4m3's three mantissa bits (~5e-2 on these random inputs).
FP8_TOL = 3e-2   # the kernel against fp8_reference64 (the H200 measured 2.3e-2 against exact-P emulation)
FP8_EXACT_TOL = 8e-2  # either against exact float64 attention


def fp8_reference64(q, k, v, qk_int8=False):
    from wan_tpu.kernels.flash_mgpu import P_SHIFT, fp8_operands

    q8, k8, vt8, scales = fp8_operands(q, k, v, qk_int8)
    sq, skv = q.shape[1], k.shape[1]
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    qd, kd, vtd = f64(q8[:, :sq]), f64(k8[:, :skv]), f64(vt8[..., :skv])
    logit, out = np.asarray(scales[:, :, 0, :sq], np.float64), np.asarray(scales[:, :, 1, :sq], np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", qd, kd) * logit[..., None]  # log2 units
    p = np.exp2(s - s.max(-1, keepdims=True) + P_SHIFT)
    l = p.sum(-1, keepdims=True)
    p8 = f64(jnp.asarray(p, jnp.float32).astype(jnp.float8_e4m3fn))
    o = np.einsum("bhqk,bhdk->bhqd", p8, vtd) / l * out[..., None]
    return o.transpose(0, 2, 1, 3)


def test_fp8_operands_and_reference():
    """Without a GPU: the FP8 kernel's operands (scales, padding, V transposed) and its float64 yardstick."""
    from wan_tpu.kernels.flash_mgpu import F8_MAX, fp8_operands

    seed, (q, k, v) = random_qkv(2, 300, 129, 3, 128, jnp.bfloat16)
    q8, k8, vt8, scales = fp8_operands(q, k, v)
    assert q8.shape == (2, 304, 3, 128) and k8.shape == (2, 136, 3, 128) and q8.dtype == jnp.float8_e4m3fn
    assert vt8.shape == (2, 3, 128, 256) and scales.shape == (2, 3, 2, 304)
    q_amax = np.abs(np.asarray(q8[:, :300].astype(jnp.float32))).max(-1)
    np.testing.assert_array_equal(q_amax, F8_MAX)  # each (token, head) row's amax lands on 448
    assert not np.asarray(q8[:, 300:].astype(jnp.float32)).any() and not np.asarray(vt8[..., 129:].astype(jnp.float32)).any()
    # logit factor / (log2e/√D) = s_q · s_k: dequantised Q·K from it against the true logits
    s_q = np.abs(np.asarray(q, np.float64)).max(-1) / F8_MAX                      # (B, Sq, H)
    s_k = np.abs(np.asarray(k, np.float64)).max((1, 3)) / F8_MAX                  # (B, H)
    np.testing.assert_allclose(np.asarray(scales[:, :, 0, :300]) / (np.log2(np.e) / np.sqrt(128)),
                               s_q.transpose(0, 2, 1) * s_k[..., None], rtol=1e-6)
    s_v = np.abs(np.asarray(v, np.float64)).max((1, 3)) / F8_MAX
    np.testing.assert_allclose(np.asarray(scales[:, :, 1, :300]), np.broadcast_to(s_v[..., None], (2, 3, 300)), rtol=1e-6)
    v_back = np.asarray(vt8[..., :129].astype(jnp.float32), np.float64).transpose(0, 3, 1, 2) * s_v[:, None, :, None]
    err = np.linalg.norm(v_back - np.asarray(v, np.float64)) / np.linalg.norm(np.asarray(v, np.float64))
    assert err < 3e-2, f"V dequantised rel. error {err:.2e} (seed {seed})"
    # the kernel's V: the same operand with its keys in KEY_ORDER_16
    from wan_tpu.kernels.flash_mgpu import _v_in_operand_order

    vt8_ordered = fp8_operands(q, k, v, v_operand_order=True)[2]
    np.testing.assert_array_equal(np.asarray(vt8_ordered.astype(jnp.float32)),
                                  np.asarray(_v_in_operand_order(vt8).astype(jnp.float32)))
    ref = reference64(q, k, v)
    err = np.linalg.norm(fp8_reference64(q, k, v) - ref) / np.linalg.norm(ref)
    assert 1e-2 < err <= FP8_EXACT_TOL, f"FP8 arithmetic rel. error {err:.2e} (seed {seed})"
    # int8 Q·Kᵀ (7 bits where e4m3 has 3): the logits' share of the error mostly goes
    err_i8 = np.linalg.norm(fp8_reference64(q, k, v, qk_int8=True) - ref) / np.linalg.norm(ref)
    assert err_i8 < 0.85 * err, f"int8 Q·Kᵀ rel. error {err_i8:.2e} vs e4m3 {err:.2e} (seed {seed})"


def _owned_elements(layout, shape):
    """Mosaic GPU's `thread_idxs` evaluated in numpy: {(thread, register index): the flat indices of
    that register's elements, in vector order} for a warpgroup's 128 threads."""
    contiguous = tuple(int(x) for x in np.cumprod((1, *shape[::-1]))[:-1][::-1])
    strides = layout.tiling.tile_strides(contiguous)
    suffix, sizes = strides[-layout.tiled_tiling_rank:], layout.tiled_tiling_shape

    def offset(index, dims):  # `_delinearize_index`, then the dot with the suffix's strides
        dim_strides = np.cumprod((1, *[sizes[d] for d in dims][::-1]))[:-1][::-1]
        return sum((index // st) % sizes[d] * suffix[d] for d, st in zip(dims, dim_strides))

    owned = {}
    for t in range(128):
        base = offset(t % 32, layout.lane_dims) + offset(t // 32, layout.warp_dims)
        for reg in np.ndindex(layout.registers_shape(shape)):
            start = base + sum(i * st for i, st in zip(reg, strides))
            owned[t, reg] = [start + e * suffix[layout.vector_dim] for e in range(layout.vector_length)]
    return owned


def test_fp8_p_stays_on_its_threads():
    """Without a GPU: the 8-bit kernel's P in registers. Paired as the kernel pairs them, the scores'
    registers hold on every thread exactly the P values that the 8-bit operand's layout places there
    with the keys in KEY_ORDER_16, and V's keys are put in that same order."""
    from jax.experimental.mosaic import gpu as mgpu

    from wan_tpu.kernels.flash_mgpu import KEY_ORDER_16, _pair_registers, _v_in_operand_order

    shape = (64, 256)
    order = (np.arange(shape[1]) // 16 * 16 + np.array(KEY_ORDER_16)[np.arange(shape[1]) % 16])
    np.testing.assert_array_equal(np.asarray(_v_in_operand_order(jnp.arange(shape[1]))), order)
    scores = _owned_elements(mgpu.WGMMA_LAYOUT, shape)
    operand = _owned_elements(mgpu.WGMMA_LAYOUT_8BIT, shape)
    for t in range(128):
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
        for reg in np.ndindex(regs.shape):
            regs[reg] = scores[t, reg]
        paired = _pair_registers(regs, lambda pair: pair[0] + pair[1])
        for reg in np.ndindex(paired.shape):
            (rows, keys), (want_rows, slots) = np.divmod(paired[reg], shape[1]), np.divmod(operand[t, reg], shape[1])
            np.testing.assert_array_equal(rows, want_rows)
            np.testing.assert_array_equal(keys, order[slots])


@pytest.mark.parametrize("kw", [dict(), dict(block_kv=128, stages=4), dict(persistent=132), dict(q_major=True),
                                dict(qk_int8=True), dict(qk_int8=True, pv_two_level=False),
                                dict(qk_int8=True, fa3_turns=True), dict(qk_int8=True, fa3_turns=True, cluster=2),
                                dict(qk_int8=True, pv_two_level=False, block_kv=128, stages=4, persistent=132),
                                dict(qk_int8=True, fa3_turns=True, cluster=2, pv_row_sums=False)])
@pytest.mark.parametrize("b, sq, skv, h", [(1, 32760, 32760, 12), (2, 1000, 769, 3)])
def test_fp8_kernel_lowers_for_cuda(kw, b, sq, skv, h):
    from wan_tpu.kernels.flash_mgpu import mgpu_attention_fp8

    q = jax.ShapeDtypeStruct((b, sq, h, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, skv, h, 128), jnp.bfloat16)
    text = jax.jit(lambda q, k, v: mgpu_attention_fp8(q, k, v, **kw)).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1


def test_fp8_impl_refuses_without_hopper():
    from wan_tpu.errors import WanInputError
    from wan_tpu.kernels.flash_gpu import flash_attention_fp8, is_hopper

    if is_hopper():
        pytest.skip("a Hopper GPU runs the FP8 kernel")
    q = jnp.zeros((1, 8, 1, 128), jnp.bfloat16)
    with pytest.raises(WanInputError, match="needs a Hopper GPU"):
        jax.jit(flash_attention_fp8).trace(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(), dict(block_kv=128, stages=4), dict(persistent=132), dict(qk_int8=True),
                                dict(qk_int8=True, pv_two_level=False), dict(persistent=132, qk_int8=True),
                                dict(qk_int8=True, fa3_turns=True), dict(qk_int8=True, fa3_turns=True, cluster=2),
                                dict(qk_int8=True, fa3_turns=True, cluster=4),
                                dict(qk_int8=True, pv_two_level=False, block_kv=128, stages=4, persistent=132),
                                dict(qk_int8=True, fa3_turns=True, cluster=2, pv_row_sums=False)])
@pytest.mark.parametrize("b, sq, skv, h", [(1, 7, 7, 2), (1, 4100, 4100, 2), (2, 1000, 769, 3)])
def test_fp8_kernel_on_device(kw, b, sq, skv, h):
    from wan_tpu.kernels.flash_mgpu import mgpu_attention_fp8

    seed, (q, k, v) = random_qkv(b, sq, skv, h, 128, jnp.bfloat16)
    out = np.asarray(mgpu_attention_fp8(q, k, v, **kw).astype(jnp.float32), np.float64)
    assert out.shape == (b, sq, h, 128) and np.isfinite(out).all(), f"seed {seed}"
    reference = fp8_reference64(q, k, v, kw.get("qk_int8", False))
    for ref, tol in ((reference, FP8_TOL), (reference64(q, k, v), FP8_EXACT_TOL)):
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err <= tol, f"rel. error {err:.2e} > {tol} (seed {seed})"


@pytest.mark.gpu
def test_fp8_impl_through_dispatch():
    """Self-attention on the FP8 kernel; cross-attention keeps the bf16 choice (bf16 tolerance)."""
    from wan_tpu.kernels.tuning import GPU_FP8_BLOCKS

    check_fp8 = lambda q, k, v: attention(q, k, v, impl="pallas_gpu_fp8")  # noqa: E731
    seed, (q, k, v) = random_qkv(1, 4100, 4100, 2, 128, jnp.bfloat16)
    ref = fp8_reference64(q, k, v, GPU_FP8_BLOCKS["qk_int8"])
    err = np.linalg.norm(np.asarray(check_fp8(q, k, v).astype(jnp.float32), np.float64) - ref) / np.linalg.norm(ref)
    assert err <= FP8_TOL, f"rel. error {err:.2e} (seed {seed})"
    check(check_fp8, 1, 2000, 512, 2, 128, jnp.bfloat16)


def _fp8_error_script():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fp8_error.py")
    spec = importlib.util.spec_from_file_location("fp8_error", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_error_emulations_agree():
    """`benchmarks/fp8_error.py`'s emulations of the 8-bit kernel: unquantised it is exact attention; the
    step-by-step loop (running max, 256-key steps, float32 sums) matches the one-shot emulation, whose
    arithmetic `fp8_reference64` (the kernel's yardstick) also has; cutting the sums to 13 bits moves it.
    Float32 dots at full precision: a GPU's default (TF32) moved the exact emulation by 1.9e-4."""
    with jax.default_matmul_precision("highest"):
        _emulations_agree()


def _emulations_agree():
    script = _fp8_error_script()
    seed, (q, k, v) = random_qkv(1, 300, 600, 2, 128, jnp.bfloat16)
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    exact = f64(script.emulated_8bit_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                               qk=None, pv=False))
    assert rel(exact, reference64(q, k, v)) < 1e-5, f"seed {seed}"
    one_shot = f64(script.emulated_8bit_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                                  qk="int8", pv=True))
    # float32 against float64: a few P values land on the other side of an e4m3 rounding boundary
    assert rel(one_shot, fp8_reference64(q, k, v, qk_int8=True)) < 1e-3, f"seed {seed}"
    loop = f64(script.emulated_kernel_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                                acc_bits=None))
    assert rel(loop, one_shot) < FP8_TOL, f"seed {seed}"  # P rounded against the running max
    cut = f64(script.emulated_kernel_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                               acc_bits=13))
    assert 0 < rel(cut, loop) < 1e-2, f"seed {seed}"


def test_fp8_accumulation_study():
    """`benchmarks/fp8_error.py --accumulation`: under Hopper's FP8 MMA accumulation rule (about 14 bits
    kept as products are added), a running accumulator loses a growing share of P·V when V's rows share
    a mean; a fresh accumulator per 256-key step (`pv_two_level`) does not."""
    script = _fp8_error_script()
    running, fresh = (script.accumulation_study(2048, 1.0, 13, two_level) for two_level in (False, True))
    assert fresh < 5e-3 and running > 10 * fresh, (running, fresh)
    assert script.accumulation_study(2048, 0.0, 13, False) < 5e-3  # zero-mean V (random tests) hides it


@pytest.mark.gpu
def test_fp8_kernel_keeps_long_sums():
    """32,768 keys whose values share a mean (as a DiT's do; random tests' do not): the FP8 kernel
    against the float64 emulation of its arithmetic, with the shipped two-level accumulation (the
    single-level accumulator loses these sums: `test_fp8_accumulation_study`, docs/PERFORMANCE.md)."""
    from wan_tpu.kernels.flash_mgpu import mgpu_attention_fp8

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 256, 1, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 32768, 1, 128)), jnp.bfloat16)
    v = jnp.asarray(1.0 + 0.3 * rng.standard_normal((1, 32768, 1, 128)), jnp.bfloat16)
    out = np.asarray(mgpu_attention_fp8(q, k, v, qk_int8=True).astype(jnp.float32), np.float64)
    ref = fp8_reference64(q, k, v, qk_int8=True)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= FP8_TOL, f"rel. error {err:.2e}"


@pytest.mark.parametrize("kw", [dict(cluster=3), dict(cluster=2, persistent=132)])
def test_cluster_is_refused_where_it_does_not_apply(kw):
    """CTA pairs (or fours) walk one tile each: a persistent CTA's tiles are not its partner's."""
    from wan_tpu.errors import WanInputError
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    with pytest.raises(WanInputError, match="cluster must be 1, or 2 or 4 without persistent CTAs"):
        jax.jit(lambda q, k, v: mgpu_attention(q, k, v, **kw)).trace(q, q, q).lower(lowering_platforms=("cuda",))


def test_overlap_is_refused_where_it_does_not_apply():
    """FA3's intra-warpgroup overlap is a bf16/fp16 option: the 8-bit path keeps P in shared memory,
    and two-level sums would need a third accumulator's registers."""
    from wan_tpu.errors import WanInputError
    from wan_tpu.kernels.flash_mgpu import mgpu_attention

    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    with pytest.raises(WanInputError, match="overlap"):
        jax.jit(lambda q, k, v: mgpu_attention(q, k, v, overlap=True, pv_two_level=True)).trace(q, q, q).lower(
            lowering_platforms=("cuda",))


@pytest.mark.parametrize("ceiling", ["no_exp2", "no_softmax"])
def test_ceilings_lower_and_bad_ones_are_refused(ceiling):
    """`benchmarks/bench_power.py`'s ceilings (the kernel without exp2, or without its softmax) lower
    for CUDA with the tuned tiles, the 8-bit kernel's too; a misspelt ceiling, or one on a path it
    does not cut, is an error."""
    from wan_tpu.errors import WanInputError
    from wan_tpu.kernels.flash_mgpu import mgpu_attention, mgpu_attention_fp8
    from wan_tpu.kernels.tuning import GPU_FP8_BLOCKS

    q = jax.ShapeDtypeStruct((1, 32760, 2, 128), jnp.bfloat16)
    lower = lambda fn=mgpu_attention, **kw: jax.jit(lambda q, k, v: fn(q, k, v, **kw)).trace(q, q, q).lower(  # noqa: E731
        lowering_platforms=("cuda",))
    assert lower(block_kv=192, cluster=2, ceiling=ceiling).as_text().count("mosaic_gpu") >= 1
    assert lower(mgpu_attention_fp8, **GPU_FP8_BLOCKS, ceiling=ceiling).as_text().count("mosaic_gpu") >= 1
    with pytest.raises(WanInputError, match="ceiling"):
        lower(ceiling="no_max")
    with pytest.raises(WanInputError, match="ceiling"):
        lower(ceiling=ceiling, half_p=True)


def test_pv_row_sums_needs_two_level():
    """The 8-bit kernel's row sums from P·V (a row of ones under V) need each step's products in a fresh
    accumulator: a running FP8 one keeps ~14 bits and the sums only grow. Off by itself without
    `pv_two_level`, and an error asked for there."""
    from wan_tpu.errors import WanInputError
    from wan_tpu.kernels.flash_mgpu import mgpu_attention_fp8

    q = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
    lower = lambda fn, **kw: jax.jit(lambda q, k, v: fn(q, k, v, **kw)).trace(q, q, q).lower(  # noqa: E731
        lowering_platforms=("cuda",))
    assert lower(mgpu_attention_fp8, pv_two_level=False).as_text().count("mosaic_gpu") >= 1
    with pytest.raises(WanInputError, match="pv_row_sums"):
        lower(mgpu_attention_fp8, pv_two_level=False, pv_row_sums=True)
