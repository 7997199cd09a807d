"""PyTorch `.pth` / `.pt` / `.bin` state dicts (the official Wan files), read lazily and memory-mapped.

    tensors = open_pth("Wan2.1_VAE.pth")     # name → numpy array, converted per tensor on access
    tensors["encoder.conv1.weight"]          # a view of the file's bytes: no copy in host memory

`torch.load(path, mmap=True, weights_only=True)` unpickles only the structure (names, shapes, storage
offsets); the tensors stay in the file's memory map, and each access converts one tensor to numpy
without copying (bfloat16 and float8 through `ml_dtypes`, bit for bit). Weights-only unpickling runs no
code from the file: a pickle that needs anything beyond tensors and plain containers is refused in one
line, as is a file that is not a PyTorch zip checkpoint (the legacy pre-1.6 format cannot be mapped).

The result has `TensorSource`'s interface (`shape`, `dtype`, `read_into`, `files`), so the loaders'
one placement path (`wan_tpu.loading.params`) reads it like a safetensors file.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Iterator, Mapping

import numpy as np

from wan_tpu.errors import WanInputError

# Wrappers training code puts around a state dict; unwrapped when they are the only thing holding tensors.
_WRAPPERS = ("state_dict", "model", "module", "model_state_dict", "ema")


def _numpy_dtype(torch_dtype):
    import ml_dtypes
    import torch

    table = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
             torch.float8_e5m2: ml_dtypes.float8_e5m2, torch.int64: np.int64, torch.int32: np.int32,
             torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}
    return np.dtype(table[torch_dtype]) if torch_dtype in table else None


def _to_numpy(tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes (no copy), reinterpreted where numpy lacks the dtype."""
    import torch

    dtype = _numpy_dtype(tensor.dtype)
    if dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):  # numpy has no such dtype: move the bits
        same_width = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
        return tensor.detach().view(same_width).numpy().view(dtype)
    return tensor.detach().numpy()


def _flatten(obj, prefix: str, out: dict) -> None:
    import torch

    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, Mapping):
            _flatten(value, name + ".", out)


def _state_dict(obj) -> dict:
    import torch

    while isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        wrapped = [k for k in _WRAPPERS if isinstance(obj.get(k), Mapping)]
        if len(wrapped) != 1:
            break
        obj = obj[wrapped[0]]
    out: dict = {}
    if isinstance(obj, Mapping):
        _flatten(obj, "", out)
    return out


def _load(path: str):
    import pickle

    import torch

    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            legacy = f.read(2) in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
        if legacy:
            raise WanInputError(f"{path}: a PyTorch checkpoint in the legacy (pre-1.6) format, which cannot be "
                                "memory-mapped; re-save it with torch.save(torch.load(path), path) or as .safetensors")
        raise WanInputError(f"{path}: not a PyTorch checkpoint (.pth) nor a safetensors file; check the path")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        needs = f" (it needs {found.group(1)})" if found else ""
        raise WanInputError(f"{path}: the pickle holds more than tensors{needs}, and only weights-only pickles are "
                            "loaded; save just its state dict (torch.save(model.state_dict(), path)) or convert it "
                            "to .safetensors") from None
    except (RuntimeError, OSError, EOFError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WanInputError(f"{path}: unreadable PyTorch checkpoint ({first}); re-download it") from None


class PthTensors(Mapping):
    """Name → numpy view of one tensor of a memory-mapped PyTorch state dict (see the module docstring)."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        tensors = _state_dict(_load(self.path))
        odd = next((n for n, t in tensors.items() if _numpy_dtype(t.dtype) is None or t.device.type != "cpu"), None)
        if odd is not None:
            raise WanInputError(f"{self.path}: tensor {odd!r} has dtype {tensors[odd].dtype}, which is not a weight "
                                "dtype the loaders read; convert the checkpoint to float32, float16 or bfloat16")
        if not tensors:
            raise WanInputError(f"{self.path}: holds no tensors (not a state dict); pass the model's weights file")
        self._tensors = tensors  # keeps the file's memory map alive

    def __getitem__(self, name: str) -> np.ndarray:
        return _to_numpy(self._tensors[name])

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Copy tensor `name` into `out` (its element count and itemsize), as `TensorSource.read_into`."""
        value = self[name]
        if out.size != value.size or out.dtype.itemsize != value.dtype.itemsize:
            raise ValueError(f"read_into({name!r}): a {out.dtype} buffer of {out.size} elements does not fit the "
                             f"{value.dtype} tensor of {value.size}")
        np.copyto(out, value.reshape(out.shape).view(out.dtype), casting="no")

    @property
    def files(self) -> list[str]:
        return [self.path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> np.dtype:
        return _numpy_dtype(self._tensors[name].dtype)

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def open_pth(path) -> PthTensors:
    """The tensors of a PyTorch state-dict file, memory-mapped (see the module docstring). A missing
    file, a non-weights pickle or a file that is no PyTorch checkpoint is a one-line `WanInputError`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WanInputError(f"checkpoint file {path!r} does not exist; check the path")
    return PthTensors(path)
