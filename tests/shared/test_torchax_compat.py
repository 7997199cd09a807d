"""torchax shim and SDPA swap (`wan_tpu/runtime/torchax_compat.py`).

References: eager torch (float32) for single ops, SDPA variants and diffusers' `WanTransformer3DModel`;
our Flax DiT (`wan_tpu.load_transformer`) from the same `save_pretrained` folder when it exists.
"""

import importlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from wan_tpu.runtime import torchax_compat

SDPA_TOL = 1e-5  # float32, absolute on O(1) outputs
MODEL_TOL = 1e-5  # float32, relative (Frobenius) to the reference output


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts calls that reach `wan_tpu.layers.attention.attention` (at trace time under jit)."""
    module = importlib.import_module("wan_tpu.layers.attention")
    original = module.attention
    calls = []

    def counting(q, k, v, **kwargs):
        calls.append((q.shape, kwargs))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(module, "attention", counting)
    return calls


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def test_shim_imports_torchax_and_leaves_torch_unpatched():
    torchax = torchax_compat.import_torchax()
    env = torchax_compat.default_env()
    assert torchax.__version__ == "0.0.13"
    assert env is torchax.default_env() is torchax_compat.default_env()
    assert torch._ops.OpOverloadPacket.__getattr__.__qualname__ == "OpOverloadPacket.__getattr__"
    if "dim_Dimname" in torch.ops.aten.prod.overloads():
        pytest.skip(f"torch {torch.__version__} still has the named-tensor overloads: nothing to shim")
    with pytest.raises(AttributeError, match="dim_Dimname"):
        torch.ops.aten.prod.dim_Dimname
    with pytest.raises(AttributeError, match="no_such_overload"):
        torch.ops.aten.prod.no_such_overload


def test_fresh_process_imports_torchax_through_the_shim():
    """Import and first environment from scratch (the in-process tests may find torchax imported)."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from wan_tpu.runtime import torchax_compat\n"
        "env = torchax_compat.default_env()\n"
        "x = torch.randn(1, 2, 4, 8)\n"
        "with env:\n"
        "    out = F.scaled_dot_product_attention(*env.to_xla((x, x, x)))\n"
        "assert torch.allclose(out.torch(), F.scaled_dot_product_attention(x, x, x), atol=1e-5)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_op_runs_through_torchax():
    env = torchax_compat.default_env()
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with env:
        out = torch.softmax(env.to_xla(a) @ env.to_xla(b), dim=-1)
    np.testing.assert_allclose(out.jax(), torch.softmax(a @ b, dim=-1).numpy(), atol=SDPA_TOL)


SDPA_CASES = {
    "plain": dict(),
    "default_scale": dict(scale=8**-0.5),
    "float_mask": dict(attn_mask="float"),
    "bool_mask_with_empty_row": dict(attn_mask="bool"),
    "causal": dict(is_causal=True),
    "scale_one_plus_bias": dict(attn_mask="float", scale=1.0),  # UMT5's call
    "gqa": dict(enable_gqa=True),
}


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_matches_torch(case, attention_calls):
    kwargs = dict(SDPA_CASES[case])
    gen = torch.Generator().manual_seed(0)
    kv_heads = 1 if case == "gqa" else 3
    q = torch.randn(2, 3, 5, 8, generator=gen)
    k, v = torch.randn(2, kv_heads, 7, 8, generator=gen), torch.randn(2, kv_heads, 7, 8, generator=gen)
    if kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(2, 1, 5, 7, generator=gen)
    elif kwargs.get("attn_mask") == "bool":
        mask = torch.rand(2, 1, 5, 7, generator=gen) > 0.4
        mask[0, 0, 1] = False  # a query that sees no key: torch gives zeros
        kwargs["attn_mask"] = mask
    ref = F.scaled_dot_product_attention(q, k, v, **kwargs)
    env = torchax_compat.default_env()
    with env:
        moved = env.to_xla(dict(q=q, k=k, v=v, **{n: t for n, t in kwargs.items() if torch.is_tensor(t)}))
        out = F.scaled_dot_product_attention(
            moved.pop("q"), moved.pop("k"), moved.pop("v"), **{**kwargs, **moved}
        )
    np.testing.assert_allclose(out.jax(), ref.numpy(), atol=SDPA_TOL)
    plain = case in ("plain", "default_scale")
    assert len(attention_calls) == (1 if plain else 0)
    if plain:
        assert attention_calls[0][0] == (2, 5, 3, 8)  # handed over in (B, S, H, D)


def test_sdpa_registration_is_idempotent():
    env = torchax_compat.default_env()
    op = env._ops[F.scaled_dot_product_attention]
    assert torchax_compat.default_env() is env
    assert env._ops[F.scaled_dot_product_attention] is op
    assert op.is_user_defined


def test_attention_impl_reaches_wan_attention(attention_calls):
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 4, 8)), jnp.float32)
    with torchax_compat.attention_impl("reference"):
        torchax_compat.scaled_dot_product_attention(q, q, q)
    assert attention_calls[0][1]["impl"] == "reference"


TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)
# Wan 2.1 I2V: CLIP tokens through `image_dim`; diffusers splits them off a 512-token text context.
TINY_WAN_I2V = dict(TINY_WAN, image_dim=24, added_kv_proj_dim=16)


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_wan_transformer_through_torchax_matches_eager(variant, tmp_path, attention_calls):
    from diffusers import WanTransformer3DModel

    config = TINY_WAN if variant == "t2v" else TINY_WAN_I2V
    torch.manual_seed(0)
    WanTransformer3DModel(**config).save_pretrained(tmp_path / "transformer")
    reference = WanTransformer3DModel.from_pretrained(tmp_path / "transformer").eval()
    inputs = {
        "hidden_states": torch.randn(2, 4, 3, 8, 8),
        "timestep": torch.tensor([999.0, 250.0]),
        "encoder_hidden_states": torch.randn(2, 7 if variant == "t2v" else 512, 16),
    }
    if variant == "i2v":
        inputs["encoder_hidden_states_image"] = torch.randn(2, 5, 24)
    with torch.no_grad():
        ref = reference(**inputs, return_dict=False)[0].numpy()

    module = WanTransformer3DModel.from_pretrained(tmp_path / "transformer").eval()
    state = torchax_compat.module_state(module)
    forward = jax.jit(
        lambda state, inputs: torchax_compat.functional_call(
            module, state, (), {**inputs, "return_dict": False}, output=lambda out: out[0]
        )
    )
    jax_inputs = {name: jnp.asarray(t.numpy()) for name, t in inputs.items()}
    assert rel_err(forward(state, jax_inputs), ref) <= MODEL_TOL
    # Traced once: self- and text cross-attention per block, plus image cross-attention for I2V.
    assert len(attention_calls) == (2 if variant == "t2v" else 3) * config["num_layers"]

    try:
        from wan_tpu.wan.transformer_loading import load_transformer
    except ImportError:
        pytest.skip("wan_tpu.wan.transformer_loading.load_transformer not written yet")
    dit = load_transformer(tmp_path / "transformer", dtype=jnp.float32)
    assert rel_err(dit(**jax_inputs), ref) <= MODEL_TOL
