"""`WanTransformer` against diffusers' `WanTransformer3DModel` (float32, CPU).

Each reference is a tiny diffusers model with every parameter randomized (diffusers zero-initializes
some, which would hide mapping mistakes), saved with `save_pretrained` and loaded by our loader.
Tolerance: relative Frobenius error ≤ 1e-5 in float32; ≤ 2e-2 for a bfloat16 load against the
float32 reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from flax import nnx

from wan_tpu.configs.models import config_from_json
from wan_tpu.wan.transformer import WanTransformer, forward
from wan_tpu.wan.transformer_loading import load_transformer

F32_TOL = 1e-5
BF16_TOL = 2e-2

BASE = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True, rope_max_seq_len=64)
CASES = {
    "t2v": {},
    "t2v_hd32_no_cross_norm": dict(attention_head_dim=32, cross_attn_norm=False),
    "t2v_hd48": dict(attention_head_dim=48, num_attention_heads=1),
    "i2v": dict(in_channels=8, image_dim=20, added_kv_proj_dim=32),
    "flf2v": dict(in_channels=8, image_dim=20, added_kv_proj_dim=32, pos_embed_seq_len=6),
    "ti2v": dict(in_channels=6, out_channels=6),
}


def randomize_(model: torch.nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.ndim == 2 or name.endswith("patch_embedding.weight"):
                p.copy_(noise / p[0].numel() ** 0.5)
            else:
                p.copy_(0.2 * noise)


@functools.cache
def _reference(case: str, folder: str):
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**BASE, **CASES[case]}).eval()
    randomize_(model, seed=len(case))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    def get(case):
        folder = str(tmp_path_factory.getbasetemp() / f"dit_{case}")
        return _reference(case, folder), folder

    return get


def _inputs(case, batch=1, frames=3, height=6, width=10, text_len=7, seed=0):
    cfg = {**BASE, **CASES[case]}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg["in_channels"], frames, height, width, generator=g)
    if case == "ti2v":
        seq = frames * (height // 2) * (width // 2)
        t = torch.rand(batch, seq, generator=g) * 1000
        t[:, : seq // frames] = 0.0  # the conditioning frame sits at t = 0, as in Wan 2.2 TI2V
    else:
        t = torch.rand(batch, generator=g) * 1000
    image = None
    if cfg.get("image_dim"):
        text_len = 512  # diffusers splits image from text tokens assuming 512 text tokens
        n_img = cfg.get("pos_embed_seq_len") or 5
        # FLF2V: two images per sample, each n/2 tokens, stacked on the batch axis (diffusers' layout).
        rows = 2 * batch if cfg.get("pos_embed_seq_len") else batch
        image = torch.randn(rows, n_img // (2 if cfg.get("pos_embed_seq_len") else 1), cfg["image_dim"], generator=g)
    c = torch.randn(batch, text_len, cfg["text_dim"], generator=g)
    return x, t, c, image


def _run_ref(model, x, t, c, image):
    with torch.no_grad():
        return model(x, t, c, encoder_hidden_states_image=image, return_dict=False)[0].numpy()


def _run_ours(dit, x, t, c, image):
    j = lambda a: None if a is None else jnp.asarray(a.numpy())  # noqa: E731
    return np.asarray(dit(j(x), j(t), j(c), j(image)), np.float32)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers_float32(reference, case):
    model, folder = reference(case)
    dit = load_transformer(folder)
    inputs = _inputs(case)
    ref = _run_ref(model, *inputs)
    ours = _run_ours(dit, *inputs)
    assert ours.shape == ref.shape
    assert _rel(ours, ref) <= F32_TOL, f"{case}: rel err {_rel(ours, ref):.2e} > {F32_TOL}"


def test_batch_of_two_with_different_timesteps(reference):
    model, folder = reference("t2v_hd32_no_cross_norm")
    dit = load_transformer(folder)
    x, t, c, _ = _inputs("t2v_hd32_no_cross_norm", batch=2, frames=5, height=4, width=6, text_len=9, seed=3)
    t = torch.tensor([999.0, 17.5])
    ref = _run_ref(model, x, t, c, None)
    ours = _run_ours(dit, x, t, c, None)
    assert _rel(ours, ref) <= F32_TOL
    # The two samples really differ in timestep: swapping them changes the output.
    assert _rel(_run_ours(dit, x, t.flip(0), c, None), ref) > 1e-3


def test_ti2v_batch_of_two(reference):
    model, folder = reference("ti2v")
    dit = load_transformer(folder)
    inputs = _inputs("ti2v", batch=2, seed=5)
    assert _rel(_run_ours(dit, *inputs), _run_ref(model, *inputs)) <= F32_TOL


def test_bfloat16_load_close_to_float32_reference(reference):
    model, folder = reference("i2v")
    dit = load_transformer(folder, dtype=jnp.bfloat16)
    assert dit.blocks.attn1.to_q.kernel.dtype == jnp.bfloat16
    # diffusers' _keep_in_fp32_modules stay float32.
    for p in (dit.scale_shift_table, dit.blocks.scale_shift_table, dit.blocks.norm2.weight,
              dit.condition_embedder.time_embedder.linear_1.kernel, dit.condition_embedder.image_embedder.norm1.weight):
        assert p.dtype == jnp.float32
    inputs = _inputs("i2v")
    ref = _run_ref(model, *inputs)
    assert _rel(_run_ours(dit, *inputs), ref) <= BF16_TOL


def test_stacked_parameters_are_transposed_diffusers_weights(reference):
    model, folder = reference("t2v")
    dit = load_transformer(folder)
    sd = model.state_dict()
    kernel = np.asarray(dit.blocks.attn1.to_q.kernel[...])
    assert kernel.shape == (2, 32, 32)
    for i in range(2):
        np.testing.assert_array_equal(kernel[i], sd[f"blocks.{i}.attn1.to_q.weight"].numpy().T)
    np.testing.assert_array_equal(np.asarray(dit.blocks.ffn.proj_out.bias[1]), sd["blocks.1.ffn.net.2.bias"].numpy())
    np.testing.assert_array_equal(np.asarray(dit.blocks.attn2.to_out.kernel[0]),
                                  sd["blocks.0.attn2.to_out.0.weight"].numpy().T)


def test_pure_forward_inside_jit_and_fori_loop(reference):
    """The functional form the sampler uses gives the same result as the module call."""
    _, folder = reference("t2v")
    dit = load_transformer(folder)
    x, t, c, _ = (jnp.asarray(a.numpy()) if a is not None else None for a in _inputs("t2v"))
    graphdef, state = nnx.split(dit)

    @jax.jit
    def two_steps(state, x):
        return jax.lax.fori_loop(0, 2, lambda i, x: x - 0.1 * forward(graphdef, state, x, t, c), x)

    expected = x
    for _ in range(2):
        expected = expected - 0.1 * dit(expected, t, c)
    np.testing.assert_allclose(np.asarray(two_steps(state, x)), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_hooks_are_called_with_documented_names():
    cfg = config_from_json({**BASE, "patch_size": [1, 2, 2]})
    dit = WanTransformer(cfg, rngs=nnx.Rngs(0))
    calls = {"self": 0, "cross": 0, "names": set()}

    def counting(kind):
        def attn(q, k, v):
            calls[kind] += 1
            return jax.nn.dot_product_attention(q, k, v)

        return attn

    def shard(x, name):
        calls["names"].add(name)
        return x

    x, t, c, _ = (jnp.asarray(a.numpy()) if a is not None else None for a in _inputs("t2v"))
    before = np.asarray(dit(x, t, c))
    dit.self_attention, dit.cross_attention, dit.shard_activation = counting("self"), counting("cross"), shard
    after = np.asarray(dit(x, t, c))
    # Traced once: the scanned block body calls each hook once.
    assert calls["self"] == 1 and calls["cross"] == 1
    assert calls["names"] == {"tokens", "context"}
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_problem():
    from wan_tpu.errors import WanInputError

    dit = WanTransformer(config_from_json(BASE), rngs=nnx.Rngs(0))
    x = jnp.zeros((1, 4, 3, 6, 10))
    t = jnp.zeros((1,))
    c = jnp.zeros((1, 7, 24))
    with pytest.raises(WanInputError, match="height 5 is not a multiple"):
        dit(jnp.zeros((1, 4, 3, 5, 10)), t, c)
    with pytest.raises(WanInputError, match="timestep has shape"):
        dit(x, jnp.zeros((1, 3)), c)
    with pytest.raises(WanInputError, match="encoder_hidden_states has shape"):
        dit(x, t, jnp.zeros((1, 7, 8)))
    with pytest.raises(WanInputError, match="takes no encoder_hidden_states_image"):
        dit(x, t, c, jnp.zeros((1, 5, 20)))


def test_models_of_one_config_share_compiled_code():
    """Two experts of one config (Wan 2.2 A14B) have equal graphdefs, so jit compiles once."""
    cfg = config_from_json(BASE)
    a, b = WanTransformer(cfg, rngs=nnx.Rngs(0)), WanTransformer(cfg, rngs=nnx.Rngs(1))
    assert nnx.graphdef(a) == nnx.graphdef(b)
    assert nnx.graphdef(a) != nnx.graphdef(WanTransformer(cfg, rngs=nnx.Rngs(0), attention_impl="reference"))


@pytest.mark.parametrize("case", ["t2v", "ti2v"])
def test_unfused_elementwise_path_matches_diffusers_float32(reference, case):
    """The block's `fused_elementwise=False` baseline (diffusers' op order) stays exact too: it is
    what benchmarks/bench_dit.py times the fused default against."""
    model, folder = reference(case)
    dit = load_transformer(folder)
    inputs = _inputs(case)
    fused = _run_ours(dit, *inputs)
    dit.blocks.fused_elementwise = False
    unfused = _run_ours(dit, *inputs)
    ref = _run_ref(model, *inputs)
    assert _rel(unfused, ref) <= F32_TOL and _rel(fused, ref) <= F32_TOL
    assert not np.array_equal(fused, unfused)  # the switch really changes the graph
