"""load_vae: every checkpoint tensor is checked (missing / unexpected / wrong shape → one-line WanInputError
naming it), dtypes and mesh placement are honoured. Reference: a tiny diffusers AutoencoderKLWan saved
with save_pretrained."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from flax import nnx
from safetensors.torch import load_file, save_file

from wan_tpu.errors import WanInputError
from wan_tpu.vae.loading import load_vae

TINY = dict(base_dim=8, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae")
    torch.manual_seed(0)
    AutoencoderKLWan(**TINY).save_pretrained(path)
    return path


def _edit(saved, tmp_path, edit):
    """A copy of the saved checkpoint with its tensor dict changed by `edit`."""
    tensors = load_file(os.path.join(saved, WEIGHTS))
    edit(tensors)
    save_file(tensors, os.path.join(tmp_path, WEIGHTS))
    with open(os.path.join(saved, "config.json")) as f, open(os.path.join(tmp_path, "config.json"), "w") as g:
        g.write(f.read())
    return str(tmp_path)


def test_loads_every_tensor_with_our_layouts(saved):
    tensors = load_file(os.path.join(saved, WEIGHTS))
    vae = load_vae(str(saved), dtype=jnp.bfloat16)
    conv = tensors["decoder.up_blocks.0.upsamplers.0.time_conv.weight"].numpy()  # (out, in, t, h, w)
    np.testing.assert_array_equal(
        np.asarray(vae.decoder.up_blocks[0].upsampler.time_conv.kernel[...], np.float32),
        conv.transpose(2, 3, 4, 1, 0).astype(jnp.bfloat16).astype(np.float32),
    )
    qkv = tensors["decoder.mid_block.attentions.0.to_qkv.weight"].numpy()  # (3C, C, 1, 1)
    np.testing.assert_allclose(np.asarray(vae.decoder.mid_block.attentions[0].to_qkv.kernel[...], np.float32), qkv[:, :, 0, 0].T, rtol=1e-2)
    params = jax.tree.leaves(nnx.state(vae, nnx.Param))
    assert all(p.dtype == jnp.bfloat16 for p in params)
    assert sum(p.size for p in params) == sum(t.numel() for t in tensors.values())


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t: t.pop("encoder.conv_in.weight"), "'encoder.conv_in.weight' (shape (8, 3, 3, 3, 3)) is missing"),
        (lambda t: t.update({"decoder.extra.weight": torch.zeros(2)}), "unexpected tensor 'decoder.extra.weight'"),
        (lambda t: t.update({"quant_conv.bias": torch.zeros(9)}), "'quant_conv.bias' has shape (9,), expected (8,)"),
    ],
)
def test_checkpoint_problems_name_the_tensor(saved, tmp_path, edit, words):
    with pytest.raises(WanInputError) as info:
        load_vae(_edit(saved, tmp_path, edit))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_config_problems_are_input_errors(saved, tmp_path):
    path = _edit(saved, tmp_path, lambda t: None)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "num_layers": 3}, f)
    with pytest.raises(WanInputError, match="unknown fields.*num_layers"):
        load_vae(path)
    with pytest.raises(WanInputError, match="does not exist"):
        load_vae(str(tmp_path / "nowhere"))


def test_mesh_replicates_weights(saved):
    vae = load_vae(str(saved), mesh=jax.make_mesh((8,), ("w",)))
    for p in jax.tree.leaves(nnx.state(vae, nnx.Param)):
        assert len(p.sharding.device_set) == 8 and p.sharding.is_fully_replicated
