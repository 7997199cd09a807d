"""`load_transformer`: checkpoint problems fail with one-line `WanInputError`s that name the tensor or
file, sharded checkpoints load like single files, and diffusers' ignorable tensors are ignored.

The checkpoint is a tiny diffusers `WanTransformer3DModel` saved with `save_pretrained`; "equal" below
means bit-identical parameters (same float32 bytes).
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file

from wan_tpu.errors import WanInputError
from wan_tpu.wan.transformer_loading import load_transformer

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=8, out_channels=4,
              text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, image_dim=20, added_kv_proj_dim=32)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("ckpt") / "transformer"
    model.save_pretrained(folder)
    return model, folder


def _copy(folder, tmp_path, edit=None):
    out = tmp_path / "transformer"
    shutil.copytree(folder, out)
    if edit is not None:
        tensors = load_file(out / WEIGHTS)
        edit(tensors)
        save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
    return out


def _flat(dit):
    from flax import nnx

    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(dit))}


def test_sharded_checkpoint_loads_like_single_file(saved, tmp_path):
    model, folder = saved
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert any(n.endswith(".safetensors.index.json") for n in os.listdir(sharded))
    a, b = _flat(load_transformer(str(folder))), _flat(load_transformer(str(sharded)))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_ignored_norm_added_q_is_accepted(saved, tmp_path):
    _, folder = saved
    out = _copy(folder, tmp_path, lambda t: t.update({"blocks.0.attn2.norm_added_q.weight": torch.ones(32)}))
    load_transformer(str(out))


def test_bfloat16_checkpoint_keeps_fp32_modules_fp32(saved, tmp_path):
    model, _ = saved
    folder = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(folder)
    model.float()
    dit = load_transformer(str(folder), dtype=jnp.bfloat16)
    assert dit.blocks.attn2.add_k_proj.kernel.dtype == jnp.bfloat16
    assert dit.condition_embedder.time_embedder.linear_2.kernel.dtype == jnp.float32
    expected = model.state_dict()["blocks.1.ffn.net.0.proj.weight"].to(torch.bfloat16).float().numpy().T
    np.testing.assert_array_equal(np.asarray(dit.blocks.ffn.proj_in.kernel[1], np.float32), expected)


def test_missing_tensor(saved, tmp_path):
    out = _copy(saved[1], tmp_path, lambda t: t.pop("blocks.1.attn2.add_v_proj.bias"))
    with pytest.raises(WanInputError, match=r"'blocks.1.attn2.add_v_proj.bias' \(shape \(32,\)\) is missing"):
        load_transformer(str(out))


def test_unexpected_tensor(saved, tmp_path):
    out = _copy(saved[1], tmp_path, lambda t: t.update({"blocks.0.attn1.to_qkv.weight": torch.zeros(96, 32)}))
    with pytest.raises(WanInputError, match=r"unexpected tensor 'blocks.0.attn1.to_qkv.weight'"):
        load_transformer(str(out))


def test_wrong_shape(saved, tmp_path):
    out = _copy(saved[1], tmp_path, lambda t: t.update({"proj_out.weight": torch.zeros(16, 16)}))
    expected = r"'proj_out.weight' has shape \(16, 16\), but config.json implies \(16, 32\)"
    with pytest.raises(WanInputError, match=expected):
        load_transformer(str(out))


def test_config_that_does_not_match_weights(saved, tmp_path):
    out = _copy(saved[1], tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_layers"] = 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WanInputError, match=r"tensor 'blocks.2.[a-z0-9_.]+' .* is missing"):
        load_transformer(str(out))


def test_truncated_safetensors(saved, tmp_path):
    out = _copy(saved[1], tmp_path)
    data = (out / WEIGHTS).read_bytes()
    (out / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(WanInputError, match=WEIGHTS):
        load_transformer(str(out))


def test_garbage_safetensors(saved, tmp_path):
    out = _copy(saved[1], tmp_path)
    (out / WEIGHTS).write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(WanInputError, match="corrupt safetensors header"):
        load_transformer(str(out))


def test_missing_config(saved, tmp_path):
    out = _copy(saved[1], tmp_path)
    (out / "config.json").unlink()
    with pytest.raises(WanInputError, match="no config.json"):
        load_transformer(str(out))


def test_bad_config_field(saved, tmp_path):
    out = _copy(saved[1], tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["added_kv_proj_dim"] = 40
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WanInputError, match="'added_kv_proj_dim' is 40"):
        load_transformer(str(out))


def test_missing_folder(tmp_path):
    with pytest.raises(WanInputError, match="does not exist"):
        load_transformer(str(tmp_path / "nowhere"))


def test_errors_are_one_line(saved, tmp_path):
    out = _copy(saved[1], tmp_path, lambda t: t.pop("scale_shift_table"))
    with pytest.raises(WanInputError) as e:
        load_transformer(str(out))
    assert "\n" not in str(e.value) and "scale_shift_table" in str(e.value)


def test_load_onto_a_mesh_matches_single_device(saved):
    """With a mesh, parameters land sharded as read and the forward matches (float32, ≤ 1e-5)."""
    import wan_tpu

    _, folder = saved
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 8, 3, 4, 6), np.float32))
    t = jnp.asarray([321.0])
    c = jnp.asarray(rng.standard_normal((1, 512, 24), np.float32))
    image = jnp.asarray(rng.standard_normal((1, 5, 20), np.float32))
    expected = np.asarray(load_transformer(str(folder))(x, t, c, image))
    mesh = wan_tpu.make_mesh(dp=2, sp=2, tp=2)
    dit = load_transformer(str(folder), mesh=mesh)
    assert len(dit.blocks.attn1.to_q.kernel[...].sharding.device_set) == 8
    got = np.asarray(dit(x, t, c, image))
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 1e-5


def test_original_wan_names_round_trip_through_diffusers_converter(saved):
    """Our original-Wan ↔ diffusers name maps agree with diffusers' own single-file converter
    (`convert_wan_transformer_to_diffusers`) on every tensor of an I2V transformer."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from wan_tpu.loading.wan_names import diffusers_to_original_wan, original_wan_to_diffusers

    names = list(saved[0].state_dict())
    original = {diffusers_to_original_wan(n): n for n in names}
    assert len(original) == len(names) and "blocks.0.self_attn.q.weight" in original
    assert "blocks.0.norm3.weight" in original and "head.modulation" in original
    converted = convert_wan_transformer_to_diffusers({n: torch.zeros(1) for n in original})
    assert sorted(converted) == sorted(names)
    assert all(original_wan_to_diffusers(o) == n for o, n in original.items())
