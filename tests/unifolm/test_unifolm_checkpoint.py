"""The authors' `.ckpt` → safetensors folder conversion (`wan_tpu/unifolm/convert.py`, `wan-convert-unifolm`).

A reduced `.ckpt` is built here from a state dict with the authors' key names: the encoders and VAE
of the golden file (`tests/test_unifolm_encoders.py`: their classes' names, rebuilt weights), UNet and
conditioning tensors under their prefixes, plus what the converter must drop (the heads' EMA copy,
schedule buffers) or rename (`framestride_embed`), and a non-tensor object beside the weights as a
Lightning file carries. Converted, every tensor must come back bit-exact under its component, and
the encoders must still reproduce the authors' outputs (≤ 1e-5 relative).
"""

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from wan_tpu.encoders.openclip import OpenCLIPImageEncoder, OpenCLIPTextEncoder
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import open_component
from wan_tpu.unifolm.autoencoder_kl_loading import load_autoencoder_kl
from wan_tpu.unifolm.convert import convert, save_safetensors_shards

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "unifolm_encoders_golden.safetensors"


class HyperParameters:
    """Stands for a non-tensor object (an OmegaConf config) pickled beside the weights."""

    def __init__(self):
        self.lr = 1e-4


def _authors_state():
    spec = importlib.util.spec_from_file_location("golden", ROOT / "scripts" / "make_golden_unifolm_encoders.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with safe_open(str(GOLDEN), "np") as f:
        manifest = json.loads(f.metadata()["manifest"])
    state = {
        prefix + name: torch.from_numpy(script.golden_param(name, shape))
        for prefix, names in manifest.items()
        for name, shape in names.items()
    }
    g = torch.Generator().manual_seed(0)
    unet = {
        "input_blocks.0.0.weight": torch.randn(8, 8, 3, 3, generator=g),
        "fps_embedding.0.weight": torch.randn(16, 8, generator=g),
        "action_unet.final_conv.1.bias": torch.randn(16, generator=g),
    }
    conditioning = {
        "image_proj_model.latents": torch.randn(1, 4, 8, generator=g),
        "state_projector.projector.0.weight": torch.randn(8, 16, generator=g),
        "agent_action_pos_emb": torch.randn(1, 16, 8, generator=g),
        "agent_state_pos_emb": torch.randn(1, 2, 8, generator=g),
    }
    for name, value in unet.items():
        state["model.diffusion_model." + name.replace("fps_embedding", "framestride_embed")] = value
    state.update(conditioning)
    state.update({"dp_ema_model.final_conv.1.bias": torch.zeros(3), "betas": torch.zeros(1000), "scale_arr": torch.ones(1000)})
    return state, unet, conditioning


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    state, unet, conditioning = _authors_state()
    path = folder / "model.ckpt"
    torch.save({"state_dict": state, "epoch": 3, "hyper_parameters": HyperParameters()}, path)
    return path, state, unet, conditioning


def _convert(src, dst, **kw):
    return convert(str(src), str(dst), config_name="unifolm-tiny", vision_head_width=8, text_head_width=8, **kw)


def test_round_trip(ckpt, tmp_path):
    path, state, unet, conditioning = ckpt
    _convert(path, tmp_path / "out")
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["name"] == "unifolm-tiny"
    for component, expected in (("unet", unet), ("conditioning", conditioning)):
        tensors = open_component(str(out), component)
        assert sorted(tensors) == sorted(expected)  # renamed, EMA copy and buffers dropped
        for name, value in expected.items():
            np.testing.assert_array_equal(tensors[name], value.numpy())
    with safe_open(str(GOLDEN), "np") as f:
        g = {k: f.get_tensor(k) for k in f.keys()}
    vae = load_autoencoder_kl(str(out / "vae"))
    np.testing.assert_allclose(vae.encode(g["vae_input"]).mean, g["vae_mean"], rtol=0, atol=1e-5 * np.abs(g["vae_mean"]).max())
    image = OpenCLIPImageEncoder.from_pretrained(out / "image_encoder")
    np.testing.assert_allclose(image.encode(g["image_input"]), g["image_tokens"], rtol=0, atol=1e-5 * np.abs(g["image_tokens"]).max())
    text = OpenCLIPTextEncoder.from_pretrained(out / "text_encoder", out / "tokenizer")
    np.testing.assert_allclose(text.encode_tokens(g["text_tokens"]), g["text_hidden"], rtol=0,
                               atol=1e-5 * np.abs(g["text_hidden"]).max())
    assert not (tmp_path / "out.partial").exists()


def test_deepspeed_module_and_stats(ckpt, tmp_path):
    path, state, unet, conditioning = ckpt
    ds = tmp_path / "ds.ckpt"
    torch.save({"module": {"_forward_module." + k: v for k, v in state.items()}}, ds)
    stats = tmp_path / "stats.safetensors"
    from safetensors.numpy import save_file

    save_file({"action/min": np.zeros(7, np.float32), "action/max": np.ones(7, np.float32),
               "observation.state/min": -np.ones(7, np.float32), "observation.state/max": np.ones(7, np.float32),
               "timestamp/max": np.ones(1, np.float32)}, str(stats))
    _convert(ds, tmp_path / "out", stats=str(stats))
    np.testing.assert_array_equal(open_component(str(tmp_path / "out"), "unet")["fps_embedding.0.weight"],
                                  unet["fps_embedding.0.weight"].numpy())
    with safe_open(str(tmp_path / "out" / "stats.safetensors"), "np") as f:
        assert sorted(f.keys()) == ["action/max", "action/min", "observation.state/max", "observation.state/min"]


def test_shards_are_read_back(tmp_path):
    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(5)}
    save_safetensors_shards({**tensors, "w5": tensors["w4"]}, str(tmp_path), "unet", shard_bytes=2048)  # one storage, two names
    tensors["w5"] = tensors["w4"]
    assert (tmp_path / "unet.safetensors.index.json").exists() and len(list(tmp_path.glob("unet-*.safetensors"))) == 3
    back = open_component(str(tmp_path), "unet")
    assert sorted(back) == sorted(tensors) and all(float(back[k][0]) == float(min(int(k[1:]), 4)) for k in tensors)


