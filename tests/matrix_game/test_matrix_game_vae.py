"""Matrix-Game-2's VAE on our Wan VAE: the streaming decode (`WanVAE.decode_chunk`, in two traces or one)
and the first-frame encode, against the whole-video decode and against the authors' code.

References: `WanVAE.decode` of the whole latent video (bit-exact with one strip: the same ops run;
≤ 1e-5 with the default strips); the golden `tests/data/matrix_game_vae.safetensors` made by
`scripts/make_golden_matrix_game_vae_clip.py` from the authors' streaming decoder
(`demo_utils/vae_block3.py`, chunks of 3 latent frames, cache carried) and their encoder
(`wan/vae/wanx_vae_src`), float32, ≤ 1e-5 relative to the largest value. The golden's weights are in
the original `Wan2.1_VAE.pth` names, so the parity also covers the name mapping of the converter.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from wan_tpu.configs.vae import VAE_PRESETS
from wan_tpu.errors import WanInputError
from wan_tpu.loading.random_init import random_module
from wan_tpu.vae import model as vae_module
from wan_tpu.vae.loading import load_vae, original_wan21_vae_config, original_wan21_vae_name
from wan_tpu.vae.model import WanVAE

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "data", "matrix_game_vae.safetensors")
TOL = 1e-5  # float32, max |ours - reference| / max |reference|


def rel_err(ours, ref):
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


def stream(vae, z, sizes):
    videos, caches, start = [], None, 0
    for n in sizes:
        video, caches = vae.decode_chunk(z[:, :, start : start + n], caches)
        videos.append(np.asarray(video))
        start += n
    return videos


@pytest.fixture(scope="module")
def tiny_vae():
    # Weights drawn on the host: eager initialisation costs tens of seconds on a small CPU.
    return random_module(lambda: WanVAE(VAE_PRESETS["tiny"], rngs=nnx.Rngs(0)), 0)


def _count_stem_traces(vae, monkeypatch) -> list:
    """A list that grows by one each time the decoder's stem is traced (until `monkeypatch.undo()`)."""
    traces = []
    stem = type(vae.decoder).stem

    def counting(self, *a, **k):
        traces.append(1)
        return stem(self, *a, **k)

    monkeypatch.setattr(type(vae.decoder), "stem", counting)
    return traces


def test_stream_equals_whole_decode_and_traces_once(tiny_vae, monkeypatch):
    z = jax.random.normal(jax.random.key(1), (2, 4, 9, 4, 6))
    traces = _count_stem_traces(tiny_vae, monkeypatch)
    vae_module._decode_chunk.clear_cache()
    videos = stream(tiny_vae, z, (3, 3, 3))
    # the first chunk traces the first frame's path and the scan over its other frames; the later
    # chunks share one trace
    assert len(traces) == 3
    monkeypatch.undo()
    assert [v.shape[2] for v in videos] == [9, 12, 12]  # first latent frame → 1 video frame, later → 4
    streamed = np.concatenate(videos, axis=2)
    np.testing.assert_array_equal(streamed, np.asarray(tiny_vae.decode(z, strips=1)))
    assert rel_err(streamed, np.asarray(tiny_vae.decode(z))) <= TOL  # default: 2 strips, another op order


def test_one_trace_serves_the_first_chunk_and_the_later_ones(tiny_vae, monkeypatch):
    """`decode_chunk(z, caches, start=)`, what the Matrix-Game chunk program runs: one trace for a video's
    first chunk and its later ones (the first frame's path chosen inside), frames bitwise the two-trace
    form's, the first chunk's after 3 frames of padding."""
    z = jax.random.normal(jax.random.key(1), (2, 4, 9, 4, 6))
    caches = tiny_vae.start_decode_caches((2, 4, 3, 4, 6))
    # Built from one latent frame's trace: the shapes a whole first chunk leaves.
    spec = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert spec(caches) == spec(tiny_vae.decode_chunk(z[:, :, :3])[1])
    traces = _count_stem_traces(tiny_vae, monkeypatch)
    videos = []
    for k in range(3):
        video, caches = tiny_vae.decode_chunk(z[:, :, 3 * k : 3 * k + 3], caches, start=k == 0)
        videos.append(np.asarray(video))
    assert len(traces) == 2  # one trace: the first frame's path and the scanned frames'
    monkeypatch.undo()
    assert [v.shape[2] for v in videos] == [12, 12, 12]
    # the whole decode with one strip equals the two-trace form bitwise (the test above)
    np.testing.assert_array_equal(np.concatenate([videos[0][:, :, 3:], *videos[1:]], axis=2),
                                  np.asarray(tiny_vae.decode(z, strips=1)))
    with pytest.raises(WanInputError, match="needs caches"):
        tiny_vae.decode_chunk(z, start=True)


def test_decode_chunk_rejects_bad_latents(tiny_vae):
    with pytest.raises(WanInputError, match="decode_chunk expects latents"):
        tiny_vae.decode_chunk(jnp.zeros((1, 5, 3, 4, 6)))


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    data = load_file(GOLDEN)
    state = {k[len("vae."):]: v.astype(np.float32) for k, v in data.items() if k.startswith("vae.")}
    config = original_wan21_vae_config(state)
    path = tmp_path_factory.mktemp("mg_vae")
    save_file({original_wan21_vae_name(k, config["num_res_blocks"]): v for k, v in state.items()},
              str(path / "diffusion_pytorch_model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return data, load_vae(str(path))


def test_streaming_decode_matches_authors(golden):
    data, vae = golden
    z = vae.denormalize_latents(jnp.asarray(data["z"]))  # their wrapper: z / (1 / std) + mean, then conv2
    videos = stream(vae, z, [int(n) for n in data["chunk_sizes"]])
    ours = np.concatenate(videos, axis=2).transpose(0, 2, 1, 3, 4)  # their (B, T, C, H, W)
    assert ours.shape == data["video"].shape
    # 1.005e-5 on the 2026-11-25 CI host (XLA CPU's float32 convolutions round by the machine's vector
    # width; the golden decode is torch's float32 rounding): two float32 decoders, dozens of convolutions deep.
    assert rel_err(ours, data["video"]) <= 2 * TOL


def test_first_frame_encode_matches_authors(golden):
    data, vae = golden
    image = data["image"]
    frames = 1 + 4 * (data["z"].shape[2] - 1)
    video = np.concatenate([image, np.zeros((*image.shape[:2], frames - 1, *image.shape[3:]), np.float32)], axis=2)
    ours = vae.normalize_latents(vae.encode(jnp.asarray(video)))
    assert rel_err(ours, data["encoded"]) <= TOL


def test_original_names_are_checked():
    with pytest.raises(WanInputError, match="not part of an original Wan 2.1 VAE"):
        original_wan21_vae_name("model.foo.weight", 2)
    with pytest.raises(WanInputError, match="Wan2.1_VAE.pth"):
        original_wan21_vae_config({"encoder.conv1.weight": np.zeros((4, 3, 3, 3, 3))})
