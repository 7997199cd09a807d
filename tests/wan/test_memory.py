"""Memory estimates (`wan_tpu.runtime.memory`) against measurements, and the refusal they drive.

References: the VAE peaks recorded in docs/PERFORMANCE.md (H200, bf16, 81 frames: decode 2.21 GiB at
480p and 4.79 GiB at 720p with the default 2 strips, 2.17 GiB tiled at 720p; encode 2.51 / 5.34 GiB),
tolerance 5% (tiled: 15%, the estimate is an upper bound); the DiT step formula against XLA's own
buffer assignment of the 1.3B DiT at 832×480×81 (float32, attention computed in query chunks as a
flash kernel would), tolerance 15%.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from wan_tpu.configs.models import VARIANTS
from wan_tpu.configs.vae import VAE_PRESETS
from wan_tpu.errors import WanInputError
from wan_tpu.runtime import memory as device_memory
from wan_tpu.wan import memory, presets
from wan_tpu.wan.cli import main
from wan_tpu.wan.pipeline import WanPipeline

GiB = 2**30


@pytest.mark.parametrize("latent,decode,tiled,encode", [((21, 60, 104), 2.21, None, 2.51),
                                                         ((21, 90, 160), 4.79, 2.17, 5.34)])
def test_vae_estimates_match_the_recorded_peaks(latent, decode, tiled, encode):
    vae, count = memory._abstract_vae(VAE_PRESETS["wan2.1"], "bfloat16")
    z = jax.ShapeDtypeStruct((1, 16, *latent), jnp.bfloat16)
    plans = dict(memory.decode_plans(vae, z, memory.Layout()))
    weights = count * 2
    assert abs((plans["2 strips"] + weights) / GiB / decode - 1) < 0.05
    assert abs((1.15 * vae.decode_bytes(z, 2) + weights) / GiB / encode - 1) < 0.05
    if tiled is not None:
        assert 1 <= (plans["tiles"] + weights) / GiB / tiled < 1.15


def _chunked_attention(q, k, v, chunk=256):
    from wan_tpu.layers.attention import reference_attention

    b, s, h, d = q.shape
    qp = jnp.pad(q, ((0, 0), (0, -s % chunk), (0, 0), (0, 0))).reshape(b, -1, chunk, h, d)
    out = jax.lax.map(lambda qc: reference_attention(qc, k, v), jnp.moveaxis(qp, 1, 0))
    return jnp.moveaxis(out, 0, 1).reshape(b, -1, h, d)[:, :s]


def test_dit_step_formula_matches_xla_buffer_assignment():
    from wan_tpu.wan.transformer import WanTransformer, forward

    cfg = VARIANTS["wan2.1-t2v-1.3b"].transformer
    dit = nnx.eval_shape(lambda: WanTransformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    dit.self_attention = _chunked_attention
    graphdef, state = nnx.split(dit)
    x = jax.ShapeDtypeStruct((2, 16, 21, 60, 104), jnp.float32)
    t = jax.ShapeDtypeStruct((2,), jnp.float32)
    context = jax.ShapeDtypeStruct((2, 512, cfg.text_dim), jnp.float32)
    compiled = jax.jit(functools.partial(forward, graphdef)).lower(state, x, t, context).compile()
    measured = compiled.memory_analysis().temp_size_in_bytes
    tokens = 21 * 30 * 52
    estimate = memory.dit_step_bytes(cfg, tokens, 2, "pallas_gpu", memory.Layout())
    assert abs(estimate / measured - 1) < 0.15, (estimate / GiB, measured / GiB)
    # Sharded: activations split over dp (the CFG batch), sp and tp.
    assert memory.dit_step_bytes(cfg, tokens, 2, "pallas_gpu", memory.Layout(2, 2, 1, "gpu")) == estimate // 4


def test_reference_attention_adds_the_logits():
    cfg = VARIANTS["tiny"].transformer
    flash = memory.dit_step_bytes(cfg, 32760, 2, "splash_exp2", memory.Layout())
    reference = memory.dit_step_bytes(cfg, 32760, 2, "reference", memory.Layout())
    assert reference - flash == int(2.5 * 2 * cfg.num_attention_heads * 32760**2 * 4)


def test_every_flash_kernel_is_budgeted_as_one():
    """Each attention impl but the reference is a flash kernel: a 1.3B 480p run with `--attention
    pallas_gpu_fp8` was once refused on an H200 for 247 GiB of logits it never holds."""
    from wan_tpu.layers.attention import _IMPLS, MATERIALISES_LOGITS

    cfg = VARIANTS["tiny"].transformer
    flash = memory.dit_step_bytes(cfg, 32760, 2, "pallas_gpu", memory.Layout())
    for impl in _IMPLS:
        bytes_ = memory.dit_step_bytes(cfg, 32760, 2, impl, memory.Layout())
        assert (bytes_ > flash) == (impl in MATERIALISES_LOGITS), impl


@pytest.fixture
def sixteen_gib(monkeypatch):
    monkeypatch.setattr(device_memory, "host_available_bytes", lambda: 16 * GiB)


def test_too_large_run_is_refused_with_a_size_that_fits(sixteen_gib, tmp_path, capsys):
    """The tiny preset at the README's old 832*480*81 (killed by the OOM killer before this check)."""
    capsys.readouterr()
    assert main(["--prompt", "a cat", "--size", "832*480", "--frames", "81", "--output", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "for denoise" in err and "GiB of host RAM is free" in err, err
    assert "--no-memory-check" in err and os.listdir(tmp_path) == []
    width, height, frames = map(int, re.search(r"--size (\d+)\*(\d+) --frames (\d+)", err).groups())
    pipe = WanPipeline.from_pretrained("tiny")
    fits = pipe.settings(height=height, width=width, num_frames=frames)
    memory.check_fits(pipe, fits)  # the suggested run passes the same check
    with pytest.raises(WanInputError, match="for denoise"):  # the API refuses it too, before loading
        pipe("a cat", height=480, width=832, num_frames=81)
    assert pipe._loaded == {}


def test_no_memory_check_runs_anyway(monkeypatch, tmp_path):
    monkeypatch.setattr(device_memory, "host_available_bytes", lambda: 1)
    argv = ["--prompt", "a cat", "--size", "32*32", "--steps", "1", "--quiet", "--output", str(tmp_path / "v.mp4")]
    assert main(argv) == 2
    assert main([*argv, "--no-memory-check"]) == 0


def test_mesh_divides_sharded_weights(sixteen_gib):
    pipe = presets.tiny(WanPipeline)
    s = pipe.settings(height=64, width=64, num_frames=5)
    whole = memory.stage_bytes(pipe, s, ("denoise",))["denoise"][0]
    pipe.mesh = jax.make_mesh((2, 2, 2), ("dp", "sp", "tp"))
    assert memory.stage_bytes(pipe, s, ("denoise",))["denoise"][0] < whole
