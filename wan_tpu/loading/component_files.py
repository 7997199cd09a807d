"""Single-file component checkpoints (official `.pth`, ComfyUI `.safetensors`), read lazily.

    tensors = open_weights_file("models_t5_umt5-xxl-enc-bf16.pth", "text encoder")   # memory-mapped
    tensors = weights_in_dtype(tensors, jnp.bfloat16)     # ComfyUI fp8 / fp8_scaled weights, made on read

The component loaders (`wan_tpu.vae.loading`, `wan_tpu.encoders.umt5_loading`,
`wan_tpu.encoders.clip_loading`) take such a file in place of a diffusers folder: they tell the layout
from the tensor names (the header alone; which component a file holds is `wan_tpu.loading.formats`'
`names_slot`), infer the config from the shapes and read the tensors under diffusers' names through a
`MappedSource`, so nothing is converted or copied ahead of the placement.

ComfyUI's fp8 files store the large linear weights as float8_e4m3fn; "fp8_scaled" ones add a float32
`<layer>.scale_weight` per weight and a `scaled_fp8` marker (`wan_tpu.loading.formats.scaled_fp8_weights`).
A scaled weight is restored as ComfyUI computes it, float32(weight) × scale in float32, and rounded once to
the component's dtype here on the host, one tensor at a time, so that no float32 copy of a layer stack
reaches the device; unscaled fp8 weights are cast as stored (exactly: every fp8 value is a bfloat16).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping

import numpy as np

from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import MappedSource, TensorSource
from wan_tpu.loading.formats import MARKERS, SCALE_SUFFIXES, SLOTS, UNUSED_SUFFIXES, names_slot, scaled_fp8_weights
from wan_tpu.loading.gguf import is_gguf
from wan_tpu.loading.torch_pickle import open_pth


def is_weights_file(path) -> bool:
    """Whether `path` names one file (a single-file checkpoint) rather than a component folder."""
    return os.path.isfile(os.fspath(path))


def open_weights_file(path, what: str = "model") -> Mapping:
    """A single weights file's tensors, memory-mapped: a PyTorch zip pickle (`.pth`/`.pt`/`.bin`/`.ckpt`,
    weights only) or a safetensors file, told apart by their bytes as well as the extension."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WanInputError(f"{what} file {path!r} does not exist; pass the {what}'s folder or weights file")
    if zipfile.is_zipfile(path) or path.endswith((".pth", ".pt", ".bin", ".ckpt")):
        return open_pth(path)
    if is_gguf(path):
        raise WanInputError(f"{path} is a GGUF file, which wan_tpu reads for the DiT only; pass the {what} as "
                            ".safetensors or .pth")
    return TensorSource([path])


def is_quantization_extra(name: str) -> bool:
    """A ComfyUI marker, weight scale or activation scale rather than a weight."""
    return name.rpartition(".")[2] in MARKERS or name.endswith(SCALE_SUFFIXES + UNUSED_SUFFIXES)


def weights_in_dtype(tensors, dtype) -> Mapping:
    """`tensors` without ComfyUI's markers and scales, each scaled fp8 weight made on read in `dtype`
    (see the module docstring). A file with neither comes back as it is."""
    if not any(is_quantization_extra(n) for n in tensors):
        return tensors
    # Scales stay in the map for `scaled_fp8_weights`, which takes them out as it pairs them with their weights.
    stored = {n: n for n in tensors if n.rpartition(".")[2] not in MARKERS and not n.endswith(UNUSED_SUFFIXES)}
    made, _ = scaled_fp8_weights(tensors, stored, "single file")
    dtype = np.dtype(dtype)
    made = {n: (shape, dtype, lambda read=read: read().astype(dtype)) for n, (shape, _, read) in made.items()}
    return MappedSource(tensors, stored, made)


def strip_prefix(tensors, marker: str) -> Mapping:
    """`tensors` without whatever prefix stands before `marker` (a name every layout of the component
    has, e.g. `encoder.block.0.layer.0.SelfAttention.q.weight`): ComfyUI saves a component inside larger
    checkpoints under prefixes such as `text_encoders.umt5xxl.transformer.`. Names without the prefix
    (the checkpoint's other parts) are left out."""
    found = next((n for n in tensors if n.endswith(marker) and (n == marker or n[-len(marker) - 1] == ".")), None)
    prefix = "" if found is None else found[: -len(marker)]
    if not prefix:
        return tensors
    return MappedSource(tensors, {n[len(prefix):]: n for n in tensors if n.startswith(prefix)})


def wrong_component(path, slot: str, tensors) -> WanInputError:
    """The one-line error for a file that is not a `slot` checkpoint (`wan_tpu.loading.formats.SLOTS`):
    it names what the file holds instead."""
    found = names_slot(list(tensors))
    held = SLOTS.get(found, "no Wan component wan_tpu knows") if found != slot else f"{SLOTS[slot]} in a layout wan_tpu does not read"
    return WanInputError(f"{os.fspath(path)} holds {held}, not {SLOTS[slot]} it can load; pass {SLOTS[slot]} "
                         "folder (diffusers) or file (official .pth, ComfyUI .safetensors)")
