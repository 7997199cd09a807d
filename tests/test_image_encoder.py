"""CLIP vision through torchax (`wan_tpu/image_encoder.py`).

Reference: diffusers' `WanImageToVideoPipeline.encode_image` on eager transformers `CLIPVisionModel`,
float32, on a tiny random encoder and processor saved with `save_pretrained`.
"""

import importlib
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from wan_tpu.errors import WanInputError
from wan_tpu.image_encoder import CLIPImageEncoder

TOL = 1e-5  # float32, absolute on O(1) hidden states
LAYERS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v")
    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        hidden_act="gelu",
    )
    CLIPVisionModel(config).save_pretrained(root / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        root / "image_processor"
    )
    return root


def images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)) for _ in range(2)]


def test_matches_diffusers_encode_image(checkpoint, monkeypatch):
    reference = SimpleNamespace(
        image_processor=CLIPImageProcessor.from_pretrained(checkpoint / "image_processor"),
        image_encoder=CLIPVisionModel.from_pretrained(checkpoint / "image_encoder").eval(),
    )
    with torch.no_grad():
        ref = WanImageToVideoPipeline.encode_image(reference, images(), device=torch.device("cpu")).numpy()

    attention_module = importlib.import_module("wan_tpu.layers.attention")
    calls = []
    original = attention_module.attention
    monkeypatch.setattr(attention_module, "attention", lambda *a, **k: calls.append(k) or original(*a, **k))

    encoder = CLIPImageEncoder.from_pretrained(
        checkpoint / "image_encoder", checkpoint / "image_processor", dtype=jnp.float32, attention_impl="reference"
    )
    out = np.asarray(encoder.encode(images()))
    assert out.shape == (2, (32 // 8) ** 2 + 1, 32)  # patches + class token
    np.testing.assert_allclose(out, ref, atol=TOL)
    assert len(calls) == LAYERS and all(k["impl"] == "reference" for k in calls)  # SDPA swap taken


def test_sharded_over_a_mesh_matches_unsharded(checkpoint):
    from wan_tpu.mesh import make_mesh

    folders = (checkpoint / "image_encoder", checkpoint / "image_processor")
    unsharded = np.asarray(CLIPImageEncoder.from_pretrained(*folders, dtype=jnp.float32).encode(images()))
    encoder = CLIPImageEncoder.from_pretrained(*folders, dtype=jnp.float32, mesh=make_mesh(dp=1, sp=2, tp=4))
    fc1 = encoder.state["encoder.layers.0.mlp.fc1.weight"]
    assert len(fc1.sharding.device_set) == 8 and not fc1.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(encoder.encode(images())), unsharded, atol=TOL)


def test_missing_folder_is_a_user_error(tmp_path, checkpoint):
    with pytest.raises(WanInputError, match="image_encoder folder .* has no config.json"):
        CLIPImageEncoder.from_pretrained(tmp_path, checkpoint / "image_processor")
    with pytest.raises(WanInputError, match="image_processor folder .* has no preprocessor_config.json"):
        CLIPImageEncoder.from_pretrained(checkpoint / "image_encoder", tmp_path)
