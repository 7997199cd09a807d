"""Turn a Matrix-Game-2 download into a folder `wan_tpu.MatrixGamePipeline` reads; run once.

    huggingface-cli download Skywork/Matrix-Game-2.0 --local-dir Matrix-Game-2.0
    wan-convert-matrix-game Matrix-Game-2.0 matrix-game-2-wan-tpu

The download keeps the VAE (`Wan2.1_VAE.pth`) and CLIP (`models_clip_open-clip-xlm-roberta-large-vit-
huge-14.pth`) as pickles. They are read with `torch.load(weights_only=True)` (tensors only, never a
full unpickle) and written as safetensors folders our loaders read:

    DST/vae/             diffusers AutoencoderKLWan (config.json + diffusion_pytorch_model.safetensors)
    DST/image_encoder/   transformers CLIPVisionModel: Wan's CLIP visual tower, all 32 blocks (the
                         pipeline takes the 31st block's output, as the authors' `use_31_block`)
    DST/<model dir>/     the DiT safetensors of each variant present, unchanged (hard-linked where the
                         file system allows, else copied): base_distilled_model (universal),
                         gta_distilled_model (gta_drive), templerun_distilled_model (templerun)
    DST/matrix_game.json the variants found and where their weights are

DST may be SRC itself (the new parts are added beside the download). Nothing is written under DST
until everything converted; an existing DST part is replaced only with `--overwrite`. The text
encoder (`xlm-roberta-large/`) and the foundation `base_model/` are not used by the distilled
pipeline and are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from wan_tpu.runtime.cli import CliParser, add_overwrite, run_cli

VAE_FILE = "Wan2.1_VAE.pth"
CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
DIT_FILES = {  # variant → the DiT file of Skywork/Matrix-Game-2.0
    "universal": "base_distilled_model/base_distill.safetensors",
    "gta_drive": "gta_distilled_model/gta_keyboard2dim.safetensors",
    "templerun": "templerun_distilled_model/templerun_7dim_onlykey.safetensors",
}
INDEX_FILE = "matrix_game.json"
FORMAT_VERSION = 1


def load_pickled_tensors(path: str) -> dict:
    """A `.pth` state dict, tensors only (`weights_only=True`), memory-mapped."""
    import torch

    from wan_tpu.errors import WanInputError

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling refusal or corrupt file is the user's to fix
        raise WanInputError(f"{path} cannot be read as a tensors-only checkpoint ({type(e).__name__}: {e}); "
                            f"re-download it") from None
    if not isinstance(state, dict) or not all(hasattr(v, "shape") for v in state.values()):
        raise WanInputError(f"{path} is not a state dict of tensors; re-download it")
    return state


def convert_vae(src: str, dst: str) -> None:
    from wan_tpu.vae.loading import original_wan21_vae_config, original_wan21_vae_name

    state = load_pickled_tensors(src)
    config = original_wan21_vae_config(state)
    write_vae(dst, config, {original_wan21_vae_name(k, config["num_res_blocks"]): v for k, v in state.items()})


def write_vae(dst: str, config: dict, tensors: dict) -> None:
    """`vae/`: a diffusers `AutoencoderKLWan` folder of `config` and torch `tensors` under diffusers' names."""
    from safetensors.torch import save_file

    os.makedirs(dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "diffusion_pytorch_model.safetensors"),
              metadata={"format": "pt"})
    _write_json(os.path.join(dst, "config.json"), config)


def convert_clip(src: str, dst: str, num_heads: int | None = None) -> None:
    from wan_tpu.encoders.clip_image import clip_vision_from_original

    write_image_encoder(dst, *clip_vision_from_original(load_pickled_tensors(src), num_heads=num_heads))


def write_image_encoder(dst: str, config: dict, tensors: dict) -> None:
    """`image_encoder/`: a transformers `CLIPVisionModel` folder of `config` and torch `tensors` under its names."""
    from safetensors.torch import save_file

    os.makedirs(dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(os.path.join(dst, "config.json"), config)


def link_or_copy(src: str, dst: str) -> str:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
        return "linked"
    except OSError:
        shutil.copyfile(src, dst)
        return "copied"


def convert(src: str, dst: str, overwrite: bool = False, clip_heads: int | None = None, log=print) -> dict:
    """Convert the download at `src` into `dst`; returns the index written to `dst/matrix_game.json`."""
    from wan_tpu.errors import WanInputError

    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if not os.path.isdir(src):
        raise WanInputError(f"{src} is not a folder; pass the Skywork/Matrix-Game-2.0 download")
    for name in (VAE_FILE, CLIP_FILE):
        if not os.path.isfile(os.path.join(src, name)):
            raise WanInputError(f"{src} has no {name}; download the whole Skywork/Matrix-Game-2.0 repository")
    variants = {v: f for v, f in DIT_FILES.items() if os.path.isfile(os.path.join(src, f))}
    if not variants:
        raise WanInputError(f"{src} has none of the DiT files ({', '.join(DIT_FILES.values())}); download them too")
    in_place = src == dst
    parts = ["vae", "image_encoder", INDEX_FILE] + ([] if in_place else sorted({f.split("/")[0] for f in variants.values()}))
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise WanInputError(f"{dst} is a file; pass a folder to write into")
    existing = [p for p in parts if os.path.exists(os.path.join(dst, p))]
    if existing and not overwrite:
        raise WanInputError(f"{os.path.join(dst, existing[0])} already exists; pass --overwrite to replace it")

    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.", suffix=".partial", dir=dst if in_place else parent)
    try:
        log(f"VAE: {VAE_FILE} → vae/")
        convert_vae(os.path.join(src, VAE_FILE), os.path.join(work, "vae"))
        log(f"CLIP: {CLIP_FILE} → image_encoder/ (visual tower)")
        convert_clip(os.path.join(src, CLIP_FILE), os.path.join(work, "image_encoder"), clip_heads)
        if not in_place:
            for variant, file in variants.items():
                log(f"DiT {variant}: {file} {link_or_copy(os.path.join(src, file), os.path.join(work, file))}")
        index = write_index(work, variants)
        os.makedirs(dst, exist_ok=True)
        for part in parts:
            target = os.path.join(dst, part)
            if os.path.isdir(target):
                shutil.rmtree(target)
            elif os.path.exists(target):
                os.remove(target)
            os.replace(os.path.join(work, part), target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return index


def write_index(dst: str, variants: dict) -> dict:
    """`matrix_game.json` in `dst`: the variants (name → DiT file under `dst`), the VAE and CLIP folders."""
    index = {"format": "wan_tpu-matrix-game", "version": FORMAT_VERSION, "vae": "vae",
             "image_encoder": "image_encoder", "variants": variants}
    _write_json(os.path.join(dst, INDEX_FILE), index)
    return index


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def build_parser():
    parser = CliParser(prog="wan-convert-matrix-game", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="the Skywork/Matrix-Game-2.0 download")
    parser.add_argument("dst", help="folder to write (may be SRC)")
    add_overwrite(parser, "replace converted parts that already exist in DST")
    parser.add_argument("--clip-heads", type=int, default=None, help=argparse.SUPPRESS)  # only for small test towers
    return parser


def run(args) -> None:
    index = convert(args.src, args.dst, args.overwrite, args.clip_heads)
    print(f"wrote {args.dst}: variants {', '.join(index['variants'])}")


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)
