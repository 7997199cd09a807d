"""UnifoLM-WMA checkpoints: the authors' Lightning `.ckpt` → a safetensors folder (the only format we load).

    wan-convert-unifolm unifolm_wma_dual.ckpt ckpt/unifolm-wma-0 \
        [--config unifolm-wma-0] [--stats .../meta_data/stats.safetensors] [--tokenizer CLIP_TOKENIZER_DIR]

The `.ckpt` is read with `torch.load(weights_only=True)`, never a full unpickle: non-tensor objects a
Lightning file may carry beside the weights (hyper-parameters, loop state) are replaced by inert
placeholders and dropped. Weights come from `['state_dict']` (Lightning) or `['module']` (DeepSpeed,
whose keys carry a 16-character `_forward_module.` prefix); old `framestride_embed` names become
`fps_embedding`. The folder:

    config.json                  `wan_tpu.configs.unifolm.config_to_json` (UNet, heads, projectors, schedules)
    unet.safetensors             `model.diffusion_model.*`, prefix removed, authors' names (sharded + index when large)
    conditioning.safetensors     `image_proj_model.*`, `state_projector.*`, `action_projector.*`, `agent_*_pos_emb`
    vae/                         diffusers `AutoencoderKL` (`first_stage_model.*`, renamed from the LDM layout)
    image_encoder/               transformers `CLIPVisionModel` (`embedder.model.visual.*`)
    text_encoder/                transformers `CLIPTextModel` with the last block dropped ("penultimate")
    tokenizer/                   `CLIPTokenizer` (OpenCLIP's BPE)
    stats.safetensors            optional: `action/{min,max}`, `observation.state/{min,max}` of the dataset

Dropped on purpose: the heads' EMA copy (`dp_ema_model.*`), `model_ema.*`, the diffusion schedule
buffers, and the CLIP parts the model never runs (the image tower's text half and `proj`, the text
tower's last block, `text_projection`, `logit_scale`). Any other key is an error naming it.

The command:

Convert an authors' UnifoLM-WMA Lightning `.ckpt` into the safetensors folder wan_tpu loads.

    wan-convert-unifolm unifolm_wma_dual.ckpt ckpt/unifolm-wma-0 \
        --stats stats.safetensors   # the robot dataset's meta_data/stats.safetensors (the authors' examples ship one per task)

The `.ckpt` is read with `torch.load(weights_only=True)` (never a full unpickle). The folder layout
and what is dropped are described in `wan_tpu/unifolm/convert.py`. `--config` is inferred (a
checkpoint without action/state heads is the base model). `--stats` adds the dataset's min-max table
used to unnormalise predicted actions and states; `--tokenizer` gives a CLIP tokenizer folder when
open-clip-torch (whose BPE vocabulary is used otherwise) is not installed. Bad input: one line on
stderr, exit status 2, nothing written.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
import zipfile

import numpy as np

from wan_tpu.errors import WanInputError
from wan_tpu.runtime.cli import CliParser, add_overwrite, run_cli

DEEPSPEED_PREFIX_LEN = 16  # len("_forward_module."), as the authors' loaders strip it
SHARD_BYTES = 4 << 30
VISION_HEAD_WIDTH = 80  # open_clip ViT-H-14: vision heads of 80 channels (1280 / 16)
TEXT_HEAD_WIDTH = 64  # open_clip ViT-H-14: text heads of 64 channels (1024 / 16)

_SCHEDULE_BUFFERS = {
    "betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
    "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
    "lvlb_weights", "logvar", "scale_arr", "scale_factor", "cond_pos_emb",
}  # fmt: skip
_DROPPED_PREFIXES = ("dp_ema_model.", "model_ema.")
_CONDITIONING = ("image_proj_model.", "state_projector.", "action_projector.", "agent_action_pos_emb", "agent_state_pos_emb")
_COMPONENTS = {
    "model.diffusion_model.": "unet",
    "first_stage_model.": "vae",
    "cond_stage_model.model.": "text",
    "embedder.model.": "image",
}
STATS_KEYS = ("action/min", "action/max", "observation.state/min", "observation.state/max")


# ---- reading the .ckpt -----------------------------------------------------------------------------


class _Inert:
    """Stands in for any non-tensor class a checkpoint pickles (OmegaConf configs, callbacks, ...):
    takes whatever it is given and does nothing, so nothing from the file ever runs."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


