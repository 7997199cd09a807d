"""Stage files: bit-exact round trips (checked against the safetensors library as reference
reader), metadata checks and their messages, overwrite protection and atomic writes."""

import dataclasses
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import safe_open

from wan_tpu.errors import WanInputError
from wan_tpu.wan import stages
from wan_tpu.wan.stages import FORMAT, StageMeta, config_hash, load_stage, save_stage

META = StageMeta(
    "prompt", config_hash="0123456789abcdef", prompt="a cat\non the grass, \"quoted\" ünïcode",
    negative_prompt="blurry", seed=7, size=(832, 480), frames=81, steps=50, shift=5, guidance=5.0,
    dtype=jnp.bfloat16,
)


def _bf16_all_bits():
    # Every bf16 bit pattern (NaN payloads, ±0, ±inf, subnormals), as a (256, 256) array.
    return np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256)


def test_round_trip_bit_exact_and_readable_by_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((2, 3, 5)).astype(np.float32)
    f32.flat[:3] = [np.nan, -0.0, np.inf]
    tensors = {
        "prompt_embeds": jnp.asarray(f32),  # a jax.Array is fetched from its device
        "negative_prompt_embeds": _bf16_all_bits(),
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": np.float32(1.5),
    }
    path = str(tmp_path / "stage1.safetensors")
    save_stage(path, tensors, META)
    got, meta = load_stage(path)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        want = np.asarray(t)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert got[name].tobytes() == want.tobytes(), name
    assert meta == META
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # not the 0600 of a mkstemp file
    assert meta.size == "832*480" and meta.shift == 5.0 and meta.dtype == "bfloat16"

    # The safetensors library reads the same bits and metadata (bf16 through torch: numpy has no BF16).
    ref = safetensors.torch.load_file(path)
    assert ref["negative_prompt_embeds"].dtype == torch.bfloat16
    assert ref["negative_prompt_embeds"].view(torch.int16).numpy().tobytes() == _bf16_all_bits().tobytes()
    assert ref["prompt_embeds"].numpy().tobytes() == f32.tobytes()
    with safe_open(path, "np") as f:
        assert f.metadata() == META.to_metadata()
        assert f.metadata()["format"] == FORMAT


def test_reads_bf16_written_by_safetensors(tmp_path):
    path = str(tmp_path / "ref.safetensors")
    bits = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).astype(np.int16)).view(torch.bfloat16)
    safetensors.torch.save_file({"x": bits}, path, metadata=StageMeta("latents").to_metadata())
    got, meta = load_stage(path, expect={"stage": "latents"})
    assert got["x"].dtype == ml_dtypes.bfloat16
    assert got["x"].tobytes() == _bf16_all_bits().tobytes()
    assert meta == StageMeta("latents")


def test_metadata_mismatch_names_each_differing_field(tmp_path):
    path = str(tmp_path / "x.safetensors")
    save_stage(path, {"a": np.zeros(2, np.float32)}, META)
    # Equal values in another spelling match: guidance 5 == 5.0, size as a pair, dtype object.
    load_stage(path, expect={"stage": "prompt", "guidance": 5, "size": (832, 480), "dtype": jnp.bfloat16, "steps": None})
    with pytest.raises(WanInputError) as e:
        load_stage(path, expect={"size": "1280*720", "frames": 81, "shift": 3.0, "config_hash": "ffff"})
    msg = str(e.value)
    assert msg == (
        "stage file x.safetensors was made for size 832*480, shift 5.0, model config 0123456789abcdef but this run "
        "asks for size 1280*720, shift 3.0, model config ffff; re-run the 'prompt' stage with these settings or "
        "pass matching flags"
    )
    with pytest.raises(WanInputError, match=r'prompt "a cat\\non the grass.*" but this run asks for prompt "a dog"'):
        load_stage(path, expect={"prompt": "a dog"})
    with pytest.raises(WanInputError, match=r"guidance_2 \(not recorded\)"):
        load_stage(path, expect={"guidance_2": 3.0})
    with pytest.raises(WanInputError, match="holds the 'prompt' stage, but the 'latents' stage is needed"):
        load_stage(path, expect={"stage": "latents"})
    assert "\n" not in msg


