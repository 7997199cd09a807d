"""Golden file for the official Wan component checkpoints, made with the authors' code on CPU (float32).

    python scripts/make_golden_wan_components.py --wan21 third_party/Wan2.1 --wan22 third_party/Wan2.2

`--wan21` / `--wan22` are checkouts of Wan-Video/Wan2.1 and Wan-Video/Wan2.2, e.g. cloned into
`third_party/` (a folder of this checkout that git ignores); their commits are recorded in the file.
Writes `tests/data/wan_components.safetensors`:

- `t5.*`: a small random `T5Encoder` of `wan/modules/t5.py` built as `umt5_xxl(encoder_only=True)`
  builds it (gated tanh-GELU feed-forward, a relative-position table per block), every tensor under the
  names of `models_t5_umt5-xxl-enc-bf16.pth` and in bfloat16 as that file stores them;
  `t5_ids` / `t5_mask` (two prompts, the second padded) and `t5_output`, the encoder's float32 output
  for them with those weights (padded positions zeroed, as `T5EncoderModel.__call__` cuts them off).
- metadata `vae21` / `vae22`: the state-dict names and shapes (JSON) of a small `WanVAE_` of Wan2.1's
  `wan/modules/vae.py`, built as `_video_vae` builds it (two residual blocks per level, the structure
  diffusers' single-file converter expects), and of Wan2.2's `wan/modules/vae2_2.py` (the structure of
  `Wan2.2_VAE.pth`: residual down/up blocks, 2×2 patchify). Names and shapes are what a loader of these
  files has to get right; the tests draw the values.

Runtime patches, none of which change the arithmetic: the `wan` packages are entered without their
`__init__` (which imports the whole generation stack); `wan/modules/tokenizers.py` is stubbed (no text
is tokenised); `torch.cuda.current_device`, evaluated as a default argument when t5.py is imported,
returns 0 on a CPU-only torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data")
T5 = dict(vocab=64, dim=32, dim_attn=32, dim_ffn=48, num_heads=4, num_layers=2, num_buckets=32, shared_pos=False,
          dropout=0.0)
VAE21 = dict(dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
             temperal_downsample=[False, True, True], dropout=0.0)
VAE22 = dict(dim=4, dec_dim=4, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
             temperal_downsample=[False, True, True], dropout=0.0)


def load_module(path: str, name: str):
    tokenizers = types.ModuleType(f"{name.rpartition('.')[0]}.tokenizers")
    tokenizers.HuggingfaceTokenizer = None
    sys.modules[tokenizers.__name__] = tokenizers
    for package in ("wan", "wan.modules"):
        sys.modules.setdefault(package, types.ModuleType(package))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = name.rpartition(".")[0]
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        spec.loader.exec_module(module)
    finally:
        torch.cuda.current_device = current
    return module


def randomize(module: torch.nn.Module, seed: int, dtype) -> None:
    """O(1) activations: norm gains near 1, weights ~ N(0, 0.5²/fan_in), biases small; every value then
    rounded to `dtype` so that the stored weights are exact."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif "embedding" in name:
                p.copy_(noise)
            elif p.dim() > 1:
                p.copy_(noise * 0.5 / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.05 * noise)
            p.copy_(p.to(dtype).float())


def make_t5(t5, seed: int) -> dict:
    model = t5.T5Encoder(**T5).eval()
    randomize(model, seed, torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(2, T5["vocab"], (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    ids[1, 4:] = 0
    with torch.no_grad():
        out = model(ids, mask) * mask[..., None]
    return {**{f"t5.{k}": v.to(torch.bfloat16) for k, v in model.state_dict().items()},
            "t5_ids": ids.to(torch.int32), "t5_mask": mask.to(torch.int32), "t5_output": out.float()}


def vae_shapes(vae, config: dict) -> str:
    return json.dumps({k: list(v.shape) for k, v in vae.WanVAE_(**config).state_dict().items()})


def commit_of(ref: str) -> str:
    return subprocess.run(["git", "-C", ref, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wan21", required=True, help="checkout of Wan-Video/Wan2.1")
    parser.add_argument("--wan22", required=True, help="checkout of Wan-Video/Wan2.2")
    parser.add_argument("--out", default=OUT, help="folder to write the golden file into (default: tests/data)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    t5 = load_module(os.path.join(args.wan21, "wan", "modules", "t5.py"), "wan.modules.t5")
    vae21 = load_module(os.path.join(args.wan21, "wan", "modules", "vae.py"), "wan.modules.vae")
    vae22 = load_module(os.path.join(args.wan22, "wan", "modules", "vae2_2.py"), "wan.modules.vae2_2")
    meta = {"reference": "Wan-Video/Wan2.1 wan/modules/t5.py, vae.py; Wan-Video/Wan2.2 wan/modules/vae2_2.py",
            "reference_commit": f"Wan2.1 {commit_of(args.wan21)}; Wan2.2 {commit_of(args.wan22)}",
            "script": "scripts/make_golden_wan_components.py",
            "vae21": vae_shapes(vae21, VAE21), "vae22": vae_shapes(vae22, VAE22)}
    tensors = make_t5(t5, 0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "wan_components.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)
    print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
