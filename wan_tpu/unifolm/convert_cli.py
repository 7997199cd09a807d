"""Convert an authors' UnifoLM-WMA Lightning `.ckpt` into the safetensors folder wan_tpu loads.

    wan-convert-unifolm unifolm_wma_dual.ckpt ckpt/unifolm-wma-0 \
        --stats unifolm-world-model-action/examples/world_model_interaction_prompts/transitions/unitree_z1_stackbox/meta_data/stats.safetensors

The `.ckpt` is read with `torch.load(weights_only=True)` (never a full unpickle). The folder layout
and what is dropped are described in `wan_tpu/unifolm/convert.py`. `--config` is inferred (a
checkpoint without action/state heads is the base model). `--stats` adds the dataset's min-max table
used to unnormalise predicted actions and states; `--tokenizer` gives a CLIP tokenizer folder when
open-clip-torch (whose BPE vocabulary is used otherwise) is not installed. Bad input: one line on
stderr, exit status 2, nothing written.
"""

from __future__ import annotations

import time

from wan_tpu.runtime.cli import CliParser, add_overwrite, run_cli
from wan_tpu.unifolm.convert import TEXT_HEAD_WIDTH, VISION_HEAD_WIDTH, convert


def build_parser() -> CliParser:
    ap = CliParser(prog="wan-convert-unifolm", description="UnifoLM-WMA .ckpt → safetensors folder")
    ap.add_argument("src", help="the authors' .ckpt (Lightning or DeepSpeed)")
    ap.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    ap.add_argument("--config", default=None, help="config name (default: inferred, unifolm-wma-0 or unifolm-wma-0-base)")
    ap.add_argument("--stats", default=None, help="LeRobot meta_data/stats.safetensors of the robot's dataset")
    ap.add_argument("--tokenizer", default=None, help="a CLIP tokenizer folder (default: open_clip's BPE)")
    ap.add_argument("--vision-head-width", type=int, default=VISION_HEAD_WIDTH, help="CLIP vision head width (ViT-H-14: 80)")
    ap.add_argument("--text-head-width", type=int, default=TEXT_HEAD_WIDTH, help="CLIP text head width (ViT-H-14: 64)")
    add_overwrite(ap, "replace an existing output folder")
    return ap


def run(args) -> None:
    start = time.perf_counter()
    name = convert(args.src, args.dst, args.config, args.stats, args.tokenizer, args.overwrite,
                   args.vision_head_width, args.text_head_width)
    print(f"wrote {args.dst} ({name}) in {time.perf_counter() - start:.1f} s")


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)
