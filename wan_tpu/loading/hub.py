"""Where a model comes from: a folder, a Hugging Face model id, or an original-format Wan folder.

    python -m wan_tpu.generate --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "..."        # from the HF cache
    python -m wan_tpu.generate --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --download --prompt "..."   # fetch if absent

A model id (`org/name`) resolves through the local Hugging Face cache exactly as diffusers'
`from_pretrained` does (`huggingface_hub.snapshot_download`, the snapshot `refs/main` points at),
honouring `HF_HUB_CACHE` and `HF_HOME` as they are when the call is made. Nothing is fetched unless
`download=True` (`--download`); a model that is not in the cache gets one line naming the download
command.

The official Wan repositories (`Wan-AI/Wan2.1-T2V-1.3B`, ...) ship another layout
(`diffusion_pytorch_model*.safetensors` and `config.json` at the top level, `Wan2.1_VAE.pth`,
`models_t5_*.pth`, `google/umt5-xxl/`), which `wan_tpu.loading.formats` reads as it is; when one is
incomplete or damaged, `original_format_hint` says so and names the `-Diffusers` repository of the
same model as the other way to get it.
"""

from __future__ import annotations

import glob
import json
import os
import re

from wan_tpu.errors import WanInputError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_repo_id(name: str) -> bool:
    """`org/name` as the Hub spells model ids (a relative path of two parts looks the same)."""
    return bool(_REPO_ID.fullmatch(name))


def hub_cache_dir() -> str:
    """The HF hub cache, from the environment as it is now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def download_command(repo_id: str) -> str:
    """The shell command that downloads `repo_id` with the installed huggingface_hub's CLI."""
    import huggingface_hub

    major = int(huggingface_hub.__version__.split(".")[0])
    return f"{'hf' if major >= 1 else 'huggingface-cli'} download {repo_id}"


def resolve_model(name: str, download: bool = False) -> str:
    """The local folder of `name`: itself if it is a folder, else the cached snapshot of model id `name`.

    Anything else (a preset name, a missing path that is no model id) is returned unchanged for the
    caller to report. `download=True` fetches a model id that is not cached (progress on stderr).
    """
    if os.path.isdir(name) or not is_repo_id(name):
        return name
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return snapshot_download(name, cache_dir=cache, local_files_only=not download)
    except Exception as e:  # noqa: BLE001 — every failure here means "not available"; the type is named
        if download:
            raise WanInputError(
                f"could not download {name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"check the model id, your network and HF_TOKEN, or run `{download_command(name)}` yourself"
            ) from None
        raise WanInputError(
            f"model {name!r} is not a folder and not in the Hugging Face cache ({cache}); download it with "
            f"`{download_command(name)}` (or pass --download), or fix the path"
        ) from None


# ---- original-format Wan folders ----------------------------------------------------------------

_ORIGINAL_MARKERS = ("diffusion_pytorch_model*.safetensors", "diffusion_pytorch_model*.pth", "Wan2.*_VAE.pth",
                     "models_t5_*.pth", "google/umt5-xxl", "high_noise_model")


def original_format_hint(path: str, problem: str | None = None) -> str | None:
    """One line naming the `-Diffusers` repository to download when `path` holds an original-format
    Wan checkpoint (the official repositories' layout) that cannot be read as it is (`problem`: why;
    `wan_tpu.loading.formats` reads complete ones); None for any other folder."""
    if os.path.isdir(os.path.join(path, "transformer")):
        return None
    found = sorted({os.path.basename(m) for pattern in _ORIGINAL_MARKERS for m in glob.glob(os.path.join(path, pattern))})
    if not found:
        return None
    repos = _diffusers_repos(path)
    if repos:
        fix = f"download {' or '.join(repos)} instead (`{download_command(repos[0])}`, or --model {repos[0]} --download)"
    else:
        fix = "download the matching Wan-AI/...-Diffusers repository instead (see wan_tpu/configs/models.py)"
    if problem is None:
        problem = "it is incomplete (the DiT weights, Wan2.*_VAE.pth, models_t5_*.pth and google/umt5-xxl/ are all needed)"
    return f"{path} is an original-format Wan checkpoint ({', '.join(found[:3])}) that cannot be read: {problem}; fix that, or {fix}"


def _diffusers_repos(path: str) -> list[str]:
    """The `-Diffusers` repositories whose DiT matches the original `config.json` (`WanModel`: dim,
    num_layers, ffn_dim, in_dim, model_type); several when only the resolution tells them apart."""
    from wan_tpu.configs.models import VARIANTS

    two_experts = os.path.isdir(os.path.join(path, "high_noise_model"))
    config_path = os.path.join(path, "high_noise_model" if two_experts else "", "config.json")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
        key = (int(cfg["dim"]), int(cfg["num_layers"]), int(cfg["ffn_dim"]), int(cfg["in_dim"]), str(cfg["model_type"]))
    except (OSError, ValueError, KeyError, TypeError):
        return []
    repos = [v.repo for v in VARIANTS.values() if v.repo and (v.transformer_2 is not None) == two_experts and key == (
        v.transformer.inner_dim, v.transformer.num_layers, v.transformer.ffn_dim, v.transformer.in_channels, v.task)]
    # I2V 480P and 720P share one architecture; the folder name usually says which.
    named = [r for r in repos if r.split("-")[-2].lower() in os.path.basename(os.path.abspath(path)).lower()]
    return named if len(named) == 1 else repos
