"""Reading diffusers-format checkpoint folders (config.json + safetensors) tensor by tensor.

The safetensors container is parsed here directly (an 8-byte header length, a JSON header, then
raw little-endian data) and every tensor is a read-only `np.memmap` view, so a 57 GB checkpoint is
never held twice in host memory: callers convert and place one tensor at a time. Parsing the header
ourselves also lets a corrupt or truncated file fail with a message that names it.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from wan_tpu.errors import WanInputError

SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    # ComfyUI's fp8 checkpoints; safetensors names them so since 0.4.
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: str) -> dict[str, _Entry]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise WanInputError(f"{path}: not a safetensors file (shorter than its 8-byte header length); re-download or re-save it")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or 8 + n > size:
            raise WanInputError(f"{path}: corrupt safetensors header (length {n} for a {size}-byte file); re-download or re-save it")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WanInputError(f"{path}: corrupt safetensors header ({e}); re-download or re-save it") from None
    if not isinstance(header, dict):
        raise WanInputError(f"{path}: corrupt safetensors header (not a JSON object); re-download or re-save it")
    start = 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] not in SAFETENSORS_DTYPES:
            raise WanInputError(f"{path}: tensor {name!r} is stored as {info['dtype']}, which wan_tpu does not read "
                                f"(it reads {', '.join(SAFETENSORS_DTYPES)}); convert the file to bf16 or fp8_e4m3fn")
        try:
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (start + int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WanInputError(f"{path}: corrupt safetensors entry for tensor {name!r}; re-download or re-save it") from None
        if end > size or end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise WanInputError(
                f"{path}: tensor {name!r} lies outside the file or has the wrong byte count (truncated download?); re-download it"
            )
        entries[name] = _Entry(path, dtype, shape, begin, end)
    return entries


def file_entries(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name → (shape, dtype) of one safetensors file from its header alone; a truncated or corrupt file fails
    here with one line (every tensor must lie inside the file)."""
    return {name: (e.shape, e.dtype) for name, e in _read_header(path).items()}


