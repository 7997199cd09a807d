"""Golden files for Matrix-Game-2's VAE and CLIP, made with the authors' code on CPU (float32).

    python scripts/make_golden_matrix_game_vae_clip.py --ref third_party/Matrix-Game

`--ref` is a checkout of SkyworkAI/Matrix-Game (the model lives in its `Matrix-Game-2/` folder), e.g.
cloned into `third_party/Matrix-Game`, a folder of this checkout that git ignores; its
commit is recorded in each file. Writes, under `tests/data/`:

- `matrix_game_vae.safetensors`: a small random Wan 2.1 VAE (`VideoVAE_` with dim 4, one res block per
  level, z 16) in the original names of `Wan2.1_VAE.pth`; the latents of an image followed by gray
  frames as `inference.py` encodes them (`WanVAE.encode`, tiled with one tile as at 352×640); and
  random latents decoded by the streaming decoder `demo_utils/vae_block3.VAEDecoderWrapper` in chunks
  of 3 latent frames with its feature cache carried, exactly as `pipeline/causal_inference.py` calls it.
- `matrix_game_actions.safetensors`: the authors' random benchmark actions (`utils/conditions.py`
  `Bench_actions_{universal,gta_drive,templerun}(597)` after `random.seed(0)`, as `inference.py` seeds).
- `matrix_game_clip.safetensors`: a small random `XLMRobertaCLIP` (every tensor of the `.pth`, text
  tower included, in its original names) and the visual tokens `CLIPModel.encode_video` gives for an
  image (bicubic resize to the tower's size, CLIP normalisation, the first n-1 of n blocks).

Weights are stored as float16 values (float32 tensors whose values float16 holds exactly) to keep the
files small; the computation is float32. Runtime patches, none of which change the arithmetic:
the `wan` packages are entered without their `__init__` (which imports the whole text-to-video stack);
flash-attn (CUDA, half precision) is replaced by exact float32 softmax attention; `torchvision` is not
installed here, so a stand-in provides the one transform that runs, `Normalize` ((x - mean) / std);
the text tokenizer (ftfy) is stubbed, as no text is encoded.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import types

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data")
CHUNKS = (3, 3, 3)  # latent frames per streamed chunk, as num_frame_per_block
LATENT_HW = (2, 3)  # the VAE golden's latent height and width (16×24 pixels)
CLIP_IMAGE_HW = (44, 80)  # larger than the tower's 28², as 352×640 is larger than 224²


def import_reference(ref: str):
    root = os.path.join(ref, "Matrix-Game-2")
    if not os.path.isdir(os.path.join(root, "demo_utils")):
        sys.exit(f"error: {ref} is not a Matrix-Game checkout (no Matrix-Game-2/demo_utils)")
    sys.path.insert(0, root)
    for name in ("wan", "wan.modules", "wan.vae", "wan.vae.wanx_vae_src"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = package
    tokenizers = types.ModuleType("wan.vae.wanx_vae_src.tokenizers")
    tokenizers.HuggingfaceTokenizer = None
    sys.modules[tokenizers.__name__] = tokenizers

    class Normalize:
        def __init__(self, mean, std):
            self.mean, self.std = torch.tensor(mean), torch.tensor(std)

        def __call__(self, x):
            return (x - self.mean[:, None, None]) / self.std[:, None, None]

    from diffusers.models import ModelMixin  # noqa: F401  (before the stand-in: diffusers probes for torchvision)

    transforms = types.ModuleType("torchvision.transforms")
    transforms.Normalize = Normalize
    vision = types.ModuleType("torchvision")
    vision.transforms = transforms
    sys.modules.update({"torchvision": vision, "torchvision.transforms": transforms})

    import demo_utils.vae_block3 as vae_block3
    import wan.vae.wanx_vae_src.clip as clip
    import wan.vae.wanx_vae_src.vae as wanx_vae

    clip.flash_attention = exact_attention
    return wanx_vae, vae_block3, clip


def exact_attention(q, k, v, **_):
    """flash_attention's contract ([B, L, N, C] in and out, scale 1/sqrt(C)) in float32."""
    logits = torch.einsum("blnc,bmnc->bnlm", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("bnlm,bmnc->blnc", logits.softmax(-1), v.float()).to(q.dtype)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """O(1) activations: gammas/norm weights near 1, weights ~ N(0, 0.5²/fan_in), biases small; then every
    value rounded to float16 so the stored weights are exact."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("gamma") or ("norm" in name and name.endswith("weight")):
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() > 1:
                p.copy_(noise * 0.5 / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.05 * noise)
            p.copy_(p.half().float())


def make_vae(wanx_vae, vae_block3, seed: int) -> dict:
    model = wanx_vae.VideoVAE_(dim=4, z_dim=16, num_res_blocks=1).eval()
    randomize(model, seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    wrapper = wanx_vae.WanVAE(z_dim=16)  # the wrapper inference.py encodes with; its model swapped for ours
    wrapper.model = model
    g = torch.Generator().manual_seed(seed + 1)
    n = sum(CHUNKS)
    h, w = (8 * d for d in LATENT_HW)
    image = torch.rand((1, 3, 1, h, w), generator=g) * 2 - 1
    video = torch.cat([image, torch.zeros(1, 3, 4 * (n - 1), h, w)], dim=2)
    with torch.no_grad():
        encoded = wrapper.encode(video, device="cpu", tiled=True, tile_size=LATENT_HW,
                                 tile_stride=tuple(-(-d // 2) for d in LATENT_HW))

    decoder = vae_block3.VAEDecoderWrapper()
    decoder.decoder = vae_block3.VAEDecoder3d(dim=4, z_dim=16, num_res_blocks=1)
    decoder.load_state_dict({k: v for k, v in state.items() if "decoder." in k or "conv2" in k})
    decoder.eval()
    z = torch.randn((1, 16, n, *LATENT_HW), generator=g)
    cache, frames, start = [None] * 32, [], 0
    with torch.no_grad():
        for size in CHUNKS:
            chunk, cache = decoder(z[:, :, start : start + size].transpose(1, 2), *cache)
            frames.append(chunk)
            start += size
    return {
        **{f"vae.{k}": v for k, v in state.items()},
        "image": image, "encoded": encoded.float(), "z": z,
        "chunk_sizes": torch.tensor(CHUNKS, dtype=torch.int32),
        "video": torch.cat(frames, dim=1).float(),  # (B, T, C, H, W), as the wrapper returns it
    }


def make_clip(clip, seed: int) -> dict:
    model = clip.XLMRobertaCLIP(
        embed_dim=16, image_size=28, patch_size=14, vision_dim=32, vision_mlp_ratio=4, vision_heads=2,
        vision_layers=3, vocab_size=32, max_text_len=10, text_dim=16, text_heads=2, text_layers=1,
    ).eval()
    randomize(model, seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    image = torch.rand((1, 3, 1, *CLIP_IMAGE_HW), generator=g) * 2 - 1
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    encoder = types.SimpleNamespace(model=model, transforms=types.SimpleNamespace(transforms=[clip.T.Normalize(mean, std)]),
                                    dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        tokens = clip.CLIPModel.encode_video(encoder, image.clone())
    return {**{f"clip.{k}": v for k, v in state.items()}, "image": image, "tokens": tokens.float()}


def make_actions() -> dict:
    import random

    import utils.conditions as conditions

    out = {}
    for family in ("universal", "gta_drive", "templerun"):
        random.seed(0)
        data = getattr(conditions, f"Bench_actions_{family}")(597)
        out[f"{family}.keyboard"] = data["keyboard_condition"].float()
        if "mouse_condition" in data:
            out[f"{family}.mouse"] = data["mouse_condition"].float()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", required=True, help="checkout of SkyworkAI/Matrix-Game")
    parser.add_argument("--out", default=OUT, help="folder to write the golden files into (default: tests/data)")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "-C", args.ref, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    torch.set_grad_enabled(False)
    wanx_vae, vae_block3, clip = import_reference(args.ref)
    meta = {"reference": "SkyworkAI/Matrix-Game", "reference_commit": commit or "unknown",
            "script": "scripts/make_golden_matrix_game_vae_clip.py"}
    os.makedirs(args.out, exist_ok=True)
    goldens = (("matrix_game_vae", make_vae(wanx_vae, vae_block3, 0)), ("matrix_game_clip", make_clip(clip, 1)),
               ("matrix_game_actions", make_actions()))
    for name, tensors in goldens:
        path = os.path.join(args.out, f"{name}.safetensors")
        stored = {k: (v.half() if k.startswith(("vae.", "clip.")) and v.is_floating_point() else v).contiguous()
                  for k, v in tensors.items()}
        save_file(stored, path, metadata=meta)
        print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
