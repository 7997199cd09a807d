"""GPU autotuning results shipped with the package: a first run on a GPU they were measured on tunes nothing.

    wan-autotune-packs export CACHE_DIR [CACHE_DIR ...]   # a pack from cold runs' cache folders (`autotune_cli`)
    wan-autotune-packs list                               # the packs shipped

XLA times candidate kernels on the device for every convolution, matrix product and fusion it compiles (its
autotuning) and keeps each result as a file in the compilation cache's per-fusion folder (`FOLDER`, in the version
folder of `wan_tpu.runtime.compile_cache`), where a later compile of the same instruction finds it. A cold start
pays all of that tuning. On an H200 (jax 0.11.2, 2026-11-29, `benchmarks/profile_compile.py`, cold = an empty cache
folder) with the pack shipped here, cold over warm: Wan 2.1 1.3B 480p 50 steps 4.15 and 5.68 s (6.0–10.5 without),
14B 720p 4 steps with a LoRA 3.81 s (7.5–12.6 without); Matrix-Game-2's first chunk 11.97–13.44 s cold (16.0–25.0
without); UnifoLM-WMA's first sampling 33.41–34.91 s (45.39 without: its pieces' compiles, not their tuning, are
what it waits for). With the pack none of them prints XLA's rematerialisation warnings, which the convolution
autotuner's candidates cause. A pack is those files, gathered from the cold runs of the commands people run first, one
per version folder name (jax, jaxlib, device kind): when the compilation cache makes a version folder, the pack of
that name, if shipped, fills its per-fusion folder with the files it lacks (never replacing one). Like vLLM's kernel
configurations per GPU, it serves only where it was measured: XLA names each result by the device's compute
capability, core count, clocks, memory bandwidth, L2 size and cuDNN version and the instruction's own text, so
another GPU, cuDNN or program shape finds nothing and tunes as before; a result only picks among the candidates XLA
would time itself. `WAN_TPU_AUTOTUNE_PACKS=0` turns the packs off.

Packs are gzip'd JSON ({"version": the version folder name, "files": {path in FOLDER: its bytes in base64}}, XLA's
files being serialised protos, in a sub-folder per device), written by `export` from the cache folders of cold runs
made with the same versions on the same GPU; shipped in `wan_tpu/runtime/autotune/`. A code change that
changes a program's instructions leaves their results unused (a miss, never a wrong result) until the pack is made
again (docs/PERFORMANCE.md says how).
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import os

from wan_tpu.runtime import interrupt

FOLDER = "xla_gpu_per_fusion_autotune_cache_dir"
ENV = "WAN_TPU_AUTOTUNE_PACKS"
PACKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autotune")
SUFFIX = ".json.gz"


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() not in ("0", "false", "off", "no")


def pack_path(version: str) -> str:
    return os.path.join(PACKS, version + SUFFIX)


def shipped() -> list[str]:
    """The version folder names a pack is shipped for."""
    if not os.path.isdir(PACKS):
        return []
    return sorted(name[: -len(SUFFIX)] for name in os.listdir(PACKS) if name.endswith(SUFFIX))


def read(path: str) -> dict:
    """A pack → {"version": ..., "files": {relative path: bytes}}; ValueError if it is not one."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            pack = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not an autotuning pack ({e})") from None
    files = pack.get("files") if isinstance(pack, dict) else None
    if not isinstance(files, dict) or not isinstance(pack.get("version"), str) or not all(
            isinstance(k, str) and isinstance(v, str) and _safe(k) for k, v in files.items()):
        raise ValueError(f"{path} is not an autotuning pack (a version and a map of relative paths to base64)")
    try:
        return {"version": pack["version"], "files": {k: base64.b64decode(v, validate=True) for k, v in files.items()}}
    except binascii.Error:
        raise ValueError(f"{path} is not an autotuning pack (a file's bytes are not base64)") from None


def _safe(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return bool(path) and not os.path.isabs(path) and ".." not in parts and "" not in parts


def seed(version_folder: str) -> int:
    """Fill `version_folder`'s per-fusion folder from the pack shipped for its name, if any, with the files it
    lacks → how many were written. Nothing where packs are off. Each file is written whole under a temporary
    name and renamed, so a process that reads it meanwhile sees all of it or none."""
    if not enabled():
        return 0
    path = pack_path(os.path.basename(os.path.normpath(version_folder)))
    if not os.path.isfile(path):
        return 0
    pack = read(path)
    target = os.path.join(version_folder, FOLDER)
    written = 0
    for name, data in pack["files"].items():
        out = os.path.join(target, name)
        if os.path.exists(out):
            continue
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = f"{out}.{os.getpid()}.tmp"
        try:
            with interrupt.temporary(tmp), open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, out)
        except BaseException:  # a full disk or a stop: no half-written file left in the cache folder
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        written += 1
    return written


def export(cache_dirs: list[str], out_dir: str | None = None) -> dict[str, int]:
    """Packs from cache folders (a `WAN_TPU_CACHE_DIR`, or one of its version folders): per version folder
    name, the union of their per-fusion results, merged into the pack of that name in `out_dir` (default: the
    package's, `PACKS`) → {pack path: files in it}. Each pack is written whole, then renamed."""
    out_dir = PACKS if out_dir is None else out_dir
    found: dict[str, dict[str, bytes]] = {}
    for cache in cache_dirs:
        cache = os.path.normpath(cache)
        versions = [cache] if os.path.isdir(os.path.join(cache, FOLDER)) else [
            os.path.join(cache, v) for v in sorted(os.listdir(cache)) if os.path.isdir(os.path.join(cache, v, FOLDER))]
        for version in versions:
            files = found.setdefault(os.path.basename(version), {})
            root = os.path.join(version, FOLDER)
            for parent, _, names in os.walk(root):
                for name in names:
                    if name.endswith(".tmp"):
                        continue
                    full = os.path.join(parent, name)
                    with open(full, "rb") as f:
                        files[os.path.relpath(full, root).replace(os.sep, "/")] = f.read()
    written = {}
    os.makedirs(out_dir, exist_ok=True)
    for version, files in found.items():
        path = os.path.join(out_dir, version + SUFFIX)
        if os.path.isfile(path):
            files = {**read(path)["files"], **files}
        encoded = {name: base64.b64encode(data).decode() for name, data in files.items()}
        data = json.dumps({"version": version, "files": encoded}, sort_keys=True, indent=0).encode()
        tmp = f"{path}.{os.getpid()}.tmp"
        with interrupt.temporary(tmp):  # written whole, then renamed: a stopped export leaves the old pack
            with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:  # same bytes, same files
                f.write(data)
            os.replace(tmp, path)
        interrupt.record(path)
        written[path] = len(files)
    return written
