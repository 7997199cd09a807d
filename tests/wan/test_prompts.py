"""`--prompts FILE` (`wan_tpu.wan.prompts`): several videos in one run with each component loaded once,
predictable output names, per-line settings; a bad line is refused with its line number (exit 2)
before anything is loaded or written."""

import json
import os

import numpy as np
import pytest

from wan_tpu.runtime.video import read_video
from wan_tpu.wan import presets
from wan_tpu.wan.cli import main
from wan_tpu.wan.prompts import numbered_output, read_prompts

FAST = ["--model", "tiny", "--size", "32*32", "--frames", "5", "--steps", "2", "--quiet"]


@pytest.fixture
def load_counts(monkeypatch):
    """Component name → how many times the tiny preset's loader for it ran."""
    counts, tiny = {}, presets.PRESETS["tiny"]

    def counting_tiny(cls, **kwargs):
        pipe = tiny(cls, **kwargs)
        loaders = pipe._loaders

        def counted(name):
            counts[name] = counts.get(name, 0) + 1
            return loaders[name]()

        pipe._loaders = {name: (lambda name=name: counted(name)) for name in loaders}
        return pipe

    monkeypatch.setitem(presets.PRESETS, "tiny", counting_tiny)
    return counts


def test_three_prompts_three_videos_one_load(tmp_path, load_counts, capsys):
    lines = [{"prompt": "a cat walks", "seed": 1}, {"prompt": "a dog runs"},
             {"prompt": "a cat walks", "seed": 1, "output": str(tmp_path / "custom.mp4")}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    out = tmp_path / "videos"
    out.mkdir()
    assert main(["--prompts", str(prompts), *FAST, "--output", str(out / "clip.mp4")]) == 0
    assert sorted(os.listdir(out)) == ["clip_001.mp4", "clip_002.mp4"]
    assert load_counts == {"text_encoder": 1, "transformer": 1, "vae": 1}
    first, second, third = (read_video(str(p))[0] for p in (out / "clip_001.mp4", out / "clip_002.mp4",
                                                             tmp_path / "custom.mp4"))
    assert first.shape == (5, 32, 32, 3)
    assert np.array_equal(first, third) and not np.array_equal(first, second)  # same prompt and seed, same video
    assert capsys.readouterr().out.count("wrote ") == 3


def test_plain_text_file_and_output_names(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n\n  a dog on the grass  \n")
    jobs = read_prompts(str(prompts), "out/v.mp4")
    assert [(j.prompt, j.output, j.line) for j in jobs] == [("a cat", "out/v_001.mp4", 1),
                                                            ("a dog on the grass", "out/v_002.mp4", 3)]
    assert numbered_output("v.mp4", 7, 1500) == "v_0007.mp4"


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "a cat"}\n{"prompt": "a dog", "seed": "one"}\n', "line 2: \"seed\" must be a non-negative integer"),
    ('{"prompt": "a cat"}\n{"prompt": "a dog"\n', "line 2 is not valid JSON"),
    ('{"prompt": "a cat"}\n\n{"text": "a dog"}\n', "line 3 has unknown key 'text'"),
    ('{"prompt": "a cat"}\n["a dog"]\n', "line 2 is not a JSON object"),
    ('{"seed": 3}\n', "line 1 needs a \"prompt\" string"),
    ('{"prompt": "a", "output": "x.mp4"}\n{"prompt": "b", "output": "x.mp4"}\n', "line 2: output x.mp4 is also line 1's"),
    ('{"prompt": "a", "output": "x.avi"}\n', "line 1: output 'x.avi' must end in .mp4"),
    ('{"prompt": "", "negative_prompt": ""}\n', "line 1: the prompt is empty"),
    ('{"prompt": "a", "image": "missing.png"}\n', "line 1: tiny is a text-to-video model"),
    ("\n\n", "holds no prompt"),
])
def test_bad_line_is_refused_before_any_work(content, match, tmp_path, load_counts, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(content)
    before = sorted(os.listdir(tmp_path))
    capsys.readouterr()
    assert main(["--prompts", "p.jsonl", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert sorted(os.listdir(tmp_path)) == before and load_counts == {}


def test_existing_output_is_refused_naming_the_line(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a cat\na dog\n")
    (tmp_path / "v_002.mp4").write_bytes(b"precious")
    capsys.readouterr()
    assert main(["--prompts", str(tmp_path / "p.txt"), *FAST, "--output", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err
    assert "p.txt line 2: output" in err and "--overwrite" in err
    assert (tmp_path / "v_002.mp4").read_bytes() == b"precious" and not (tmp_path / "v_001.mp4").exists()


def test_prompt_and_prompts_exclude_each_other(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a cat\n")
    assert main(["--prompt", "a", "--prompts", str(tmp_path / "p.txt"), *FAST]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["--prompts", str(tmp_path / "p.txt"), "--keep-stages", str(tmp_path / "s"), *FAST]) == 2
    assert "--keep-stages writes the stage files of one video" in capsys.readouterr().err
