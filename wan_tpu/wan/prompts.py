"""`--prompts FILE`: many videos from one process, loading and compiling once.

    python -m wan_tpu.generate --model tiny --prompts prompts.txt --output videos/cat.mp4

The file is either plain text, one prompt per line, or JSONL (when its first non-blank line starts
with `{`), one object per line:

    {"prompt": "a cat walks on the grass", "seed": 3}
    {"prompt": "a red fox in snow", "negative_prompt": "", "image": "fox.png", "output": "fox.mp4"}

Keys: `prompt` (required), `negative_prompt`, `seed`, `image`, `output`; a key left out takes the
command line's value (`--negative-prompt`, `--seed`, `--image`). Blank lines are skipped.

Outputs: a line's `output`, else `<stem>_<n>.<ext>` beside `--output` (default `output.mp4`), where
`n` is the prompt's position in the file counting from 1, zero-padded to three digits
(`output_001.mp4`, `output_002.mp4`, ...). Every output is checked before any work starts: none
may exist (unless `--overwrite`), and no two lines may name the same file. A malformed line is
reported with its line number, exit status 2, before anything is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from wan_tpu.errors import WanInputError

KEYS = ("prompt", "negative_prompt", "seed", "image", "output")


@dataclass(frozen=True)
class Job:
    """One video to make. None fields take the command line's values; `line` is the file line (None
    for `--prompt`)."""

    prompt: str
    output: str
    negative_prompt: str | None = None
    seed: int | None = None
    image: str | None = None
    line: int | None = None

    def where(self, path: str | None) -> str:
        """The prefix of a message about this job: `FILE line N: ` (empty for `--prompt`)."""
        return "" if self.line is None else f"{path} line {self.line}: "


def numbered_output(output: str, index: int, count: int) -> str:
    """`<stem>_<index>.<ext>`: the output of the index-th prompt (1-based) of `count`."""
    stem, ext = os.path.splitext(output)
    return f"{stem}_{index:0{max(3, len(str(count)))}d}{ext}"


def read_prompts(path: str, output: str) -> list[Job]:
    """The jobs of a prompts file (see the module docstring); WanInputError names the bad line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise WanInputError(f"prompts file {path} does not exist; fix the --prompts path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WanInputError(f"prompts file {path} cannot be read as UTF-8 text ({e}); fix the file") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise WanInputError(f"prompts file {path} holds no prompt; write one prompt per line (or JSONL)")
    jsonl = numbered[0][1].lstrip().startswith("{")
    fields = [_parse(path, n, line) if jsonl else {"prompt": line.strip()} for n, line in numbered]
    jobs, seen = [], {}
    for index, ((n, _), f) in enumerate(zip(numbered, fields), 1):
        out = f.get("output") or numbered_output(output, index, len(numbered))
        key = os.path.abspath(out)
        if key in seen:
            raise WanInputError(f"{path} line {n}: output {out} is also line {seen[key]}'s; give each line its own output")
        seen[key] = n
        jobs.append(Job(f["prompt"], out, f.get("negative_prompt"), f.get("seed"), f.get("image"), n))
    return jobs


def _parse(path: str, n: int, line: str) -> dict:
    where = f"{path} line {n}"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise WanInputError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); write one JSON object per line") from None
    if not isinstance(value, dict):
        raise WanInputError(f"{where} is not a JSON object; write e.g. {{\"prompt\": \"a cat\", \"seed\": 3}}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise WanInputError(f"{where} has unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    if not isinstance(value.get("prompt"), str):
        raise WanInputError(f"{where} needs a \"prompt\" string")
    for key in ("negative_prompt", "image", "output"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise WanInputError(f"{where}: {key!r} must be a string, got {value[key]!r}")
    seed = value.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise WanInputError(f"{where}: \"seed\" must be a non-negative integer, got {seed!r}")
    return value
