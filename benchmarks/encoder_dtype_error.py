"""How far bfloat16 moves UnifoLM-WMA's CLIP towers (`UnifolmPipeline.from_pretrained(encoder_dtype=...)`)
from float32: OpenCLIP ViT-H-14 at its real size (image tower: 32 blocks of 1280, 257 tokens; text tower:
the penultimate 23 blocks of 1024, 77 tokens), the same seeded random weights in both dtypes
(`wan_tpu.encoders.clip.random_clip`), random images in [-1, 1] and random token ids.

    python benchmarks/encoder_dtype_error.py            # CPU: about a minute

Prints the relative error (Frobenius) of each tower's tokens, bf16 against float32. Random weights: the
figure measures the arithmetic, not a trained checkpoint's sensitivity.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    harness.print_env(jax.devices())

    from wan_tpu.encoders.clip import CLIPTextTransformer, CLIPVisionTransformer, random_clip
    from wan_tpu.encoders.openclip import OpenCLIPImageEncoder, text_config, vision_config

    rng = np.random.default_rng(args.seed)
    images = rng.uniform(-1, 1, (args.batch, 3, 320, 512)).astype(np.float32)  # UnifoLM's frame size
    vision = vision_config(1280, 32, 16, 14)
    text = text_config(1024, 23, 16)
    ids = rng.integers(1, text.vocab_size - 2, (args.batch, text.max_position_embeddings)).astype(np.int32)
    ids[:, 0], ids[:, -1] = text.bos_token_id, text.eos_token_id
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        image_tower = OpenCLIPImageEncoder(random_clip(lambda d=dtype: CLIPVisionTransformer(vision, d), args.seed))
        text_tower = random_clip(lambda d=dtype: CLIPTextTransformer(text, d), args.seed + 1)
        out[dtype] = (np.asarray(image_tower.encode(images), np.float32),
                      np.asarray(text_tower(jnp.asarray(ids)), np.float32))
        del image_tower, text_tower
    for i, name in enumerate(("image tower (257 tokens × 1280)", "text tower, penultimate (77 tokens × 1024)")):
        print(f"{name}: bf16 vs float32 relative error {harness.rel_error(out[jnp.bfloat16][i], out[jnp.float32][i]):.2e}")


if __name__ == "__main__":
    main()
