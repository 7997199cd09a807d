"""Model ids through the local Hugging Face cache (`wan_tpu.loading.hub`): a cache laid out as huggingface_hub
writes it (`models--org--name/snapshots/<rev>/`, `refs/main`) under `HF_HUB_CACHE` (or `HF_HOME/hub`)
resolves offline; a model that is not cached exits 2 naming the download command; `--download` is
the only way anything is fetched."""

import shutil

import pytest

from wan_tpu.errors import WanInputError
from wan_tpu.loading import hub
from wan_tpu.wan.cli import main
from wan_tpu.wan.pipeline import WanPipeline

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.wan.presets import save_diffusers_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_diffusers_checkpoint(str(path), VARIANTS["tiny"].transformer, TINY_VAE)
    return path


def _cache(root, checkpoint, repo="Wan-AI/Tiny-Wan-Diffusers"):
    folder = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(checkpoint, folder / "snapshots" / REV)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(REV)
    return folder / "snapshots" / REV


def test_model_id_resolves_from_hf_hub_cache(checkpoint, tmp_path, monkeypatch, capsys):
    snapshot = _cache(tmp_path / "hub", checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = WanPipeline.from_pretrained("Wan-AI/Tiny-Wan-Diffusers")
    assert pipe.name == str(snapshot) and pipe.weight_elements["transformer"] > 0
    out = tmp_path / "v.mp4"
    assert main(["--model", "Wan-AI/Tiny-Wan-Diffusers", "--prompt", "a cat", "--size", "32*32", "--frames", "5",
                 "--steps", "1", "--quiet", "--output", str(out)]) == 0
    assert out.exists()


def test_hf_home_is_honoured(checkpoint, tmp_path, monkeypatch):
    snapshot = _cache(tmp_path / "home" / "hub", checkpoint)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.resolve_model("Wan-AI/Tiny-Wan-Diffusers") == str(snapshot)


def test_missing_model_id_names_the_download_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    capsys.readouterr()
    assert main(["--model", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--prompt", "a cat", "--output",
                 str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"`{hub.download_command('Wan-AI/Wan2.1-T2V-1.3B-Diffusers')}`" in err and "--download" in err
    assert not (tmp_path / "v.mp4").exists()


def test_download_only_when_asked(checkpoint, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, cache_dir=None, local_files_only=False, **kwargs):
        calls.append((repo_id, local_files_only))
        if local_files_only:
            raise FileNotFoundError("not cached")
        return str(checkpoint)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(WanInputError, match="not in the Hugging Face cache"):
        hub.resolve_model("Wan-AI/Other-Diffusers")
    assert hub.resolve_model("Wan-AI/Other-Diffusers", download=True) == str(checkpoint)
    assert calls == [("Wan-AI/Other-Diffusers", True), ("Wan-AI/Other-Diffusers", False)]
    assert hub.resolve_model(str(checkpoint)) == str(checkpoint) and hub.resolve_model("tiny") == "tiny"
