"""The SD image VAE (`wan_tpu/unifolm/autoencoder_kl.py`, `autoencoder_kl_loading.py`).

Reference: diffusers' `AutoencoderKL`, tiny random, saved with `save_pretrained` and loaded by our
loader; float32, ≤ 1e-5 relative (max-abs error over max-abs value).
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL as DiffusersAutoencoderKL
from safetensors.torch import save_file

from wan_tpu.configs.autoencoder_kl import AUTOENCODER_KL_CONFIGS, config_to_json
from wan_tpu.errors import WanInputError
from wan_tpu.unifolm.autoencoder_kl_loading import load_autoencoder_kl

TOL = 1e-5


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    torch.manual_seed(0)
    cfg = config_to_json(dataclasses.replace(AUTOENCODER_KL_CONFIGS["tiny"], block_out_channels=(8, 16, 16)))
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    model = DiffusersAutoencoderKL(**cfg).eval()
    with torch.no_grad():  # random norms and biases too, so every parameter matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, model


def test_encode_decode_match_diffusers(checkpoint):
    folder, ref = checkpoint
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (2, 3, 16, 24)).astype(np.float32)
    noise = rng.standard_normal((2, 4, 4, 6)).astype(np.float32)
    with torch.no_grad():
        dist = ref.encode(torch.from_numpy(images)).latent_dist
        ref_sample = dist.mean + dist.std * torch.from_numpy(noise)
        ref_dec = ref.decode(ref_sample).sample

    vae = load_autoencoder_kl(str(folder), dtype=jnp.float32)
    posterior = vae.encode(images)
    assert rel_err(posterior.mean, dist.mean.numpy()) <= TOL
    assert rel_err(posterior.logvar, dist.logvar.numpy()) <= TOL
    sample = posterior.sample(noise)
    assert rel_err(sample, ref_sample.numpy()) <= TOL
    assert rel_err(vae.decode(sample), ref_dec.numpy()) <= TOL


def test_video_helpers_scale_and_go_frame_by_frame(checkpoint):
    folder, ref = checkpoint
    vae = load_autoencoder_kl(str(folder))
    rng = np.random.default_rng(1)
    video = rng.uniform(-1, 1, (1, 3, 3, 16, 16)).astype(np.float32)
    noise = rng.standard_normal((1, 4, 3, 4, 4)).astype(np.float32)
    latents = np.asarray(vae.encode_video(video, noise))
    frames = video[0].transpose(1, 0, 2, 3)
    with torch.no_grad():
        dist = ref.encode(torch.from_numpy(frames)).latent_dist
        z = (dist.mean + dist.std * torch.from_numpy(noise[0].transpose(1, 0, 2, 3))) * 0.18215
        dec = ref.decode(z / 0.18215).sample.numpy()
    assert rel_err(latents[0].transpose(1, 0, 2, 3), z.numpy()) <= TOL
    mean_latents = np.asarray(vae.encode_video(video))
    assert rel_err(mean_latents[0].transpose(1, 0, 2, 3), dist.mean.numpy() * 0.18215) <= TOL
    assert rel_err(np.asarray(vae.decode_video(latents))[0].transpose(1, 0, 2, 3), dec) <= TOL


def test_bad_checkpoints_name_the_tensor(checkpoint, tmp_path):
    folder, ref = checkpoint
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    cfg = json.loads((folder / "config.json").read_text())

    def write(state):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
        return str(tmp_path)

    missing = dict(sd)
    del missing["decoder.mid_block.attentions.0.to_q.weight"]
    with pytest.raises(WanInputError, match="'decoder.mid_block.attentions.0.to_q.weight'.*missing"):
        load_autoencoder_kl(write(missing))
    with pytest.raises(WanInputError, match="unexpected tensor 'extra.weight'"):
        load_autoencoder_kl(write({**sd, "extra.weight": torch.zeros(1)}))
    wrong = {**sd, "encoder.conv_in.weight": torch.zeros(8, 3, 1, 1)}
    with pytest.raises(WanInputError, match="'encoder.conv_in.weight' has shape"):
        load_autoencoder_kl(write(wrong))
    cfg["up_block_types"] = ["AttnUpDecoderBlock2D"] * 3
    with pytest.raises(WanInputError, match="up_block_types"):
        load_autoencoder_kl(write(sd))


def test_bad_shapes_are_user_errors(checkpoint):
    vae = load_autoencoder_kl(str(checkpoint[0]))
    with pytest.raises(WanInputError, match="divisible by 4"):
        vae.encode(np.zeros((1, 3, 10, 16), np.float32))
    with pytest.raises(WanInputError, match=r"expects \(N, 3, H, W\)"):
        vae.encode(np.zeros((1, 4, 16, 16), np.float32))
