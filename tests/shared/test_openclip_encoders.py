"""OpenCLIP towers and preprocessing on JAX (`wan_tpu/encoders/openclip.py`).

References, float32, ≤ 1e-5 relative (max-abs error over max-abs value):
- preprocessing: kornia's `resize(bicubic, align_corners=True, antialias=True)` + `normalize`, as the
  authors' `FrozenOpenCLIPImageEmbedderV2.preprocess` (skipped where kornia is not installed);
- towers and tokenizer: open_clip on tiny random `CLIP` configs, run the way the authors run them
  (vision: all tokens before `ln_post`; text: all blocks but the last, then `ln_final`), converted
  with `open_clip_*_to_hf`, saved with `save_pretrained` and loaded by our encoders (skipped where
  open_clip is not installed; `tests/data` goldens from the authors' own classes run everywhere).
"""

import importlib.abc
import importlib.machinery
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from wan_tpu.encoders.openclip import (
    CLIP_MEAN,
    CLIP_STD,
    OpenCLIPImageEncoder,
    OpenCLIPTextEncoder,
    open_clip_text_to_hf,
    open_clip_vision_to_hf,
    preprocess_images,
    text_config,
    tokenizer_from_open_clip,
    vision_config,
    write_tower,
)
from wan_tpu.errors import WanInputError
from wan_tpu.runtime import executable_cache

TOL = 1e-5
PROMPTS = [
    "Stack the blocks: red at the bottom, yellow in the middle, green on top.",
    "  pick UP the cup!!  &amp; don't   drop it ",
    "",
    "word " * 100,
]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


class _Stub(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {})


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """open_clip imports torchvision (transforms, ops) at import time; the towers never use it.
    The PyPI torchvision wheel cannot load beside a CPU-only torch, so placeholder modules stand in."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda n: _Stub(n, (), {}) if not n.startswith("__") else (_ for _ in ()).throw(AttributeError(n))
        return module

    def exec_module(self, module):
        pass


@pytest.fixture(scope="module")
def open_clip():
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _TorchvisionStub())
    return pytest.importorskip("open_clip")


@pytest.fixture(scope="module")
def clip_model(open_clip):
    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=16,
        vision_cfg=dict(image_size=16, patch_size=4, width=32, layers=2, head_width=8),
        text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=4, layers=3),
    ).eval()
    with torch.no_grad():  # random norms, biases and embeddings too
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _run_blocks(transformer, x, attn_mask=None, skip_last=False):
    """The authors' sequence-first loop over the blocks, on open_clip 2.x or batch-first 3.x."""
    batch_first = getattr(transformer, "batch_first", False)
    x = x if batch_first else x.permute(1, 0, 2)
    blocks = transformer.resblocks[:-1] if skip_last else transformer.resblocks
    for block in blocks:
        x = block(x, attn_mask=attn_mask)
    return x if batch_first else x.permute(1, 0, 2)


def test_preprocess_matches_kornia():
    kornia = pytest.importorskip("kornia")
    rng = np.random.default_rng(0)
    mean, std = torch.tensor(CLIP_MEAN), torch.tensor(CLIP_STD)
    for h, w, size in [(320, 512, 224), (24, 40, 16), (8, 12, 16), (16, 16, 16)]:
        x = rng.uniform(-1, 1, (2, 3, h, w)).astype(np.float32)
        ref = kornia.geometry.resize(torch.from_numpy(x), (size, size), interpolation="bicubic", align_corners=True, antialias=True)
        ref = kornia.enhance.normalize((ref + 1.0) / 2.0, mean, std).numpy()
        assert rel_err(preprocess_images(x, size), ref) <= TOL, (h, w, size)


def test_image_tower_matches_open_clip(clip_model, tmp_path):
    kornia = pytest.importorskip("kornia")
    visual = clip_model.visual
    images = np.random.default_rng(1).uniform(-1, 1, (2, 3, 40, 56)).astype(np.float32)
    with torch.no_grad():
        x = kornia.geometry.resize(torch.from_numpy(images), (16, 16), interpolation="bicubic", align_corners=True, antialias=True)
        x = kornia.enhance.normalize((x + 1.0) / 2.0, torch.tensor(CLIP_MEAN), torch.tensor(CLIP_STD))
        x = visual.conv1(x).flatten(2).permute(0, 2, 1)
        x = torch.cat([visual.class_embedding + torch.zeros(x.shape[0], 1, x.shape[-1]), x], dim=1)
        x = visual.ln_pre(visual.patch_dropout(x + visual.positional_embedding))
        ref = _run_blocks(visual.transformer, x).numpy()

    state = {k[len("visual.") :]: v for k, v in clip_model.state_dict().items() if k.startswith("visual.")}
    config = vision_config(width=32, layers=2, heads=4, patch_size=4, image_size=16)
    write_tower(tmp_path / "image_encoder", config, open_clip_vision_to_hf(state, layers=2))
    encoder = OpenCLIPImageEncoder.from_pretrained(tmp_path / "image_encoder", dtype=jnp.float32)
    out = np.asarray(encoder.encode(images))
    assert out.shape == (2, 17, 32)
    assert rel_err(out, ref) <= TOL


