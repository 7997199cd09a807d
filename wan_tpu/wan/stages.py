"""Stage files: the safetensors files the three pipeline stages hand to each other.

Stage 1 writes the prompt embeddings (and the image conditioning for I2V/TI2V), stage 2 the final
latents. Each file carries, as safetensors string metadata, the format version, the stage that
wrote it and the run settings it was made with (`StageMeta`), so that a later stage can say
exactly what differs from the run it is asked to do instead of producing a wrong video:

    save_stage("stage1.safetensors", {"prompt_embeds": e}, StageMeta("prompt", config_hash=h, ...))
    tensors, meta = load_stage("stage1.safetensors", expect={"stage": "prompt", "config_hash": h})
    meta = read_stage_meta("stage1.safetensors")     # the settings only (the next stage's defaults)

The container is written here (an 8-byte little-endian header length, a JSON header, raw
little-endian data, as the safetensors spec lays it out) so that bfloat16 is stored as its raw bits
(dtype "BF16") with no float conversion, and so that tensors stream to disk one at a time. The file
is written under a temporary name in the destination folder and renamed into place, so a failed or
interrupted write never leaves a partial stage file (nor replaces a good one). In a job of several
processes every process calls `save_stage` (arrays spread over processes are gathered, a collective) and
only process 0 writes (`wan_tpu.runtime.distributed`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import SAFETENSORS_DTYPES, TensorSource, read_metadata
from wan_tpu.runtime import distributed, interrupt

FORMAT = "wan_tpu.stage/1"
_DTYPE_NAMES = {np.dtype(t): name for name, t in SAFETENSORS_DTYPES.items()}
_INT_FIELDS = frozenset({"seed", "frames", "steps"})
_FLOAT_FIELDS = frozenset({"shift", "guidance", "guidance_2"})
_LABELS = {"config_hash": "model config", "negative_prompt": "negative prompt"}


@dataclass(frozen=True)
class StageMeta:
    """What a stage file was made from. None = not recorded (omitted from the file).

    `size` is "W*H" (as `--size` takes it; a (width, height) pair is accepted), `dtype` a numpy
    dtype name ("bfloat16"); numbers are normalized (guidance 5 == 5.0) so that comparisons are
    by value.
    """

    stage: str
    config_hash: str | None = None
    prompt: str | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    size: str | None = None
    frames: int | None = None
    steps: int | None = None
    shift: float | None = None
    guidance: float | None = None
    guidance_2: float | None = None
    scheduler: str | None = None
    dtype: str | None = None
    model: str | None = None  # what --model was (a folder, model id or preset): the next stage's default

    def __post_init__(self):
        if not isinstance(self.stage, str) or not self.stage:
            raise ValueError(f"StageMeta.stage must be a non-empty name, got {self.stage!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _normalize(f.name, value))

    def to_metadata(self) -> dict[str, str]:
        """The safetensors `__metadata__` entries (format version included)."""
        out = {"format": FORMAT}
        out.update({k: str(v) for k, v in dataclasses.asdict(self).items() if v is not None})
        return out


def _normalize(name: str, value):
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"StageMeta.{name} must be an integer, got {value!r}")
        return int(value)
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"StageMeta.{name} must be a number, got {value!r}")
        return float(value)
    if name == "size":
        if isinstance(value, (tuple, list)) and len(value) == 2:
            value = f"{int(value[0])}*{int(value[1])}"
        if not isinstance(value, str) or not re.fullmatch(r"\d+\*\d+", value):
            raise ValueError(f"StageMeta.size must be 'W*H' or (width, height), got {value!r}")
        return value
    if name == "dtype":
        return np.dtype(value).name
    if not isinstance(value, str):
        raise ValueError(f"StageMeta.{name} must be a string, got {value!r}")
    return value


def _decode(path: str, raw: Mapping[str, str]) -> StageMeta:
    names = {f.name for f in dataclasses.fields(StageMeta)}
    values = {k: v for k, v in raw.items() if k in names}
    try:
        for k in values.keys() & _INT_FIELDS:
            values[k] = int(values[k])
        for k in values.keys() & _FLOAT_FIELDS:
            values[k] = float(values[k])
        return StageMeta(**values)
    except (TypeError, ValueError) as e:
        raise WanInputError(f"stage file {path} has malformed metadata ({e}); re-run the stage that writes it") from None


def config_hash(config) -> str:
    """A short stable hash of a model config (a dataclass or a JSON-like mapping).

    Stage files record it so that a file made with another model is refused rather than used.
    """
    payload = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_stage(path: str, tensors: Mapping, meta: StageMeta | Mapping, overwrite: bool = False) -> None:
    """Write `tensors` (name → jax.Array or np.ndarray) and `meta` to the stage file `path`, atomically."""
    meta = meta if isinstance(meta, StageMeta) else StageMeta(**meta)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        example = os.path.join(path, "stage.safetensors")
        raise WanInputError(f"{path} is a folder; pass a file name for the stage file, e.g. {example}")
    if os.path.lexists(path) and not overwrite:
        raise WanInputError(f"{path} exists; pass --overwrite or choose another path")
    if not os.path.isdir(folder):
        raise WanInputError(f"folder {folder} does not exist; create it or choose another path for {os.path.basename(path)}")
    header, offset = {}, 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"stage tensor names must be non-empty strings other than __metadata__, got {name!r}")
        dtype = np.dtype(t.dtype)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"stage tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        shape = [int(d) for d in t.shape]
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = meta.to_metadata()
    head = json.dumps(header, ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as the safetensors writer pads
    if distributed.process_count() > 1:
        tensors = {name: distributed.to_host(t) for name, t in tensors.items()}
        if not distributed.is_writer():
            return

    # Created with O_EXCL under a random name (not mkstemp, whose 0600 mode would stick to the
    # renamed file): the final file gets the usual umask permissions.
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except PermissionError:
        raise WanInputError(f"cannot write in folder {folder} (permission denied); choose another path for the stage file") from None
    try:
        with interrupt.temporary(tmp), os.fdopen(fd, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for t in tensors.values():
                # One tensor on the host at a time; np.asarray fetches a jax.Array from its devices.
                f.write(np.ascontiguousarray(np.asarray(t)).tobytes())
            f.flush()
            os.fsync(f.fileno())
            interrupt.check()
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_stage_meta(path: str) -> StageMeta:
    """The metadata of stage file `path`, checked (a readable safetensors file of this stage format)
    without reading its tensors."""
    meta, _, _ = _open(path)
    return meta


def _open(path: str) -> tuple[StageMeta, dict[str, str], TensorSource]:
    if not os.path.exists(path):
        raise WanInputError(f"stage file {path} does not exist; run the stage that writes it first or fix the path")
    if os.path.isdir(path):
        raise WanInputError(f"{path} is a folder, not a stage file; pass the .safetensors file a stage wrote")
    try:
        source = TensorSource([path])
        raw = read_metadata(path)
    except WanInputError as e:
        raise WanInputError(
            f"stage file {path} is not a readable safetensors file ({e}); re-run the stage that writes it"
        ) from None
    fmt = raw.get("format")
    if fmt is None or "stage" not in raw:
        raise WanInputError(
            f"{path} is not a wan_tpu stage file (no 'format'/'stage' metadata); pass a file written by a wan_tpu stage"
        )
    if fmt != FORMAT:
        raise WanInputError(
            f"{path} is in stage-file format {fmt!r} but this wan_tpu reads {FORMAT!r}; re-run the stage that wrote it"
        )
    return _decode(path, raw), raw, source


def load_stage(path: str, expect: Mapping | None = None) -> tuple[dict[str, np.ndarray], StageMeta]:
    """Read a stage file: (name → np.ndarray, its `StageMeta`).

    `expect` maps `StageMeta` field names to this run's values (None = don't check); any that
    differ from the file's raise a `WanInputError` naming each of them.
    """
    meta, raw, source = _open(path)
    if expect:
        _check_expected(path, raw, meta, expect)
    return {name: np.array(source[name]) for name in source}, meta


def _check_expected(path: str, raw: Mapping[str, str], meta: StageMeta, expect: Mapping) -> None:
    names = {f.name for f in dataclasses.fields(StageMeta)}
    unknown = set(expect) - names
    if unknown:
        raise ValueError(f"load_stage: unknown expect fields {sorted(unknown)}; known: {sorted(names)}")
    want_stage = expect.get("stage")
    if want_stage is not None and want_stage != meta.stage:
        raise WanInputError(
            f"{path} holds the {meta.stage!r} stage, but the {want_stage!r} stage is needed here; pass the file that stage wrote"
        )
    made, asked = [], []
    for name, value in expect.items():
        if value is None or name == "stage":
            continue
        wanted = str(_normalize(name, value))
        stored = raw.get(name)
        if stored != wanted:
            label = _LABELS.get(name, name)
            made.append(f"{label} {_show(name, stored) if stored is not None else '(not recorded)'}")
            asked.append(f"{label} {_show(name, wanted)}")
    if made:
        raise WanInputError(
            f"stage file {os.path.basename(path)} was made for {', '.join(made)} but this run asks for {', '.join(asked)}; "
            f"re-run the {meta.stage!r} stage with these settings or pass matching flags"
        )


def _show(name: str, value: str, limit: int = 60) -> str:
    """A metadata value for a one-line message: prompts quoted (they may hold newlines), shortened."""
    if name not in ("prompt", "negative_prompt"):
        return value
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 2] + "…\""
