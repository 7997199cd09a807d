"""`load_matrix_game_transformer` on the released layout (one safetensors file, the authors' wrapper
names under `model.`), its one-line errors, the authors' config.json, and sharding on a mesh.

Weights: the golden file of scripts/make_golden_matrix_game.py (float16 values under the authors'
exact names). Runs on the 8 simulated CPU devices of tests/conftest.py.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from matrix_game_golden import golden, weights
from safetensors.numpy import load_file, save_file

import wan_tpu
from wan_tpu.configs.matrix_game import MATRIX_GAME_VARIANTS, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.matrix_game.loading import load_matrix_game_transformer
from wan_tpu.matrix_game.model import MatrixGameTransformer
from wan_tpu.parallel.sharding import describe_sharding


def _config(case="mouse_keyboard"):
    return golden(case)[1]["config"]


def test_every_tensor_lands_where_the_authors_use_it():
    tensors = load_file(weights("mouse_keyboard"))
    model = load_matrix_game_transformer(weights("mouse_keyboard"), config_from_json(_config()))
    run0, run1 = model.blocks  # block 0 (with actions), block 1
    pairs = [
        ("model.blocks.0.self_attn.q.weight", run0.attn1.to_q.kernel[...][0].T),
        ("model.blocks.1.cross_attn.o.bias", run1.attn2.to_out.bias[...][0]),
        ("model.blocks.0.norm3.weight", run0.norm2.weight[...][0]),  # their cross-attention norm
        ("model.blocks.1.ffn.2.weight", run1.ffn.proj_out.kernel[...][0].T),
        ("model.blocks.1.modulation", run1.scale_shift_table[...][0]),
        ("model.blocks.0.action_model.keyboard_embed.2.bias", run0.action_model.keyboard_embed.linear_2.bias[...][0]),
        ("model.blocks.0.action_model.mouse_mlp.3.weight", run0.action_model.mouse_mlp_norm.weight[...][0]),
        ("model.blocks.0.action_model.t_qkv.weight", run0.action_model.t_qkv.kernel[...][0].T),
        ("model.img_emb.proj.3.weight", model.condition_embedder.image_embedder.ff.proj_out.kernel[...].T),
        ("model.time_projection.1.bias", model.condition_embedder.time_proj.bias[...]),
        ("model.head.modulation", model.scale_shift_table[...]),
        ("model.patch_embedding.weight", model.patch_embedding.kernel[...].T.reshape(32, 36, 1, 2, 2)),
    ]
    for name, ours in pairs:
        np.testing.assert_array_equal(np.asarray(ours), tensors[name].astype(np.float32), err_msg=name)


def test_mismatched_weights_are_named_in_one_line(tmp_path):
    tensors = load_file(weights("mouse_keyboard"))
    del tensors["model.blocks.1.cross_attn.k.bias"]
    tensors["model.blocks.0.action_model.extra.weight"] = np.zeros(3, np.float16)
    tensors["model.head.head.weight"] = np.zeros((64, 31), np.float16)
    path = tmp_path / "broken.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(WanInputError) as info:
        load_matrix_game_transformer(str(path), config_from_json(_config()))
    message = str(info.value)
    assert "\n" not in message
    assert "missing: model.blocks.1.cross_attn.k.bias" in message
    assert "unexpected: model.blocks.0.action_model.extra.weight" in message
    assert "wrong shape: model.head.head.weight (64, 31) (expected (64, 32))" in message
    with pytest.raises(WanInputError, match="does not exist"):
        load_matrix_game_transformer(str(tmp_path / "nowhere.safetensors"), "universal")


def test_config_json_beside_the_weights(tmp_path):
    """The authors' config.json (`_class_name`, `inject_sample_info`, …) is read when no variant is given."""
    folder = tmp_path / "keyboard"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(open(weights("keyboard"), "rb").read())
    config = dict(_config("keyboard"), _class_name="CausalWanModel", _diffusers_version="0.35.0.dev0",
                  inject_sample_info=False)
    (folder / "config.json").write_text(json.dumps(config))
    model = load_matrix_game_transformer(str(folder))
    assert model.config == config_from_json(_config("keyboard"))
    assert not model.config.action_config.enable_mouse
    with pytest.raises(WanInputError, match="no config.json beside the weights; pass variant="):
        load_matrix_game_transformer(weights("keyboard"))


def test_loads_sharded_on_a_mesh():
    mesh = wan_tpu.make_mesh(2, 2, 2)
    model = load_matrix_game_transformer(weights("mouse_keyboard"), config_from_json(_config()), mesh=mesh)
    q = model.blocks[0].attn1.to_q.kernel[...]
    assert q.sharding.spec == P(None, ("dp", "sp"), "tp")
    assert model.self_attention.kind == model.cross_attention.kind == "cross"  # keys come from the cache


def test_sharding_rules_cover_the_released_models():
    """Every parameter of the real universal model matches a rule; the big ones are split 8 ways."""
    mesh = wan_tpu.make_mesh(2, 2, 2)
    cfg = MATRIX_GAME_VARIANTS["universal"].transformer
    model = nnx.eval_shape(lambda: MatrixGameTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    rows = {r.path: r for r in describe_sharding(model, mesh, "matrix_game")}
    assert [p for p, r in rows.items() if r.rule is None] == []
    assert rows["blocks.1.ffn.proj_in.kernel"].spec == P(None, ("dp", "sp"), "tp")
    assert rows["blocks.0.action_model.t_qkv.kernel"].spec == P(None, ("dp", "sp"))
    assert rows["blocks.0.action_model.mouse_mlp_norm.weight"].replicated


def test_the_abstract_dit_is_read_back_from_the_cache(tmp_path, monkeypatch):
    """`abstract_transformer` (the loader's and `prepare`'s module without weights) is built once, then read
    back from the executable cache: the same graphdef and shapes as building it, and a load through the
    read-back module gives the same weights."""
    from wan_tpu.loading import stacking
    from wan_tpu.matrix_game.loading import abstract_transformer
    from wan_tpu.runtime import compile_cache, executable_cache

    cfg = config_from_json(_config())
    built = stacking.eval_shape(lambda: MatrixGameTransformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    shapes = lambda m: jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(m))  # noqa: E731
    before = compile_cache.cache_dir()
    compile_cache.enable(str(tmp_path / "cache"))
    try:
        monkeypatch.setattr(executable_cache, "_ABSTRACTS", {})
        first = abstract_transformer(cfg)
        monkeypatch.setattr(executable_cache, "_ABSTRACTS", {})  # as a new process: from disk
        real = executable_cache._cached_abstract
        reads = []
        monkeypatch.setattr(executable_cache, "_cached_abstract", lambda *a: reads.append(a[0]) or real(*a))
        monkeypatch.setattr(stacking, "stack_layers", lambda *a, **k: pytest.fail("built again"))
        again = abstract_transformer(cfg)
        loaded = load_matrix_game_transformer(weights("mouse_keyboard"), cfg)
    finally:
        compile_cache.enable(before) if before else compile_cache.disable()
    assert reads == ["matrix-game-dit"]  # the loader's from this process's copy
    for module in (first, again):  # hooks read back are new (equal-valued) objects: compared by their repr
        assert repr(nnx.graphdef(module)) == repr(nnx.graphdef(built)) and shapes(module) == shapes(built)
        assert module.block_runs == built.block_runs
    fresh = load_matrix_game_transformer(weights("mouse_keyboard"), cfg)
    for a, b in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(fresh))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
