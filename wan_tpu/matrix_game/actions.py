"""Matrix-Game-2 actions: per-video-frame keyboard and mouse arrays, from files, from a seed, from text.

Each variant's keyboard is a multi-hot vector, one row per video frame, its columns the variant's
`keyboard_keys` (`wan_tpu.configs.matrix_game`); the mouse (absent for templerun) is [vertical,
horizontal] camera motion per frame (up = +, right = +; the authors use ±0.1):

    universal  keyboard 4: w (forward), s (back), a (left), d (right); mouse 2 (also foundation, tiny)
    gta_drive  keyboard 2: w (forward), s (back); mouse 2 (steering: horizontal ±0.1)
    templerun  keyboard 7: nomove, jump, slide, turnleft, turnright, leftside, rightside; no mouse
               (no key held is nomove = [1, 0, ...])

**Action files** (`--actions FILE`), one row per video frame (a video of N frames, N = 12n - 3):
- `.json`: `{"keyboard": [[1, 0, 0, 0], ...], "mouse": [[0.0, 0.1], ...]}` (no "mouse" for templerun), or
  `{"chunks": ["w", "w+a mouse left", ...]}`: one line of the interactive grammar below per chunk (the
  first chunk is 9 frames, the others 12), as if typed at `--interactive`.
- `.npz`: arrays `keyboard` (N, keys) and `mouse` (N, 2).

**Interactive grammar** (`--interactive`: one line per chunk on stdin; the authors' letters from
`inference_streaming.py`, also accepted spelled out). Items are separated by spaces or `+`:
- universal: `w` `s` `a` `d` (forward, back, left, right; several may combine, `a+d`), `q` no key;
  camera `i` `k` `j` `l` (up, down, left, right) or `mouse up|down|left|right`, `u` / `mouse none` still.
- gta_drive: `w` `s` (forward, back), `a` `d` steer left/right (the mouse's horizontal -0.1 / +0.1), `q` nothing.
- templerun: `w` jump, `s` slide, `a` leftside, `d` rightside, `z` turnleft, `c` turnright, `q` nomove.
An empty line repeats the previous chunk's action; `quit`, `exit`, `n` or end of input stops.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import numpy as np

from wan_tpu.errors import WanInputError

CAMERA = 0.1  # the authors' camera step (CAM_VALUE)
MOUSE_DIRECTIONS = {"up": (CAMERA, 0.0), "down": (-CAMERA, 0.0), "left": (0.0, -CAMERA), "right": (0.0, CAMERA),
                    "none": (0.0, 0.0)}


@dataclass(frozen=True)
class ActionSpace:
    """The actions a variant takes: its keyboard columns (`keyboard_keys` of the variant's config), whether it
    has a mouse, and the words of the interactive grammar (word → column name, "mouse <direction>", or None
    for "nothing")."""

    family: str
    keys: tuple[str, ...]
    mouse: bool
    words: dict
    idle_key: str | None = None  # the column meaning "no action" (templerun's nomove), set when nothing is pressed

    @property
    def keyboard_dim(self) -> int:
        return len(self.keys)


_CAMERA_WORDS = {"i": "mouse up", "k": "mouse down", "j": "mouse left", "l": "mouse right", "u": "mouse none"}
WORDS = {  # the authors' letters (inference_streaming.py), then the same actions spelled out
    "universal": {"q": None, "forward": "w", "back": "s", "left": "a", "right": "d", **_CAMERA_WORDS},
    "gta_drive": {"q": None, "a": "mouse left", "d": "mouse right", "forward": "w", "back": "s"},
    "templerun": {"q": None, "w": "jump", "s": "slide", "a": "leftside", "d": "rightside", "z": "turnleft",
                  "c": "turnright"},
}
FAMILIES = {"foundation": "universal", "matrix-game-tiny": "universal"}  # variants that act like another
STOP_WORDS = ("quit", "exit", "n")


def family(variant_name: str) -> str:
    return FAMILIES.get(variant_name, variant_name)


def action_space(variant) -> ActionSpace:
    """The `ActionSpace` of a `MatrixGameVariant`."""
    name = family(variant.name)
    if name not in WORDS:
        raise WanInputError(f"no action grammar for variant {variant.name!r}; known: {', '.join(WORDS)}")
    keys = tuple(variant.keyboard_keys)
    return ActionSpace(name, keys, variant.mouse, WORDS[name], "nomove" if "nomove" in keys else None)


def chunk_frames(chunk: int, latent_frames_per_chunk: int = 3) -> int:
    """Video frames of chunk `chunk` (0-based): the first latent frame of the video gives one frame."""
    return 4 * latent_frames_per_chunk - (3 if chunk == 0 else 0)


def check_frames(frames: int, latent_frames_per_chunk: int = 3) -> int:
    """The number of chunks of a `frames`-long video; frames must be 4·k·n - 3 (9, 21, 33, ... for k = 3)."""
    step = 4 * latent_frames_per_chunk
    if frames < step - 3 or (frames + 3) % step:
        lo = max(step - 3, (frames + 3) // step * step - 3)
        raise WanInputError(f"a Matrix-Game video has {step}n-3 frames ({step - 3}, {2 * step - 3}, {3 * step - 3}, ...: "
                            f"{latent_frames_per_chunk} latent frames per chunk), got {frames}; pass e.g. {lo} or {lo + step}")
    return (frames + 3) // step


def parse_line(line: str, space: ActionSpace) -> tuple[np.ndarray, np.ndarray | None]:
    """One line of the interactive grammar → (keyboard (keys,), mouse (2,) or None)."""
    keyboard = np.zeros(space.keyboard_dim, np.float32)
    mouse = np.zeros(2, np.float32) if space.mouse else None
    words = line.replace("+", " ").lower().split()
    names = set(space.keys)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "mouse" and space.mouse and i + 1 < len(words) and words[i + 1] in MOUSE_DIRECTIONS:
            word = f"mouse {words[i + 1]}"
            i += 1
        item = space.words[word] if word in space.words else word
        i += 1
        if item is None:
            continue
        if item.startswith("mouse ") and space.mouse and item[6:] in MOUSE_DIRECTIONS:
            mouse += np.asarray(MOUSE_DIRECTIONS[item[6:]], np.float32)
        elif item in names:
            keyboard[space.keys.index(item)] = 1.0
        else:
            words = sorted(set(space.keys) | set(space.words))
            raise WanInputError(f"unknown action {word!r} in {line.strip()!r}; this variant takes {' '.join(words)}"
                                + (", mouse up|down|left|right|none" if space.mouse else "") + " (see --help)")
    if space.idle_key is not None and not keyboard.any():
        keyboard[space.keys.index(space.idle_key)] = 1.0
    return keyboard, mouse


def chunk_actions(lines: list[str], space: ActionSpace, latent_frames_per_chunk: int = 3):
    """Per-chunk lines of the grammar → per-frame (keyboard (N, keys), mouse (N, 2) or None)."""
    keyboards, mice = [], []
    for k, line in enumerate(lines):
        keyboard, mouse = parse_line(line, space)
        n = chunk_frames(k, latent_frames_per_chunk)
        keyboards.append(np.repeat(keyboard[None], n, axis=0))
        if mouse is not None:
            mice.append(np.repeat(mouse[None], n, axis=0))
    return np.concatenate(keyboards), (np.concatenate(mice) if space.mouse else None)


def load_actions(path: str, space: ActionSpace, latent_frames_per_chunk: int = 3):
    """An action file (see the module docstring) → (keyboard (N, keys), mouse (N, 2) or None), checked."""
    if not os.path.isfile(path):
        raise WanInputError(f"action file {path} does not exist; pass a .json or .npz file with --actions")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        try:
            with open(path) as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WanInputError(f"action file {path} is not valid JSON ({e}); see --help for the format") from None
        if not isinstance(data, dict):
            raise WanInputError(f"action file {path} must hold a JSON object with keyboard/mouse or chunks; see --help")
        if "chunks" in data:
            _check_names(path, data, {"chunks"})
            if not isinstance(data["chunks"], list) or not all(isinstance(c, str) for c in data["chunks"]) or not data["chunks"]:
                raise WanInputError(f"action file {path}: chunks must be a non-empty list of action strings, e.g. [\"w\", \"w+a\"]")
            try:
                return chunk_actions(data["chunks"], space, latent_frames_per_chunk)
            except WanInputError as e:
                raise WanInputError(f"action file {path}: {e}") from None
    elif ext == ".npz":
        try:
            with np.load(path, allow_pickle=False) as f:
                data = {k: f[k] for k in f.files}
        except (OSError, ValueError) as e:
            raise WanInputError(f"action file {path} is not a readable .npz ({e}); save it with numpy.savez") from None
    else:
        raise WanInputError(f"action file {path} must be .json or .npz, got {ext or 'no extension'!r}")
    _check_names(path, data, {"keyboard", "mouse"} if space.mouse else {"keyboard"})
    if "keyboard" not in data or (space.mouse and "mouse" not in data):
        need = "keyboard and mouse" if space.mouse else "keyboard"
        raise WanInputError(f"action file {path} lacks {need}; this variant needs {need} arrays, one row per video frame")
    keyboard = _array(path, "keyboard", data["keyboard"], space.keyboard_dim)
    mouse = _array(path, "mouse", data["mouse"], 2) if space.mouse else None
    if mouse is not None and len(mouse) != len(keyboard):
        raise WanInputError(f"action file {path}: keyboard has {len(keyboard)} rows, mouse {len(mouse)}; "
                            "give one row per video frame in both")
    return keyboard, mouse


# The authors' actions: keys 0 or 1, mouse ±0.1 (see the module docstring). Values far outside what the
# model was trained on are refused as typos (1e30 would overflow the action MLP): keys in [0, 1], mouse
# within ±1, ten times the trained step.
KEY_RANGE = (0.0, 1.0)
MOUSE_LIMIT = 1.0


def check_values(name: str, array: np.ndarray, where: str = "") -> None:
    """`array` (keyboard or mouse rows) finite and in its range, else one line naming the fix."""
    prefix = f"{where}: " if where else ""
    if not np.isfinite(array).all():
        raise WanInputError(f"{prefix}{name} has NaN or infinite values")
    low, high = KEY_RANGE if name == "keyboard" else (-MOUSE_LIMIT, MOUSE_LIMIT)
    if array.size and (array.min() < low or array.max() > high):
        bad = array.min() if array.min() < low else array.max()
        raise WanInputError(f"{prefix}{name} value {bad:g} is outside [{low:g}, {high:g}]"
                            + ("; keys are 0 or 1" if name == "keyboard" else "; the authors' mouse steps are ±0.1"))


def _check_names(path: str, data: dict, known: set) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise WanInputError(f"action file {path}: unknown name {unknown[0]!r}; this variant takes {', '.join(sorted(known))}")


def _array(path: str, name: str, value, width: int) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise WanInputError(f"action file {path}: {name} is not a numeric array") from None
    if array.ndim != 2 or array.shape[1] != width or not len(array):
        raise WanInputError(f"action file {path}: {name} has shape {array.shape}, expected (frames, {width})")
    check_values(name, array, f"action file {path}")
    return array


def check_actions(keyboard, mouse, space: ActionSpace, frames: int | None = None):
    """Validate per-frame action arrays given to the pipeline → float32 (keyboard, mouse or None)."""
    keyboard = np.asarray(keyboard, np.float32)
    if keyboard.ndim != 2 or keyboard.shape[1] != space.keyboard_dim:
        raise WanInputError(f"keyboard must be (frames, {space.keyboard_dim}) for this variant, got {keyboard.shape}")
    check_values("keyboard", keyboard)
    if frames is not None and len(keyboard) != frames:
        raise WanInputError(f"keyboard has {len(keyboard)} rows, the video {frames} frames; give one row per video frame")
    if not space.mouse:
        if mouse is not None:
            raise WanInputError("this variant has no mouse input; pass mouse=None")
        return keyboard, None
    if mouse is None:
        raise WanInputError("this variant needs mouse actions (frames, 2): [vertical, horizontal] per video frame")
    mouse = np.asarray(mouse, np.float32)
    if mouse.shape != (len(keyboard), 2):
        raise WanInputError(f"mouse must be ({len(keyboard)}, 2) like the keyboard's rows, got {mouse.shape}")
    check_values("mouse", mouse)
    return keyboard, mouse


# ---- the authors' random benchmark trajectories (utils/conditions.py) ----

def _universal_data():
    single, double, camera = ["forward", "left", "right"], ["forward_left", "forward_right"], ["camera_l", "camera_r"]
    names = double * 5 + camera * 5 + single * 5 + [f"{a}_{c}" for a in single + double for c in camera]
    keys = {"forward": 0, "back": 1, "left": 2, "right": 3}
    cams = {"camera_l": [0, -CAMERA], "camera_r": [0, CAMERA]}
    return _segments(names, single + camera, keys, cams, 4)


def _gta_drive_data():
    single, camera = ["forward", "back"], ["camera_l", "camera_r"]
    names = camera * 2 + single * 2 + [f"{a}_{c}" for a in single for c in camera]
    return _segments(names, single + camera, {"forward": 0, "back": 1}, {"camera_l": [0, -CAMERA], "camera_r": [0, CAMERA]}, 2)


def _templerun_data():
    names = ["jump", "slide", "leftside", "rightside", "turnleft", "turnright", "nomove"]
    keys = {"nomove": 0, "jump": 1, "slide": 2, "turnleft": 3, "turnright": 4, "leftside": 5, "rightside": 6}
    return _segments(names, names, keys, {}, 7)


def _segments(names, base, keys, cams, dim, rows=4):
    """Each named action as 4 rows of keyboard and mouse, sub-actions matched by substring as the authors do."""
    data = []
    for name in names:
        keyboard, mouse = np.zeros((rows, dim), np.float32), np.zeros((rows, 2), np.float32)
        for sub in base:
            if sub in name:
                if sub in cams:
                    mouse[:] = cams[sub]
                else:
                    keyboard[:, keys[sub]] = 1
        data.append((keyboard, mouse))
    return data


RANDOM_DATA = {"universal": _universal_data, "gta_drive": _gta_drive_data, "templerun": _templerun_data}


def random_actions(space: ActionSpace, frames: int, seed: int):
    """The authors' `Bench_actions_<family>(frames)` after `random.seed(seed)`: segments of 12 frames (the
    first frame alone), each a random action of their list → (keyboard (frames, keys), mouse (frames, 2) or None)."""
    if (frames - 1) % 4:
        raise WanInputError(f"random actions need 4n+1 frames, got {frames}")
    data = RANDOM_DATA[space.family]()
    rng = random.Random(seed)
    keyboard = np.zeros((frames, space.keyboard_dim), np.float32)
    mouse = np.zeros((frames, 2), np.float32)
    current = 0
    while current < frames:
        length = [12][rng.randint(0, 0)]
        k, m = data[rng.randint(0, len(data) - 1)]
        if current == 0:
            keyboard[:1], mouse[:1] = k[:1], m[:1]
            current = 1
        else:
            length = min(length, frames - current)
            keyboard[current : current + length] = np.tile(k, (length // 4, 1))
            mouse[current : current + length] = np.tile(m, (length // 4, 1))
            current += length
    return keyboard, (mouse if space.mouse else None)
