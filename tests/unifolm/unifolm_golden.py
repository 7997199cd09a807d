"""Test helpers around the UniFoLM goldens (`tests/data/unifolm_golden_*.npz`, made by
`scripts/make_golden_unifolm.py`): reading them, rebuilding the checkpoint they ran on, comparing."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx
from unifolm_weights import write_checkpoint

from wan_tpu.configs.unifolm import CONFIGS, config_to_json

DATA = os.path.join(os.path.dirname(__file__), os.pardir, "data")
B, T, LAT, IMG, D, CLIP_DIM, A = 2, 16, 16, 128, 64, 32, 16
MAP_SHAPES = [(32, 16), (64, 8), (128, 4), (128, 2), (128, 2), (128, 2), (128, 4), (64, 8), (32, 16)]


def golden(group: str) -> dict:
    z = np.load(os.path.join(DATA, f"unifolm_golden_{group}.npz"))
    return {k: (json.loads(str(z[k])) if k == "meta" else z[k]) for k in z.files}


def assert_close(ours, theirs, tol: float, what: str = ""):
    """Relative L2 error ‖ours − theirs‖₂ / ‖theirs‖₂ ≤ tol, and no single element off by more than
    3·tol·max|theirs| (a localized error cannot hide in the norm)."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    l2 = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
    worst = float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))
    assert l2 <= tol and worst <= 3 * tol, f"{what}: relative L2 error {l2:.2e}, worst element {worst:.2e} (tol {tol})"


def jitted(module, method: str):
    """`module.method` compiled (eager dispatch of the UNet's thousands of ops is slow on CPU)."""
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda st, *a: getattr(nnx.merge(graphdef, st), method)(*a))
    return lambda *a: fn(state, *a)


def write_tiny(folder: str, base: bool = False) -> str:
    g = golden("unet")
    prefix = "base_buffer/" if base else "buffer/"
    buffers = {k[len(prefix):]: v for k, v in g.items() if k.startswith(prefix)}
    cfg = CONFIGS["unifolm-tiny-base" if base else "unifolm-tiny"]
    write_checkpoint(folder, g["meta"]["base_manifest" if base else "manifest"], buffers, config_to_json(cfg))
    return folder
