"""The checkpoints users have: which slot a file holds, and a Wan DiT in any of its layouts read under
the diffusers names that `wan_tpu.wan.weights.ParamSource` reads.

    slot = file_slot("wan2.1_t2v_14B_fp8_scaled.safetensors")       # "dit", "vae", "text_encoder", ...
    dit = open_dit("Wan2.1-T2V-14B/")                                # official folder, file, .gguf, diffusers folder
    dit.config, dit.tensors["blocks.0.attn1.to_q.weight"]

Layouts of a DiT (all from headers and names alone, no tensor read):
  * diffusers: `config.json` (`WanTransformer3DModel`) + `diffusion_pytorch_model*.safetensors`;
  * official Wan: the same file names with the authors' names (`blocks.N.self_attn.q`, `head.head`,
    ...; `wan_tpu.loading.wan_names`) and their `config.json` (`WanModel`: dim, num_heads, in_dim, ...);
  * single files (ComfyUI `diffusion_models/`): either naming, with or without a `model.diffusion_model.`
    prefix, in fp32 / fp16 / bf16 / float8_e4m3fn (cast as stored) or ComfyUI's `fp8_scaled` (a float32
    `NAME.scale_weight` beside each fp8 `NAME.weight`, and a `scaled_fp8` marker tensor): weight × scale
    in float32, then cast;
  * a PyTorch state dict (`.pth`, read weights-only and memory-mapped: `wan_tpu.loading.torch_pickle`);
  * GGUF (`wan_tpu.loading.gguf`), original names.
Without a config.json the architecture comes from the weights' shapes, matched against the variants of
`wan_tpu.configs.models` (`config_from_shapes`).
"""

from __future__ import annotations

import glob
import json
import os
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from wan_tpu.configs.models import VARIANTS, WanTransformerConfig, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import MappedSource, TensorSource, component_files, file_entries, read_config
from wan_tpu.loading.wan_names import diffusers_to_original_wan, original_wan_to_diffusers

DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
DIT_WEIGHTS = "diffusion_pytorch_model"
# Tensors that describe a file rather than hold weights (ComfyUI's fp8 marker, activation scales
# its fp8 matmuls use and ours computes per token).
MARKERS = ("scaled_fp8",)
UNUSED_SUFFIXES = (".scale_input", ".input_scale")
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
EXPERTS = ("high_noise_model", "low_noise_model")
FP8 = np.dtype("float8_e4m3fn")

ORIGINAL_MARKERS = ("head.modulation", "blocks.0.self_attn.q.weight")
DIFFUSERS_MARKERS = ("scale_shift_table", "blocks.0.attn1.to_q.weight")

# ---- slots ---------------------------------------------------------------------------------------

SLOTS = {"dit": "a Wan DiT (diffusion model)", "vae": "a Wan VAE", "text_encoder": "a UMT5 text encoder",
         "image_encoder": "a CLIP image encoder"}


# A name (or a name's end, after whatever prefix a bundling tool added) that each layout of a slot has:
# the authors' and transformers' CLIP towers, Wan's and transformers' T5, the original and diffusers VAE.
SLOT_MARKERS = {
    "image_encoder": ("visual.transformer.0.attn.to_qkv.weight", "vision_model.encoder.layers.0.self_attn.q_proj.weight"),
    "text_encoder": ("blocks.0.attn.q.weight", "encoder.block.0.layer.0.SelfAttention.q.weight", "shared.weight"),
    "vae": ("decoder.middle.0.residual.0.gamma", "decoder.mid_block.resnets.0.norm1.gamma"),
}


def names_slot(names) -> str | None:
    """Which slot a set of tensor names belongs to (None: none we know)."""
    names = set(names)
    prefix = dit_prefix(names)
    bare = {n[len(prefix):] for n in names if n.startswith(prefix)}
    if "patch_embedding.weight" in bare and (set(ORIGINAL_MARKERS + DIFFUSERS_MARKERS) & bare):
        return "dit"
    for slot, markers in SLOT_MARKERS.items():  # CLIP first: Wan's text tower has T5-like block names
        if any(n == m or n.endswith("." + m) for n in names for m in markers):
            return slot
    return None


