"""`MatrixGamePipeline.prepare` compiling every program of a stream from the components' configs
(`wan_tpu/matrix_game/compile_ahead.py`), and the fixed-shape image condition that makes it possible.

References: the loaders' modules (their graphdefs equal the abstract ones, which is what lets a
program compiled ahead serve the loaded model); a run without `prepare` (frames bit-identical); JAX's
compile events (`jax.monitoring`: on which thread each backend compile runs). The condition's frames
against the authors' full encode and stream == one-shot are in tests/test_matrix_game.py.
"""

import dataclasses
import json
import subprocess
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matrix_game_golden import golden, weights

from wan_tpu.configs.matrix_game import config_from_json
from wan_tpu.matrix_game import condition as condition_module
from wan_tpu.matrix_game import pipeline as mg

IMAGE = (np.random.default_rng(0).random((70, 130, 3)) * 255).astype(np.uint8)


def graphdef(module):
    return nnx.split(module)[0]


def test_abstract_components_have_the_loaded_graphdefs(tmp_path):
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from wan_tpu.encoders.clip_image import CLIPImageEncoder
    from wan_tpu.encoders.clip_loading import abstract_clip_vision, clip_vision_config
    from wan_tpu.matrix_game.loading import abstract_transformer, load_matrix_game_transformer, transformer_config
    from wan_tpu.vae.loading import abstract_vae, load_vae, vae_config

    cfg = config_from_json(golden("mouse_keyboard")[1]["config"])
    dit = load_matrix_game_transformer(weights("mouse_keyboard"), cfg, dtype=jnp.bfloat16)
    assert graphdef(abstract_transformer(transformer_config(weights("mouse_keyboard"), cfg), jnp.bfloat16)) == graphdef(dit)

    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4).save_pretrained(tmp_path / "vae")
    vae = load_vae(str(tmp_path / "vae"), dtype=jnp.bfloat16)
    assert graphdef(abstract_vae(vae_config(str(tmp_path / "vae")), jnp.bfloat16)) == graphdef(vae)

    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     image_size=32, patch_size=8)).save_pretrained(tmp_path / "clip")
    clip = CLIPImageEncoder.from_pretrained(tmp_path / "clip")  # the penultimate state: 2 of 3 blocks
    abstract = abstract_clip_vision(clip_vision_config(tmp_path / "clip", -1))
    assert abstract.config.num_hidden_layers == 2 and graphdef(abstract) == graphdef(clip.model)

    pipe = mg._tiny(jnp.float32, jnp.float32, None)
    for name, loaded in (("transformer", pipe.transformer), ("vae", pipe.vae), ("image_encoder", pipe.image_encoder.model)):
        assert graphdef(pipe._abstracts[name]()) == graphdef(loaded), name


def test_condition_without_a_repeat_in_the_bound_encodes_on(monkeypatch):
    """Today's behaviour where the gray latents have not repeated within `CONDITION_FRAMES`: encoded on."""
    pipe = mg._tiny(jnp.float32, jnp.float32, None)
    pixels = pipe.preprocess_image(IMAGE)
    condition = pipe.encode_image(pixels)
    assert condition.latents.shape[2] == mg.CONDITION_FRAMES
    assert condition.repeat_start + condition.repeat_len <= mg.CONDITION_FRAMES
    monkeypatch.setattr(condition_module, "CONDITION_FRAMES", 7)
    grown = pipe.encode_image(pixels)
    assert (grown.repeat_start, grown.repeat_len) == (condition.repeat_start, condition.repeat_len)
    n = condition.repeat_start + condition.repeat_len
    np.testing.assert_array_equal(np.asarray(grown.latents)[:, :, :n], np.asarray(condition.latents)[:, :, :n])


# A fresh process, so that every cache is cold: a stream after `prepare`, then (caches cleared) one
# without; the compiles of each on the caller's thread, the threads that compiled, and both videos.
_STREAMS = """import json, sys, threading
import jax, jax.numpy as jnp, numpy as np
from wan_tpu.matrix_game import pipeline as mg
from wan_tpu.matrix_game.actions import random_actions

compiles = []
jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **kw: compiles.append(
    (threading.current_thread().name, str(kw.get("fun_name"))))
    if event == "/jax/core/compile/backend_compile_duration" else None)
image = (np.random.default_rng(0).random((70, 130, 3)) * 255).astype(np.uint8)
keyboard, mouse = random_actions(mg._tiny(jnp.float32, jnp.float32, None).action_space, 21, seed=1)
out = {}
for label in ("prepare", "plain"):
    pipe = mg._tiny(jnp.float32, jnp.float32, None)
    start = len(compiles)  # before prepare: its first compile may end before prepare returns
    warmup = pipe.prepare() if label == "prepare" else None
    session = pipe.stream(image, seed=0, max_frames=21)
    frames = [session.step(keyboard[:9], mouse[:9]), session.step(keyboard[9:21], mouse[9:21])]
    if warmup is not None:
        warmup.close()
    np.save(sys.argv[1] + f"/{label}.npy", np.concatenate(frames))
    out[label] = compiles[start:]
    jax.clear_caches()
    mg._tiny.cache_clear()
print(json.dumps(out))
"""