def read_lightning_checkpoint(path: str) -> dict:
    """The weights of an authors' `.ckpt`, name → torch tensor (memory-mapped where torch can)."""
    import torch

    if not os.path.isfile(path):
        raise WanInputError(f"checkpoint {path!r} does not exist; pass the authors' .ckpt file")
    if not zipfile.is_zipfile(path):
        raise WanInputError(f"{path}: not a torch checkpoint (.ckpt zip archive); pass the authors' Lightning .ckpt")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        stand_ins = [(type(name.rsplit(".", 1)[-1], (_Inert,), {}), name) for name in unsafe]
        with torch.serialization.safe_globals(stand_ins):
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        raise WanInputError(f"{path}: cannot be read as weights only ({str(e).splitlines()[0][:160]}); is it the authors' .ckpt?") from None
    if isinstance(ckpt, dict) and isinstance(ckpt.get("state_dict"), dict):
        state = dict(ckpt["state_dict"])
    elif isinstance(ckpt, dict) and isinstance(ckpt.get("module"), dict):
        state = {k[DEEPSPEED_PREFIX_LEN:]: v for k, v in ckpt["module"].items()}
    else:
        raise WanInputError(f"{path}: no 'state_dict' (Lightning) or 'module' (DeepSpeed) entry; not a UnifoLM-WMA checkpoint")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise WanInputError(f"{path}: entry {bad[0]!r} of the state dict is not a tensor; not a UnifoLM-WMA checkpoint")
    return {k.replace("framestride_embed", "fps_embedding"): v for k, v in state.items()}


def split_components(state: dict) -> dict[str, dict]:
    """Route every tensor to its component (prefix removed): unet, conditioning, vae, text, image.
    Tensors dropped on purpose are left out; an unknown name is a `WanInputError` naming it."""
    parts = {name: {} for name in ("unet", "conditioning", "vae", "text", "image")}
    for key, value in state.items():
        if key in _SCHEDULE_BUFFERS or key.startswith(_DROPPED_PREFIXES):
            continue
        if key.startswith(_CONDITIONING):
            parts["conditioning"][key] = value
            continue
        for prefix, component in _COMPONENTS.items():
            if key.startswith(prefix):
                parts[component][key[len(prefix) :]] = value
                break
        else:
            raise WanInputError(f"unexpected tensor {key!r} in the checkpoint; not a UnifoLM-WMA checkpoint (or a newer layout)")
    empty = [name for name, p in parts.items() if not p]
    if empty:
        raise WanInputError(f"the checkpoint has no {empty[0]} tensors ({_prefix_of(empty[0])}*); not a full UnifoLM-WMA checkpoint")
    return parts


def _prefix_of(component: str) -> str:
    if component == "conditioning":
        return "image_proj_model."
    return next(p for p, c in _COMPONENTS.items() if c == component)


# ---- writing --------------------------------------------------------------------------------------


def _require(src: dict, name: str, where: str):
    if name not in src:
        raise WanInputError(f"the checkpoint has no {where}{name!r}; not a UnifoLM-WMA checkpoint")
    return src[name]