def dit_prefix(names) -> str:
    """The prefix a DiT's tensor names carry ("" for none; ComfyUI writes `model.diffusion_model.`)."""
    for prefix in DIT_PREFIXES:
        if f"{prefix}patch_embedding.weight" in names:
            return prefix
    return ""


def file_names(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name → (shape, dtype) of a weights file (.safetensors, .gguf, .pth/.pt/.ckpt), headers only."""
    from wan_tpu.loading import gguf

    if not os.path.isfile(path):
        raise WanInputError(f"{path} does not exist; fix the path")
    if gguf.is_gguf(path):
        source = gguf.GGUFSource(path)
        return {n: (source.shape(n), source.dtype(n)) for n in source}
    if is_pickle(path):
        from wan_tpu.loading.torch_pickle import open_pth

        tensors = open_pth(path)
        return {n: (tensors.shape(n), tensors.dtype(n)) for n in tensors}
    return file_entries(path)


def is_pickle(path: str) -> bool:
    """A PyTorch checkpoint (`torch.save`'s zip, or a legacy pickle by its name) rather than safetensors."""
    if path.endswith(".safetensors"):
        return False
    return path.endswith((".pth", ".pt", ".ckpt", ".bin")) or zipfile.is_zipfile(path)


def file_slot(path: str) -> str | None:
    return names_slot(file_names(path))


def check_slot(path: str, slot: str, flag: str) -> dict:
    """Refuse (one line) a file that is not a `slot` checkpoint; returns its name → (shape, dtype)."""
    names = file_names(path)
    found = names_slot(names)
    if found != slot:
        what = SLOTS.get(found, "no Wan component wan_tpu knows")
        raise WanInputError(f"{path} holds {what}, not {SLOTS[slot]}; pass {SLOTS[slot]} file with {flag}")
    return names


# ---- the DiT -------------------------------------------------------------------------------------


@dataclass
class DitCheckpoint:
    """A DiT checkpoint read under diffusers names.

    `low_precision`: diffusers weight name → (format, values, scales) for linear weights stored in 8 bits
    that our quantised layout takes as they are: `values()` the 8-bit (out, in), `scales()` float32 per
    output channel (out,), weight = values × scales ("fp8": fp8 files, exactly; "int8": GGUF Q8_0,
    rescaled from its 32-value blocks to one scale per output channel)."""

    path: str
    layout: str
    config: WanTransformerConfig
    tensors: Mapping
    low_precision: dict[str, tuple[str, Callable, Callable]] = field(default_factory=dict)


def dit_files(path: str) -> list[str]:
    """The weight files of a DiT: the file itself, or a folder's (index-listed) shards."""
    if os.path.isfile(path):
        return [path]
    gguf_files = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if gguf_files:
        return gguf_files[:1]
    return component_files(path, "transformer")


def open_dit(path: str) -> DitCheckpoint:
    """Any DiT layout of the module docstring; names, shapes and the config checked, no tensor read."""
    from wan_tpu.loading import gguf

    files = dit_files(path)
    config_json = _folder_config(path)
    if gguf.is_gguf(files[0]):
        source = gguf.GGUFSource(files[0])
        if source.architecture not in (None, "wan"):
            raise WanInputError(f"{files[0]} is a GGUF of architecture {source.architecture!r}, not a Wan DiT; pass a Wan "
                                "GGUF (general.architecture = wan)")
        layout = "gguf"
    elif len(files) == 1 and is_pickle(files[0]):
        from wan_tpu.loading.torch_pickle import open_pth

        source, layout = open_pth(files[0]), None
    else:
        source = TensorSource(files)
        layout = None
    names = {n: (tuple(source.shape(n)), source.dtype(n)) for n in source}
    if names_slot(names) != "dit":
        what = SLOTS.get(names_slot(names), "no Wan component wan_tpu knows")
        raise WanInputError(f"{path} holds {what}, not a Wan DiT; pass the diffusion model with --model")
    prefix = dit_prefix(names)
    original = any(f"{prefix}{m}" in names for m in ORIGINAL_MARKERS)
    if layout is None:
        layout = ("official" if config_json and "dim" in config_json else "single file" if os.path.isfile(path)
                  else "original") if original else "diffusers"
    rename = original_wan_to_diffusers if original else (lambda n: n)
    stored = {rename(n[len(prefix):]): n for n in names if n.startswith(prefix) and not _unused(n[len(prefix):])}
    made, low = scaled_fp8_weights(source, stored, path)
    if layout == "gguf":
        low.update(_q8_0(source, stored))
    bare = {k: names[v][0] for k, v in stored.items()}
    if layout == "diffusers" and os.path.isdir(path):
        config = config_from_json(read_config(path, "transformer"))
    else:
        config = config_from_shapes({diffusers_to_original_wan(k): s for k, s in bare.items()}, config_json, path)
    return DitCheckpoint(path, layout, config, MappedSource(source, stored, made), low)


def native_8bit(ckpt: DitCheckpoint) -> str | None:
    """"fp8" / "int8" when every linear weight of the DiT's blocks is stored in that 8-bit format, else None."""
    block = [n for n in ckpt.tensors if n.startswith("blocks.") and n.endswith(".weight")
             and len(ckpt.tensors.shape(n)) == 2]
    kinds = {ckpt.low_precision.get(n, (None,))[0] for n in block}
    return kinds.pop() if len(kinds) == 1 else None


def _unused(name: str) -> bool:
    return name in MARKERS or name.endswith(UNUSED_SUFFIXES)


def _folder_config(path: str) -> dict | None:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WanInputError(f"{os.path.join(path, 'config.json')}: not valid JSON ({e}); re-download it") from None
    if not isinstance(config, dict):
        raise WanInputError(f"{os.path.join(path, 'config.json')}: not a JSON object; re-download it")
    return config


def scaled_fp8_weights(source, stored: dict[str, str], what: str):
    """ComfyUI fp8_scaled: each `X.weight` (fp8) with a float32 `X.scale_weight` → a computed float32
    `X.weight` (weight × scale), and the 8-bit pair for the quantised layout. Scales leave the name map
    (`stored`: our name → the source's). `what` names the file in messages."""
    made, low = {}, {}
    for name in [n for n in stored if n.endswith(SCALE_SUFFIXES)]:
        scale_name = stored.pop(name)
        weight = name.rsplit(".", 1)[0] + ".weight"
        if weight not in stored:
            raise WanInputError(f"{what}: scale {scale_name!r} has no weight beside it; the fp8_scaled file "
                                "is damaged — re-download it")
        w_name = stored[weight]
        shape = tuple(source.shape(w_name))
        if source.dtype(scale_name).kind != "f" or int(np.prod(source.shape(scale_name))) not in (1, shape[0]):
            raise WanInputError(f"{what}: scale {scale_name!r} of shape {source.shape(scale_name)} does not "
                                f"fit weight {w_name!r} {shape}; re-download the file")

        def scales(scale_name=scale_name, rows=shape[0]):
            return np.broadcast_to(np.asarray(source[scale_name], np.float32).reshape(-1), (rows,)).copy()

        def dequantised(w_name=w_name, scales=scales, shape=shape):
            return source[w_name].astype(np.float32) * scales().reshape((-1,) + (1,) * (len(shape) - 1))

        made[weight] = (shape, np.float32, dequantised)
        if source.dtype(w_name) == FP8 and len(shape) == 2:
            low[weight] = ("fp8", lambda w_name=w_name: source[w_name], scales)
    for weight, w_name in stored.items():
        if weight not in made and source.dtype(w_name) == FP8 and len(source.shape(w_name)) == 2:
            rows = source.shape(w_name)[0]
            low[weight] = ("fp8", lambda w_name=w_name: source[w_name], lambda rows=rows: np.ones(rows, np.float32))
    return made, low


def _q8_0(source, stored: dict[str, str]) -> dict:
    """GGUF Q8_0 linear weights → int8 values at one scale per output channel (the layout of
    `wan_tpu.layers.quantized`), the bits `quantize_weight` gives for the dequantised weight
    (`GGUFSource.int8_rows`)."""
    return {k: ("int8", lambda n=n: source.int8_rows(n)[0], lambda n=n: source.int8_rows(n, values=False)[1])
            for k, n in stored.items() if source.type_name(n) == "Q8_0" and len(source.shape(n)) == 2}


# ---- config from shapes --------------------------------------------------------------------------


def shape_key(shapes: Mapping[str, tuple]) -> dict:
    """The architecture fields a DiT's shapes (original names) fix; heads are not among them."""
    try:
        dim, in_dim, *patch = shapes["patch_embedding.weight"]
        layers = 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("blocks."))
        key = dict(inner_dim=dim, in_channels=in_dim, patch_size=tuple(patch),
                   out_channels=shapes["head.head.weight"][0] // int(np.prod(patch)),
                   ffn_dim=shapes["blocks.0.ffn.0.weight"][0], text_dim=shapes["text_embedding.0.weight"][1],
                   freq_dim=shapes["time_embedding.0.weight"][1], num_layers=layers,
                   image_dim=shapes["img_emb.proj.0.weight"][0] if "img_emb.proj.0.weight" in shapes else None)
    except (KeyError, ValueError, IndexError):
        raise WanInputError("the DiT weights lack patch_embedding / head.head / blocks.0.ffn.0 / text_embedding / "
                            "time_embedding; the file is not a complete Wan DiT") from None
    return key


def _key_of(cfg: WanTransformerConfig) -> dict:
    return dict(inner_dim=cfg.inner_dim, in_channels=cfg.in_channels, patch_size=cfg.patch_size,
                out_channels=cfg.out_channels, ffn_dim=cfg.ffn_dim, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
                num_layers=cfg.num_layers, image_dim=cfg.image_dim)


def known_configs() -> list[WanTransformerConfig]:
    """The DiT architectures of `wan_tpu.configs.models.VARIANTS` (the table `config_from_shapes` matches)."""
    out = []
    for v in VARIANTS.values():
        for cfg in (v.transformer, v.transformer_2):
            if cfg is not None and cfg not in out:
                out.append(cfg)
    return out


def config_from_shapes(shapes: Mapping[str, tuple], official: dict | None = None, path: str = "") -> WanTransformerConfig:
    """The DiT config of weights in original names: the known architecture with these shapes, or, given the
    official `config.json` (`WanModel`: num_heads, eps, ...), that config over these shapes."""
    key = shape_key(shapes)
    if official is not None:
        heads = int(official.get("num_heads", 0) or 0)
        if heads <= 0 or key["inner_dim"] % heads:
            raise WanInputError(f"{path}: config.json num_heads={official.get('num_heads')!r} does not divide dim "
                                f"{key['inner_dim']}; re-download config.json")
        mismatch = [(k, official[k], v) for k, v in (("dim", key["inner_dim"]), ("in_dim", key["in_channels"]),
                    ("out_dim", key["out_channels"]), ("ffn_dim", key["ffn_dim"]), ("num_layers", key["num_layers"]))
                    if k in official and official[k] != v]
        if mismatch:
            k, said, found = mismatch[0]
            raise WanInputError(f"{path}: config.json says {k}={said} but the weights have {found}; the config does not "
                                "belong to these weights — re-download the checkpoint")
        image = key["image_dim"]
        return WanTransformerConfig(
            patch_size=key["patch_size"], num_attention_heads=heads, attention_head_dim=key["inner_dim"] // heads,
            in_channels=key["in_channels"], out_channels=key["out_channels"], text_dim=key["text_dim"],
            freq_dim=key["freq_dim"], ffn_dim=key["ffn_dim"], num_layers=key["num_layers"],
            eps=float(official.get("eps", 1e-6)), image_dim=image, added_kv_proj_dim=None if image is None else key["inner_dim"],
            pos_embed_seq_len=2 * 257 if "img_emb.emb_pos" in shapes else None)
    for cfg in known_configs():
        if _key_of(cfg) == key:
            return cfg
    shown = ", ".join(f"{k}={v}" for k, v in key.items() if v is not None)
    raise WanInputError(f"{path}: no Wan model wan_tpu knows has these DiT shapes ({shown}); put the model's "
                        "config.json beside the weights")


# ---- official folders ----------------------------------------------------------------------------

OFFICIAL_VAE = ("Wan2.1_VAE.pth", "Wan2.2_VAE.pth")
OFFICIAL_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
OFFICIAL_T5_TOKENIZER = os.path.join("google", "umt5-xxl")
OFFICIAL_CLIP = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"


def is_official(path: str) -> bool:
    """An official Wan download: DiT weights at the top (or in expert folders) beside `Wan2.*_VAE.pth`."""
    if not os.path.isdir(path) or os.path.isdir(os.path.join(path, "transformer")):
        return False
    vae = any(os.path.isfile(os.path.join(path, n)) for n in OFFICIAL_VAE)
    dit = glob.glob(os.path.join(path, f"{DIT_WEIGHTS}*.safetensors")) or all(
        os.path.isdir(os.path.join(path, e)) for e in EXPERTS)
    return vae and bool(dit)


def official_parts(path: str) -> dict[str, str]:
    """Component → path inside an official folder: transformer (+ transformer_2 for the A14B experts:
    high noise first, as diffusers orders them), vae, text_encoder, tokenizer, and image_encoder where
    the CLIP checkpoint is present. A missing file is named in one line."""
    experts = all(os.path.isdir(os.path.join(path, e)) for e in EXPERTS)
    parts = ({"transformer": os.path.join(path, EXPERTS[0]), "transformer_2": os.path.join(path, EXPERTS[1])}
             if experts else {"transformer": path})
    vae = [n for n in OFFICIAL_VAE if os.path.isfile(os.path.join(path, n))]
    parts["vae"] = os.path.join(path, vae[-1])
    for name, rel in (("text_encoder", OFFICIAL_T5), ("tokenizer", OFFICIAL_T5_TOKENIZER)):
        if not os.path.exists(os.path.join(path, rel)):
            raise WanInputError(f"official Wan folder {path} has no {rel}; download the complete repository")
        parts[name] = os.path.join(path, rel)
    if os.path.isfile(os.path.join(path, OFFICIAL_CLIP)):
        parts["image_encoder"] = os.path.join(path, OFFICIAL_CLIP)
    return parts


# ---- ComfyUI model folders -----------------------------------------------------------------------

COMFY_FOLDERS = {"dit": ("diffusion_models", "unet"), "vae": ("vae",), "text_encoder": ("text_encoders", "clip"),
                 "image_encoder": ("clip_vision",)}
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".pth", ".pt", ".ckpt")


def is_comfy_root(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isdir(os.path.join(path, f)) for f in COMFY_FOLDERS["dit"])


def comfy_candidates(root: str, slot: str) -> list[str]:
    return sorted(p for folder in COMFY_FOLDERS[slot] for p in glob.glob(os.path.join(root, folder, "**", "*"), recursive=True)
                  if p.endswith(WEIGHT_SUFFIXES) and os.path.isfile(p))
