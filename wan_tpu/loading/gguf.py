"""GGUF DiTs (city96's ComfyUI-GGUF conversions of Wan: `general.architecture` = "wan", original Wan
tensor names) read through the `gguf` package's own memory-mapped reader.

    source = GGUFSource("wan2.1-t2v-14b-Q8_0.gguf")    # name → array, the original Wan names
    source["blocks.0.ffn.0.weight"]                     # float32, dequantised by gguf.quants.dequantize

GGUF stores shapes innermost-first (ggml's `ne`); a tensor's torch shape is the reverse, or the
`comfy.gguf.orig_shape.NAME` array where the converter reshaped it. F32 / F16 / BF16 tensors are
views of the memory map; quantised ones are dequantised per tensor on read with
`gguf.quants.dequantize` (the package's numpy dequantiser), so the host holds one tensor at a time.
Q8_0 weights can also be read as their int8 values and per-block scales (`q8_0`), which
`wan_tpu.wan.transformer_loading` maps onto the int8 path without a bf16 copy.

Needs the optional `gguf` package (`pip install 'wan_tpu[gguf]'`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

from wan_tpu.errors import WanInputError

# The types read here: unquantised, the legacy block formats and the k-quants that
# `gguf.quants.dequantize` implements in numpy.
PLAIN = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED = (*PLAIN, *QUANTIZED)
Q8_0_BLOCK = 32  # values per Q8_0 block: a float16 scale, then 32 int8 values


def _gguf():
    try:
        import gguf
    except ImportError:
        raise WanInputError("reading .gguf files needs the gguf package: pip install 'wan_tpu[gguf]'") from None
    return gguf


def is_gguf(path: str) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


class GGUFSource(Mapping):
    """Name → array over one GGUF file (the `TensorSource` interface: `shape`, `dtype`, `read_into`, `files`).

    Opening reads the header only; every tensor is checked to lie inside the file and to be of a
    type read here, so a truncated download or an unsupported quantisation fails now, in one line."""

    def __init__(self, path: str):
        gguf = _gguf()
        self.path = path
        size = os.path.getsize(path)
        try:
            self._reader = reader = gguf.GGUFReader(path)
        except Exception as e:  # noqa: BLE001 — the reader raises ValueError, IndexError, struct errors, ...
            raise WanInputError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from None
        field = reader.get_field("general.architecture")
        self.architecture = None if field is None else str(field.contents())
        self._tensors, self._shapes = {}, {}
        for t in reader.tensors:
            kind = t.tensor_type.name
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise WanInputError(f"{path}: tensor {t.name!r} lies past the end of the file (truncated download?); re-download it")
            if kind not in SUPPORTED:
                raise WanInputError(f"{path}: tensor {t.name!r} is stored as {kind}, which wan_tpu does not read; use a "
                                    f"GGUF of type {', '.join(SUPPORTED)}")
            orig = reader.get_field(f"comfy.gguf.orig_shape.{t.name}")
            shape = tuple(int(v) for v in orig.contents()) if orig is not None else tuple(int(v) for v in reversed(t.shape))
            self._tensors[t.name], self._shapes[t.name] = t, shape

    def type_name(self, name: str) -> str:
        """The tensor's GGML type (`Q8_0`, `F16`, ...)."""
        return self._tensors[name].tensor_type.name

    def __getitem__(self, name: str) -> np.ndarray:
        t, shape = self._tensors[name], self._shapes[name]
        kind = t.tensor_type.name
        if kind in PLAIN:
            return t.data.view(PLAIN[kind]).reshape(shape)
        return _gguf().quants.dequantize(t.data, t.tensor_type).reshape(shape)

    def read_into(self, name: str, out: np.ndarray) -> None:
        out[...] = self[name]

    def q8_0(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A Q8_0 tensor of torch shape (out, in) as (int8 values (out, in), float16 scales (out, in / 32))."""
        t, shape = self._tensors[name], self._shapes[name]
        if t.tensor_type.name != "Q8_0" or len(shape) != 2:
            raise ValueError(f"{name} is a {t.tensor_type.name} tensor of shape {shape}, not a 2-D Q8_0 one")
        blocks = np.asarray(t.data).reshape(shape[0], -1, 2 + Q8_0_BLOCK)
        return blocks[..., 2:].view(np.int8).reshape(shape), np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]

    @property
    def files(self) -> list[str]:
        return [self.path]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> np.dtype:
        kind = self._tensors[name].tensor_type.name
        return np.dtype(PLAIN.get(kind, np.float32))

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
