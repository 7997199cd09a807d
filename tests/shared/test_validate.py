"""Checks before work (`wan_tpu.runtime.validate`, `wan_tpu.loading.checkpoint.check_component`): a tiny diffusers-format
checkpoint with one part truncated, corrupt or missing fails `generate` with exit 2 and one line
naming the file, within seconds and before any component is loaded (the loaders are replaced by
ones that fail the test if called), leaving no file. The same checkpoints raise `WanInputError`
from `WanPipeline.from_pretrained`."""

import json
import os
import shutil
import time

import pytest
import safetensors.numpy

from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import check_component
from wan_tpu.wan import pipeline as pipeline_module
from wan_tpu.wan.cli import main
from wan_tpu.wan.pipeline import WanPipeline


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.wan.presets import save_diffusers_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_diffusers_checkpoint(str(path), VARIANTS["tiny"].transformer, TINY_VAE)
    return path


def _truncate(path, nbytes=64):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - nbytes)


def _shard(folder, name="diffusion_pytorch_model"):
    """Re-save a component's weights as two shards with a `*.safetensors.index.json`, as large checkpoints ship."""
    single = folder / f"{name}.safetensors"
    tensors = safetensors.numpy.load_file(str(single))
    names = sorted(tensors)
    halves = {f"{name}-00001-of-00002.safetensors": names[: len(names) // 2],
              f"{name}-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in halves.items():
        safetensors.numpy.save_file({k: tensors[k] for k in keys}, str(folder / shard))
        weight_map.update({k: shard for k in keys})
    (folder / f"{name}.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single.unlink()
    return halves


def _break_index_shard(ckpt):
    shards = _shard(ckpt / "transformer")
    (ckpt / "transformer" / next(iter(shards))).unlink()


def _break_index_entry(ckpt):
    shards = _shard(ckpt / "transformer")
    index = ckpt / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    first, second = list(shards)
    data["weight_map"][shards[first][0]] = second  # the index points a tensor at the wrong shard
    index.write_text(json.dumps(data))


CASES = {
    "text encoder truncated": (lambda c: _truncate(c / "text_encoder" / "model.safetensors"),
                               "model.safetensors: tensor"),
    "transformer truncated": (lambda c: _truncate(c / "transformer" / "diffusion_pytorch_model.safetensors"),
                              "truncated download?"),
    "vae truncated": (lambda c: _truncate(c / "vae" / "diffusion_pytorch_model.safetensors", 1), "re-download it"),
    "vae header corrupt": (lambda c: (c / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"\xff" * 16),
                           "corrupt safetensors header"),
    "tokenizer truncated": (lambda c: _truncate(c / "tokenizer" / "tokenizer.json", 100), "tokenizer.json is not valid JSON"),
    "tokenizer vocabulary missing": (lambda c: (c / "tokenizer" / "tokenizer.json").unlink(), "has neither tokenizer.json"),
    "tokenizer config missing": (lambda c: (c / "tokenizer" / "tokenizer_config.json").unlink(), "tokenizer_config.json is missing"),
    "text encoder config truncated": (lambda c: _truncate(c / "text_encoder" / "config.json", 10), "config.json is not valid JSON"),
    "text encoder weights missing": (lambda c: (c / "text_encoder" / "model.safetensors").unlink(), "no *.safetensors weights"),
    "index shard missing": (_break_index_shard, "named by diffusion_pytorch_model.safetensors.index.json is missing"),
    "index names the wrong shard": (_break_index_entry, "is not in shard"),
    "model_index.json corrupt": (lambda c: _truncate(c / "model_index.json", 20), "model_index.json is not valid JSON"),
}


@pytest.fixture
def no_loading(monkeypatch):
    """Loaders that fail the test: validation must reject the checkpoint before any of them runs."""

    def loaders(*args, **kwargs):
        def fail():
            raise AssertionError("a component was loaded before the checkpoint was validated")

        return {name: fail for name in ("transformer", "vae", "text_encoder")}

    monkeypatch.setattr(pipeline_module, "_folder_loaders", loaders)


@pytest.mark.parametrize("case", list(CASES))
def test_broken_checkpoint_fails_fast_with_one_line(case, checkpoint, tmp_path, capsys, no_loading):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    damage, match = CASES[case]
    damage(ckpt)
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    start = time.perf_counter()
    code = main(["--model", str(ckpt), "--prompt", "a cat", "--steps", "2", "--quiet", "--output", str(out / "v.mp4")])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    assert elapsed < 5, elapsed
    assert os.listdir(out) == []
    with pytest.raises(WanInputError) as e:
        WanPipeline.from_pretrained(str(ckpt))
    assert f"error: {e.value}" == lines[0]


def test_check_component_reports_shapes_of_a_sharded_folder(checkpoint, tmp_path):
    folder = tmp_path / "transformer"
    shutil.copytree(checkpoint / "transformer", folder)
    whole = check_component(str(folder))
    _shard(folder)
    assert check_component(str(folder)) == whole
    assert all(isinstance(shape, tuple) for shape, _ in whole.values())


def test_original_format_folder_names_the_diffusers_repo(tmp_path, capsys):
    """An official-layout Wan folder (config.json + diffusion_pytorch_model.safetensors + .pth files at
    the top) is recognised and the -Diffusers repository of the same model is named."""
    folder = tmp_path / "Wan2.1-T2V-1.3B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "dim": 1536, "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "in_dim": 16,
        "model_type": "t2v", "num_heads": 12, "num_layers": 30, "out_dim": 16, "text_len": 512}))
    for name in ("diffusion_pytorch_model.safetensors", "Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth"):
        (folder / name).write_bytes(b"")
    capsys.readouterr()
    assert main(["--model", str(folder), "--prompt", "a cat", "--output", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "original-format Wan checkpoint" in err
    assert "download Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in err

    a14b = tmp_path / "Wan2.2-I2V-A14B"
    (a14b / "high_noise_model").mkdir(parents=True)
    (a14b / "high_noise_model" / "config.json").write_text(json.dumps(
        {"dim": 5120, "ffn_dim": 13824, "in_dim": 36, "model_type": "i2v", "num_layers": 40}))
    with pytest.raises(WanInputError, match="Wan-AI/Wan2.2-I2V-A14B-Diffusers"):
        WanPipeline.from_pretrained(str(a14b))


def test_unwritable_output_folder_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", denied)  # a read-only folder (chmod does not stop root)
    capsys.readouterr()
    assert main(["--prompt", "a cat", "--output", str(tmp_path / "v.mp4")]) == 2
    assert "cannot write in folder" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
