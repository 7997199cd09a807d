"""UnifoLM-WMA's encoders and VAE against goldens from the authors' own classes.

Reference: `tests/data/unifolm_encoders_golden.safetensors`, made by
`scripts/make_golden_unifolm_encoders.py` (it records the authors' commit) with their
`FrozenOpenCLIPImageEmbedderV2`, `FrozenOpenCLIPEmbedder(layer="penultimate")` and `AutoencoderKL` on
small random weights. The same weights are rebuilt here from the recorded names and shapes
(`golden_param`), converted as `wan-convert-unifolm` (`wan_tpu/unifolm/convert.py`) converts a `.ckpt`
(`wan_tpu.unifolm.convert.write_*`), loaded by our loaders and run; float32, ≤ 1e-5 relative
(max-abs error over max-abs value).
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from wan_tpu.encoders.openclip import OpenCLIPImageEncoder, OpenCLIPTextEncoder
from wan_tpu.unifolm.autoencoder_kl_loading import load_autoencoder_kl
from wan_tpu.unifolm.convert import write_image_encoder, write_text_encoder, write_tokenizer, write_vae

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "unifolm_encoders_golden.safetensors"


def _script():
    spec = importlib.util.spec_from_file_location("make_golden_unifolm_encoders", ROOT / "scripts" / "make_golden_unifolm_encoders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.fixture(scope="module")
def golden():
    with safe_open(str(GOLDEN), "np") as f:
        meta = f.metadata()
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["reference"] == "unitreerobotics/unifolm-world-model-action" and len(meta["commit"]) == 40
    script = _script()
    states = {
        prefix: {name: torch.from_numpy(script.golden_param(name, shape)) for name, shape in names.items()}
        for prefix, names in json.loads(meta["manifest"]).items()
    }
    return meta, arrays, states


def test_vae_matches_authors_autoencoder(golden, tmp_path):
    meta, g, states = golden
    write_vae(str(tmp_path / "vae"), states["first_stage_model."], scale_factor=0.18215)
    vae = load_autoencoder_kl(str(tmp_path / "vae"))
    posterior = vae.encode(g["vae_input"])
    assert rel_err(posterior.mean, g["vae_mean"]) <= TOL
    assert rel_err(posterior.logvar, g["vae_logvar"]) <= TOL
    z = posterior.sample(g["vae_noise"])
    assert rel_err(z, g["vae_sample"]) <= TOL
    assert rel_err(vae.decode(z), g["vae_decoded"]) <= TOL


def test_image_tower_matches_authors_embedder(golden, tmp_path):
    meta, g, states = golden
    head_width = json.loads(meta["clip_vision"])["head_width"]
    write_image_encoder(str(tmp_path / "image_encoder"), states["embedder.model."], head_width=head_width)
    encoder = OpenCLIPImageEncoder.from_pretrained(tmp_path / "image_encoder")
    out = np.asarray(encoder.encode(g["image_input"]))
    assert out.shape == g["image_tokens"].shape == (1, 257, 32)
    assert rel_err(out, g["image_tokens"]) <= TOL


def test_text_tower_matches_authors_embedder(golden, tmp_path):
    meta, g, states = golden
    cfg = json.loads(meta["clip_text"])
    write_text_encoder(str(tmp_path / "text_encoder"), states["cond_stage_model.model."], head_width=cfg["width"] // cfg["heads"])
    write_tokenizer(str(tmp_path / "tokenizer"), cfg["vocab_size"])
    encoder = OpenCLIPTextEncoder.from_pretrained(tmp_path / "text_encoder", tmp_path / "tokenizer")
    assert encoder.config.num_hidden_layers == cfg["layers"] - 1  # penultimate: the last block is dropped
    assert rel_err(encoder.encode_tokens(g["text_tokens"]), g["text_hidden"]) <= TOL
