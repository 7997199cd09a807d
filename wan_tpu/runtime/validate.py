"""Checks that run before any work: everything a run will read or write, in milliseconds.

    from wan_tpu.runtime.validate import check_checkpoint, check_image, check_writable
    weights = check_checkpoint("/ckpt/Wan2.1-T2V-1.3B-Diffusers", model_parts(variant))   # name → elements

A broken input must fail before minutes of loading, text encoding and denoising, with one line
that names the file and the fix (`WanInputError`), never a traceback from deep inside a loader.
`WanPipeline.from_pretrained` checks the checkpoint, the pipeline call and the CLIs check their
inputs and outputs, and `wan_tpu.runtime.memory` checks that the run fits, all before the first component
is loaded. Only headers and small JSON files are read: a 14B checkpoint is checked in well under a
second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile

import numpy as np

from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import check_component

# Files a tokenizer/ folder needs: its config and one vocabulary (fast tokenizer JSON or sentencepiece).
_TOKENIZER_VOCABS = ("tokenizer.json", "spiece.model")


def _json(path: str, fix: str) -> dict:
    if not os.path.isfile(path):
        raise WanInputError(f"{path} is missing; {fix}")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WanInputError(f"{path} is not valid JSON ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(value, dict):
        raise WanInputError(f"{path} is not a JSON object; {fix}")
    return value


def check_checkpoint(path: str, parts: dict[str, str]) -> dict[str, int]:
    """Check every part of a diffusers-format checkpoint that the run will read; returns component
    name → number of weight elements (for the memory estimate).

    `parts`: component name → sub-folder (`wan_tpu.wan.settings.model_parts`). Model folders: config.json
    parses; the safetensors index names no missing shard; every file's header parses and its size
    covers every tensor's extent. `tokenizer`: its config and vocabulary parse. `image_processor`:
    its preprocessor config parses.
    """
    fix = "re-download the checkpoint"
    if os.path.exists(os.path.join(path, "model_index.json")):
        _json(os.path.join(path, "model_index.json"), fix)
    elements = {}
    for name, sub in parts.items():
        folder = os.path.join(path, sub)
        if not os.path.isdir(folder):
            raise WanInputError(f"checkpoint {path} has no {sub}/ folder; {fix} (all of model_index.json's parts)")
        if name == "tokenizer":
            check_tokenizer(folder)
        elif name == "image_processor":
            _json(os.path.join(folder, "preprocessor_config.json"), fix)
        else:
            _json(os.path.join(folder, "config.json"), fix)
            entries = check_component(folder, name)
            elements[name] = sum(int(np.prod(shape, dtype=np.int64)) for shape, _ in entries.values())
    return elements


def check_tokenizer(folder: str) -> None:
    fix = "re-download the checkpoint's tokenizer/ folder"
    _json(os.path.join(folder, "tokenizer_config.json"), fix)
    vocabs = [n for n in _TOKENIZER_VOCABS if os.path.isfile(os.path.join(folder, n))]
    if not vocabs:
        raise WanInputError(f"tokenizer folder {folder} has neither {' nor '.join(_TOKENIZER_VOCABS)}; {fix}")
    if vocabs[0] == "tokenizer.json":
        _json(os.path.join(folder, "tokenizer.json"), fix)
    elif os.path.getsize(os.path.join(folder, vocabs[0])) == 0:
        raise WanInputError(f"{os.path.join(folder, vocabs[0])} is empty; {fix}")


def check_image(image) -> None:
    """An image path must exist and decode (a PIL image or an array is checked by its use)."""
    if image is None or not isinstance(image, (str, os.PathLike)):
        return
    from wan_tpu.runtime.images import load_image

    load_image(image)


def check_readable(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise WanInputError(f"{what} {path} does not exist; fix the path")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise WanInputError(f"{what} {path} cannot be read ({e.strerror}); fix its permissions") from None


def check_writable(path: str) -> None:
    """The folder of output `path` accepts a new file (probed with a temporary file, removed at once:
    permission bits alone say nothing for root or on read-only mounts)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise WanInputError(f"cannot write in folder {folder} ({e.strerror}); choose another output path") from None


def check_output(path: str, overwrite: bool, suffix: str) -> None:
    """Fail before any work when an output (mp4, stage file, vectors) cannot be written: wrong suffix, an
    existing file without `overwrite`, a folder that is missing or is a file, a folder that refuses new
    files, or (mp4) no video encoder. Nothing the user made is replaced silently."""
    if not path.lower().endswith(suffix):
        raise WanInputError(f"output {path!r} must end in {suffix}; pass e.g. --output out{suffix}")
    if os.path.isdir(path):
        raise WanInputError(f"output {path} is a folder; pass a file name, e.g. --output {os.path.join(path, 'out' + suffix)}")
    if os.path.lexists(path) and not overwrite:
        raise WanInputError(f"output {path} already exists; pass --overwrite or choose another --output")
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise WanInputError(f"{probe} is a file, so output {path} cannot be written under it; choose another --output")
    if not os.path.isdir(parent):
        raise WanInputError(f"folder {parent} of output {path} does not exist; create it or choose another --output")
    check_writable(path)
    # Checked here, not when the frames are ready: without it the encoder fails after the whole run.
    if suffix == ".mp4" and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise WanInputError("writing mp4 needs the imageio-ffmpeg package (a wan_tpu dependency; it brings its own "
                            "ffmpeg): pip install imageio-ffmpeg")
