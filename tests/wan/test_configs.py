"""`wan_tpu/configs/models.py`: presets equal the config.json diffusers writes for the same model; bad fields
fail with a WanInputError naming the field."""

import dataclasses
import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from wan_tpu.configs.models import (
    VARIANTS,
    WanTransformerConfig,
    config_from_json,
    config_to_json,
    variant_for_config,
)
from wan_tpu.errors import WanInputError

# transformer/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers on the Hugging Face Hub, verbatim.
HUB_T2V_1_3B = {
    "_class_name": "WanTransformer3DModel",
    "_diffusers_version": "0.33.0.dev0",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}


def _diffusers_config_json(cfg: WanTransformerConfig, tmp_path) -> dict:
    """The config.json diffusers' save_pretrained writes for a model built with these values."""
    with torch.device("meta"):
        model = WanTransformer3DModel(**config_to_json(cfg))
    model.save_config(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_preset_equals_diffusers_config_json(name, tmp_path):
    variant = VARIANTS[name]
    for cfg in filter(None, (variant.transformer, variant.transformer_2)):
        written = _diffusers_config_json(cfg, tmp_path)
        assert written["_class_name"] == "WanTransformer3DModel"
        assert config_from_json(written) == cfg
        assert variant_for_config(config_from_json(written)).transformer == cfg


def test_hub_config_matches_preset():
    cfg = config_from_json(HUB_T2V_1_3B)
    assert cfg == VARIANTS["wan2.1-t2v-1.3b"].transformer
    assert variant_for_config(cfg).name == "wan2.1-t2v-1.3b"
    assert cfg.inner_dim == 1536


def test_variant_facts():
    assert VARIANTS["wan2.2-t2v-a14b"].boundary_ratio == 0.875
    assert VARIANTS["wan2.2-i2v-a14b"].boundary_ratio == 0.9
    assert VARIANTS["wan2.2-ti2v-5b"].expand_timesteps and VARIANTS["wan2.2-ti2v-5b"].vae == "wan2.2"
    assert VARIANTS["wan2.2-ti2v-5b"].fps == 24 and VARIANTS["wan2.1-t2v-14b"].fps == 16
    assert VARIANTS["wan2.1-i2v-14b-480p"].uses_clip_image and not VARIANTS["wan2.2-i2v-a14b"].uses_clip_image
    for v in VARIANTS.values():
        assert (v.sample_frames - 1) % 4 == 0, v.name


def test_out_channels_null_means_in_channels():
    cfg = config_from_json({**HUB_T2V_1_3B, "out_channels": None})
    assert cfg.out_channels == 16


def test_unknown_field_is_named():
    with pytest.raises(WanInputError, match="unknown field 'vace_layers'"):
        config_from_json({**HUB_T2V_1_3B, "vace_layers": [0, 2]})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("patch_size", [2, 2], "'patch_size' is"),
        ("attention_head_dim", 127, "'attention_head_dim' is 127"),
        ("num_layers", 0, "'num_layers' is 0"),
        ("out_channels", 32, "'out_channels' is 32"),
        ("qk_norm", "rms_norm", "'qk_norm' is 'rms_norm'"),
        ("added_kv_proj_dim", 5120, "'added_kv_proj_dim' is 5120"),  # without image_dim
        ("eps", -1.0, "'eps' is -1.0"),
        ("cross_attn_norm", "yes", "'cross_attn_norm' is 'yes'"),
    ],
)
def test_inconsistent_field_is_named(field, value, message):
    with pytest.raises(WanInputError, match=message):
        config_from_json({**HUB_T2V_1_3B, field: value})


def test_added_kv_must_match_width():
    i2v = config_to_json(VARIANTS["wan2.1-i2v-14b-480p"].transformer)
    with pytest.raises(WanInputError, match="'added_kv_proj_dim' is 4096"):
        config_from_json({**i2v, "added_kv_proj_dim": 4096})


def test_unmatched_config_has_no_variant():
    cfg = dataclasses.replace(VARIANTS["tiny"].transformer, num_layers=3)
    assert variant_for_config(cfg) is None