def test_overwrite_refused_without_flag(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_stage(path, {"a": np.ones(3, np.float32)}, {"stage": "latents", "seed": 1})
    with pytest.raises(WanInputError, match="s.safetensors exists; pass --overwrite or choose another path"):
        save_stage(path, {"a": np.zeros(3, np.float32)}, {"stage": "latents", "seed": 2})
    assert load_stage(path)[1].seed == 1
    save_stage(path, {"a": np.zeros(3, np.float32)}, {"stage": "latents", "seed": 2}, overwrite=True)
    got, meta = load_stage(path)
    assert meta.seed == 2 and not got["a"].any()


@pytest.mark.parametrize("failure", ["tensor_cannot_be_fetched", "disk_full"])
def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, failure):
    old = str(tmp_path / "old.safetensors")
    save_stage(old, {"keep": np.full(3, 2.0, np.float32)}, {"stage": "latents", "seed": 3})
    tensors = {"ok": np.ones((64, 64), np.float32)}
    if failure == "tensor_cannot_be_fetched":
        gone = jnp.ones((4, 4), jnp.bfloat16)
        gone.delete()  # fails in np.asarray, after the header and the first tensor are written
        tensors["gone"], error = gone, RuntimeError
    else:
        def no_space(fd):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(stages.os, "fsync", no_space)
        error = OSError
    with pytest.raises(error):
        save_stage(str(tmp_path / "new.safetensors"), tensors, {"stage": "latents"})
    with pytest.raises(error):
        save_stage(old, tensors, {"stage": "latents"}, overwrite=True)
    assert os.listdir(tmp_path) == ["old.safetensors"]  # no new file, no temporary left
    monkeypatch.undo()
    got, meta = load_stage(old)
    assert meta.seed == 3 and list(got) == ["keep"]


def test_bad_files_and_paths(tmp_path):
    with pytest.raises(WanInputError, match="does not exist; run the stage that writes it first"):
        load_stage(str(tmp_path / "missing.safetensors"))
    with pytest.raises(WanInputError, match="is a folder"):
        load_stage(str(tmp_path))

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(WanInputError, match="junk.safetensors is not a readable safetensors file"):
        load_stage(str(junk))

    plain = str(tmp_path / "plain.safetensors")
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, plain)
    with pytest.raises(WanInputError, match="not a wan_tpu stage file"):
        load_stage(plain)

    future = str(tmp_path / "future.safetensors")
    metadata = {"format": "wan_tpu.stage/99", "stage": "latents"}
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, future, metadata=metadata)
    with pytest.raises(WanInputError, match="format 'wan_tpu.stage/99' but this wan_tpu reads 'wan_tpu.stage/1'"):
        load_stage(future)

    with pytest.raises(WanInputError, match="does not exist; create it"):
        save_stage(str(tmp_path / "no" / "dir.safetensors"), {"a": np.ones(1, np.float32)}, {"stage": "latents"})
    with pytest.raises(ValueError, match="StageMeta.size"):
        StageMeta("latents", size="832x480")


def test_unwritable_folder_is_an_input_error(tmp_path, monkeypatch):
    def denied(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(stages.os, "open", denied)  # a read-only folder (chmod does not stop root)
    with pytest.raises(WanInputError, match="cannot write in folder .* choose another path"):
        save_stage(str(tmp_path / "s.safetensors"), {"a": np.ones(1, np.float32)}, {"stage": "latents"})


@dataclasses.dataclass(frozen=True)
class _Config:
    dim: int = 16
    heads: int = 2
    patch_size: tuple = (1, 2, 2)


def test_config_hash_is_stable_and_tells_models_apart():
    h = config_hash(_Config())
    assert h == config_hash(_Config()) == config_hash({"patch_size": [1, 2, 2], "heads": 2, "dim": 16})
    assert len(h) == 16 and int(h, 16) >= 0
    assert config_hash(_Config(dim=32)) != h
