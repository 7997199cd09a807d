"""UniFoLM-WMA models (`wan_tpu.unifolm`) against goldens of the authors' code.

Reference: unitreerobotics/unifolm-world-model-action (commit in the golden files), run on CPU in
float32 with small random weights by `scripts/make_golden_unifolm.py`. The checkpoint the goldens ran
on is regenerated (`tests/unifolm_weights.py`), written in the converter's layout and read by our
loader. Tolerance: float32, relative error ‖ours − theirs‖₂ / ‖theirs‖₂ ≤ 1e-5 per component (the
largest single-element deviation is also bounded: ≤ 3e-5 · max |theirs|).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from unifolm_golden import CLIP_DIM, IMG, LAT, MAP_SHAPES, A, B, D, T, assert_close, golden, jitted, write_tiny
from unifolm_weights import det

from wan_tpu.configs.unifolm import CONFIGS, config_from_json, config_to_json
from wan_tpu.errors import WanInputError
from wan_tpu.unifolm.loading import load_unifolm


@pytest.fixture
def tiny(tiny_model):
    return tiny_model


def unet_inputs():
    return dict(x=det("in:x", (B, 8, T, LAT, LAT)), context=det("in:context", (B, 2 + 16 + 77 + T * 16, D)),
                xa=det("in:xa", (B, T, A)), xs=det("in:xs", (B, T, A)),
                obs_img=np.tanh(det("in:obs_img", (B, 3, 2, IMG, IMG))), obs_state=det("in:obs_state", (B, 2, A)))


def test_golden_commit_recorded():
    for group in ("unet", "parts", "sampling"):
        assert len(golden(group)["meta"]["commit"]) == 40


def test_resampler_projectors_action_tokens(tiny):
    g = golden("parts")
    pairs = [
        (jitted(tiny.image_proj_model, "__call__")(det("in:resampler", (B, 257, CLIP_DIM))), g["resampler"]),
        (jitted(tiny.state_projector, "__call__")(det("in:state", (B, 2, A))), g["state_projector"]),
        (jitted(tiny.action_projector, "__call__")(det("in:action", (B, 16, A))), g["action_projector"]),
        (jitted(tiny.diffusion_model.action_token_projector, "__call__")(det("in:tokens", (B, 1, D))),
         g["action_tokens"]),
    ]
    for ours, theirs in pairs:
        assert ours.shape == theirs.shape
        assert_close(ours, theirs, 1e-5)


def test_action_head(tiny):
    x = unet_inputs()
    head = tiny.diffusion_model.action_unet
    maps = [jnp.asarray(det(f"in:map{i}", (B, T, c, hw, hw))).transpose(0, 1, 3, 4, 2).reshape(B * T, hw, hw, c)
            for i, (c, hw) in enumerate(MAP_SHAPES)]
    obs = jitted(head, "encode_observations")(jnp.transpose(x["obs_img"], (0, 2, 3, 4, 1)), x["obs_state"])
    out = jitted(head, "__call__")(x["xa"], jnp.array([999, 500]), maps, obs)
    assert_close(out, golden("parts")["head/action"], 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("with_action_tokens", [True, False])
def test_unet_forward_with_heads(tiny, with_action_tokens):
    """Their WMAModel.forward: per-frame context expansion (incl. the output blocks' slicing quirk and
    the block-causal action mask), fps conditioning, both heads."""
    x, g = unet_inputs(), golden("unet")
    unet = tiny.diffusion_model
    context = x["context"] if with_action_tokens else np.concatenate([x["context"][:, :2], x["context"][:, 18:]], 1)
    frames = jitted(unet, "expand_context")(context)
    obs = jitted(unet, "encode_observations")(x["obs_img"], x["obs_state"])
    v, a, s = jitted(unet, "__call__")(x["x"], jnp.array([999, 500]), frames, jnp.array([7, 5]), x["xa"], x["xs"], obs)
    key = "unet" if with_action_tokens else "unet_no_action"
    for ours, name in ((v, "v"), (a, "action"), (s, "state")):
        assert_close(ours, g[f"{key}/{name}"], 1e-5, name)


@pytest.mark.slow
def test_unet_with_out_first_conv_kernels_equals_golden(tiny_folder, monkeypatch):
    """The GPU's convolution kernel layout (out, *k, in), forced here: loaded from the same torch weights,
    the same forward (`wan_tpu.layers.conv`)."""
    monkeypatch.setenv("WAN_TPU_CONV_KERNEL", "out_first")
    model = load_unifolm(tiny_folder)
    unet = model.diffusion_model
    conv_in = unet.input_blocks[0][0]
    assert conv_in.out_first and conv_in.kernel.shape[1:3] == (3, 3)  # (out, 3, 3, in)
    x, g = unet_inputs(), golden("unet")
    frames = jitted(unet, "expand_context")(x["context"])
    obs = jitted(unet, "encode_observations")(x["obs_img"], x["obs_state"])
    v, a, s = jitted(unet, "__call__")(x["x"], jnp.array([999, 500]), frames, jnp.array([7, 5]), x["xa"], x["xs"], obs)
    for ours, name in ((v, "v"), (a, "action"), (s, "state")):
        assert_close(ours, g[f"unet/{name}"], 1e-5, name)


@pytest.mark.slow
def test_base_unet_without_heads(tmp_path):
    base = load_unifolm(write_tiny(str(tmp_path / "base"), base=True))
    assert base.diffusion_model.action_unet is None
    x = unet_inputs()
    v, a, s = jitted(base.diffusion_model, "__call__")(x["x"], jnp.array([999, 500]),
                                                       det("in:base_context", (B * T, 77 + 16, D)),
                                                       jnp.array([7, 5]), np.zeros((B, T, A), np.float32),
                                                       np.zeros((B, T, A), np.float32), None)
    assert_close(v, golden("unet")["base_unet/v"], 1e-5)
    assert not np.any(np.asarray(a)) and not np.any(np.asarray(s))


def test_loader_names_every_bad_key_in_one_line(tmp_path):
    folder = write_tiny(str(tmp_path / "bad"), base=True)
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "conditioning.safetensors")
    tensors = load_file(path)
    tensors.pop("state_projector.projector.0.bias")
    tensors["state_projector.projector.2.weight"] = np.zeros((3, 3), np.float32)
    tensors["stray.weight"] = np.zeros((2,), np.float32)
    save_file(tensors, path)
    with pytest.raises(WanInputError) as e:
        load_unifolm(folder)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("missing (1): conditioning:state_projector.projector.0.bias", "unexpected (1): conditioning:stray.weight",
                 "mis-shaped (1): conditioning:state_projector.projector.2.weight (3, 3)"):
        assert part in msg


def test_early_puts_load_the_same_bits_and_a_bad_folder_keeps_none(tmp_path, monkeypatch):
    """Every UNet tensor put early (`EarlyPuts`, here from any size) and laid out on the device: each parameter
    the same bits as converted on the host (the tiny tensors' own path), each tensor put once; a folder that
    fails the checks leaves no early put behind."""
    from flax import nnx

    from wan_tpu.loading import params as param_loading
    from wan_tpu.loading.checkpoint import open_component
    from wan_tpu.unifolm import loading

    folder = write_tiny(str(tmp_path / "tiny"))
    host = nnx.to_flat_state(nnx.state(load_unifolm(folder)))
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", 0)
    puts, put_stored = [], param_loading._put_stored
    monkeypatch.setattr(param_loading, "_put_stored", lambda t, n: puts.append(n) or put_stored(t, n))
    device = dict(nnx.to_flat_state(nnx.state(load_unifolm(folder))))
    assert sorted(puts) == sorted(open_component(folder, "unet"))
    for key, var in host:
        a, b = np.asarray(var.get_value()), np.asarray(device[key].get_value())
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), key

    made = []
    monkeypatch.setattr(loading, "EarlyPuts", lambda src: made.append(param_loading.EarlyPuts(src)) or made[-1])
    path = os.path.join(folder, "conditioning.safetensors")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path)
    tensors["stray.weight"] = np.zeros((2,), np.float32)
    save_file(tensors, path)
    with pytest.raises(WanInputError, match="unexpected"):
        load_unifolm(folder)
    assert len(made) == 1 and not made[0]._futures


def test_loader_rejects_bad_folders(tmp_path):
    with pytest.raises(WanInputError, match="no config.json"):
        load_unifolm(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config_to_json(CONFIGS["unifolm-tiny"])))
    with pytest.raises(WanInputError, match="no unet.safetensors"):
        load_unifolm(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"name": "x", "bogus": 1}))
    with pytest.raises(WanInputError, match="unknown field"):
        load_unifolm(str(tmp_path))


def test_config_json_round_trip():
    for cfg in CONFIGS.values():
        assert config_from_json(json.loads(json.dumps(config_to_json(cfg)))) == cfg


def test_an_abstract_build_draws_nothing_and_keeps_every_shape():
    """`KeyCounter` gives `SHAPES_ONLY`: the abstract model and VAE (loaders, sharding plans, compile-ahead) are built
    with zeros traced, not random draws, and have the very structure, shapes and dtypes of a build with real keys."""
    import jax
    from flax import nnx

    from wan_tpu.configs.autoencoder_kl import AutoencoderKLConfig
    from wan_tpu.layers.initializers import SHAPES_ONLY
    from wan_tpu.unifolm.autoencoder_kl import AutoencoderKL
    from wan_tpu.unifolm.model import KeyCounter, UnifolmWMA
    from wan_tpu.unifolm.presets import preset_config

    cfg = preset_config("unifolm-tiny")
    assert KeyCounter(0).params() is SHAPES_ONLY
    for build in (lambda keys: UnifolmWMA(cfg, dtype=jnp.bfloat16, rngs=keys),
                  lambda keys: AutoencoderKL(AutoencoderKLConfig(block_out_channels=(32, 64)), rngs=keys)):
        shapes_only = nnx.split(nnx.eval_shape(lambda: build(KeyCounter(0))))
        drawn = nnx.split(nnx.eval_shape(lambda: build(KeyCounter(0, shapes_only=False))))
        assert repr(shapes_only[0]) == repr(drawn[0])  # the structure (equality holds for one module only)
        described = lambda state: jax.tree.map(lambda a: (a.shape, a.dtype), state)  # noqa: E731
        assert described(shapes_only[1]) == described(drawn[1])
        jaxpr = jax.make_jaxpr(lambda: nnx.state(build(KeyCounter(0))))()
        assert not any("random" in eqn.primitive.name for eqn in jaxpr.jaxpr.eqns)
