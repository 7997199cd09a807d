"""Single-file component checkpoints (`wan_tpu.loading.component_files`, `torch_pickle`): the official Wan
`.pth` files and ComfyUI's `.safetensors`, through the real loaders (`load_vae`, `load_umt5`,
`load_clip_vision`), against the diffusers-format copy of the same weights.

References and tolerances:
  * official files are the authors' own modules' state dicts, tiny (golden `tests/data/wan_components.safetensors`
    from `scripts/make_golden_wan_components.py`: Wan2.1 `T5Encoder` weights and output, the names and shapes
    of Wan2.1's and Wan2.2's `WanVAE_`, random values drawn here; `tests/data/matrix_game_clip.safetensors`:
    Wan's `XLMRobertaCLIP`), written with `torch.save` as the official files are;
  * Wan 2.1 VAE: diffusers' own single-file converter (`convert_wan_vae_to_diffusers`) makes the
    diffusers copy; Wan 2.2: the renames of diffusers' `scripts/convert_wan_to_diffusers.py`
    `convert_vae_22` (not in the installed package; transcribed below); both loaded strictly into
    `AutoencoderKLWan` and saved with `save_pretrained`. Every parameter bit-equal;
  * Wan's T5: the authors' encoder output for two prompts (one padded), float32 computation with the file's
    bfloat16 weights, ≤ 1e-5 relative (1.7e-7 measured);
  * Wan's CLIP: the folder `clip_vision_from_original` writes (itself checked against the authors'
    tokens in tests/matrix_game/test_matrix_game_convert.py), every parameter bit-equal;
  * ComfyUI UMT5 / clip_vision_h: transformers' `UMT5EncoderModel` / `CLIPVisionModelWithProjection`
    saved with `save_pretrained`; their `model.safetensors` is the single file (ComfyUI's files use those
    names), for UMT5 also under ComfyUI's prefix with its `spiece_model` bytes, and as fp8_e4m3fn_scaled
    (float8 weights, a float32 `scale_weight` each, the `scaled_fp8` marker, as ComfyUI writes them):
    parameters bit-equal to the folder's, or to the exact dequantisation float32(w8)·scale (the fp8
    encoder's output then lies 6.7e-2 from the unquantised one's, its weights 3.6e-2: e4m3's 3 mantissa bits);
  * ComfyUI VAE files: the official names in bfloat16, equal to the diffusers copy of the rounded weights;
  * the encoders' own `from_pretrained` over one file: parameters bit-equal to the folder's, and a CLIP file's
    default preprocessing equal to transformers' default `CLIPImageProcessor` saved with `save_pretrained`.
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from wan_tpu.encoders.clip_loading import clip_vision_from_original, load_clip_vision
from wan_tpu.encoders.umt5_loading import load_umt5, umt5_config
from wan_tpu.errors import WanInputError
from wan_tpu.loading.torch_pickle import open_pth
from wan_tpu.vae.loading import load_vae, vae_config

DATA = os.path.join(os.path.dirname(__file__), os.pardir, "data")
TOL = 1e-5


GOLDEN = os.path.join(DATA, "wan_components.safetensors")


@pytest.fixture(scope="module")
def golden():
    return load_file(GOLDEN)


def authors_vae(version: str) -> dict:
    """A state dict with the names and shapes of the authors' `WanVAE_` (`vae21` / `vae22`), random values."""
    from safetensors import safe_open

    with safe_open(GOLDEN, "pt") as f:
        shapes = json.loads(f.metadata()[version])
    g = torch.Generator().manual_seed(0)
    return {k: (1.0 if k.endswith("gamma") else 0.0) + 0.1 * torch.randn(shape, generator=g) for k, shape in shapes.items()}


def part(tensors, prefix):
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def flat(module):
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(module))}


def assert_same_params(a, b):
    a, b = flat(a), flat(b)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


# ---- VAE ----------------------------------------------------------------------------------------------

_RESIDUAL = {".residual.0.gamma": ".norm1.gamma", ".residual.2.weight": ".conv1.weight", ".residual.2.bias": ".conv1.bias",
             ".residual.3.gamma": ".norm2.gamma", ".residual.6.weight": ".conv2.weight", ".residual.6.bias": ".conv2.bias",
             ".shortcut.weight": ".conv_shortcut.weight", ".shortcut.bias": ".conv_shortcut.bias"}
