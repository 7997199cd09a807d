"""`wan_tpu.runtime.autotune_packs`: the GPU autotuning results shipped with the package fill a new cache version
folder of their name (never another's, never replacing a file), and `export` makes a pack from cold runs' cache
folders. The entries are the files XLA itself wrote on an H200 (the shipped pack); nothing here needs a GPU."""

import gzip
import os
import re
import subprocess
import sys

import pytest

from wan_tpu.runtime import autotune_cli, autotune_packs, compile_cache

H200 = "jax-0.11.2_jaxlib-0.11.2_gpu_NVIDIA-H200"
SHIPPED = os.path.join(autotune_packs.PACKS, H200 + autotune_packs.SUFFIX)


def xla_entries(count: int) -> dict[str, bytes]:
    """`count` result files as XLA wrote them (from the shipped H200 pack)."""
    files = autotune_packs.read(SHIPPED)["files"]
    return dict(sorted(files.items())[:count])


def cache_folder(base, version: str, files: dict[str, bytes]) -> str:
    """A compilation cache folder as a GPU run leaves it: a version folder holding a program and XLA's results."""
    folder = os.path.join(base, version)
    for name, data in files.items():
        path = os.path.join(folder, autotune_packs.FOLDER, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    with open(os.path.join(folder, "jit__step-0123-cache"), "wb") as f:
        f.write(b"a compiled program")
    return str(base)


def test_the_shipped_pack_holds_xlas_own_result_files():
    assert H200 in autotune_packs.shipped()
    pack = autotune_packs.read(SHIPPED)
    assert pack["version"] == H200 and len(pack["files"]) > 100
    for name, data in pack["files"].items():
        # XLA's layout: a folder per device description hash, a serialised result per key hash, the key's
        # hashes inside the proto (its first field).
        device, key = re.fullmatch(r"([0-9a-f]{16})/([0-9a-f]{32})\.pb", name).groups()
        assert data[:1] == b"\n" and device.encode() in data and key.encode() in data, name


def test_a_new_version_folder_starts_with_the_pack_of_its_name(tmp_path, monkeypatch, capsys):
    version = compile_cache.version_key()
    entries = xla_entries(5)
    monkeypatch.setattr(autotune_packs, "PACKS", str(tmp_path / "packs"))
    assert autotune_packs.export([cache_folder(tmp_path / "run", version, entries)]) == {
        os.path.join(tmp_path, "packs", version + autotune_packs.SUFFIX): 5}
    cache_folder(tmp_path / "other", "jax-0.0.1_jaxlib-0.0.1_gpu_Another-GPU", xla_entries(2))
    autotune_packs.export([str(tmp_path / "other")])
    assert autotune_packs.shipped() == sorted(["jax-0.0.1_jaxlib-0.0.1_gpu_Another-GPU", version])

    # A user's folder that already holds one of the results (its own tuning): kept as it is.
    first, kept = next(iter(entries)), b"this machine's own result"
    own = tmp_path / "user" / version / autotune_packs.FOLDER / first
    own.parent.mkdir(parents=True)
    own.write_bytes(kept)
    target = compile_cache._version_folder(str(tmp_path / "user"))
    results = os.path.join(target, autotune_packs.FOLDER)
    got = {os.path.relpath(os.path.join(p, n), results).replace(os.sep, "/"): open(os.path.join(p, n), "rb").read()
           for p, _, names in os.walk(results) for n in names}
    assert got == {**entries, first: kept}  # the other version's pack is not used
    assert autotune_packs.seed(target) == 0  # all there: nothing written twice

    # A write that fails (a full disk): a warning, and no half-written file left among the results.
    def full(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(autotune_packs.os, "replace", full)
        with pytest.warns(UserWarning, match="No space left on device"):
            partial = compile_cache._version_folder(str(tmp_path / "full"))
    assert [n for _, _, names in os.walk(partial) for n in names] == []

    monkeypatch.setenv(autotune_packs.ENV, "0")
    off = compile_cache._version_folder(str(tmp_path / "off"))
    assert not os.path.exists(os.path.join(off, autotune_packs.FOLDER))
    monkeypatch.delenv(autotune_packs.ENV)

    # A damaged pack: a warning, the folder made all the same, no result written.
    with gzip.open(autotune_packs.pack_path(version), "wt") as f:
        f.write('{"version": 3}')
    with pytest.warns(UserWarning, match="shipped autotuning results were not used"):
        damaged = compile_cache._version_folder(str(tmp_path / "damaged"))
    assert os.path.isdir(damaged) and not os.path.exists(os.path.join(damaged, autotune_packs.FOLDER))
    capsys.readouterr()
    assert autotune_cli.main(["list"]) == 2
    err = capsys.readouterr().err
    assert "is not an autotuning pack" in err and len(err.strip().splitlines()) == 1


def test_export_merges_runs_and_says_what_is_wrong(tmp_path):
    entries = xla_entries(6)
    names = list(entries)
    a = cache_folder(tmp_path / "a", H200, {n: entries[n] for n in names[:4]})
    b = cache_folder(tmp_path / "b", H200, {n: entries[n] for n in names[2:]})
    out = tmp_path / "packs"

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "wan_tpu.runtime.autotune_cli", *argv], capture_output=True,
                              text=True, timeout=120)

    done = cli("export", a, os.path.join(b, H200), "--out", str(out))  # a cache folder, or one of its version folders
    assert done.returncode == 0 and done.stdout.strip().endswith(f"{H200}.json.gz: 6 results")
    pack = out / (H200 + autotune_packs.SUFFIX)
    assert autotune_packs.read(str(pack))["files"] == entries
    first = pack.read_bytes()
    os.remove(pack)
    assert cli("export", b, a, "--out", str(out)).returncode == 0 and pack.read_bytes() == first  # same bytes
    for argv, says in (((str(tmp_path / "none"),), "is not a folder"), ((str(tmp_path),), "only GPU runs write")):
        bad = cli("export", *argv, "--out", str(out))
        assert bad.returncode == 2 and says in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    listed = cli("list")
    assert listed.returncode == 0 and f"{H200}: " in listed.stdout
