"""The Wan I2V CLIP image encoder (`wan_tpu/encoders/clip_image.py`): native tower and image processor.

References: diffusers' `WanImageToVideoPipeline.encode_image` on eager transformers `CLIPVisionModel`
and `CLIPImageProcessor` (its PIL backend, as diffusers gets it without torchvision), float32, on a tiny
random encoder and processor saved with `save_pretrained`: hidden states ≤ 1e-5 absolute on O(1) values;
the processor's pixel values bit-equal on several sizes and modes.
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

from wan_tpu.encoders.clip_image import CLIPImageEncoder, ImageProcessor
from wan_tpu.errors import WanInputError

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
    assert encoder.config.num_hidden_layers == LAYERS - 1  # the last block's output is never read: not loaded
    out = np.asarray(encoder.encode(images()))
    assert out.shape == (2, (32 // 8) ** 2 + 1, 32)  # patches + class token
    np.testing.assert_allclose(out, ref, atol=TOL)
    assert calls and all(k["impl"] == "reference" for k in calls)  # the shared attention dispatch, as asked


@pytest.mark.parametrize(
    "size, crop",
    [({"shortest_edge": 32}, {"height": 32, "width": 32}), ({"shortest_edge": 224}, {"height": 224, "width": 224}),
     ({"height": 24, "width": 40}, {"height": 20, "width": 36}), ({"shortest_edge": 48}, {"height": 64, "width": 40})],
)
def test_processor_equals_clip_image_processor_bit_for_bit(tmp_path, size, crop):
    CLIPImageProcessor(size=size, crop_size=crop).save_pretrained(tmp_path)
    theirs = CLIPImageProcessor.from_pretrained(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    rng = np.random.default_rng(1)
    inputs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
              ((40, 56), (57, 31), (480, 832), (33, 33), (10, 300))]
    inputs.append(Image.fromarray(rng.integers(0, 256, (45, 60, 4), dtype=np.uint8), "RGBA"))  # alpha onto white
    inputs.append(Image.fromarray(rng.integers(0, 256, (45, 60), dtype=np.uint8), "L"))
    for image in inputs:
        expected = theirs(images=[image], return_tensors="np").pixel_values
        got = ours([image])
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    array = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)  # uint8 HWC arrays too
    np.testing.assert_array_equal(ours([array]), theirs(images=[array], return_tensors="np").pixel_values)


def test_sharded_over_a_mesh_matches_unsharded(checkpoint):
    from wan_tpu.parallel.mesh import make_mesh

    folders = (checkpoint / "image_encoder", checkpoint / "image_processor")
    unsharded = np.asarray(CLIPImageEncoder.from_pretrained(*folders, dtype=jnp.float32).encode(images()))
    encoder = CLIPImageEncoder.from_pretrained(*folders, dtype=jnp.float32, mesh=make_mesh(dp=1, sp=2, tp=4))
    fc1 = encoder.model.encoder.layers.mlp.fc1.weight[...]
    assert len(fc1.sharding.device_set) == 8 and not fc1.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(encoder.encode(images())), unsharded, atol=TOL)


def test_missing_folder_is_a_user_error(tmp_path, checkpoint):
    with pytest.raises(WanInputError, match="image_encoder folder .* has no config.json"):
        CLIPImageEncoder.from_pretrained(tmp_path, checkpoint / "image_processor")
    with pytest.raises(WanInputError, match="image_processor folder .* has no preprocessor_config.json"):
        CLIPImageEncoder.from_pretrained(checkpoint / "image_encoder", tmp_path)
    encoder = CLIPImageEncoder.from_pretrained(checkpoint / "image_encoder")
    with pytest.raises(WanInputError, match="without an image_processor"):
        encoder.encode(images())
    with pytest.raises(WanInputError, match=r"\(B, 3, 32, 32\)"):
        encoder.encode_pixels(np.zeros((1, 3, 16, 16), np.float32))
