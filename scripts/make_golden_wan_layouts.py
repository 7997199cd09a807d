"""Golden file of the official Wan DiT layout, made with the authors' `WanModel` on CPU.

    python scripts/make_golden_wan_layouts.py --wan21 third_party/Wan2.1 --wan22 third_party/Wan2.2 [--out tests/data]

`--wan21` / `--wan22` are checkouts of Wan-Video/Wan2.1 and Wan-Video/Wan2.2 (e.g. cloned into
`third_party/`, a folder of this checkout that git ignores); their commits are recorded in the file.
Their `wan/modules/model.py` is imported unmodified (its package's `__init__` and the flash-attention
module are stubbed: only the constructor runs), built at the tiny preset's widths for each model type
(2.1 t2v and i2v, 2.2 ti2v and i2v), and saved with its own `save_pretrained`, exactly as the official
checkpoints were written. Recorded per model: the `config.json` it wrote and every tensor's name,
shape and dtype from the safetensors header. `tests/wan/test_checkpoint_formats.py` checks our
original ↔ diffusers renames and config reading against it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types

TINY = dict(dim=64, num_heads=2, ffn_dim=128, freq_dim=32, text_dim=32, num_layers=2, eps=1e-6)
MODELS = {
    "wan2.1-t2v": ("wan21", dict(model_type="t2v", in_dim=16, out_dim=16)),
    "wan2.1-i2v": ("wan21", dict(model_type="i2v", in_dim=36, out_dim=16)),
    "wan2.2-ti2v": ("wan22", dict(model_type="ti2v", in_dim=48, out_dim=48)),
    "wan2.2-i2v": ("wan22", dict(model_type="i2v", in_dim=36, out_dim=16)),
}


def load_model_module(repo: str, tag: str):
    """`wan/modules/model.py` of `repo` as module `<tag>.modules.model`, with stub parent packages."""
    for name in (tag, f"{tag}.modules"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    attention = types.ModuleType(f"{tag}.modules.attention")
    attention.flash_attention = None  # the forward is never run here
    sys.modules[attention.__name__] = attention
    spec = importlib.util.spec_from_file_location(f"{tag}.modules.model", os.path.join(repo, "wan", "modules", "model.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def header(path: str) -> dict:
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    return {k: [v["dtype"], v["shape"]] for k, v in sorted(head.items()) if k != "__metadata__"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wan21", required=True)
    parser.add_argument("--wan22", required=True)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    args = parser.parse_args()
    import torch

    torch.manual_seed(0)
    repos = {"wan21": args.wan21, "wan22": args.wan22}
    modules = {tag: load_model_module(repo, tag) for tag, repo in repos.items()}
    out = {"commits": {tag: subprocess.check_output(["git", "-C", repo, "rev-parse", "HEAD"], text=True).strip()
                       for tag, repo in repos.items()}, "models": {}}
    for name, (tag, kwargs) in MODELS.items():
        model = modules[tag].WanModel(**TINY, **kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            with open(os.path.join(tmp, "config.json")) as f:
                config = json.load(f)
            files = sorted(n for n in os.listdir(tmp) if n.endswith(".safetensors"))
            tensors = {}
            for file in files:
                tensors.update(header(os.path.join(tmp, file)))
        out["models"][name] = {"config": config, "files": files, "tensors": tensors}
    path = os.path.join(args.out, "wan_official_layouts.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