def read_metadata(path: str) -> dict[str, str]:
    """The `__metadata__` string map of one safetensors file (empty when absent)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return dict(json.loads(f.read(n)).get("__metadata__", {}) or {})


class TensorSource(Mapping):
    """Name → memory-mapped numpy array over one or more safetensors files.

    Each file is mapped once, on its first tensor's read, and every tensor is a view of that map. A map per
    tensor costs an `mmap` and a `munmap` per tensor (each takes the process's memory-map lock for writing,
    stalling every other thread's page faults) and Python time under the GIL: UnifoLM's 2,198 tensors spent
    4.9 s of thread time making maps in a warm start (H200 host, a sampling profile), beside the other
    components' loads. `name in source` reads the header's table alone."""

    def __init__(self, files: list[str]):
        self._entries: dict[str, _Entry] = {}
        for path in files:
            self._entries.update(_read_header(path))
        self._maps: dict[str, np.ndarray] = {}
        self._maps_lock = threading.Lock()

    def _map(self, path: str) -> np.ndarray:
        m = self._maps.get(path)
        if m is None:
            with self._maps_lock:
                m = self._maps.get(path)
                if m is None:
                    m = self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return m

    def __getitem__(self, name: str) -> np.ndarray:
        e = self._entries[name]
        return self._map(e.file)[e.begin:e.end].view(e.dtype).reshape(e.shape)

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._entries

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Read tensor `name` into `out` (C-contiguous, its shape's element count, its dtype's itemsize).

        Plain positioned reads straight into the destination: no memory map faulted in page by page,
        and the GIL is released while the bytes move, so several threads read at once."""
        e = self._entries[name]
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.flags.c_contiguous else memoryview(b"")
        if not out.flags.c_contiguous or view.nbytes != e.end - e.begin or out.dtype.itemsize != e.dtype.itemsize:
            raise ValueError(f"read_into({name!r}): a {out.dtype} buffer of {out.nbytes} bytes does not fit the "
                             f"{e.dtype} tensor of {e.end - e.begin} bytes")
        fd = os.open(e.file, os.O_RDONLY)
        try:
            done = 0
            while done < view.nbytes:
                n = os.preadv(fd, [view[done:]], e.begin + done)
                if n <= 0:
                    raise WanInputError(f"{e.file}: ends inside tensor {name!r} (truncated download?); re-download it")
                done += n
        finally:
            os.close(fd)

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The box `index` (contiguous slices, one per leading dimension) of tensor `name`, reading only its bytes:
        one positioned read per contiguous run (a multi-host load reads each device's shard, not the tensor)."""
        e = self._entries[name]
        spans = [sl.indices(n)[:2] for sl, n in zip(tuple(index) + (slice(None),) * (len(e.shape) - len(index)), e.shape)]
        out = np.empty(tuple(max(0, b - a) for a, b in spans), e.dtype)
        # Dimensions after the last partial one are read whole with it: one run per index of those before.
        partial = [d for d, (a, b) in enumerate(spans) if (a, b) != (0, e.shape[d])]
        k = partial[-1] if partial else 0
        run = out.dtype.itemsize * int(np.prod(out.shape[k:], dtype=np.int64))
        strides = np.cumprod((e.shape[1:] + (1,))[::-1])[::-1] * e.dtype.itemsize
        if out.size == 0:
            return out
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(e.file, os.O_RDONLY)
        try:
            for n, outer in enumerate(np.ndindex(*out.shape[:k])):
                offset = e.begin + sum(int(strides[d]) * (spans[d][0] + i) for d, i in enumerate(outer))
                offset += int(strides[k]) * spans[k][0] if spans else 0
                done = 0
                while done < run:
                    got = os.preadv(fd, [view[n * run + done:(n + 1) * run]], offset + done)
                    if got <= 0:
                        raise WanInputError(f"{e.file}: ends inside tensor {name!r} (truncated download?); re-download it")
                    done += got
        finally:
            os.close(fd)
        return out

    @property
    def files(self) -> list[str]:
        """The safetensors files the tensors live in."""
        return sorted({e.file for e in self._entries.values()})

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name].dtype

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class MappedSource(Mapping):
    """Another source's tensors under other names (`names`: ours → its), some of them made on read.

    `made`: name → (shape, dtype, read) for tensors that are computed from the source rather than
    stored (an fp8 weight times its scale, a GGUF block dequantised): `read()` returns the host array,
    so a caller holds one such tensor at a time. Everything else is the source's own memory map."""

    def __init__(self, source, names: dict[str, str], made: dict | None = None):
        self.source, self._names, self._made = source, dict(names), dict(made or {})

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._made:
            return self._made[name][2]()
        return self.source[self._names[name]]

    def read_into(self, name: str, out: np.ndarray) -> None:
        if name in self._made or not hasattr(self.source, "read_into"):
            out[...] = self[name]
        else:
            self.source.read_into(self._names[name], out)

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name in self._made or not hasattr(self.source, "read_slice"):
            return np.ascontiguousarray(self[name][index])
        return self.source.read_slice(self._names[name], index)

    @property
    def files(self) -> list[str]:
        return self.source.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._made[name][0]) if name in self._made else tuple(self.source.shape(self._names[name]))

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self._made[name][1]) if name in self._made else self.source.dtype(self._names[name])

    def __contains__(self, name) -> bool:
        return name in self._made or name in self._names

    def __iter__(self) -> Iterator[str]:
        yield from self._made
        yield from (n for n in self._names if n not in self._made)

    def __len__(self) -> int:
        return len(self._made) + sum(1 for n in self._names if n not in self._made)


