"""The built-in `tiny` preset and the diffusers-layout checkpoint writer.

Checks: weights are a pure function of the seed (two builds are bit-identical, another seed
differs); `random_module` draws at the documented scales; a whole tiny run gives varied uint8
frames of the preset's size; `save_diffusers_checkpoint` writes a folder that diffusers and our
loader both read, and our loaded DiT equals diffusers' forward (float32, 1e-5 relative).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from wan_tpu.configs.models import VARIANTS
from wan_tpu.configs.vae import TINY_VAE
from wan_tpu.loading.random_init import random_module
from wan_tpu.wan.pipeline import WanPipeline
from wan_tpu.wan.presets import PRESETS, save_diffusers_checkpoint, tiny


def params(module):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module))]


def test_tiny_weights_depend_only_on_the_seed():
    a, b, c = tiny(WanPipeline, dtype=jnp.float32), tiny(WanPipeline, dtype=jnp.float32), tiny(WanPipeline, dtype=jnp.float32, seed=1)
    for name in ("transformer", "vae"):
        pa, pb, pc = params(a.component(name)), params(b.component(name)), params(c.component(name))
        assert all(np.array_equal(x, y) for x, y in zip(pa, pb))
        assert not all(np.array_equal(x, y) for x, y in zip(pa, pc))
    ea = np.asarray(a.text_encoder.encode(["a cat"]))
    eb = np.asarray(b.text_encoder.encode(["a cat"]))
    assert np.array_equal(ea, eb) and ea.shape == (1, 512, VARIANTS["tiny"].transformer.text_dim)


def test_random_module_scales():
    from wan_tpu.wan.transformer import WanTransformer

    cfg = VARIANTS["tiny"].transformer
    model = random_module(lambda: WanTransformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), seed=0)
    kernel = np.asarray(model.blocks.ffn.proj_in.kernel[...])  # (layers, dim, ffn)
    assert kernel.shape == (cfg.num_layers, cfg.inner_dim, cfg.ffn_dim)
    assert abs(kernel.std() * math.sqrt(cfg.inner_dim) - 1) < 0.05
    assert np.array_equal(np.asarray(model.blocks.attn1.norm_q.weight[...]), np.ones((cfg.num_layers, cfg.inner_dim)))


def test_tiny_run_gives_frames_of_the_preset_size():
    pipe = PRESETS["tiny"](WanPipeline, dtype=jnp.bfloat16)
    frames = pipe("a cat walks on the grass", num_inference_steps=2, seed=0)
    w, h = pipe.variant.sample_size
    assert frames.shape == (pipe.variant.sample_frames, h, w, 3) and frames.dtype == np.uint8
    assert frames.std() > 1.0  # not a constant image


def test_saved_checkpoint_reads_back_in_both(tmp_path):
    import diffusers

    from wan_tpu.wan.transformer_loading import load_transformer

    cfg = VARIANTS["tiny"].transformer
    save_diffusers_checkpoint(str(tmp_path), cfg, TINY_VAE, seed=3)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model_index.json", "transformer", "vae", "text_encoder", "tokenizer", "scheduler"} <= names
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "transformer").eval()
    ours = load_transformer(str(tmp_path / "transformer"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 2, 4, 4)).astype(np.float32)
    ctx = rng.standard_normal((1, 8, cfg.text_dim)).astype(np.float32)
    t = np.array([700.0], np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), return_dict=False)[0].numpy()
    got = np.asarray(ours(jnp.asarray(x), jnp.asarray(t), jnp.asarray(ctx)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

