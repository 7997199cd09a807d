"""Golden outputs of UnifoLM-WMA's encoders and VAE from the authors' own classes, on small random weights.

    python scripts/make_golden_unifolm_encoders.py --ref third_party/unifolm-world-model-action \
        [--out tests/data/unifolm_encoders_golden.safetensors]

`--ref` is a checkout of unitreerobotics/unifolm-world-model-action, e.g. cloned into
`third_party/unifolm-world-model-action`, a folder of this checkout that git ignores.

Runs on CPU, float32, in an environment with the authors' pins that matter here: open-clip-torch
2.22 (sequence-first transformer, `visual.input_patchnorm`), kornia 0.7.3, einops (e.g. the
reference venv of `make_golden_unifolm.py`). Their `FrozenOpenCLIPImageEmbedderV2` (kornia preprocessing, 257 tokens before
`ln_post`), `FrozenOpenCLIPEmbedder(layer="penultimate")` (`encode_with_transformer`, given token ids)
and `AutoencoderKL` (`encode` → posterior mean, logvar, `sample(noise)` with injected noise, `decode`)
run unmodified; only their imports are satisfied: `open_clip.create_model_and_transforms` returns a
tiny random `CLIP` instead of downloading ViT-H-14, and `cv2`, `pytorch_lightning` (LightningModule =
nn.Module) and, where its wheel cannot load beside a CPU torch, `torchvision` are placeholder modules.

Weights are not stored: every tensor is `golden_param(name, shape)` (seeded by its name), and the file
records each component's tensor names and shapes, so `tests/unifolm/test_unifolm_encoders.py` rebuilds the
same state dicts, converts them as `wan_tpu/unifolm/convert.py` does (`wan-convert-unifolm`) and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zlib

import numpy as np

SEED = 20251123
CLIP_VISION = dict(image_size=224, patch_size=14, width=32, layers=2, head_width=8)
CLIP_TEXT = dict(context_length=77, vocab_size=514, width=32, heads=4, layers=3)
DDCONFIG = dict(double_z=True, z_channels=4, resolution=64, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 1, 2, 2],
                num_res_blocks=1, attn_resolutions=[], dropout=0.0)
EMBED_DIM = 4


def golden_param(name: str, shape) -> np.ndarray:
    """The value of tensor `name`: seeded by the name, so order and framework do not matter. Matrices
    and convs (torch layout, fan-in after the first axis) N(0, 1/fan_in); 1-D `*weight` (norm scales)
    1 + N(0, 0.1²); other 1-D tensors N(0, 0.1²)."""
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    x = rng.standard_normal(tuple(shape))
    if len(shape) >= 2:
        x = x / np.sqrt(np.prod(shape[1:]))
    elif name.endswith("weight"):
        x = 1.0 + 0.1 * x
    else:
        x = 0.1 * x
    return np.asarray(x, np.float32)


def _stub_imports():
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import types

    import torch

    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]

        class Placeholder(type):
            def __getattr__(cls, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return Placeholder(name, (), {})

        class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "torchvision":
                    return importlib.machinery.ModuleSpec(name, self, is_package=True)

            def create_module(self, spec):
                module = types.ModuleType(spec.name)
                module.__path__ = []
                module.__getattr__ = lambda n: Placeholder(n, (), {}) if not n.startswith("__") else None
                return module

            def exec_module(self, module):
                pass

        sys.meta_path.insert(0, Finder())
    for name in ("cv2", "pytorch_lightning"):
        if importlib.util.find_spec(name) is None:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.LightningModule = torch.nn.Module
            sys.modules[name] = module


def _fill(module, prefix=""):
    import torch

    with torch.no_grad():
        for name, p in module.state_dict().items():
            p.copy_(torch.from_numpy(golden_param(prefix + name, p.shape)))
    return {prefix + k: list(v.shape) for k, v in module.state_dict().items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="checkout of unitreerobotics/unifolm-world-model-action")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                  "unifolm_encoders_golden.safetensors"))
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "-C", args.ref, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    sys.path.insert(0, os.path.join(args.ref, "src"))
    _stub_imports()

    import open_clip
    import torch
    from safetensors.torch import save_file

    def tiny_clip(arch, device=None, pretrained=None, **kwargs):
        return open_clip.model.CLIP(embed_dim=16, vision_cfg=CLIP_VISION, text_cfg=CLIP_TEXT), None, None

    open_clip.create_model_and_transforms = tiny_clip
    from unifolm_wma.models.autoencoder import AutoencoderKL
    from unifolm_wma.modules.encoders.condition import FrozenOpenCLIPEmbedder, FrozenOpenCLIPImageEmbedderV2

    torch.manual_seed(0)
    rng = np.random.default_rng(SEED)
    out, manifest = {}, {}

    image_embedder = FrozenOpenCLIPImageEmbedderV2(device="cpu").eval()
    manifest["embedder.model."] = _fill(image_embedder.model)
    # 40 px tall is upscaled (no blur), 256 wide is shrunk (kornia's Gaussian antialias runs).
    images = rng.uniform(-1, 1, (1, 3, 40, 256)).astype(np.float32)
    with torch.no_grad():
        out["image_tokens"] = image_embedder(torch.from_numpy(images))
    out["image_input"] = torch.from_numpy(images)

    text_embedder = FrozenOpenCLIPEmbedder(device="cpu", layer="penultimate").eval()
    manifest["cond_stage_model.model."] = _fill(text_embedder.model)
    n = CLIP_TEXT["vocab_size"]
    tokens = np.zeros((2, 77), np.int64)  # open_clip framing: [sot] + ids + [eot], zero-padded
    tokens[0, :12] = [n - 2, *rng.integers(0, n - 2, 10), n - 1]
    tokens[1] = [n - 2, *rng.integers(0, n - 2, 75), n - 1]
    with torch.no_grad():
        out["text_hidden"] = text_embedder.encode_with_transformer(torch.from_numpy(tokens))
    out["text_tokens"] = torch.from_numpy(tokens)

    vae = AutoencoderKL(ddconfig=DDCONFIG, lossconfig={"target": "torch.nn.Identity"}, embed_dim=EMBED_DIM).eval()
    manifest["first_stage_model."] = _fill(vae)
    x = rng.uniform(-1, 1, (2, 3, 32, 48)).astype(np.float32)
    noise = rng.standard_normal((2, 4, 4, 6)).astype(np.float32)
    with torch.no_grad():
        posterior = vae.encode(torch.from_numpy(x))
        z = posterior.sample(noise=torch.from_numpy(noise))
        out.update(vae_input=torch.from_numpy(x), vae_noise=torch.from_numpy(noise), vae_mean=posterior.mean,
                   vae_logvar=posterior.logvar, vae_sample=z, vae_decoded=vae.decode(z))

    metadata = {
        "reference": "unitreerobotics/unifolm-world-model-action",
        "commit": commit,
        "open_clip": open_clip.version.__version__,
        "manifest": json.dumps(manifest),
        "clip_vision": json.dumps(CLIP_VISION),
        "clip_text": json.dumps(CLIP_TEXT),
        "ddconfig": json.dumps(DDCONFIG),
        "embed_dim": str(EMBED_DIM),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file({k: v.float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in out.items()},
              args.out, metadata=metadata)
    print(f"wrote {args.out} ({os.path.getsize(args.out) // 1024} KB) from {commit}")


if __name__ == "__main__":
    main()