def _count(src: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in src if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def save_safetensors_shards(tensors: dict, folder: str, name: str, shard_bytes: int = SHARD_BYTES) -> None:
    """`NAME.safetensors`, or `NAME-0000i-of-0000n.safetensors` + `NAME.safetensors.index.json` when larger
    than `shard_bytes` (the layout `wan_tpu.loading.checkpoint.open_component` reads)."""
    from safetensors.torch import save_file

    shards, current, size, seen = [], {}, 0, set()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        # Their keypoint modules 4–8 are modules 3–0 again: one storage under two names, which
        # safetensors refuses to write; each name gets its own copy (the loader ignores 4–8 anyway).
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key], size = t, size + nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, f"{name}.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"{name}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    with open(os.path.join(folder, f"{name}.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def write_vae(folder: str, ldm: dict, scale_factor: float) -> None:
    """The authors' first stage (LDM names) → a diffusers `AutoencoderKL` folder; ddconfig read off the shapes."""
    from safetensors.torch import save_file

    from wan_tpu.configs.autoencoder_kl import config_from_ldm, config_to_json
    from wan_tpu.unifolm.autoencoder_kl_loading import ldm_to_diffusers_name, ldm_to_diffusers_tensor

    where = "first_stage_model."
    ch = _require(ldm, "encoder.conv_in.weight", where).shape[0]
    levels = _count(ldm, r"encoder\.down\.(\d+)\.")
    ddconfig = dict(
        double_z=True,
        z_channels=_require(ldm, "decoder.conv_in.weight", where).shape[1],
        in_channels=ldm["encoder.conv_in.weight"].shape[1],
        out_ch=_require(ldm, "decoder.conv_out.weight", where).shape[0],
        ch=ch,
        ch_mult=[_require(ldm, f"encoder.down.{i}.block.0.conv1.weight", where).shape[0] // ch for i in range(levels)],
        num_res_blocks=_count(ldm, r"encoder\.down\.0\.block\.(\d+)\."),
        attn_resolutions=[],
    )
    embed_dim = _require(ldm, "quant_conv.weight", where).shape[0] // 2
    config = config_from_ldm(ddconfig, embed_dim, scale_factor)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_to_json(config), f, indent=1)
    tensors = {}
    for name, value in ldm.items():
        new = ldm_to_diffusers_name(name, levels)
        tensors[new] = _as_torch(ldm_to_diffusers_tensor(new, value))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "diffusion_pytorch_model.safetensors"),
              metadata={"format": "pt"})


def _as_torch(x):
    import torch

    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


