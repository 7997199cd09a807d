"""Reading the Matrix-Game-2 golden files (`scripts/make_golden_matrix_game.py`, the authors' code on CPU).

Each `tests/data/matrix_game_{case}.npz` holds the reference outputs and, in `meta`, the config, the
reference commit and the seeds its inputs were drawn from; `matrix_game_{case}.safetensors` holds the
random weights under the released checkpoints' names (`model.blocks.0.self_attn.q.weight`, …).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).parents[1] / "data"
LATENT = (44, 80)


def randn(seed: int, shape) -> np.ndarray:
    """The script's input convention."""
    return np.random.RandomState(seed).standard_normal(tuple(shape)).astype(np.float32)


def golden(case: str):
    """(arrays, meta) of one golden case; `meta["inputs"]` regenerated into `meta["arrays"]`."""
    data = np.load(DATA / f"matrix_game_{case}.npz")
    meta = json.loads(str(data["meta"]))
    meta["arrays"] = {name: randn(seed, shape) for name, (seed, shape) in meta["inputs"].items()}
    return data, meta


def weights(case: str) -> str:
    return str(DATA / f"matrix_game_{case}.safetensors")


def rel_err(ours, ref) -> float:
    """max |ours − ref| / max |ref|: the relative error the tolerances refer to."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())
