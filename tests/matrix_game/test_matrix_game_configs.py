"""The Matrix-Game-2 config table (`wan_tpu.configs.matrix_game`): the authors' config.json parses onto
our table (SkyworkAI/Matrix-Game 3ceb311, `Matrix-Game-2/configs/distilled_model/universal/config.json`,
copied below), each variant's sampling values (`wan_tpu/configs/inference_yaml/*.yaml`), and one-line errors."""

import pytest

from wan_tpu.configs.matrix_game import MATRIX_GAME_VARIANTS, config_from_json, get_variant
from wan_tpu.errors import WanInputError

UNIVERSAL_CONFIG_JSON = {
    "_class_name": "CausalWanModel",
    "_diffusers_version": "0.35.0.dev0",
    "action_config": {
        "blocks": list(range(15)), "enable_keyboard": True, "enable_mouse": True, "heads_num": 16,
        "hidden_size": 128, "img_hidden_size": 1536, "keyboard_dim_in": 4, "keyboard_hidden_dim": 1024,
        "mouse_dim_in": 2, "mouse_hidden_dim": 1024, "mouse_qk_dim_list": [8, 28, 28], "patch_size": [1, 2, 2],
        "qk_norm": True, "qkv_bias": False, "rope_dim_list": [8, 28, 28], "rope_theta": 256,
        "vae_time_compression_ratio": 4, "windows_size": 3,
    },
    "dim": 1536, "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "in_dim": 36, "inject_sample_info": False,
    "local_attn_size": 6, "model_type": "i2v", "num_heads": 12, "num_layers": 30, "out_dim": 16, "sink_size": 0,
    "text_len": 512,
}


def test_authors_config_json_is_our_universal():
    assert config_from_json(UNIVERSAL_CONFIG_JSON) == MATRIX_GAME_VARIANTS["universal"].transformer


@pytest.mark.parametrize("name, keys, mouse, window, steps", [
    ("universal", 4, True, 6, (1000, 666, 333)),
    ("gta_drive", 2, True, 4, (1000, 666, 333)),
    ("templerun", 7, False, 6, (1000, 750, 500, 250)),
    ("foundation", 4, True, 15, None),
])
def test_variants(name, keys, mouse, window, steps):
    v = get_variant(name)
    cfg = v.transformer
    assert (cfg.dim, cfg.num_heads, cfg.head_dim, cfg.num_layers, cfg.ffn_dim) == (1536, 12, 128, 30, 8960)
    assert cfg.action_config.keyboard_dim_in == len(v.keyboard_keys) == keys
    assert v.mouse == cfg.action_config.enable_mouse == mouse
    assert cfg.window_frames == window
    assert v.denoising_step_list == steps
    assert (v.timestep_shift, v.num_frame_per_block, v.latent_size, v.fps) == (5.0, 3, (44, 80), 12)
    assert sorted(cfg.action_blocks) == list(range(30 if name == "foundation" else 15))


@pytest.mark.parametrize("edit, message", [
    (dict(sink_size=2), "'sink_size' is 2; it must be 0"),
    (dict(local_attn_size=0), "'local_attn_size' is 0"),
    (dict(num_heads=7), "'dim' is 1536; it must be a multiple of num_heads=7"),
    (dict(color=1), "unknown field 'color'"),
    (dict(action_config=dict(UNIVERSAL_CONFIG_JSON["action_config"], blocks=[0, 30])),
     "distinct block indices below num_layers=30"),
    (dict(action_config=dict(UNIVERSAL_CONFIG_JSON["action_config"], heads_num=8)),
     "'keyboard_hidden_dim' is 1024; it must be heads_num × sum(rope_dim_list) = 512"),
    (dict(action_config=dict(UNIVERSAL_CONFIG_JSON["action_config"], img_hidden_size=1024)),
     "'action_config.img_hidden_size' is 1024; it must be equal to dim=1536"),
])
def test_bad_config_is_one_line(edit, message):
    with pytest.raises(WanInputError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        config_from_json(dict(UNIVERSAL_CONFIG_JSON, **edit))
    assert "\n" not in str(info.value)


def test_unknown_variant():
    with pytest.raises(WanInputError, match="unknown Matrix-Game variant 'gta'; choose one of universal, gta_drive"):
        get_variant("gta")