_TOP = {"conv1.": "quant_conv.", "conv2.": "post_quant_conv.", "encoder.conv1.": "encoder.conv_in.",
        "decoder.conv1.": "decoder.conv_in.", "encoder.head.0.": "encoder.norm_out.", "encoder.head.2.": "encoder.conv_out.",
        "decoder.head.0.": "decoder.norm_out.", "decoder.head.2.": "decoder.conv_out."}


def convert_vae_22(old):
    """diffusers `scripts/convert_wan_to_diffusers.py` `convert_vae_22`: its renames, rule by rule."""
    new = {}
    for key, value in old.items():
        top = next((t for t in _TOP if key.startswith(t)), None)
        if top is not None:
            new[_TOP[top] + key[len(top):]] = value
            continue
        k = key
        for side in ("encoder", "decoder"):
            for i, block in (("0", "resnets.0"), ("1", "attentions.0"), ("2", "resnets.1")):
                k = k.replace(f"{side}.middle.{i}.", f"{side}.mid_block.{block}.")
        for side, kind, blocks, sampler in (("encoder", "downsamples", "down_blocks", "downsampler"),
                                            ("decoder", "upsamples", "up_blocks", "upsampler")):
            if k.startswith(f"{side}.{kind}."):
                k = k.replace(f"{side}.{kind}.", f"{side}.{blocks}.")
                if "residual" in k or "shortcut" in k:
                    k = k.replace(f".{kind}.", ".resnets.")
                elif "resample" in k or "time_conv" in k:
                    parts = k.split(".")
                    k = ".".join(parts[:3] + [sampler] + parts[5:])
        for a, b in _RESIDUAL.items():
            k = k.replace(a, b)
        new[k] = value
    return new


def diffusers_vae(state, convert, config, folder):
    from diffusers import AutoencoderKLWan

    model = AutoencoderKLWan(**{k: v for k, v in config.items() if not k.startswith("_")})
    model.load_state_dict(convert(dict(state)), strict=True)
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_official_vae_pth_equals_the_diffusers_conversion(golden, tmp_path, version):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from wan_tpu.vae.loading import open_vae

    state = authors_vae(f"vae{version.replace('.', '')}")
    pth = tmp_path / f"Wan{version}_VAE.pth"
    torch.save(state, pth)
    config = open_vae(pth)[0]
    folder = diffusers_vae(state, convert_wan_vae_to_diffusers if version == "2.1" else convert_vae_22, config,
                           tmp_path / "vae")
    assert vae_config(str(pth)) == vae_config(folder)
    assert vae_config(str(pth)).is_residual == (version == "2.2")
    assert_same_params(load_vae(pth), load_vae(folder))
    # ComfyUI's vae/wan_2.1_vae.safetensors, wan2.2_vae.safetensors: the same names, in bfloat16.
    comfy = tmp_path / "comfy_vae.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(comfy))
    rounded = diffusers_vae({k: v.to(torch.bfloat16).float() for k, v in state.items()},
                            convert_wan_vae_to_diffusers if version == "2.1" else convert_vae_22, config, tmp_path / "bf16")
    assert_same_params(load_vae(str(comfy)), load_vae(rounded))


# ---- UMT5 ---------------------------------------------------------------------------------------------


def encode(model, embed, ids, mask):
    return np.asarray(model(jnp.asarray(embed(ids)), jnp.asarray(mask))) * mask[..., None]


def test_official_t5_pth_matches_the_authors_encoder(golden, tmp_path):
    pth = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save(part(golden, "t5."), pth)  # bfloat16, as the official file
    model, embed = load_umt5(pth, dtype=jnp.float32)
    ids, mask, ref = (golden[k].numpy() for k in ("t5_ids", "t5_mask", "t5_output"))
    out = encode(model, embed, ids, mask)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= TOL
    assert umt5_config(pth) == model.config and model.config.feed_forward_proj == "gated-gelu"


@pytest.fixture(scope="module")
def hf_umt5(tmp_path_factory):
    """transformers' UMT5 encoder with the golden T5's shapes (the config the loader infers: one compiled program)."""
    from transformers import UMT5Config, UMT5EncoderModel

    folder = tmp_path_factory.mktemp("umt5") / "text_encoder"
    torch.manual_seed(0)
    UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                feed_forward_proj="gated-gelu")).save_pretrained(folder)
    return folder


