"""`benchmarks/bench_e2e.py` at tiny scale on CPU: the random checkpoint it writes is what diffusers and
transformers load without a missing or unexpected key (the reference for "diffusers layout"), with
the weight scales it promises; the whole generate path runs through our loaders (on a one-device
mesh, to stay fast) and writes a playable mp4; meshes needing more devices than exist are reported as skipped."""

import os

import bench_e2e as bench
import numpy as np
import pytest
from safetensors import safe_open


def _cells(line: str) -> list[str]:
    """The cells of one markdown table row."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(out: str, first: str) -> list[list[str]]:
    """The markdown table whose header starts with the cell `first`: header, then each row, as cells."""
    lines = out[out.index(f"| {first} |"):].splitlines()
    assert set(lines[1]) == {"|", "-"}  # the rule under the header
    rows = [lines[0]]
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return [_cells(line) for line in rows]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_e2e")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "SHARD_BYTES", 1 << 13)  # several shards + index files, as at real size
        bench.ensure_checkpoint(str(path), "tiny")
    return path


def test_checkpoint_loads_in_diffusers_and_transformers(workdir):
    import diffusers
    import torch
    from transformers import UMT5EncoderModel

    ckpt = bench.ensure_checkpoint(str(workdir), "tiny")  # reused, not rewritten
    assert os.path.isfile(os.path.join(ckpt, "transformer", "diffusion_pytorch_model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(ckpt, "text_encoder", "model.safetensors.index.json"))
    dit, info = diffusers.WanTransformer3DModel.from_pretrained(os.path.join(ckpt, "transformer"),
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = safe_open(os.path.join(ckpt, "transformer", "diffusion_pytorch_model-00001-of-00051.safetensors"), "pt")
    assert {stored.get_tensor(k).dtype for k in stored.keys()} == {torch.bfloat16}
    _, info = diffusers.AutoencoderKLWan.from_pretrained(os.path.join(ckpt, "vae"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    umt5, info = UMT5EncoderModel.from_pretrained(os.path.join(ckpt, "text_encoder"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(umt5.encoder.embed_tokens.weight, umt5.shared.weight)

    # Scales (tolerance: 5% of the promised std, a few thousand samples each).
    w = dit.blocks[0].ffn.net[0].proj.weight.float()
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1) < 0.05
    assert torch.all(dit.blocks[0].attn1.norm_q.weight == 1)
    sst = dit.blocks[1].scale_shift_table.float()
    assert abs(sst.std().item() * sst.shape[-1] ** 0.5 - 1) < 0.05
    q = umt5.encoder.block[1].layer[0].SelfAttention.q.weight.float()
    assert abs(q.std().item() * q.shape[1] ** 0.5 - 1) < 0.05
    assert not torch.equal(dit.blocks[0].attn1.to_q.weight, dit.blocks[1].attn1.to_q.weight)


def test_tiny_generate_end_to_end(workdir, capsys):
    from wan_tpu.runtime.video import read_video

    assert bench.main(["--config", "tiny", "--steps", "2", "--size", "32*32", "--frames", "5", "--mesh", "1,1,1",
                       "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("jax ") and " · device " in out.splitlines()[0]  # what ran where, first
    for stage in ("load text encoder", "text encode", "load transformer", "denoise (2 steps)",
                  "denoise excl. compile", "s/step", "vae decode", "mp4 write", "total (one generate)", "MFU",
                  "peak memory"):
        assert stage in out
    head, row = _table(out, "mesh dp,sp,tp")
    assert head == ["mesh dp,sp,tp", "load", "text enc", "denoise", "excl.compile", "s/step", "vae dec", "mp4", "total",
                    "total@default", "MFU", "peak GiB"]
    assert row[0] == "1,1,1" and len(row) == 12
    assert float(row[8]) > float(row[3]) > 0  # total > denoise
    frames, fps = read_video(os.path.join(workdir, "bench_e2e_tiny_1x1x1.mp4"))
    assert frames.shape == (5, 32, 32, 3) and fps == 16
    assert np.ptp(frames) > 0


def test_meshes_run_in_their_own_processes_and_skip_when_devices_are_missing(workdir, capsys):
    # With a time limit (or several meshes) each mesh runs in a child process; this one needs more
    # than the 8 simulated CPU devices.
    assert bench.main(["--config", "tiny", "--meshes", "2,2,8", "--time-limit", "600", "--workdir", str(workdir)]) == 0
    _, row = _table(capsys.readouterr().out, "mesh dp,sp,tp")
    assert row[:2] == ["2,2,8", "skipped (needs 32 devices, 8 here)"] and len(row) == 12


def test_bad_mesh_is_one_line_error(workdir, capsys):
    assert bench.main(["--config", "tiny", "--mesh", "2,1", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: mesh '2,1' is not dp,sp,tp") and "\n" not in err


def test_time_limit_still_prints_the_table(workdir, capsys):
    assert bench.main(["--config", "tiny", "--meshes", "1,1,1", "--time-limit", "0", "--workdir", str(workdir)]) == 0
    _, row = _table(capsys.readouterr().out, "mesh dp,sp,tp")
    assert row[:2] == ["1,1,1", "not run (--time-limit 0 s reached)"]


@pytest.mark.slow
def test_peer_diffusers_times_whole_commands(workdir, capsys):
    """`--peer diffusers`: our command cold (empty cache) and warm, and diffusers' WanPipeline script, each a
    fresh process writing its mp4; the table has every part and the ratio to diffusers eager."""
    from wan_tpu.runtime.video import read_video

    argv = ["--config", "tiny", "--peer", "diffusers", "--entries", "ours-cold", "ours-warm", "diffusers-eager",
            "--steps", "2", "--size", "32*32", "--frames", "5", "--workdir", str(workdir)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    head, *table = _table(out, "entry")
    assert head == ["entry", "wall", "load", "text", "denoise", "decode", "write", "other", "s/step", "wall@4",
                    "vs diffusers eager"]
    rows = {cells[0]: cells[1:] for cells in table}
    assert set(rows) == {"wan_tpu, empty cache (cold)", "wan_tpu, cache filled (warm)", "diffusers eager"}
    assert rows["diffusers eager"][-1] == "1.00x"
    for cells in rows.values():
        wall, parts = float(cells[0]), [float(c) for c in cells[1:6]]
        assert wall > sum(parts) > 0 and cells[-1].endswith("x")
    assert "projected from 2 steps to 4" in out
    for who in ("ours", "diffusers"):
        frames, fps = read_video(os.path.join(workdir, f"peer_tiny_{who}.mp4"))
        assert frames.shape == (5, 32, 32, 3) and fps == 16
    assert not [n for n in os.listdir(workdir) if n.startswith("bench_e2e_cache_")]  # the cold cache is removed


@pytest.mark.slow
def test_peer_few_step_with_a_lora(workdir, capsys):
    """`--few-step --lora-rank R`: both sides run 4 Euler steps at guidance 1 with the same random LoRA merged."""
    argv = ["--config", "tiny", "--peer", "diffusers", "--entries", "ours-cold", "diffusers-eager", "--few-step",
            "--lora-rank", "4", "--size", "32*32", "--frames", "5", "--workdir", str(workdir)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "4 Euler steps (sigmas [1.0, 0.75, 0.5, 0.25], shift 5), guidance 1, a random rank-4 kohya LoRA merged" in out
    head, *table = _table(out, "entry")
    assert not [c for c in head if c.startswith("wall@")]  # 4 given steps: nothing to project
    rows = {cells[0]: cells[1:] for cells in table}
    assert set(rows) == {"wan_tpu, empty cache (cold)", "diffusers eager"} and rows["diffusers eager"][-1] == "1.00x"
    assert os.path.isfile(os.path.join(workdir, "tiny-lora-r4.safetensors"))


def test_peer_cache_diffusers_lacks_is_skipped(workdir, capsys):
    argv = ["--config", "tiny", "--peer", "diffusers", "--entries", "diffusers-eager", "--cache", "teacache",
            "--steps", "2", "--size", "32*32", "--frames", "5", "--workdir", str(workdir)]
    assert bench.main(argv) == 0
    assert "skipped: diffusers has no teacache" in capsys.readouterr().out


def test_processes_spawn_one_run(monkeypatch, tmp_path):
    """`--command-mesh 1,4,1 --processes 2`: every process gets the same command plus its place in the run, its
    share of the devices and its own cache folder; the wall spans them all, process 0's output is kept."""
    import argparse
    import json
    import sys

    probe = ("import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cache': os.environ['WAN_TPU_CACHE_DIR'], "
             "'flags': os.environ.get('XLA_FLAGS', ''), 'gpus': os.environ.get('CUDA_VISIBLE_DEVICES')}))")
    monkeypatch.setattr(bench.harness, "device_kind", lambda devices=None: "cpu")
    args = argparse.Namespace(processes=2, command_mesh="1,4,1")
    wall, rc, out = bench._run_processes([sys.executable, "-c", probe, "--mesh", "1,4,1"], args, str(tmp_path))
    seen = json.loads(out)
    assert rc == 0 and wall > 0
    assert seen["argv"][:2] == ["--mesh", "1,4,1"] and seen["argv"][-4:] == ["--num-processes", "2", "--process-id", "0"]
    assert seen["argv"][2] == "--coordinator" and seen["argv"][3].startswith("localhost:")
    assert seen["cache"] == os.path.join(str(tmp_path), "process0") and seen["gpus"] is None
    assert seen["flags"].endswith("--xla_force_host_platform_device_count=2")

    monkeypatch.setattr(bench.harness, "device_kind", lambda devices=None: "4× NVIDIA H200")
    wall, rc, out = bench._run_processes([sys.executable, "-c", probe], args, str(tmp_path))
    assert json.loads(out)["gpus"] == "0,1"


def test_processes_need_a_mesh_they_divide(workdir, capsys):
    argv = ["--config", "tiny", "--peer", "diffusers", "--processes", "3", "--command-mesh", "1,4,1",
            "--workdir", str(workdir)]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --processes 3 needs --command-mesh with a multiple of 3 devices") and "\n" not in err