def test_bad_inputs_name_the_problem(ckpt, tmp_path):
    path, state, _, _ = ckpt
    cases = []
    (tmp_path / "notes.txt").write_text("hello")
    cases.append((tmp_path / "notes.txt", "not a torch checkpoint"))
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump({"state_dict": {}}, f)
    cases.append((tmp_path / "plain.pkl", "not a torch checkpoint"))
    torch.save({"weights": {}}, tmp_path / "other.ckpt")
    cases.append((tmp_path / "other.ckpt", "no 'state_dict'"))
    torch.save({"state_dict": {**state, "mystery.weight": torch.zeros(1)}}, tmp_path / "extra.ckpt")
    cases.append((tmp_path / "extra.ckpt", "unexpected tensor 'mystery.weight'"))
    torch.save({"state_dict": {k: v for k, v in state.items() if not k.startswith("first_stage_model.")}}, tmp_path / "novae.ckpt")
    cases.append((tmp_path / "novae.ckpt", "no vae tensors"))
    cases.append((tmp_path / "missing.ckpt", "does not exist"))
    for src, message in cases:
        with pytest.raises(WanInputError, match=message):
            _convert(src, tmp_path / "never")
        assert not (tmp_path / "never").exists() and not (tmp_path / "never.partial").exists()
    (tmp_path / "taken").mkdir()
    with pytest.raises(WanInputError, match="exists; .*--overwrite"):
        _convert(path, tmp_path / "taken")


def test_cli_exits_2_with_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = subprocess.run([sys.executable, "-c", "from wan_tpu.commands import convert_unifolm; convert_unifolm()",
                           str(tmp_path / "notes.txt"), str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a torch checkpoint" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_full_model_round_trip_loads(tmp_path):
    """The whole reduced model under the authors' names: the UNet/heads/projector manifest of
    uni-model's golden (`tests/data/unifolm_golden_unet.npz`, weights rebuilt by
    `tests/unifolm_weights.py`) plus the encoders above, as one Lightning `.ckpt`. Converted, the
    `unet`/`conditioning` files hold exactly what that golden's tests load, and our loader accepts
    the folder (every name and shape checked against the `unifolm-tiny` config)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from unifolm_weights import init_tensor, write_checkpoint

    from wan_tpu.configs.unifolm import CONFIGS, config_to_json
    from wan_tpu.unifolm.loading import load_unifolm

    golden = np.load(ROOT / "tests" / "data" / "unifolm_golden_unet.npz", allow_pickle=False)
    manifest = json.loads(str(golden["meta"]))["manifest"]
    buffers = {k[len("buffer/"):]: golden[k] for k in golden.files if k.startswith("buffer/")}
    write_checkpoint(str(tmp_path / "expected"), manifest, buffers, config_to_json(CONFIGS["unifolm-tiny"]))
    encoders, _, _ = _authors_state()
    state = {k: v for k, v in encoders.items() if k.startswith(("first_stage_model.", "cond_stage_model.", "embedder."))}
    for component, prefix in (("unet", "model.diffusion_model."), ("conditioning", "")):
        expected = open_component(str(tmp_path / "expected"), component)
        state.update({prefix + name: torch.from_numpy(np.array(expected[name])) for name in expected})
    torch.save({"state_dict": state}, tmp_path / "tiny.ckpt")
    _convert(tmp_path / "tiny.ckpt", tmp_path / "out")
    for component in ("unet", "conditioning"):
        got, expected = open_component(str(tmp_path / "out"), component), open_component(str(tmp_path / "expected"), component)
        assert sorted(got) == sorted(expected)
        assert all(np.array_equal(got[k], expected[k]) for k in expected)
    model = load_unifolm(str(tmp_path / "out"))
    assert model.config.name == "unifolm-tiny"
    np.testing.assert_array_equal(np.asarray(model.agent_state_pos_emb[...]),
                                  init_tensor("conditioning:agent_state_pos_emb", model.agent_state_pos_emb.shape))
    # The whole pipeline from the folder, its CLIP towers in float32 (the default) and in bfloat16
    # (`encoder_dtype`): the bf16 towers hold bf16 weights and give the float32 ones' tokens to bf16
    # precision (relative error ≤ 3e-2; the real-size figure is in docs/PERFORMANCE.md).
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.unifolm.pipeline import UnifolmPipeline

    pipes = {d: UnifolmPipeline.from_pretrained(str(tmp_path / "out"), encoder_dtype=d) for d in (jnp.float32, jnp.bfloat16)}
    images = np.random.default_rng(0).uniform(-1, 1, (1, 3, 64, 64)).astype(np.float32)
    tokens = {}
    for dtype, pipe in pipes.items():
        for tower in (pipe.image_encoder.model, pipe.text_encoder.model):
            assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(tower))} == {jnp.dtype(dtype)}
        tokens[dtype] = (np.asarray(pipe.image_encoder.encode(images), np.float64),
                         np.asarray(pipe.text_encoder.encode(["stack the cups"]), np.float64))
    for bf16, f32 in zip(tokens[jnp.bfloat16], tokens[jnp.float32]):
        assert np.linalg.norm(bf16 - f32) / np.linalg.norm(f32) <= 3e-2
