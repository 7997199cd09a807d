"""`wan_tpu.attention` dispatch: choice by backend, named impls, errors, and the reference itself
against float64 numpy (fresh random inputs; the seed is in each failure message)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_splash_exp2 import random_qkv, reference64

import wan_tpu
from wan_tpu.layers import attention as attention_lib
from wan_tpu.layers.attention import attention, reference_attention

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend's choices")


def rel_error(out, ref):
    out = np.asarray(out, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("sq, skv", [(1, 1), (7, 1000), (1000, 7)])
def test_reference_matches_float64(sq, skv):
    seed, (q, k, v) = random_qkv(2, sq, skv, 2, 64, jnp.float32)
    err = rel_error(reference_attention(q, k, v), reference64(q, k, v))
    assert err <= 1e-5, f"rel. error {err:.2e} > 1e-5 (seed {seed})"


@on_cpu
def test_cpu_picks_reference(monkeypatch):
    monkeypatch.delenv("WAN_TPU_ATTENTION", raising=False)
    _, (q, k, v) = random_qkv(1, 100, 50, 2, 64, jnp.float32)
    jaxpr = str(jax.make_jaxpr(attention)(q, k, v))
    assert "pallas_call" not in jaxpr
    np.testing.assert_array_equal(attention(q, k, v), reference_attention(q, k, v))


def test_public_name_is_callable_after_submodule_import():
    _, (q, k, v) = random_qkv(1, 9, 9, 1, 64, jnp.float32)
    np.testing.assert_array_equal(wan_tpu.attention(q, k, v), attention_lib.attention(q, k, v))


def test_env_var_overrides_default(monkeypatch):
    monkeypatch.setenv("WAN_TPU_ATTENTION", "splash_exp2")
    seed, (q, k, v) = random_qkv(1, 300, 200, 2, 64, jnp.float32)
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: attention(*a, interpret=True))(q, k, v))
    err = rel_error(attention(q, k, v, interpret=True), reference64(q, k, v))
    assert err <= 1e-5, f"rel. error {err:.2e} > 1e-5 (seed {seed})"


def test_splash_exp2_through_dispatch_with_block_sizes():
    seed, (q, k, v) = random_qkv(1, 1000, 1000, 1, 128, jnp.bfloat16)
    out = attention(q, k, v, impl="splash_exp2", interpret=True, block_sizes={"block_q": 256, "block_kv": 512})
    assert np.isfinite(np.asarray(out, np.float32)).all()
    err = rel_error(out, reference64(q, k, v))
    assert err <= 1e-2, f"rel. error {err:.2e} > 1e-2 (seed {seed})"


@on_cpu
@pytest.mark.parametrize("impl", ["bogus", "cudnn", "pallas_gpu", "splash_exp2"])
def test_impl_that_cannot_run_here_lists_what_can(impl):
    q = jnp.ones((1, 8, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"choose one of \['reference'\]") as info:
        attention(q, q, q, impl=impl)
    assert "\n" not in str(info.value)


def test_unknown_block_size_key():
    q = jnp.ones((1, 8, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="unknown block_sizes keys \\['bq'\\]"):
        attention(q, q, q, impl="splash_exp2", interpret=True, block_sizes={"bq": 128})


def test_named_impl_honoured_when_exporting_for_tpu():
    spec = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
    exported = jax.export.export(jax.jit(lambda q, k, v: attention(q, k, v, impl="splash_exp2")),
                                 platforms=("tpu",))(spec, spec, spec)
    assert "tpu_custom_call" in exported.mlir_module()


def _masked64(q, k, v, kv_len):
    """float64 numpy attention where row b sees keys [0, kv_len[b])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    keep = np.arange(k.shape[1])[None, :] < np.asarray(kv_len)[:, None]
    logits = np.where(keep[:, None, None, :], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@on_cpu
def test_kv_len_masks_keys_and_picks_the_reference_here(monkeypatch):
    monkeypatch.delenv("WAN_TPU_ATTENTION", raising=False)
    seed, (q, k, v) = random_qkv(4, 37, 64, 2, 64, jnp.float32)
    kv_len = jnp.array([16, 32, 48, 64])
    out = attention(q, k, v, kv_len=kv_len)
    np.testing.assert_array_equal(out, reference_attention(q, k, v, kv_len=kv_len))
    err = rel_error(out, _masked64(q, k, v, kv_len))
    assert err <= 1e-5, f"rel. error {err:.2e} > 1e-5 (seed {seed})"


def test_kv_len_refuses_an_impl_without_a_mask():
    _, (q, k, v) = random_qkv(1, 8, 8, 1, 64, jnp.float32)
    with pytest.raises(wan_tpu.WanInputError, match="takes no kv_len"):
        attention(q, k, v, impl="splash_exp2", kv_len=jnp.array([4]))


@pytest.mark.gpu
def test_kv_len_on_a_gpu_uses_cudnn_s_padding_mask():
    """UniFoLM's action branch: 16 frames, frame f sees (f + 1)·16 of 256 keys, without the logits in memory."""
    seed, (q, k, v) = random_qkv(16, 2560, 256, 5, 64, jnp.bfloat16)
    kv_len = (jnp.arange(16) + 1) * 16
    assert "cudnn" in str(jax.jit(lambda *a: attention(*a, kv_len=kv_len)).lower(q, k, v).as_text()).lower()
    err = rel_error(attention(q, k, v, kv_len=kv_len), _masked64(q, k, v, kv_len))
    assert err <= 1e-2, f"rel. error {err:.2e} > 1e-2 (seed {seed})"


@pytest.mark.parametrize("sq, skv, expected", [
    (32760, 32760, "pallas_gpu"),   # Wan 1.3B self-attention
    (32760, 512, "pallas_gpu"),     # Wan's cross-attention to the text (measured faster than cuDNN)
    (2640, 5280, "pallas_gpu"),     # Matrix-Game-2: a chunk's queries over a long cache
    (2640, 2640, "cudnn"),          # short on both sides: measured mixed across shapes, cuDNN keeps it
    (16, 16, "cudnn"),              # UnifoLM-WMA's temporal attention
])
def test_hopper_dispatch_by_shape_class(monkeypatch, sq, skv, expected):
    """impl=None on a Hopper GPU follows `wan_tpu/kernels/tuning.py`'s measured table per shape class."""
    import wan_tpu.kernels.flash_gpu as flash_gpu
    from wan_tpu.layers.attention import _default_impl

    monkeypatch.delenv("WAN_TPU_ATTENTION", raising=False)
    monkeypatch.setattr(flash_gpu, "is_hopper", lambda: True)
    q = jnp.zeros((1, sq, 2, 128), jnp.bfloat16)
    k = jnp.zeros((1, skv, 2, 128), jnp.bfloat16)
    assert _default_impl(q, k, "gpu") == expected