@pytest.mark.slow  # compiles every program of a stream twice (about 50 s on 2 cores)
def test_prepare_compiles_every_program_off_the_callers_thread(tmp_path):
    result = subprocess.run([sys.executable, "-c", _STREAMS, str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    compiles = json.loads(result.stdout.strip().splitlines()[-1])
    prepared = [name for name, _ in compiles["prepare"]]
    assert "MainThread" not in prepared, compiles["prepare"]  # image preparation and two chunks: all compiled ahead
    assert set(prepared) == {f"wan_tpu-compile-{n}" for n in ("encode-first", "condition", "clip", "cache", "key",
                                                              "chunk-denoise", "chunk-decode")}
    for program in ("jit(chunk_denoise_program)", "jit(chunk_decode_program)"):  # one of each for both chunks
        assert [f for _, f in compiles["prepare"]].count(program) == 1
    # Without `prepare`: everything on the caller's thread, the chunk program once, on the first chunk.
    plain = [tuple(c) for c in compiles["plain"]]
    assert {thread for thread, _ in plain} == {"MainThread"}
    assert plain.count(("MainThread", "jit(chunk_denoise_program)")) == plain.count(("MainThread", "jit(chunk_decode_program)")) == 1
    np.testing.assert_array_equal(np.load(tmp_path / "prepare.npy"), np.load(tmp_path / "plain.npy"))


@pytest.mark.slow  # compiles the chunk programs (about 30 s on 2 cores) unless an earlier test did
def test_a_failed_compile_ahead_is_a_warning_and_the_stream_works():
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.vae.loading import abstract_vae

    tiny = mg._tiny(jnp.float32, jnp.float32, None)
    # A VAE config that does not describe the weights: 8 latent channels where the DiT makes 16.
    wrong = dataclasses.replace(TINY_VAE, z_dim=8, latents_mean=TINY_VAE.latents_mean[:8],
                                latents_std=TINY_VAE.latents_std[:8])
    pipe = mg.MatrixGamePipeline(tiny.variant, tiny._loaders, name="broken", dtype=jnp.float32, vae_dtype=jnp.float32,
                                 abstracts={**tiny._abstracts, "vae": lambda: abstract_vae(wrong, jnp.float32)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pipe.prepare():
            session = pipe.stream(IMAGE, seed=0, max_frames=9)
            frames = session.step([1, 0, 0, 0], [0, 0])
    assert frames.shape == (9, *pipe.size, 3) and frames.dtype == np.uint8
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("compiling chunk-denoise ahead of time failed") for m in messages), messages


@pytest.mark.slow  # compiles the stream's programs unless the compile cache has them
@pytest.mark.parametrize("graphs", [False, True])
def test_a_first_run_waits_for_every_program_and_on_a_gpu_for_every_load(monkeypatch, tmp_path, graphs):
    """`_wait_compiled(name)` waits for all of `prepare`'s programs (not only `name`'s), and where XLA
    captures CUDA graphs (patched in here) for the components' loads too: a first run must not overlap
    other CUDA work."""
    from wan_tpu.matrix_game import compile_ahead as matrix_game_warmup
    from wan_tpu.runtime import compile_cache

    monkeypatch.setattr(matrix_game_warmup, "captures_graphs", lambda: graphs)
    before = compile_cache.cache_dir()  # the executable cache on, in a folder of this test's
    compile_cache.enable(str(tmp_path / "cache"))
    try:
        _first_runs(graphs)
    finally:
        compile_cache.enable(before) if before else compile_cache.disable()


def _first_runs(graphs):
    import threading

    tiny = mg._tiny(jnp.float32, jnp.float32, None)
    gate = threading.Event()

    def pipeline(loaders):
        return mg.MatrixGamePipeline(tiny.variant, loaders, name="t", dtype=jnp.float32, vae_dtype=jnp.float32,
                                     abstracts=tiny._abstracts, configs=lambda: tiny.configs)

    first = pipeline(tiny._loaders)
    warmup = first.prepare()  # every program compiled (or found) and stored
    for name in list(warmup.compiles):
        warmup.wait_compiled(name)
    warmup.close()

    def transformer():
        gate.wait(60)
        return tiny._loaders["transformer"]()

    pipe = pipeline({**tiny._loaders, "transformer": transformer})  # the DiT's load held until `gate`
    with pipe.prepare() as warmup:
        waiting = threading.Thread(target=pipe._wait_compiled, args=("key",))
        waiting.start()
        waiting.join(0.5 if graphs else 120)  # without graphs it needs no load: only the programs
        assert waiting.is_alive() == graphs  # with graphs: waiting for the DiT's load
        gate.set()
        waiting.join()
        assert {"chunk-denoise", "chunk-decode", "key", "clip", "cache", "encode-first", "gray-latents"} <= set(
            pipe._programs._compiled)
        assert not warmup.compiles  # every program waited for
        if graphs:
            assert {"transformer", "vae", "image_encoder"} <= set(pipe._loaded)
