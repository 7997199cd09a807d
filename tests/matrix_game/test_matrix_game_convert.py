"""`wan_tpu/matrix_game/convert.py` on a tiny download-shaped folder whose `.pth` files hold the
golden state dicts made with the authors' classes (`tests/data/matrix_game_{vae,clip}.safetensors`, original
names), and Wan's CLIP visual tower on JAX against the authors' `CLIPModel.encode_video` (their bicubic
resize without antialiasing, CLIP normalisation, the first n-1 of n blocks): float32, ≤ 1e-5 relative."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from wan_tpu.encoders.clip_image import CLIPImageEncoder, preprocess_tensor
from wan_tpu.matrix_game import convert
from wan_tpu.vae.loading import original_wan21_vae_config, original_wan21_vae_name

DATA = os.path.join(os.path.dirname(__file__), os.pardir, "data")
TOL = 1e-5


def golden(name, prefix):
    data = load_file(os.path.join(DATA, f"matrix_game_{name}.safetensors"))
    state = {k[len(prefix):]: torch.from_numpy(v.astype(np.float32)) for k, v in data.items() if k.startswith(prefix)}
    return data, state


@pytest.fixture
def download(tmp_path):
    src = tmp_path / "Matrix-Game-2.0"
    (src / "base_distilled_model").mkdir(parents=True)
    torch.save(golden("vae", "vae.")[1], src / convert.VAE_FILE)
    torch.save(golden("clip", "clip.")[1], src / convert.CLIP_FILE)
    save_file({"model.x": np.zeros(3, np.float32)}, str(src / convert.DIT_FILES["universal"]))
    return src


def run(*argv):
    return convert.main([str(a) for a in argv])


def test_round_trip(download, tmp_path):
    dst = tmp_path / "converted"
    assert run(download, dst, "--clip-heads", "2") == 0
    index = json.loads((dst / "matrix_game.json").read_text())
    assert index["variants"] == {"universal": convert.DIT_FILES["universal"]}
    dit = dst / convert.DIT_FILES["universal"]
    assert os.path.samefile(dit, download / convert.DIT_FILES["universal"]) or dit.read_bytes() == (
        download / convert.DIT_FILES["universal"]).read_bytes()

    _, vae_state = golden("vae", "vae.")
    config = json.loads((dst / "vae" / "config.json").read_text())
    assert config == original_wan21_vae_config(vae_state)
    tensors = load_file(str(dst / "vae" / "diffusion_pytorch_model.safetensors"))
    assert tensors.keys() == {original_wan21_vae_name(k, config["num_res_blocks"]) for k in vae_state}
    for k, v in vae_state.items():
        np.testing.assert_array_equal(tensors[original_wan21_vae_name(k, config["num_res_blocks"])], v.numpy())

    data, _ = golden("clip", "clip.")
    encoder = CLIPImageEncoder.from_pretrained(str(dst / "image_encoder"))
    pixels = preprocess_tensor(data["image"][:, :, 0], encoder.config.image_size)
    tokens = np.asarray(encoder.encode_pixels(pixels))
    assert tokens.shape == data["tokens"].shape
    assert np.abs(tokens - data["tokens"]).max() / np.abs(data["tokens"]).max() <= TOL


def test_in_place_and_overwrite(download, capsys):
    assert run(download, download, "--clip-heads", "2") == 0
    assert (download / "vae" / "config.json").is_file() and (download / "image_encoder" / "model.safetensors").is_file()
    assert run(download, download, "--clip-heads", "2") == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert run(download, download, "--clip-heads", "2", "--overwrite") == 0
    assert not [n for n in os.listdir(download) if n.endswith(".partial")]


@pytest.mark.parametrize("damage, message", [
    ("missing clip", "has no models_clip"),
    ("corrupt clip", "cannot be read as a tensors-only checkpoint"),
    ("no dit", "has none of the DiT files"),
])
def test_bad_download_leaves_nothing(download, tmp_path, capsys, damage, message):
    if damage == "missing clip":
        (download / convert.CLIP_FILE).unlink()
    elif damage == "corrupt clip":
        (download / convert.CLIP_FILE).write_bytes(b"not a checkpoint")
    else:
        os.remove(download / convert.DIT_FILES["universal"])
    dst = tmp_path / "converted"
    assert run(download, dst, "--clip-heads", "2") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not dst.exists()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def test_clip_heads_must_be_known(download, tmp_path, capsys):
    assert run(download, tmp_path / "converted") == 2
    assert "head count" in capsys.readouterr().err
