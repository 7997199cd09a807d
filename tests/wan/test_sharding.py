"""`wan_tpu.parallel.sharding` on the 8 simulated CPU devices (tests/conftest.py).

- The sharded DiT, loaded with `load_transformer(path, mesh=...)` from a tiny diffusers checkpoint
  (`save_pretrained`), matches diffusers' `WanTransformer3DModel` and our single-device forward:
  relative Frobenius error ≤ 1e-5 (float32), on every mesh shape and fallback (12 heads on 8
  devices, batch 1 on dp=2, a token count no mesh axis divides).
- The sharded attention hooks match `wan_tpu.layers.attention.reference_attention` to 1e-5.
- Weights land with their rule's spec and each device holds 1/8 of every 8-way-sharded weight.
- The rule tables cover every parameter of every preset's DiT, of our UMT5 encoder and of our
  CLIP towers (tests/test_clip.py): nothing falls through, and what is replicated is on an explicit allow-list.
- The compiled sharded forward gathers only one layer's weights at a time (FSDP) and K/V inside
  the attention `shard_map`: no activation all-gathers, no all-to-all, no full rematerialization.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_transformer import randomize_

import wan_tpu
from wan_tpu.configs.models import VARIANTS, WanTransformerConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers.attention import reference_attention
from wan_tpu.parallel.sharding import (
    ShardedAttention,
    describe_sharding,
    fit_spec,
    match_rule,
    param_bytes_per_device,
    param_spec,
    place_param,
    shard_transformer,
)
from wan_tpu.wan.transformer import WanTransformer, forward
from wan_tpu.wan.transformer_loading import load_transformer

TOL = 1e-5

BASE = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
MODELS = {
    "h8": {},
    "h12": dict(num_attention_heads=12, ffn_dim=96),
}
# Small parameters that may be replicated: norms, biases, modulation tables, patch embedding in and
# unpatchify projection out.
REPLICATED_OK = re.compile(r"(norm\w*\.(scale|weight)|\.bias|scale_shift_table|patch_embedding\.kernel|^proj_out\.kernel|pos_embed)$")


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@functools.cache
def _checkpoint(name: str, folder: str):
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**BASE, **MODELS[name]}).eval()
    randomize_(model, seed=1)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def get(name):
        folder = str(tmp_path_factory.getbasetemp() / f"sharding_dit_{name}")
        return _checkpoint(name, folder), folder

    return get


def _inputs(name: str, batch: int):
    """Latent 3×6×10 → 45 tokens: divisible by no mesh axis, so every sharded path pads."""
    cfg = {**BASE, **MODELS[name]}
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, cfg["in_channels"], 3, 6, 10, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    c = torch.randn(batch, 7, cfg["text_dim"], generator=g)
    return x, t, c, None


@functools.cache
def _expected(name: str, batch: int, folder: str):
    """(diffusers output, our single-device output) for one model and batch size."""
    model = _checkpoint(name, folder)
    x, t, c, image = _inputs(name, batch)
    with torch.no_grad():
        ref = model(x, t, c, encoder_hidden_states_image=image, return_dict=False)[0].numpy()
    ours = np.asarray(load_transformer(folder)(*_jax(x, t, c, image)))
    return ref, ours


def _jax(*tensors):
    return tuple(None if a is None else jnp.asarray(a.numpy()) for a in tensors)


@pytest.mark.parametrize(
    "name, mesh_shape, batch",
    [
        ("h8", (1, 1, 8), 2),  # heads over tp
        ("h8", (2, 1, 4), 2),  # CFG pair over dp, heads over tp
        ("h8", (2, 2, 2), 2),
        ("h8", (1, 8, 1), 2),  # context parallel only
        ("h12", (1, 1, 8), 2),  # 12 heads on tp=8: sequence-parallel fallback
        ("h12", (2, 2, 2), 1),  # one video on dp=2: dp joins the sequence axes
    ],
)
def test_sharded_forward_matches_single_device_and_diffusers(checkpoint, name, mesh_shape, batch):
    _, folder = checkpoint(name)
    ref, single = _expected(name, batch, folder)
    mesh = wan_tpu.make_mesh(*mesh_shape)
    dit = load_transformer(folder, mesh=mesh)
    out = dit(*_jax(*_inputs(name, batch)))
    assert _rel(out, single) <= TOL, f"vs single device: {_rel(out, single):.2e}"
    assert _rel(out, ref) <= TOL, f"vs diffusers: {_rel(out, ref):.2e}"


def test_loaded_weights_land_sharded_by_the_rules(checkpoint):
    _, folder = checkpoint("h8")
    mesh = wan_tpu.make_mesh(2, 2, 2)
    dit = load_transformer(folder, mesh=mesh)
    rows = {r.path: r for r in describe_sharding(dit, mesh, "dit")}
    for path, var in nnx.to_flat_state(nnx.state(dit, nnx.Param)):
        value = var.get_value()
        path = ".".join(map(str, path))
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, rows[path].spec), value.ndim), path
    assert rows["blocks.attn1.to_q.kernel"].spec == P(None, ("dp", "sp"), "tp")
    assert rows["blocks.ffn.proj_out.kernel"].spec == P(None, "tp", ("dp", "sp"))

    # Every block kernel is split 8 ways: each device holds exactly 1/8 of those bytes.
    per_device = param_bytes_per_device(dit.blocks)
    kernels = [v.get_value() for p, v in nnx.to_flat_state(nnx.state(dit.blocks, nnx.Param)) if p[-1] == "kernel"]
    kernel_bytes = sum(k.nbytes for k in kernels)
    for k in kernels:
        assert all(s.data.nbytes * 8 == k.nbytes for s in k.addressable_shards)
    small = sum(v.get_value().nbytes for p, v in nnx.to_flat_state(nnx.state(dit.blocks, nnx.Param)) if p[-1] != "kernel")
    assert len(per_device) == 8
    for n in per_device.values():
        assert kernel_bytes / 8 <= n <= kernel_bytes / 8 + small


def test_heads_not_divisible_by_tp_store_tp_as_fsdp():
    cfg = WanTransformerConfig(**{**BASE, **MODELS["h12"]})
    dit = nnx.eval_shape(lambda: WanTransformer(cfg, rngs=nnx.Rngs(0)))
    mesh = AbstractMesh((1, 1, 8), ("dp", "sp", "tp"))
    rows = {r.path: r.spec for r in describe_sharding(dit, mesh, "dit")}
    assert rows["blocks.attn1.to_q.kernel"] == P(None, "tp")  # (2, 96, 96): 96 splits 8 ways on the input dim
    assert rows["blocks.attn1.to_out.kernel"] == P(None, None, "tp")
    assert rows["blocks.attn1.to_q.bias"] == P()


@pytest.mark.parametrize(
    "kind, mesh_shape, batch, heads",
    [
        ("self", (2, 1, 4), 2, 4),  # heads over tp
        ("self", (1, 8, 1), 2, 4),  # K/V gathered over sp=8, 13 tokens padded to 16
        ("self", (2, 2, 2), 1, 3),  # batch and heads both indivisible: sequence over dp·sp·tp
        ("cross", (2, 2, 2), 2, 4),
        ("cross", (1, 1, 8), 1, 3),
    ],
)
def test_sharded_attention_matches_reference(kind, mesh_shape, batch, heads):
    keys = jax.random.split(jax.random.key(0), 3)
    sq, skv = 13, (13 if kind == "self" else 5)
    q = jax.random.normal(keys[0], (batch, sq, heads, 8))
    k = jax.random.normal(keys[1], (batch, skv, heads, 8))
    v = jax.random.normal(keys[2], (batch, skv, heads, 8))
    hook = ShardedAttention(wan_tpu.make_mesh(*mesh_shape), kind, impl="reference")
    out = jax.jit(hook)(q, k, v)
    assert _rel(out, np.asarray(reference_attention(q, k, v))) <= TOL


def test_dit_needs_the_three_mesh_axes():
    cfg = WanTransformerConfig(**BASE)
    dit = nnx.eval_shape(lambda: WanTransformer(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(WanInputError, match=r"needs a mesh with axes \('dp', 'sp', 'tp'\), got \('w',\)"):
        shard_transformer(dit, jax.make_mesh((8,), ("w",)))


def test_fit_spec_falls_back_per_dimension():
    mesh = AbstractMesh((2, 2, 2), ("dp", "sp", "tp"))
    spec, notes = fit_spec(P(None, ("dp", "sp"), "tp"), (3, 6, 5), mesh)
    assert spec == P(None, "dp")
    assert len(notes) == 2 and "dim 1 (6)" in notes[0] and "dim 2 (5)" in notes[1]
    assert fit_spec(P("tp", "dp"), (8,), mesh)[0] == P()  # a rule longer than the array: replicated
    assert fit_spec(P(("dp", "sp"), "tp"), (8, 8), AbstractMesh((1, 4, 2), ("dp", "sp", "tp")))[0] == P("sp", "tp")


def test_place_param_sends_each_device_its_slice(tmp_path):
    mesh = wan_tpu.make_mesh(2, 2, 2)
    host = np.arange(2 * 8 * 16, dtype=np.float32).reshape(2, 8, 16)
    np.save(tmp_path / "w.npy", host)
    mapped = np.load(tmp_path / "w.npy", mmap_mode="r")
    arr = place_param(mesh, "dit", "blocks.attn1.to_q.kernel", mapped, dtype=jnp.bfloat16)
    assert arr.dtype == jnp.bfloat16 and arr.sharding.spec == P(None, ("dp", "sp"), "tp")
    for shard in arr.addressable_shards:
        assert shard.data.shape == (2, 2, 8)
        np.testing.assert_array_equal(np.asarray(shard.data, np.float32), host[shard.index])
    unmatched = place_param(mesh, "dit", "some.new.weight", host)
    assert unmatched.sharding.is_fully_replicated
    assert match_rule("dit", "some.new.weight") == (None, P())
    (row,) = describe_sharding({"some.new.weight": host}, mesh, "dit")
    assert row.rule is None and "[no rule: replicated]" in str(row)


def _preset_configs():
    """One entry per distinct transformer architecture of the presets, named by its first variant."""
    out = {}
    for v in VARIANTS.values():
        for cfg in (v.transformer, v.transformer_2):
            if cfg is not None and cfg not in out.values():
                out[f"{v.name}:{cfg.in_channels}ch"] = cfg
    return out


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 1, 8), (2, 4, 8)])
@pytest.mark.parametrize("name", sorted(_preset_configs()))
def test_rules_cover_every_preset_parameter(name, mesh_shape):
    cfg = _preset_configs()[name]
    dit = nnx.eval_shape(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    mesh = AbstractMesh(mesh_shape, ("dp", "sp", "tp"))
    rows = describe_sharding(dit, mesh, "dit")
    assert [r.path for r in rows if r.rule is None] == []
    assert [r.path for r in rows if r.replicated and not REPLICATED_OK.search(r.path)] == []
    assert [r.path for r in rows if r.path.startswith("blocks.") and r.spec and r.spec[0] is not None] == []
    # The weights not on the allow-list are split over every device (the tiny preset's 32-wide
    # weights cannot be on 64 devices: those fall back, with a note).
    sharded = [r for r in rows if not REPLICATED_OK.search(r.path)]
    assert [r.path for r in sharded if _shards(mesh, r.spec) != mesh.size and not r.notes] == []
    if not name.startswith("tiny"):
        assert [r.path for r in sharded if r.notes] == []


def _shards(mesh, spec):
    n = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            n *= mesh.shape[axis]
    return n


def test_umt5_and_clip_rules_cover_every_parameter():
    from flax import nnx

    from wan_tpu.encoders.clip import CLIPVisionConfig, CLIPVisionTransformer
    from wan_tpu.encoders.umt5 import UMT5Config, UMT5Encoder

    umt5 = nnx.eval_shape(lambda: UMT5Encoder(UMT5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                                         num_heads=4)))
    clip = nnx.eval_shape(lambda: CLIPVisionTransformer(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14)))
    mesh = AbstractMesh((2, 2, 2), ("dp", "sp", "tp"))
    for family, model in (("umt5", umt5), ("clip", clip)):
        rows = {r.path: r for r in describe_sharding(model, mesh, family)}
        assert [p for p, r in rows.items() if r.rule is None] == []
        assert all(r.replicated for p, r in rows.items() if re.search(r"(norm|layrnorm|relative_attention_bias|embeddings\.)", p))
    # torch layout (out, in) behind the stacked layer axis: q column-parallel, o row-parallel; the layer axis whole.
    assert param_spec(mesh, "umt5", "blocks.attention.q.weight", (2, 16, 16)) == P(None, "tp", ("dp", "sp"))
    assert param_spec(mesh, "umt5", "blocks.attention.o.weight", (2, 16, 16)) == P(None, ("dp", "sp"), "tp")
    assert param_spec(mesh, "umt5", "blocks.ffn.wo.weight", (2, 16, 32)) == P(None, ("dp", "sp"), "tp")
    assert param_spec(mesh, "clip", "encoder.layers.mlp.fc2.weight", (2, 16, 32)) == P(None, ("dp", "sp"), "tp")
    assert param_spec(mesh, "vae", "decoder.up_blocks.0.resnets.0.conv1.weight", (16, 16, 3, 3, 3)) == P()


def _collectives(hlo: str):
    """(op, result shape, source op name) of every collective in compiled HLO text."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (.+?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(", line)
        if m:
            name = re.search(r'op_name="([^"]+)"', line)
            out.append((m.group(2), m.group(1), name.group(1) if name else ""))
    return out