def scaled_fp8(tensors):
    """ComfyUI's fp8_e4m3fn_scaled layout: each linear weight float8 with a float32 per-tensor scale_weight
    (amax / 448), the `scaled_fp8` marker; norms, tables and the embedding as they were."""
    out, expected = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}, {}
    for k, v in tensors.items():
        if v.ndim == 2 and ".layer." in k and "relative_attention_bias" not in k:
            scale = v.abs().max().float() / 448.0
            q = (v.float() / scale).to(torch.float8_e4m3fn)
            out[k], out[k[: -len("weight")] + "scale_weight"] = q, scale
            expected[k] = q.float() * scale
        else:
            out[k] = expected[k] = v
    return out, expected


def test_comfyui_umt5_files(hf_umt5, golden, tmp_path):
    tensors = load_file(hf_umt5 / "model.safetensors")
    reference = load_umt5(hf_umt5, dtype=jnp.float32)
    for name, file in (("plain", tensors), ("prefixed", {f"text_encoders.umt5xxl.transformer.{k}": v for k, v in tensors.items()})):
        path = tmp_path / f"umt5_xxl_{name}.safetensors"
        save_file({**file, "spiece_model": torch.zeros(3, dtype=torch.uint8)}, str(path))
        model, embed = load_umt5(path, dtype=jnp.float32)
        assert_same_params(model, reference[0])
        assert np.array_equal(embed(np.arange(64)), reference[1](np.arange(64)))

    quantized, dequantized = scaled_fp8(tensors)
    path = tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
    save_file(quantized, str(path))
    exact = tmp_path / "exact"
    shutil.copytree(hf_umt5, exact)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(exact / "model.safetensors"))
    model, embed = load_umt5(path, dtype=jnp.float32)
    assert_same_params(model, load_umt5(exact, dtype=jnp.float32)[0])
    # The error fp8 leaves against the unquantised weights, on the encoder's output (e4m3: 3 mantissa bits).
    ids, mask = golden["t5_ids"].numpy(), golden["t5_mask"].numpy()
    ref = encode(*reference, ids, mask)
    err = np.abs(encode(model, embed, ids, mask) - ref).max() / np.abs(ref).max()
    assert 1e-4 < err < 0.1, err


def test_text_encoder_from_pretrained_takes_a_file(hf_umt5, golden, tmp_path):
    """`UMT5TextEncoder.from_pretrained(file, tokenizer)`: the folder's encoder from ComfyUI's single file; a
    file of another component is named before the tokenizer is read."""
    from wan_tpu.encoders.tokenizers import tiny_hf_tokenizer
    from wan_tpu.encoders.umt5_text import UMT5TextEncoder

    tokenizer = tmp_path / "tokenizer"
    tiny_hf_tokenizer().save_pretrained(str(tokenizer))
    path = tmp_path / "umt5_xxl_fp16.safetensors"
    shutil.copy(hf_umt5 / "model.safetensors", path)
    from_file = UMT5TextEncoder.from_pretrained(path, tokenizer, dtype=jnp.float32)
    from_folder = UMT5TextEncoder.from_pretrained(hf_umt5, tokenizer, dtype=jnp.float32)
    assert_same_params(from_file.model, from_folder.model)
    assert np.array_equal(from_file.embed_tokens(np.arange(64)), from_folder.embed_tokens(np.arange(64)))
    assert from_file.tokenize(["a cat"])[0].tolist() == from_folder.tokenize(["a cat"])[0].tolist()
    vae = tmp_path / "Wan2.1_VAE.pth"
    torch.save(authors_vae("vae21"), vae)
    with pytest.raises(WanInputError, match="holds a Wan VAE, not a UMT5 text encoder") as e:
        UMT5TextEncoder.from_pretrained(vae, tmp_path / "no-tokenizer")
    assert "\n" not in str(e.value)


# ---- CLIP ---------------------------------------------------------------------------------------------


def test_official_clip_pth_equals_the_converted_folder(tmp_path):
    state = part(load_file(os.path.join(DATA, "matrix_game_clip.safetensors")), "clip.")
    pth = tmp_path / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    torch.save(state, pth)
    config, tensors = clip_vision_from_original(state, num_heads=2)
    folder = tmp_path / "image_encoder"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    assert_same_params(load_clip_vision(pth, num_layers=-1, num_heads=2), load_clip_vision(folder, num_layers=-1))
    with pytest.raises(WanInputError, match="cannot tell the head count of a 32-wide CLIP tower; pass num_heads"):
        load_clip_vision(pth)


