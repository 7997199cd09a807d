"""Matrix-Game-2 actions (`wan_tpu/matrix_game/actions.py`): the interactive grammar, action files, and the
random benchmark trajectories against the authors' `Bench_actions_*` (golden
`tests/data/matrix_game_actions.safetensors` from `scripts/make_golden_matrix_game_vae_clip.py`: exact)."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from wan_tpu.configs.matrix_game import get_variant
from wan_tpu.errors import WanInputError
from wan_tpu.matrix_game import actions

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "data", "matrix_game_actions.safetensors")
UNIVERSAL, GTA, TEMPLERUN = (actions.action_space(get_variant(n)) for n in ("universal", "gta_drive", "templerun"))


@pytest.mark.parametrize("space", [UNIVERSAL, GTA, TEMPLERUN], ids=lambda s: s.family)
def test_random_actions_are_the_authors(space):
    golden = load_file(GOLDEN)
    keyboard, mouse = actions.random_actions(space, 597, seed=0)
    np.testing.assert_array_equal(keyboard, golden[f"{space.family}.keyboard"])
    if space.mouse:
        np.testing.assert_array_equal(mouse, golden[f"{space.family}.mouse"])
    else:
        assert mouse is None


@pytest.mark.parametrize("space, line, keyboard, mouse", [
    (UNIVERSAL, "w", [1, 0, 0, 0], [0, 0]),
    (UNIVERSAL, "a+d", [0, 0, 1, 1], [0, 0]),
    (UNIVERSAL, "w mouse up", [1, 0, 0, 0], [0.1, 0]),
    (UNIVERSAL, "forward+l", [1, 0, 0, 0], [0, 0.1]),  # spelled out; the authors' camera letter
    (UNIVERSAL, "q u", [0, 0, 0, 0], [0, 0]),
    (GTA, "w a", [1, 0], [0, -0.1]),  # steering is the mouse's horizontal axis
    (GTA, "s+d", [0, 1], [0, 0.1]),
    (TEMPLERUN, "z", [0, 0, 0, 1, 0, 0, 0], None),
    (TEMPLERUN, "q", [1, 0, 0, 0, 0, 0, 0], None),  # nothing held is nomove
    (TEMPLERUN, "jump", [0, 1, 0, 0, 0, 0, 0], None),
])
def test_grammar(space, line, keyboard, mouse):
    k, m = actions.parse_line(line, space)
    np.testing.assert_allclose(k, keyboard)
    if mouse is None:
        assert m is None
    else:
        np.testing.assert_allclose(m, mouse, atol=1e-7)


@pytest.mark.parametrize("space, line", [(UNIVERSAL, "x"), (TEMPLERUN, "mouse up"), (GTA, "i")])
def test_grammar_rejects_unknown_words(space, line):
    with pytest.raises(WanInputError, match="unknown action"):
        actions.parse_line(line, space)


def test_frame_counts():
    assert [actions.chunk_frames(k) for k in range(3)] == [9, 12, 12]
    assert actions.check_frames(33) == 3 and actions.check_frames(597) == 50
    with pytest.raises(WanInputError, match="12n-3"):
        actions.check_frames(32)


def test_files(tmp_path):
    keyboard, mouse = actions.random_actions(UNIVERSAL, 21, seed=3)
    arrays = tmp_path / "a.json"
    arrays.write_text(json.dumps({"keyboard": keyboard.tolist(), "mouse": mouse.tolist()}))
    np.savez(tmp_path / "a.npz", keyboard=keyboard, mouse=mouse)
    for path in (arrays, tmp_path / "a.npz"):
        k, m = actions.load_actions(str(path), UNIVERSAL)
        np.testing.assert_array_equal(k, keyboard)
        np.testing.assert_array_equal(m, mouse)
    chunks = tmp_path / "c.json"
    chunks.write_text(json.dumps({"chunks": ["w", "a mouse left"]}))
    k, m = actions.load_actions(str(chunks), UNIVERSAL)
    assert k.shape == (21, 4) and m.shape == (21, 2)
    np.testing.assert_array_equal(k[:9], [[1, 0, 0, 0]] * 9)
    np.testing.assert_array_equal(m[9:], np.float32([[0, -0.1]] * 12))


@pytest.mark.parametrize("content, message", [
    ({"keyboard": [[1, 0, 0]] * 9, "mouse": [[0, 0]] * 9}, r"shape \(9, 3\), expected \(frames, 4\)"),
    ({"keyboard": [[1, 0, 0, 0]] * 9, "mouse": [[0, 0]] * 8}, "9 rows, mouse 8"),
    ({"keyboard": [[1, 0, 0, 0]] * 9, "mouse": [[0, 0]] * 9, "jump": 1}, "unknown name 'jump'"),
    ({"keyboard": [[1, 0, 0, 0]] * 9}, "lacks keyboard and mouse"),
    ({"chunks": ["w", "fly"]}, "unknown action 'fly'"),
    ([1, 2], "must hold a JSON object"),
])
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(WanInputError, match=message):
        actions.load_actions(str(path), UNIVERSAL)


def test_pipeline_arrays_are_checked():
    with pytest.raises(WanInputError, match="no mouse"):
        actions.check_actions(np.zeros((9, 7)), np.zeros((9, 2)), TEMPLERUN)
    with pytest.raises(WanInputError, match="needs mouse"):
        actions.check_actions(np.zeros((9, 4)), None, UNIVERSAL)
    with pytest.raises(WanInputError, match="9 frames"):
        actions.check_actions(np.zeros((12, 4)), np.zeros((12, 2)), UNIVERSAL, frames=9)