def write_image_encoder(folder: str, model: dict, head_width: int = VISION_HEAD_WIDTH) -> None:
    """The authors' `embedder.model.*` (an open_clip CLIP without its text tower) → `CLIPVisionModel`."""
    from wan_tpu.encoders.openclip import open_clip_vision_to_hf, vision_config, write_tower

    visual = {k[len("visual.") :]: _as_torch(v) for k, v in model.items() if k.startswith("visual.")}
    conv = _require(visual, "conv1.weight", "embedder.model.visual.")
    width, patch = conv.shape[0], conv.shape[-1]
    layers = _count(visual, r"transformer\.resblocks\.(\d+)\.")
    grid = int(round((_require(visual, "positional_embedding", "embedder.model.visual.").shape[0] - 1) ** 0.5))
    mlp_ratio = visual["transformer.resblocks.0.mlp.c_fc.weight"].shape[0] / width
    config = vision_config(width, layers, width // head_width, patch, grid * patch, mlp_ratio)
    write_tower(folder, config, open_clip_vision_to_hf(visual, layers))


def write_text_encoder(folder: str, model: dict, head_width: int = TEXT_HEAD_WIDTH) -> None:
    """The authors' `cond_stage_model.model.*` (open_clip CLIP without `visual`) → `CLIPTextModel` with
    the last block dropped: its `last_hidden_state` is their "penultimate" output."""
    from wan_tpu.encoders.openclip import open_clip_text_to_hf, text_config, write_tower

    model = {k: _as_torch(v) for k, v in model.items()}
    vocab, width = _require(model, "token_embedding.weight", "cond_stage_model.model.").shape
    layers = _count(model, r"transformer\.resblocks\.(\d+)\.") - 1
    context = _require(model, "positional_embedding", "cond_stage_model.model.").shape[0]
    config = text_config(width, layers, width // head_width, vocab, context)
    write_tower(folder, config, open_clip_text_to_hf(model, layers))


def write_tokenizer(folder: str, vocab_size: int, source: str | None = None) -> None:
    """`tokenizer/`: a copy of `source` (a CLIP tokenizer folder), else OpenCLIP's BPE when open_clip
    imports, else (only for the 514-id tiny vocabulary) the in-process tiny tokenizer."""
    if source is not None:
        if not os.path.isdir(source):
            raise WanInputError(f"--tokenizer {source!r} is not a folder; pass a CLIP tokenizer folder (tokenizer_config.json, ...)")
        shutil.copytree(source, folder)
        return
    from wan_tpu.encoders.clip_tokenizer import tiny_hf_clip_tokenizer

    tiny = tiny_hf_clip_tokenizer()
    if vocab_size == len(tiny):
        tiny.save_pretrained(folder)
        return
    try:
        import open_clip
    except (ImportError, RuntimeError):
        raise WanInputError(
            "no tokenizer: pass --tokenizer DIR (a CLIP tokenizer folder, e.g. the tokenizer of "
            "laion/CLIP-ViT-H-14-laion2B-s32B-b79K) or install open-clip-torch, whose BPE vocabulary is used"
        ) from None
    from wan_tpu.encoders.openclip import tokenizer_from_open_clip

    tokenizer_from_open_clip(open_clip.tokenizer._tokenizer).save_pretrained(folder)


def write_stats(path: str, source: str) -> None:
    """The dataset's min-max table from a LeRobot `meta_data/stats.safetensors` (action and state)."""
    from safetensors.numpy import save_file

    from wan_tpu.loading.checkpoint import TensorSource

    if not os.path.isfile(source):
        raise WanInputError(f"--stats {source!r} does not exist; pass the dataset's meta_data/stats.safetensors")
    stats = TensorSource([source])
    missing = [k for k in STATS_KEYS if k not in stats]
    if missing:
        raise WanInputError(f"{source}: no {missing[0]!r}; pass a LeRobot stats.safetensors with action and observation.state min/max")
    save_file({k: np.ascontiguousarray(stats[k], np.float32) for k in STATS_KEYS}, path)


def convert(src: str, dst: str, config_name: str | None = None, stats: str | None = None,
            tokenizer: str | None = None, overwrite: bool = False, vision_head_width: int = VISION_HEAD_WIDTH,
            text_head_width: int = TEXT_HEAD_WIDTH) -> str:
    """Convert the authors' `.ckpt` at `src` into the folder `dst` (written under a temporary name, then
    renamed into place: nothing partial is left). Returns the config name used. The CLIP head widths
    are not in the weights: ViT-H-14's are the defaults."""
    from wan_tpu.configs.unifolm import CONFIGS, config_to_json

    if os.path.exists(dst) and not overwrite:
        raise WanInputError(f"{dst!r} exists; choose another folder or pass --overwrite")
    if config_name is not None and config_name not in CONFIGS:
        raise WanInputError(f"--config {config_name!r} is unknown; choose one of {', '.join(CONFIGS)}")
    parts = split_components(read_lightning_checkpoint(src))
    if config_name is None:
        has_heads = any(k.startswith("action_unet.") for k in parts["unet"])
        config_name = "unifolm-wma-0" if has_heads else "unifolm-wma-0-base"
    cfg = CONFIGS[config_name]
    tmp = f"{dst.rstrip(os.sep)}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_to_json(cfg), f, indent=1)
        save_safetensors_shards(parts["unet"], tmp, "unet")
        save_safetensors_shards(parts["conditioning"], tmp, "conditioning")
        write_vae(os.path.join(tmp, "vae"), parts["vae"], cfg.scale_factor)
        write_image_encoder(os.path.join(tmp, "image_encoder"), parts["image"], vision_head_width)
        write_text_encoder(os.path.join(tmp, "text_encoder"), parts["text"], text_head_width)
        write_tokenizer(os.path.join(tmp, "tokenizer"), parts["text"]["token_embedding.weight"].shape[0], tokenizer)
        if stats is not None:
            write_stats(os.path.join(tmp, "stats.safetensors"), stats)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return config_name


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
