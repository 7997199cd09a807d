"""The official Wan generate.py names (`wan_tpu.wan.official`): the same command written with them gives
bit-identical latents and frames to ours; `--task` is checked against the checkpoint; official flags
with no counterpart get a one-line answer; `--help` lists every alias."""

import numpy as np
import pytest

from wan_tpu.runtime.video import read_video
from wan_tpu.wan.cli import build_parser, main
from wan_tpu.wan.official import ALIASES
from wan_tpu.wan.stages import load_stage

OURS = ["--model", "tiny", "--size", "32*48", "--frames", "5", "--steps", "3", "--shift", "4", "--guidance", "4",
        "--seed", "7", "--scheduler", "dpm++"]
OFFICIAL = ["--task", "t2v-1.3B", "--ckpt_dir", "tiny", "--size", "32*48", "--frame_num", "5", "--sample_steps", "3",
            "--sample_shift", "4", "--sample_guide_scale", "4", "--base_seed", "7", "--sample_solver", "dpm++"]


def test_official_names_give_the_same_latents(tmp_path):
    runs = {}
    for name, flags, out_flag in (("ours", OURS, "--output"), ("official", OFFICIAL, "--save_file")):
        out = tmp_path / name
        argv = ["--prompt", "a cat walks", *flags, "--quiet", out_flag, str(out / "v.mp4"), "--keep-stages", str(out)]
        out.mkdir()
        assert main(argv) == 0
        latents, meta = load_stage(str(out / "stage2.safetensors"))
        runs[name] = latents["latents"], meta, read_video(str(out / "v.mp4"))[0]
    (a, meta_a, frames_a), (b, meta_b, frames_b) = runs["ours"], runs["official"]
    assert np.array_equal(a, b) and np.array_equal(frames_a, frames_b)
    assert meta_a == meta_b
    assert (meta_b.seed, meta_b.steps, meta_b.shift, meta_b.guidance, meta_b.scheduler, meta_b.frames) == (
        7, 3, 4.0, 4.0, "dpm++", 5)


def test_help_lists_every_official_name():
    text = build_parser().format_help()
    for ours, official in ALIASES.items():
        assert ours in text and official in text, official


@pytest.mark.parametrize("flags,match", [
    (["--task", "i2v-14B"], "--task i2v-14B does not match the checkpoint, which holds tiny (t2v)"),
    (["--task", "flf2v-14B"], "is not one wan_tpu runs"),
    (["--ulysses_size", "4"], "pass --mesh 1,N,1"),
    (["--offload_model", "True"], "released when its stage is done"),
    (["--sample_solver", "ddim"], "invalid choice"),
])
def test_official_flags_we_do_not_take(flags, match, tmp_path, capsys):
    capsys.readouterr()
    assert main(["--prompt", "a cat", "--save_file", str(tmp_path / "v.mp4"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_negative_seed_draws_one_and_says_which(capsys):
    """--base_seed -1 (the official default) draws a random seed and prints it, so the video can be remade."""
    from wan_tpu.wan.cli import resolve_defaults

    args = build_parser().parse_args(["--prompt", "a cat", "--base_seed", "-1"])
    resolve_defaults(args)
    assert 0 <= args.seed < 2**31
    assert f"seed: {args.seed} (random; pass --seed {args.seed}" in capsys.readouterr().out
