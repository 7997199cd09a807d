"""UnifoLM's CLIP towers leave the device between encodes where the run would not fit
(`UnifolmPipeline.set_offload`, `encoders_leave_device`, `wan_tpu.parallel.offload.park`), on `unifolm-tiny`.

- The decision for an injected device size: "auto" parks the towers exactly when the loaded weights and
  the sampling's working set (`sampling_bytes`) exceed the device; nothing where the backend reports no
  memory (CPU); "none" / "encoders" fixed; a bad choice is a one-line user error.
- A call parks both towers in host memory once its conditions are encoded and brings each back when it
  encodes again (the text tower only for a prompt not encoded before), with bit-identical encodings.
  The sampling and decode are stubbed here: a whole `decide` compiles the sampling loop (the modes' own
  tests run it), and parking changes where the towers' weights are, not what any program computes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.unifolm import pipeline as unifolm_pipeline
from wan_tpu.unifolm.pipeline import UnifolmPipeline, sampling_bytes


def _kinds(encoder):
    return {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(encoder.model))}


def _bytes(module):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(getattr(module, "model", module))))


@pytest.fixture(scope="module")
def pipe():
    return UnifolmPipeline.from_pretrained("unifolm-tiny")


def test_auto_parks_the_towers_where_the_run_would_not_fit(pipe):
    assert pipe.offload == "auto"
    need = sum(_bytes(pipe.component(n)) for n in pipe.COMPONENTS) + sampling_bytes(pipe.config, pipe.dtype)
    assert not pipe.encoders_leave_device(device_bytes=need)
    assert pipe.encoders_leave_device(device_bytes=need - 1)
    assert not pipe.encoders_leave_device()  # CPU: no device memory limit reported
    assert not pipe.set_offload("none").encoders_leave_device(device_bytes=1)
    assert pipe.set_offload("encoders").encoders_leave_device(device_bytes=10 * need)
    with pytest.raises(WanInputError, match="offload 'blocks' is not one of auto, none, encoders") as err:
        pipe.set_offload("blocks")
    assert "\n" not in str(err.value)
    pipe.set_offload("auto")
    # UnifoLM-WMA-0's sampling at 16 × 40 × 64 latents, 320 channels: 1.92 GiB in bf16 (the H100 run), twice in float32.
    from wan_tpu.configs.unifolm import CONFIGS

    assert sampling_bytes(CONFIGS["unifolm-wma-0"], jnp.bfloat16) == pytest.approx(1.92 * 2**30, rel=0.01)


def test_a_call_parks_the_towers_after_encoding(pipe, monkeypatch):
    images = np.random.default_rng(0).integers(0, 256, (2, 128, 128, 3), dtype=np.uint8)
    pixels = pipe.check_images(images)[:, :, -1]
    text, tokens = (np.asarray(x) for x in (pipe.text_encoder.encode(["a"]), pipe.image_encoder.encode(pixels)))
    seen = []
    h, w = pipe.config.latent_size

    def encode_conditions(model, vae, image_encoder, text_emb, *args):
        seen.append((_kinds(pipe.image_encoder), _kinds(pipe.text_encoder)))
        return None

    monkeypatch.setattr(pipe, "_encode_conditions", encode_conditions)
    monkeypatch.setattr(pipe, "_sample", lambda model, cond, *args: (
        jnp.zeros((1, 4, 16, h, w)), jnp.zeros((1, 16, 16)), jnp.zeros((1, 16, 16))))
    monkeypatch.setattr(unifolm_pipeline, "_decode_split", lambda vae, z, key: jnp.zeros((1, 3, 16, 128, 128)))
    pipe.set_offload("encoders")
    states = np.zeros((2, 7), np.float32)
    pipe.decide("a", images, states, num_steps=1)
    assert _kinds(pipe.image_encoder) == _kinds(pipe.text_encoder) == {"pinned_host"}
    pipe.decide("a", images, states, num_steps=1)  # the prompt's embedding is cached: its tower stays parked
    pipe.decide("b", images, states, num_steps=1)
    assert seen == [({"device"}, {"device"}), ({"device"}, {"pinned_host"}), ({"device"}, {"device"})]
    assert _kinds(pipe.image_encoder) == _kinds(pipe.text_encoder) == {"pinned_host"}
    pipe.set_offload("auto")
    pipe._text_cache.clear()
    monkeypatch.undo()
    np.testing.assert_array_equal(np.asarray(pipe.encode_text("a")[0]), text[0])
    assert _kinds(pipe.text_encoder) == {"device"}
    from wan_tpu.parallel.offload import unpark

    unpark(pipe.image_encoder.model)
    np.testing.assert_array_equal(np.asarray(pipe.image_encoder.encode(pixels)), tokens)
