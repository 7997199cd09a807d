"""GGUF DiTs (city96's ComfyUI-GGUF conversions of Wan: `general.architecture` = "wan", original Wan
tensor names) read through the `gguf` package's own memory-mapped reader.

    source = GGUFSource("wan2.1-t2v-14b-Q8_0.gguf")    # name → array, the original Wan names
    source["blocks.0.ffn.0.weight"]                     # float32, dequantised
    values, scales = source.int8_rows("blocks.0.ffn.0.weight")  # int8 (out, in), one float32 scale per row

GGUF stores shapes innermost-first (ggml's `ne`); a tensor's torch shape is the reverse, or the
`comfy.gguf.orig_shape.NAME` array where the converter reshaped it. F32 / F16 / BF16 tensors are
views of the memory map; quantised ones are dequantised per tensor on read with
`gguf.quants.dequantize` (the package's numpy dequantiser), so the host holds one tensor at a time.
Q8_0 weights can also be read as their int8 values and per-block scales (`q8_0`), or rescaled to one
scale per output channel (`int8_rows`), which `wan_tpu.wan.transformer_loading` places on the int8 path
without a bf16 copy.

2-D Q8_0 tensors, the DiT's linears, are dequantised and rescaled here rather than in `gguf.quants`: a few
rows at a time in every core (`ROW_CHUNK_BYTES`), so that a chunk's float32 temporaries stay in the core's
cache and numpy's loops run beside each other without the GIL, in one pass over the values and their
block scales (the rescale needs no float32 copy of the tensor). The 1.3B DiT's Q8_0 → int8 load on a
2-core CPU: 3.3–5.5 s (6.1 s of CPU time), against 7.3–14.2 s (14–15 s) when each tensor was rescaled in
one numpy expression, dequantised twice (values, scales), as the 14B's 69.1 s on an H200's host was.

Needs the optional `gguf` package (`pip install 'wan_tpu[gguf]'`).
"""

from __future__ import annotations

import concurrent.futures
import functools
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
ROW_CHUNK_BYTES = 1 << 17  # int8 values per rescale task: their float32 copy (512 KiB) stays in a core's L2


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
        self._tensors, self._shapes, self._row_scales = {}, {}, {}
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
        if kind == "Q8_0" and len(shape) == 2:
            q, d = self.q8_0(name)
            out = np.empty(shape, np.float32)
            _by_rows(shape, lambda r: _dequantised(q[r], d[r], out[r]))
            return out
        return _gguf().quants.dequantize(t.data, t.tensor_type).reshape(shape)

    def read_into(self, name: str, out: np.ndarray) -> None:
        out[...] = self[name]

    def __contains__(self, name) -> bool:  # Mapping's would dequantise the tensor
        return name in self._tensors

    def q8_0(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A 2-D Q8_0 tensor (out, in) as (int8 values (out, in / 32, 32), a view of the file; float16 block
        scales (out, in / 32))."""
        t, shape = self._tensors[name], self._shapes[name]
        if t.tensor_type.name != "Q8_0" or len(shape) != 2:
            raise ValueError(f"{name} is a {t.tensor_type.name} tensor of shape {shape}, not a 2-D Q8_0 one")
        blocks = np.asarray(t.data).reshape(shape[0], -1, 2 + Q8_0_BLOCK)
        return blocks[..., 2:].view(np.int8), np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]

    def int8_rows(self, name: str, values: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """A 2-D Q8_0 tensor (out, in) → (int8 (out, in), float32 (out,)): one scale per output channel, the
        bits `wan_tpu.layers.quantized.quantize_weight` gives for the dequantised weight (amax floored at
        1e-12, / 127, round half to even; `_int8_rows`). `values=False`: the scales only, those of the last
        values read of `name` where there was one (`wan_tpu.wan.transformer_loading` reads the scales after
        the values)."""
        if not values and name in self._row_scales:
            return None, self._row_scales.pop(name)
        q, d = self.q8_0(name)
        out = np.empty(self._shapes[name], np.int8) if values else None
        scale = np.empty(q.shape[0], np.float32)
        _by_rows(self._shapes[name], lambda r: _int8_rows(q[r], d[r], scale[r], None if out is None else out[r]))
        if values:
            self._row_scales[name] = scale
        return out, scale

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


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="wan_tpu-q8_0")


def _by_rows(shape: tuple[int, int], fn) -> None:
    """`fn(rows)` for every chunk of `ROW_CHUNK_BYTES` values of a 2-D tensor (`rows` a slice), in every core."""
    step = max(1, ROW_CHUNK_BYTES // shape[1])
    list(_pool().map(lambda start: fn(slice(start, start + step)), range(0, shape[0], step)))


def _dequantised(q: np.ndarray, d: np.ndarray, out: np.ndarray) -> None:
    """Rows of Q8_0 blocks → float32 value × block scale into `out` (rows, in): `gguf.quants`' arithmetic."""
    np.multiply(q, d.astype(np.float32)[..., None], out=out.reshape(q.shape), dtype=np.float32)


def _int8_rows(q: np.ndarray, d: np.ndarray, scale: np.ndarray, out: np.ndarray | None) -> None:
    """Rows of Q8_0 blocks (values (rows, blocks, 32) int8, scales (rows, blocks) float16) → their per-row
    float32 `scale` and, given `out` (rows, in), the int8 values at that scale.

    The float32 operations XLA runs for `quantize_weight` on the dequantised weight w = value × block scale
    (exact in float32: 8 bits times 11): its algebraic simplifier turns `/ 127` and `/ scale` into products
    with the reciprocals, so the host multiplies too (true division differs in the last bit of about one
    scale in twenty on random weights; on a quantiser's own files, whose row maximum is 127 × a block scale,
    the two agree). |w| / scale cannot pass 127.5, so no clip."""
    w = q.astype(np.float32)
    w *= d.astype(np.float32)[..., None]
    flat = w.reshape(len(w), -1)
    amax = np.maximum(flat.max(axis=1), -flat.min(axis=1))
    np.multiply(np.maximum(amax, np.float32(1e-12)), np.float32(1.0) / np.float32(127.0), out=scale)
    if out is None:
        return
    flat *= (np.float32(1.0) / scale)[:, None]
    np.rint(flat, out=flat)
    out[...] = flat
