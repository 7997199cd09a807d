"""The CLI `python -m wan_tpu.generate`, the stage scripts and mp4 writing, on the built-in tiny preset.

End to end: the mp4 has the requested frame count and size (read back with imageio); the three
stage scripts chained give exactly (bit for bit) the frames and latents of one `generate` run with
the same seed; `--profile` leaves a trace file. Bad input: one line on stderr, exit status 2, and
no file left behind.
"""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from wan_tpu.runtime.video import read_video, write_video
from wan_tpu.wan.cli import main
from wan_tpu.wan.stages import load_stage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = ["--model", "tiny", "--steps", "2", "--quiet"]


def script(name):
    return importlib.import_module(f"wan_tpu.wan.{name}").main


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One generate run (tiny, 48x32, 5 frames, 2 steps, seed 3) with its stage files and a trace."""
    out = tmp_path_factory.mktemp("gen")
    argv = ["--prompt", "a cat walks", "--size", "32*48", "--frames", "5", "--seed", "3", *FAST,
            "--output", str(out / "video.mp4"), "--keep-stages", str(out / "stages"), "--profile", str(out / "trace")]
    assert main(argv) == 0
    return out


def test_generate_writes_a_playable_mp4(generated, capsys):
    frames, fps = read_video(str(generated / "video.mp4"))
    assert frames.shape == (5, 48, 32, 3) and fps == 16.0
    assert not [n for n in os.listdir(generated) if n.startswith(".")]  # no temporary file left


def test_stage_scripts_chained_match_generate(generated, tmp_path):
    s1, s2, mp4 = (str(tmp_path / n) for n in ("s1.safetensors", "s2.safetensors", "v.mp4"))
    common = ["--model", "tiny", "--size", "32*48", "--frames", "5"]
    assert script("stage1_encode")(["--prompt", "a cat walks", *common, "--output", s1]) == 0
    assert script("stage2_denoise")([*common, "--steps", "2", "--seed", "3", "--quiet", "--input", s1, "--output", s2]) == 0
    assert script("stage3_decode")(["--model", "tiny", "--input", s2, "--output", mp4]) == 0
    kept, _ = load_stage(str(generated / "stages" / "stage2.safetensors"))
    chained, meta = load_stage(s2)
    assert np.array_equal(kept["latents"], chained["latents"])
    assert meta.prompt == "a cat walks" and meta.seed == 3 and meta.size == "32*48"
    assert np.array_equal(read_video(mp4)[0], read_video(str(generated / "video.mp4"))[0])


def test_profile_writes_a_trace_with_the_stage_regions(generated):
    import gzip
    import json

    files = [os.path.join(d, f) for d, _, names in os.walk(generated / "trace") for f in names]
    assert any(f.endswith(".xplane.pb") for f in files), files
    traces = [f for f in files if f.endswith(".trace.json.gz")]
    if traces:  # the Perfetto/Chrome JSON export, where this JAX writes one
        names = {e.get("name") for e in json.load(gzip.open(traces[0]))["traceEvents"]}
        assert {"pipeline", "data_preparation", "text encode", "step_0", "step_1", "vae_decode", "export"} <= names


def test_video_round_trip(tmp_path):
    frames = np.zeros((9, 32, 48, 3), np.uint8)
    frames[:, :, :, 0] = np.linspace(0, 255, 9, dtype=np.uint8)[:, None, None]
    path = write_video(str(tmp_path / "a.mp4"), frames, fps=24)
    back, fps = read_video(path)
    assert back.shape == frames.shape and fps == 24.0
    assert np.abs(back.astype(int) - frames.astype(int)).mean() < 3  # H.264 is lossy; flat colours survive


def test_video_keeps_detail(tmp_path):
    """Moving gradients and edges through the encoder at its speed preset: PSNR against the frames ≥ 40 dB
    (41.6 measured here, 41.6 with x264's default preset too; chroma subsampling bounds it)."""
    y, x = np.mgrid[0:96, 0:160].astype(np.float32)
    frames = np.stack([np.stack([np.sin((x + 5 * t) / 30) * 60 + 128, np.cos((x * 0.7 - y * 0.4 + 7 * t) / 20) * 90 + 128,
                                 ((x // 32 + y // 32 + t // 4) % 2) * 120 + 60], -1) for t in range(9)]).astype(np.uint8)
    back, _ = read_video(write_video(str(tmp_path / "d.mp4"), frames, fps=16))
    mse = np.mean((back.astype(np.float64) - frames) ** 2)
    assert 10 * np.log10(255**2 / mse) >= 40


def bad(argv, capsys, tmp_path, match):
    capsys.readouterr()
    before = sorted(os.listdir(tmp_path))
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    assert sorted(os.listdir(tmp_path)) == before
    return lines[0]


@pytest.mark.parametrize("flags,match", [
    (["--size", "100*64"], "not a multiple of 16"),
    (["--size", "64"], "not W*H"),
    (["--frames", "6"], "not 4n+1"),
    (["--steps", "0"], "positive integer"),
    (["--prompt", "", "--negative-prompt", ""], "prompt is empty"),
    (["--model", "no-such-preset"], "is neither a checkpoint folder"),
    (["--mesh", "3,1,1"], "needs 3 devices"),
    (["--mesh", "2,2"], "not dp,sp,tp"),
    (["--image", "missing.png"], "takes no image"),
    (["--shift", "-1"], "shift must be positive"),
    (["--attention", "flash9"], "cannot run on cpu"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(flags, match, capsys, tmp_path):
    argv = ["--prompt", "a cat", *FAST, "--output", str(tmp_path / "out.mp4"), *flags]
    bad(argv, capsys, tmp_path, match)


def test_missing_video_encoder_is_caught_before_the_run(capsys, tmp_path, monkeypatch):
    """An environment without imageio-ffmpeg (a --no-deps install) once ran a whole 1.3B job and then
    failed at the mp4 write; now it stops at the start."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else find_spec(name, *a))
    bad(["--prompt", "a cat", *FAST, "--output", str(tmp_path / "out.mp4")], capsys, tmp_path, "pip install imageio-ffmpeg")


def test_existing_output_is_kept(capsys, tmp_path):
    out = tmp_path / "out.mp4"
    out.write_bytes(b"precious")
    bad(["--prompt", "a cat", *FAST, "--output", str(out)], capsys, tmp_path, "--overwrite")
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("flags,match", [
    (["--timesteps", "1000,500"], "UniPC takes a schedule as --sigmas"),
    (["--sigmas", "1,x"], "--sigmas '1,x' is not a comma-separated list"),
    (["--sigmas", "0.5,0.9", "--scheduler", "euler"], "must decrease strictly"),
    (["--sigmas", "1,0.5", "--steps", "3"], "2 sigmas/timesteps but 3 steps"),
    (["--cache-threshold", "0.1"], "a cache threshold needs a cache"),
    (["--cache", "teacache", "--cache-threshold", "-1"], "threshold must be a number >= 0"),
    (["--lora", "missing.safetensors"], "LoRA file 'missing.safetensors' does not exist"),
    (["--lora-low", "missing.safetensors"], "has one transformer, not two experts"),
])
def test_bad_few_step_lora_and_cache_flags(flags, match, capsys, tmp_path):
    argv = ["--prompt", "a cat", *FAST, "--output", str(tmp_path / "out.mp4"), *flags]
    bad(argv, capsys, tmp_path, match)


def test_lora_few_step_and_cache_flags(capsys, tmp_path):
    """A LoRA with a scale, a given 4-sigma Euler schedule, no CFG and a step cache: the run says how
    many steps skipped the DiT blocks."""
    import torch
    from safetensors.torch import save_file

    from wan_tpu.configs.models import VARIANTS

    d = VARIANTS["tiny"].transformer.inner_dim
    lora = tmp_path / "style.safetensors"
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(4, d) * 0.1,
               "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.randn(d, 4) * 0.1}, str(lora))
    argv = ["--prompt", "a cat", "--model", "tiny", "--quiet", "--size", "32*32", "--frames", "5",
            "--lora", f"{lora}:0.5", "--scheduler", "euler", "--sigmas", "1,0.75,0.5,0.25", "--shift", "5",
            "--guidance", "1", "--cache", "fbcache", "--output", str(tmp_path / "v.mp4")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "steps skipped" in out and "of 4  (fbcache, threshold 0.05)" in out
    assert read_video(str(tmp_path / "v.mp4"))[0].shape == (5, 32, 32, 3)


def test_missing_checkpoint_part(capsys, tmp_path):
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.wan.presets import save_diffusers_checkpoint

    ckpt = tmp_path / "ckpt"
    save_diffusers_checkpoint(str(ckpt), VARIANTS["tiny"].transformer, TINY_VAE)
    for sub in ("vae", "text_encoder"):
        os.rename(ckpt / sub, tmp_path / sub)
    bad(["--prompt", "a cat", "--model", str(ckpt), "--output", str(tmp_path / "o.mp4")], capsys, tmp_path,
        "has no vae/ folder")
    os.rename(tmp_path / "vae", ckpt / "vae")
    bad(["--prompt", "a cat", "--model", str(ckpt), "--output", str(tmp_path / "o.mp4")], capsys, tmp_path,
        "has no text_encoder/ folder")
    os.rename(tmp_path / "text_encoder", ckpt / "text_encoder")
    os.remove(ckpt / "transformer" / "config.json")
    bad(["--prompt", "a cat", "--model", str(ckpt), "--output", str(tmp_path / "o.mp4")], capsys, tmp_path,
        "config.json is missing")


def test_stage_file_from_another_run_is_refused(generated, capsys, tmp_path):
    stage1 = str(generated / "stages" / "stage1.safetensors")
    stage2 = str(generated / "stages" / "stage2.safetensors")
    out = str(tmp_path / "s2.safetensors")
    capsys.readouterr()
    denoise = script("stage2_denoise")
    before = sorted(os.listdir(tmp_path))
    assert denoise(["--model", "tiny", "--size", "64*64", "--frames", "5", "--input", stage1, "--output", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "size 32*48" in err and "size 64*64" in err
    # A latents file is not an embeddings file.
    assert denoise(["--model", "tiny", "--size", "32*48", "--frames", "5", "--input", stage2, "--output", out]) == 2
    assert "'latents' stage" in capsys.readouterr().err
    assert script("stage3_decode")(["--model", "tiny", "--frames", "9", "--input", stage2, "--output",
                                    str(tmp_path / "v.mp4")]) == 2
    assert "frames 5" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == before


def test_stage_file_from_another_model_is_refused(generated, capsys, tmp_path):
    from wan_tpu.configs.models import WanTransformerConfig
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.wan.presets import save_diffusers_checkpoint

    other = tmp_path / "other"
    cfg = WanTransformerConfig(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64,
                               num_layers=1)
    save_diffusers_checkpoint(str(other), cfg, TINY_VAE)
    capsys.readouterr()
    code = script("stage3_decode")(["--model", str(other), "--input", str(generated / "stages" / "stage2.safetensors"),
                                    "--output", str(tmp_path / "v.mp4")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model config" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "v.mp4").exists()


def test_cli_entry_point_exit_status():
    """The real `python -m wan_tpu.generate` process: status 2 and a single stderr line."""
    proc = subprocess.run([sys.executable, "-m", "wan_tpu.generate", "--prompt", "x", "--frames", "6"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "4n+1" in proc.stderr


def test_mfu_uses_the_anchor_flop_count():
    """DiT model FLOPs per forward as in docs (shared anchors): 1.3B 480p 2.83e14, 14B 720p 6.52e15."""
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.runtime.profiling import dit_forward_flops, mfu, peak_flops

    assert abs(dit_forward_flops(VARIANTS["wan2.1-t2v-1.3b"].transformer, 32760) / 2.83e14 - 1) < 0.005
    assert abs(dit_forward_flops(VARIANTS["wan2.1-t2v-14b"].transformer, 75600) / 6.52e15 - 1) < 0.005

    class H200:
        device_kind = "NVIDIA H200"

    assert peak_flops(H200())[0] == 772e12
    assert mfu(772e12 * 0.5, 1.0, 1, H200())[0] == "50.0%"
    assert mfu(1e12, 1.0, 1, type("Cpu", (), {"device_kind": "cpu"})())[0] == "n/a"


def test_image_to_video_cli(capsys, tmp_path):
    """I2V (Wan 2.1 layout: 36-channel DiT + CLIP) through the CLI: frames of the requested size; no image → exit 2."""
    import dataclasses

    from PIL import Image
    from transformers import CLIPVisionConfig

    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.wan.presets import save_diffusers_checkpoint

    ckpt, image = tmp_path / "i2v", tmp_path / "first.png"
    dit = dataclasses.replace(VARIANTS["tiny"].transformer, in_channels=36, image_dim=32, added_kv_proj_dim=64)
    clip = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            image_size=32, patch_size=8)
    save_diffusers_checkpoint(str(ckpt), dit, TINY_VAE, image_encoder=clip)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(image)
    common = ["--model", str(ckpt), "--prompt", "a cat", "--size", "48*32", "--frames", "5", "--steps", "2", "--quiet"]
    assert main([*common, "--image", str(image), "--output", str(tmp_path / "v.mp4")]) == 0
    assert read_video(str(tmp_path / "v.mp4"))[0].shape == (5, 32, 48, 3)
    bad([*common, "--output", str(tmp_path / "w.mp4")], capsys, tmp_path, "pass the first frame with --image")


def test_stage_files_carry_their_settings(tmp_path, monkeypatch):
    """Stage 2 with only --input takes the model, size, frames, guidance and dtype from the stage-1
    file; stage 3 with only --input takes the model, size and frames from the stage-2 file. The result
    equals stage 2 run with every flag spelled out."""
    monkeypatch.chdir(tmp_path)
    settings = ["--model", "tiny", "--size", "32*48", "--frames", "5", "--guidance", "3", "--dtype", "float32"]
    assert script("stage1_encode")(["--prompt", "a cat", *settings, "--output", "s1.safetensors"]) == 0
    assert script("stage2_denoise")(["--input", "s1.safetensors", "--quiet"]) == 0
    _, meta = load_stage("stage2.safetensors")
    assert (meta.model, meta.size, meta.frames, meta.guidance, meta.dtype, meta.seed, meta.scheduler) == (
        "tiny", "32*48", 5, 3.0, "float32", 0, "unipc")
    assert meta.steps == 4 and meta.prompt == "a cat"  # the tiny model's default steps
    assert script("stage2_denoise")([*settings, "--seed", "0", "--input", "s1.safetensors", "--output",
                                     "spelled.safetensors", "--quiet"]) == 0
    assert np.array_equal(load_stage("stage2.safetensors")[0]["latents"], load_stage("spelled.safetensors")[0]["latents"])
    assert script("stage3_decode")(["--input", "stage2.safetensors"]) == 0
    assert read_video("output.mp4")[0].shape == (5, 48, 32, 3)


def test_prompt_may_be_empty_with_guidance(tmp_path):
    """An empty prompt runs with CFG against the (official) negative prompt, as the README says."""
    assert main(["--prompt", "", *FAST, "--size", "32*32", "--output", str(tmp_path / "v.mp4")]) == 0

