"""Native CLIP towers (`wan_tpu/encoders/clip.py`) and their loader (`wan_tpu/encoders/clip_loading.py`).

Reference: transformers' `CLIPVisionModel` / `CLIPTextModel` (eager, float32) on tiny random models saved
with `save_pretrained` and loaded by `load_clip_vision` / `load_clip_text`: `last_hidden_state`, and with
the last block left out `hidden_states[-2]` (vision) / the model without its last block (text, UnifoLM's
penultimate), ≤ 1e-5 relative (max-abs error over max-abs value). Sharded on a simulated 8-device
mesh (subprocess) equal to unsharded at the same tolerance.
"""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModel

from wan_tpu.encoders.clip_loading import load_clip_text, load_clip_vision
from wan_tpu.errors import WanInputError

TOL = 1e-5
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8)
TEXT = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=20, bos_token_id=98, eos_token_id=99, pad_token_id=0)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def _random(model):
    torch.manual_seed(0)
    with torch.no_grad():  # random norms, biases and embeddings too
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _saved(model, folder, prefix=""):
    """`save_pretrained` (transformers 5: no `vision_model.` prefix); `prefix` renames the tensors as
    transformers 4 saved them (and as our converters write them)."""
    model.save_pretrained(folder)
    if prefix:
        path = os.path.join(folder, "model.safetensors")
        save_file({prefix + k: v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("act, prefix", [("gelu", "vision_model."), ("quick_gelu", "")])
def test_vision_matches_transformers(tmp_path, act, prefix):
    model = _random(CLIPVisionModel(CLIPVisionConfig(**VISION, hidden_act=act)))
    folder = _saved(model, tmp_path, prefix)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(pixels, output_hidden_states=True)
    assert rel_err(load_clip_vision(folder)(jnp.asarray(pixels.numpy())), ref.last_hidden_state) <= TOL
    penultimate = load_clip_vision(folder, num_layers=-1)
    assert penultimate.config.num_hidden_layers == 2
    assert rel_err(penultimate(jnp.asarray(pixels.numpy())), ref.hidden_states[-2]) <= TOL
    # No block kept (a one-block tower's penultimate state, as a tiny Wan I2V checkpoint has): the embeddings.
    embeddings = load_clip_vision(folder, num_layers=0)
    assert rel_err(embeddings(jnp.asarray(pixels.numpy())), ref.hidden_states[0]) <= TOL


@pytest.mark.parametrize("act, prefix", [("gelu", ""), ("quick_gelu", "text_model.")])
def test_text_matches_transformers(tmp_path, act, prefix):
    model = _random(CLIPTextModel(CLIPTextConfig(**TEXT, hidden_act=act)))
    folder = _saved(model, tmp_path, prefix)
    ids = torch.randint(0, 100, (2, 20))
    with torch.no_grad():
        ref, ref_short = model(ids).last_hidden_state, model(ids[:, :7]).last_hidden_state
        model.encoder.layers = model.encoder.layers[:-1]  # UnifoLM's "penultimate"
        ref_penultimate = model(ids).last_hidden_state
    text = load_clip_text(folder)
    assert rel_err(text(jnp.asarray(ids.numpy())), ref) <= TOL
    assert rel_err(text(jnp.asarray(ids[:, :7].numpy())), ref_short) <= TOL  # fewer tokens than positions
    assert rel_err(load_clip_text(folder, num_layers=-1)(jnp.asarray(ids.numpy())), ref_penultimate) <= TOL


def test_bfloat16_is_close_to_float32(tmp_path):
    folder = _saved(_random(CLIPVisionModel(CLIPVisionConfig(**VISION, hidden_act="gelu"))), tmp_path)
    pixels = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 32, 32)), jnp.float32)
    out = load_clip_vision(folder, dtype=jnp.bfloat16)(pixels)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, load_clip_vision(folder)(pixels)) <= 3e-2


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    folder = _saved(_random(CLIPVisionModel(CLIPVisionConfig(**VISION))), tmp_path / "good")
    tensors = load_file(os.path.join(folder, "model.safetensors"))

    def variant(name, changed):
        os.makedirs(tmp_path / name)
        os.link(os.path.join(folder, "config.json"), tmp_path / name / "config.json")
        save_file(changed, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    missing = variant("missing", {k: v for k, v in tensors.items() if k != "encoder.layers.2.mlp.fc2.bias"})
    extra = variant("extra", {**tensors, "encoder.layers.3.mlp.fc2.bias": torch.zeros(32)})
    shape = variant("shape", {**tensors, "embeddings.position_embedding.weight": torch.zeros(16, 32)})
    for path, message in ((missing, "missing tensor 'encoder.layers.2.mlp.fc2.bias'"),
                          (extra, "unexpected tensor 'encoder.layers.3.mlp.fc2.bias'"),
                          (shape, r"tensor 'embeddings.position_embedding.weight' has shape \(16, 32\), but config.json "
                                  r"implies \(17, 32\)")):
        with pytest.raises(WanInputError, match=message) as e:
            load_clip_vision(path, num_layers=-1)  # the unread last block is checked too
        assert "\n" not in str(e.value)
    with pytest.raises(WanInputError, match="cannot keep -1 of the 3 CLIP blocks"):
        load_clip_vision(folder, num_layers=-4)
    with pytest.raises(WanInputError, match=r"\(B, 3, 32, 32\)"):
        load_clip_vision(folder)(jnp.zeros((1, 3, 16, 16)))


def test_sharded_on_8_devices_equals_unsharded(tmp_path):
    _saved(_random(CLIPVisionModel(CLIPVisionConfig(**VISION, hidden_act="gelu"))), tmp_path / "vision", "vision_model.")
    _saved(_random(CLIPTextModel(CLIPTextConfig(**TEXT, hidden_act="gelu"))), tmp_path / "text")
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        from wan_tpu.parallel.mesh import make_mesh
        from wan_tpu.encoders.clip_loading import load_clip_text, load_clip_vision
        assert jax.device_count() == 8
        mesh = make_mesh(dp=2, sp=2, tp=2)
        pixels = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 32, 32)), jnp.float32)
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 20)), jnp.int32)
        for load, x in ((load_clip_vision, pixels), (load_clip_text, ids)):
            folder = {str(tmp_path)!r} + ("/vision" if load is load_clip_vision else "/text")
            ref, model = np.asarray(load(folder, num_layers=-1)(x)), load(folder, mesh=mesh, num_layers=-1)
            q = model.encoder.layers.self_attn.q_proj.weight[...]
            assert q.sharding.spec == P(None, "tp", ("dp", "sp")), q.sharding.spec
            out = np.asarray(model(x))
            err = np.abs(out - ref).max() / np.abs(ref).max()
            assert err <= {TOL}, err
        print("ok")
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_sharding_rules_cover_every_parameter():
    from flax import nnx
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from wan_tpu.encoders.clip import CLIPTextConfig as TextConfig
    from wan_tpu.encoders.clip import CLIPTextTransformer, CLIPVisionTransformer
    from wan_tpu.encoders.clip import CLIPVisionConfig as VisionConfig
    from wan_tpu.parallel.sharding import describe_sharding

    mesh = AbstractMesh((2, 2, 2), ("dp", "sp", "tp"))
    for build in (lambda: CLIPVisionTransformer(VisionConfig(**VISION)), lambda: CLIPTextTransformer(TextConfig(**TEXT))):
        rows = describe_sharding(nnx.eval_shape(build), mesh, "clip")
        assert [r.path for r in rows if r.rule is None] == []
        assert all(not r.spec or r.spec[0] is None for r in rows if r.path.startswith("encoder.layers."))  # the scan axis
        assert all(r.replicated for r in rows if "norm" in r.path or r.path.startswith("embeddings."))
        specs = {r.path: r.spec for r in rows}
        # torch layout (out, in): q and fc1 column-parallel, out_proj and fc2 row-parallel.
        assert specs["encoder.layers.self_attn.q_proj.weight"] == P(None, "tp", ("dp", "sp"))
        assert specs["encoder.layers.mlp.fc2.weight"] == P(None, ("dp", "sp"), "tp")