def _rank(shape: str) -> int:
    return len(re.search(r"\[([\d,]*)\]", shape).group(1).split(","))


@pytest.mark.parametrize("heads, mesh_shape", [(8, (2, 2, 2)), (12, (1, 1, 8))])
def test_compiled_forward_gathers_only_layer_weights_and_kv(capfd, heads, mesh_shape):
    # Enough tokens (4,096) that activations outweigh one layer's weights, as at real sizes.
    cfg = WanTransformerConfig(**{**BASE, "num_attention_heads": heads, "ffn_dim": 128})
    dit = nnx.eval_shape(lambda: WanTransformer(cfg, rngs=nnx.Rngs(0)))
    mesh = wan_tpu.make_mesh(*mesh_shape)
    shard_transformer(dit, mesh)
    graphdef, state = nnx.split(dit)
    args = (jax.ShapeDtypeStruct((2, 4, 4, 64, 64), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32),
            jax.ShapeDtypeStruct((2, 8, cfg.text_dim), jnp.float32))
    hlo = jax.jit(forward, static_argnums=0).lower(graphdef, state, *args).compile().as_text()
    ops = _collectives(hlo)
    gathers = [(shape, src) for op, shape, src in ops if op == "all-gather"]
    assert len([shape for shape, src in gathers if "shard_map" in src]) == 2  # K and V, once in the layer scan
    # Everything else the layer scan gathers is one layer's 2-D weight (FSDP) or a (B, dim) vector.
    body = [shape for shape, src in gathers if "while/body" in src and "shard_map" not in src]
    assert body and [s for s in body if _rank(s) != 2] == []
    # Nowhere a stacked (layers, in, out) weight or a (B, S, dim) token activation; only the small
    # latent (B, C, F, H, W) at the model's edges may be gathered.
    assert [s for s, src in gathers if "shard_map" not in src and _rank(s) in (3, 4)] == []
    assert not [op for op, _, _ in ops if op == "all-to-all"]
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