def test_text_tower_and_tokenizer_match_open_clip(open_clip, clip_model, tmp_path):
    tokens = open_clip.tokenize(PROMPTS)
    with torch.no_grad():
        x = clip_model.token_embedding(tokens) + clip_model.positional_embedding
        x = _run_blocks(clip_model.transformer, x, attn_mask=clip_model.attn_mask, skip_last=True)
        ref = clip_model.ln_final(x).numpy()

    state = {k: v for k, v in clip_model.state_dict().items() if not k.startswith("visual.")}
    write_tower(tmp_path / "text_encoder", text_config(width=32, layers=2, heads=4), open_clip_text_to_hf(state, layers=2))
    tokenizer_from_open_clip(open_clip.tokenizer._tokenizer).save_pretrained(tmp_path / "tokenizer")
    encoder = OpenCLIPTextEncoder.from_pretrained(tmp_path / "text_encoder", tmp_path / "tokenizer")
    np.testing.assert_array_equal(encoder.tokenize(PROMPTS), tokens.numpy())
    assert rel_err(encoder.encode(PROMPTS), ref) <= TOL


def test_weights_that_do_not_match_are_named(clip_model, tmp_path):
    state = {k[len("visual.") :]: v for k, v in clip_model.state_dict().items() if k.startswith("visual.")}
    tensors = open_clip_vision_to_hf(state, layers=2)
    config = vision_config(width=32, layers=2, heads=4, patch_size=4, image_size=16)
    write_tower(tmp_path / "a", config, {k: v for k, v in tensors.items() if not k.endswith("layers.1.mlp.fc2.bias")})
    with pytest.raises(WanInputError, match="missing tensor .*layers.1.mlp.fc2.bias"):
        OpenCLIPImageEncoder.from_pretrained(tmp_path / "a")
    write_tower(tmp_path / "b", config, {**tensors, "vision_model.extra": torch.zeros(2)})
    with pytest.raises(WanInputError, match="unexpected tensor .*extra"):
        OpenCLIPImageEncoder.from_pretrained(tmp_path / "b")


def test_bad_inputs_are_user_errors(tmp_path):
    with pytest.raises(WanInputError, match=r"\(B, 3, H, W\)"):
        preprocess_images(np.zeros((1, 4, 8, 8), np.float32))
    with pytest.raises(WanInputError, match="image_encoder folder .* has no config.json"):
        OpenCLIPImageEncoder.from_pretrained(tmp_path)
    with pytest.raises(WanInputError, match="text_encoder folder .* has no config.json"):
        OpenCLIPTextEncoder.from_pretrained(tmp_path, tmp_path)


def test_a_pickle_where_safetensors_are_expected_is_named(tmp_path):
    write_tower(tmp_path, vision_config(width=32, layers=1, heads=4, patch_size=4, image_size=16), {})
    torch.save({"x": torch.zeros(1)}, tmp_path / "model.safetensors")  # a pickle under the safetensors name
    with pytest.raises(WanInputError, match="model.safetensors: (not a safetensors file|corrupt safetensors header)"):
        OpenCLIPImageEncoder.from_pretrained(tmp_path)


def test_the_encode_program_compiled_from_the_abstract_tower_serves_the_loaded_one(tmp_path):
    """`abstract(folder)` and `from_pretrained(folder)` give equal graphdefs and program keys; the encode program
    compiled ahead from the abstract tower (`executable_cache.ahead`, as a pipeline's `prepare` does it, in a
    thread of its own) is the one the loaded tower then runs, nothing compiled on the caller's thread. Reference:
    the same tower without a program key (the jitted path), bitwise."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     image_size=16, patch_size=4)).save_pretrained(tmp_path / "image_encoder")
    encoder = OpenCLIPImageEncoder.from_pretrained(tmp_path / "image_encoder")
    abstract = OpenCLIPImageEncoder.abstract(tmp_path / "image_encoder")
    assert abstract.program_key == encoder.program_key is not None
    assert nnx.graphdef(abstract.model) == nnx.graphdef(encoder.model)
    images = np.random.default_rng(2).uniform(-1, 1, (1, 3, 20, 24)).astype(np.float32)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **kw: compiles.append(
        (threading.current_thread().name, str(kw.get("fun_name"))))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    with executable_cache.ahead():
        jax.eval_shape(lambda: abstract.encode(images))
    assert ("wan_tpu-compile-openclip-image", "jit(_image_tokens)") in compiles
    start = len(compiles)
    out = np.asarray(encoder.encode(images))
    assert ("MainThread", "jit(_image_tokens)") not in compiles[start:]
    np.testing.assert_array_equal(out, np.asarray(OpenCLIPImageEncoder(encoder.model).encode(images)))
