"""Deterministic random tensors shared by `scripts/make_golden_unifolm.py` and the UniFoLM tests.

The goldens keep only outputs: weights (ResNet18 ×2 alone is 22M parameters) and large inputs are
regenerated here from their names, so the test rebuilds exactly the checkpoint and inputs the authors'
code ran on, writes the checkpoint in the converter's layout and loads it through our real loader.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np


def det(name: str, shape, scale: float = 1.0) -> np.ndarray:
    """Standard normal × scale, float32, seeded by `name` only."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (rng.standard_normal(tuple(shape)) * scale).astype(np.float32)


def init_tensor(name: str, shape) -> np.ndarray:
    """A parameter in torch layout: weights ~ N(0, 1/fan_in), 1-D `weight`s (norms) ~ 1 + N(0, 0.1²),
    biases ~ N(0, 0.05²), embeddings/latents ~ N(0, 0.5²)."""
    shape = tuple(shape)
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) >= 2 and leaf == "weight":
        return det(name, shape, 1.0 / np.sqrt(np.prod(shape[1:])))
    if leaf == "weight":
        return 1.0 + det(name, shape, 0.1)
    if leaf == "bias":
        return det(name, shape, 0.05)
    return det(name, shape, 0.5)


def write_checkpoint(folder: str, manifest: dict, buffers: dict, config: dict) -> None:
    """A converted checkpoint folder (config.json + one safetensors per component) from a golden's
    manifest {component: [[name, shape, kind], ...]}, kind "param" | "buffer" | "alias:<name>"."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    for component, entries in manifest.items():
        tensors = {}
        for name, shape, kind in entries:
            if kind == "param":
                tensors[name] = init_tensor(f"{component}:{name}", shape)
            elif kind == "buffer":
                tensors[name] = buffers[f"{component}:{name}"]
        for name, _shape, kind in entries:
            if kind.startswith("alias:"):
                tensors[name] = tensors[kind[len("alias:"):]]
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(folder, f"{component}.safetensors"))