def component_files(path: str, what: str = "model") -> list[str]:
    """The safetensors files of a component folder: the shards its `*.safetensors.index.json` names
    (each must exist), else every `*.safetensors` in it."""
    if not os.path.isdir(path):
        raise WanInputError(f"{what} checkpoint folder {path!r} does not exist; pass a diffusers-format folder")
    indexes = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
    if indexes:
        return _index_shards(path, indexes[0], "re-download the checkpoint")
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise WanInputError(f"{path}: no *.safetensors weights; save the {what} with save_pretrained(safe_serialization=True)")
    return files


def _index_shards(folder: str, index_name: str, fix: str) -> list[str]:
    """The shard files a `*.safetensors.index.json` in `folder` names (each must exist)."""
    index = os.path.join(folder, index_name)
    try:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise WanInputError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e}); {fix}") from None
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        raise WanInputError(f"{folder}: shard {missing[0]} named by {index_name} is missing; {fix}")
    return [os.path.join(folder, s) for s in shards]


def check_component(path: str, what: str = "model") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Check a component folder's weights without reading them: every header parses, every tensor lies
    inside its file with the byte count its shape and dtype need (a truncated download fails here),
    and every tensor an index names is in its shard. Returns name → (shape, stored dtype).

    Reads only the headers (kilobytes), so a whole checkpoint is checked in milliseconds."""
    files = component_files(path, what)
    entries: dict[str, _Entry] = {}
    for file in files:
        entries.update(_read_header(file))
    indexes = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
    if indexes:
        with open(os.path.join(path, indexes[0])) as f:
            weight_map = json.load(f)["weight_map"]
        for name, shard in weight_map.items():
            entry = entries.get(name)
            if entry is None or os.path.basename(entry.file) != shard:
                raise WanInputError(
                    f"{path}: tensor {name!r} is not in shard {shard} as {indexes[0]} says; re-download the checkpoint"
                )
    return {name: (e.shape, e.dtype) for name, e in entries.items()}


def open_checkpoint(path: str, what: str = "model") -> tuple[dict, TensorSource]:
    """Open a diffusers-format component folder: returns (config.json as a dict, its tensors).

    Accepts one `*.safetensors` file or shards listed by `*.safetensors.index.json`.
    """
    return read_config(path, what), TensorSource(component_files(path, what))


def read_config(path: str, what: str = "model") -> dict:
    """The config.json of a diffusers-format component folder as a dict, reading no tensor (what
    `open_checkpoint` checks first: a missing folder or config.json is named in one line)."""
    if not os.path.isdir(path):
        raise WanInputError(f"{what} checkpoint folder {path!r} does not exist; pass a diffusers-format folder")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise WanInputError(f"{path}: no config.json; pass the {what}'s diffusers folder (it holds config.json and *.safetensors)")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise WanInputError(f"{cfg_path}: not valid JSON ({e}); re-download it") from None
    return config


def require_file(folder, filename: str, component: str) -> None:
    """Raise `WanInputError` unless `folder` (a diffusers `component/` folder) holds `filename`."""
    if not os.path.isfile(os.path.join(os.fspath(folder), filename)):
        raise WanInputError(
            f"{component} folder {os.fspath(folder)!r} has no {filename}; "
            f"pass the {component}/ folder of a diffusers-format Wan checkpoint"
        )


def open_component(folder: str, name: str) -> TensorSource:
    """The tensors of one component of a multi-component folder: `folder/NAME.safetensors`, or shards
    listed by `folder/NAME.safetensors.index.json` (UniFoLM: unet, conditioning, vae, ...)."""
    index = f"{name}.safetensors.index.json"
    if os.path.isfile(os.path.join(folder, index)):
        return TensorSource(_index_shards(folder, index, "re-convert the checkpoint"))
    path = os.path.join(folder, f"{name}.safetensors")
    if not os.path.isfile(path):
        raise WanInputError(f"{folder}: no {name}.safetensors; convert the checkpoint with wan-convert-unifolm")
    return TensorSource([path])
