"""`benchmarks/random_folders.py`: the tiny random folders load through the pipelines users run (every
component, through the real loaders, which check every tensor's name and shape), the tensors land where the
loaders put them, and the files keep the release's dtypes. Generating from them compiles for half a minute:
`python benchmarks/random_folders.py matrix-game-tiny DIR --check` (and `unifolm-tiny`) does that."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import random_folders
from safetensors import safe_open

from wan_tpu.errors import WanInputError


def _stored(path, name):
    """One tensor of a safetensors file as float32 numpy, and its dtype as stored (torch's name)."""
    with safe_open(path, "pt") as f:
        value = f.get_tensor(name)
    return value.float().numpy(), str(value.dtype)


def test_matrix_game_tiny_folder_loads(tmp_path):
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline

    folder = tmp_path / "mg"
    random_folders.write("matrix-game-tiny", str(folder), log=lambda _: None)
    index = json.loads((folder / "matrix_game.json").read_text())
    pipe = MatrixGamePipeline.from_pretrained(str(folder), dtype=jnp.float32, vae_dtype=jnp.float32, compile_cache=False)
    # the authors' `head.head` is our `proj_out`, stored (out, in) in bfloat16 as released
    stored, dtype = _stored(str(folder / index["variants"]["matrix-game-tiny"]), "model.head.head.weight")
    assert dtype == "torch.bfloat16" and stored.std() > 0
    np.testing.assert_array_equal(np.asarray(pipe.transformer.proj_out.kernel[...]), stored.T)
    assert _stored(str(folder / "image_encoder" / "model.safetensors"), "vision_model.pre_layrnorm.bias")[1] == "torch.float16"
    assert pipe.vae is not None and pipe.image_encoder is not None  # both loaded: every tensor checked
    with pytest.raises(WanInputError, match="already exists; pass --overwrite"):
        random_folders.write("matrix-game-tiny", str(folder), log=lambda _: None)
    assert not os.path.exists(f"{folder}.partial")


def test_unifolm_tiny_folder_loads(tmp_path):
    from wan_tpu.layers.conv import torch_to_kernel
    from wan_tpu.unifolm.pipeline import UnifolmPipeline

    folder = tmp_path / "uf"
    random_folders.write("unifolm-tiny", str(folder), log=lambda _: None)
    pipe = UnifolmPipeline.from_pretrained(str(folder), compile_cache=False)
    for name in ("vae", "image_encoder", "text_encoder"):  # every tensor checked by its loader
        assert pipe.component(name) is not None
    conv = pipe.model.diffusion_model.out_conv
    stored, dtype = _stored(str(folder / "unet.safetensors"), "out.2.weight")  # (out, in, kh, kw) as the authors'
    assert dtype == "torch.float32" and stored.std() > 0
    np.testing.assert_array_equal(np.asarray(conv.kernel[...]), torch_to_kernel(stored, conv.out_first))


@pytest.mark.slow  # compiles the tiny stage programs (about 15 s on 2 cores)
def test_unifolm_folder_compiles_its_stages_before_the_encoders_load(tmp_path, backend_compiles, monkeypatch):
    """A converted folder's `prepare` compiles the stage programs for the CLIP towers built from their
    configs: with the towers' loads held back, the stage programs still compile; the towers then load with the
    abstract ones' structure, and `decide` runs the programs compiled ahead (none compiled on its thread). The
    UNet's host conversions all wait for the stage programs' trace to end."""
    import threading

    from flax import nnx

    from wan_tpu.loading.params import StoredParam
    from wan_tpu.unifolm.pipeline import UnifolmPipeline

    folder = tmp_path / "uf"
    random_folders.write("unifolm-tiny", str(folder), log=lambda _: None)
    pipe = UnifolmPipeline.from_pretrained(str(folder), compile_cache=False)
    gate = threading.Event()
    for name in ("image_encoder", "text_encoder"):
        load = pipe._loaders[name]
        pipe._loaders[name] = lambda load=load: (gate.wait(60), load())[1]
    traced, unet_conversions = [], []
    compile_stages, read_host = pipe._compile_stages, StoredParam.read_host
    pipe._compile_stages = lambda *a: (traced.append(a[-1]), compile_stages(*a))[1]
    monkeypatch.setattr(StoredParam, "read_host", lambda self: (
        unet_conversions.append(traced[0].is_set()) if any(f.endswith("unet.safetensors") for f in self.tensors.files)
        else None, read_host(self))[1])
    with pipe.prepare("decision", num_steps=2) as warmup:
        warmup.compiles["stages"].result(timeout=300)
        assert not gate.is_set() and not warmup.loads["image_encoder"].done()
        gate.set()
    assert len(traced) == 1 and unet_conversions and all(unet_conversions)
    for name in ("image_encoder", "text_encoder"):
        assert nnx.graphdef(pipe._abstracts[name]().model) == nnx.graphdef(pipe.component(name).model)
    start = len(backend_compiles)
    images = np.zeros((2, pipe.height, pipe.width, 3), np.uint8)
    out = pipe.decide("pick up the cup", images, np.zeros((2, 16), np.float32), num_steps=2)
    assert out.actions.shape == (16, 16)
    stages = {"jit(_prepare_program)", "jit(_sample_loop)", "jit(_decode_program)"}
    assert not stages & {f for f, thread in backend_compiles[start:] if thread == "MainThread"}