def test_comfyui_clip_vision_file(tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    folder = tmp_path / "image_encoder"
    CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28, patch_size=14,
        projection_dim=16, hidden_act="gelu")).save_pretrained(folder)
    path = tmp_path / "clip_vision_h.safetensors"
    shutil.copy(folder / "model.safetensors", path)
    assert_same_params(load_clip_vision(path, num_layers=-1, num_heads=2), load_clip_vision(folder, num_layers=-1))


def test_image_encoder_from_pretrained_takes_a_file(tmp_path):
    """`CLIPImageEncoder.from_pretrained(file)`: the folder's tower (its width's head count known), and the
    preprocessing of transformers' default `CLIPImageProcessor` saved with `save_pretrained`, which a file
    lacks; a folder without an image processor still has none."""
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    from wan_tpu.encoders.clip_image import CLIPImageEncoder

    torch.manual_seed(0)
    folder = tmp_path / "image_encoder"
    CLIPVisionModel(CLIPVisionConfig(hidden_size=768, intermediate_size=32, num_hidden_layers=2, num_attention_heads=12,
                                     image_size=28, patch_size=14)).save_pretrained(folder)
    CLIPImageProcessor().save_pretrained(tmp_path / "image_processor")
    path = tmp_path / "clip_vision_h.safetensors"
    shutil.copy(folder / "model.safetensors", path)
    from_file = CLIPImageEncoder.from_pretrained(path)
    from_folder = CLIPImageEncoder.from_pretrained(folder, tmp_path / "image_processor")
    assert_same_params(from_file.model, from_folder.model)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    assert np.array_equal(from_file.preprocess([image]), from_folder.preprocess([image]))
    assert CLIPImageEncoder.from_pretrained(folder).image_processor is None


# ---- wrong files ------------------------------------------------------------------------------------


def test_a_file_of_another_component_is_named_in_one_line(golden, tmp_path):
    vae = tmp_path / "Wan2.1_VAE.pth"
    torch.save(authors_vae("vae21"), vae)
    t5 = tmp_path / "t5.pth"
    torch.save(part(golden, "t5."), t5)
    for load, path, words in ((load_umt5, vae, "holds a Wan VAE, not a UMT5 text encoder"),
                              (load_vae, t5, "holds a UMT5 text encoder, not a Wan VAE"),
                              (load_clip_vision, t5, "holds a UMT5 text encoder, not a CLIP image encoder")):
        with pytest.raises(WanInputError, match=words) as e:
            load(path)
        assert "\n" not in str(e.value)


def test_pickles_that_need_more_than_weights_are_refused(tmp_path):
    path = tmp_path / "model.pth"
    torch.save({"weights": torch.zeros(2), "config": _Opaque()}, path)
    with pytest.raises(WanInputError, match=r"holds more than tensors \(it needs .*_Opaque\)") as e:
        open_pth(path)
    assert "\n" not in str(e.value)
    legacy = tmp_path / "legacy.pth"
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(WanInputError, match="legacy .* cannot be memory-mapped"):
        load_vae(legacy)
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(WanInputError, match="not a PyTorch checkpoint"):
        load_umt5(junk)


class _Opaque:
    pass


def test_open_pth_is_lazy_and_bit_exact(tmp_path):
    """Every tensor a view of the file's bytes (no copy), bfloat16 and float8 through ml_dtypes."""
    tensors = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.randn(5).to(torch.float8_e4m3fn),
               "c.d": torch.randn(2, 3), "e": torch.arange(4)}
    path = tmp_path / "x.pth"
    torch.save({"state_dict": {"a": tensors["a"], "b": tensors["b"], "c": {"d": tensors["c.d"]}, "e": tensors["e"]},
                "epoch": 3}, path)
    opened = open_pth(path)
    assert sorted(opened) == sorted(tensors)
    for k, t in tensors.items():
        value = opened[k]
        assert not value.flags.owndata and opened.shape(k) == tuple(t.shape)
        np.testing.assert_array_equal(value.astype(np.float32), t.float().numpy())
        out = np.empty(value.shape, opened.dtype(k))
        opened.read_into(k, out)
        assert out.tobytes() == value.tobytes()
