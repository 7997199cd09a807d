"""The Wan models users have besides diffusers folders: an official Wan download, a DiT file with its
component files (ComfyUI's `.safetensors`, a `.gguf`), or a ComfyUI `models/` root.

    files = resolve_files("wan2.1_t2v_1.3B_bf16.safetensors", vae="wan_2.1_vae.safetensors",
                          text_encoder="umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    files.parts        # component → file or folder, as `WanPipeline`'s loaders read them
    files.variant      # which Wan model, from the DiT's shapes (or the official config.json)

Everything is checked from headers and names alone (`wan_tpu.loading.formats`), before any weight is
read: each file holds what its slot needs (a VAE passed as the DiT, a T5 as the image encoder, ... are
refused in one line naming the flag), the VAE's latent channels match the DiT's (a Wan 2.2 VAE with a
Wan 2.1 DiT is refused), and a ComfyUI root with several candidates for a slot names them and the
flag that picks one. Single files carry no tokenizer: the UMT5 tokenizer is `tokenizer=` (a folder),
else the Hugging Face cache's `google/umt5-xxl` (fetched only with `download=True`).

Wan 2.2 A14B comes as two DiT files, its experts (ComfyUI's `wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors`
and `…_low_noise_…`): the high-noise one is the DiT (`transformer`, used first), the low-noise one
`transformer_2=` (`--model-low FILE`), as diffusers names them; a ComfyUI root whose DiT files are one
high/low pair is that model. Both must have one architecture, and a file named as one expert is refused
without the other.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from wan_tpu.configs.models import VARIANTS, WanVariant
from wan_tpu.configs.vae import WanVAEConfig
from wan_tpu.errors import WanInputError
from wan_tpu.loading import formats

TOKENIZER_REPO = "google/umt5-xxl"
COMPONENT_FLAGS = {"transformer_2": "--model-low FILE (transformer_2=)", "vae": "--vae FILE (vae=)",
                   "text_encoder": "--text-encoder FILE (text_encoder=)", "image_encoder": "--image-encoder FILE (image_encoder=)"}
# How file names tell the two experts of Wan 2.2 A14B (ComfyUI's `high_noise`, QuantStack's GGUF `HighNoise`, ...),
# compared without case, `_` and `-`.
EXPERT_MARKERS = {"transformer": "highnoise", "transformer_2": "lownoise"}
# Token embeddings a text-encoder file may hold: looked up on the host, never placed on a device.
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "token_embedding.weight")


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    layout: str  # "official", "files", "comfyui"
    parts: dict[str, str]
    variant: WanVariant
    vae_config: WanVAEConfig
    weights: dict[str, int]  # component → weight elements on the device (memory estimates)
    native_8bit: str | None  # "fp8" / "int8": every DiT block linear is stored in that format
    text_config: object  # the text encoder's `UMT5Config` (what `prepare` compiles it from)


def uses_files(path: str, **components) -> bool:
    """Whether `path` (with these component files) is one of this module's layouts, not a diffusers folder."""
    return (os.path.isfile(path) or formats.is_official(path) or formats.is_comfy_root(path)
            or any(v is not None for v in components.values()))


def resolve_files(path: str, *, transformer_2=None, vae=None, text_encoder=None, image_encoder=None, tokenizer=None,
                  download: bool = False) -> ModelFiles:
    """The parts, variant and checks of the model at `path` (see the module docstring); `WanInputError`
    for anything wrong, before any weight is read. Parts are absolute paths."""
    given = {k: os.fspath(v) for k, v in (("transformer_2", transformer_2), ("vae", vae), ("text_encoder", text_encoder),
                                          ("image_encoder", image_encoder)) if v is not None}
    for slot, file in given.items():
        if not os.path.isfile(file):
            raise WanInputError(f"{COMPONENT_FLAGS[slot].split()[0]} {file} does not exist; fix the path")
    if "transformer_2" in given and not os.path.isfile(path):
        raise WanInputError(f"--model-low (transformer_2=) is the low-noise DiT file of a Wan 2.2 A14B model and goes with "
                            f"its high-noise DiT file in --model, but {path} is a folder; pass the high-noise file")
    if os.path.isfile(path):
        layout, parts = "files", {"transformer": path}
    elif formats.is_official(path):
        layout, parts = "official", formats.official_parts(path)
    elif formats.is_comfy_root(path):
        layout, parts = "comfyui", _comfy_dits(path)
        for slot in ("vae", "text_encoder", "image_encoder"):
            if slot not in given:
                found = _comfy_pick(path, slot, slot, required=slot != "image_encoder")
                if found is not None:
                    parts[slot] = found
    else:
        raise WanInputError(f"{path} is a diffusers-format folder; component files ({', '.join(given)}) go with a DiT file, "
                            "an official Wan folder or a ComfyUI models/ folder — drop them")
    parts.update(given)
    parts = {name: os.path.abspath(p) for name, p in parts.items()}
    if layout != "official":
        _check_experts(parts)
    if "transformer_2" in given:
        formats.check_slot(parts["transformer_2"], "dit", "--model-low")

    dits = {name: formats.open_dit(parts[name]) for name in ("transformer", "transformer_2") if name in parts}
    cfg = dits["transformer"].config
    if "transformer_2" in dits and dits["transformer_2"].config != cfg:
        raise WanInputError(f"the low-noise DiT {parts['transformer_2']} ({_describe(dits['transformer_2'].config)}) and the "
                            f"high-noise DiT {parts['transformer']} ({_describe(cfg)}) differ; pass the two experts of one "
                            "Wan 2.2 A14B model with --model HIGH_NOISE_FILE --model-low LOW_NOISE_FILE")
    for slot in ("vae", "text_encoder"):
        if slot not in parts:
            raise WanInputError(f"the DiT {parts['transformer']} needs {formats.SLOTS[slot]} file; pass {COMPONENT_FLAGS[slot]}")
    names = {slot: formats.check_slot(parts[slot], slot, COMPONENT_FLAGS[slot].split(" (")[0])
             for slot in ("vae", "text_encoder", "image_encoder") if slot in parts}
    if cfg.image_dim is None:
        parts.pop("image_encoder", None)
        names.pop("image_encoder", None)
    elif "image_encoder" not in parts:
        raise WanInputError(f"the DiT {parts['transformer']} is Wan 2.1 image-to-video, which needs a CLIP image encoder; "
                            f"pass {COMPONENT_FLAGS['image_encoder']}")
    from wan_tpu.encoders.umt5_loading import umt5_config
    from wan_tpu.vae.loading import vae_config

    vae_cfg, text_cfg = vae_config(parts["vae"]), umt5_config(parts["text_encoder"])
    z_dim = vae_cfg.z_dim
    if z_dim != cfg.out_channels:
        raise WanInputError(
            f"the VAE {parts['vae']} has {z_dim} latent channels ({_vae_name(z_dim)}) but the DiT {parts['transformer']} "
            f"takes {cfg.out_channels} ({_vae_name(cfg.out_channels)}); pass the matching VAE with --vae")
    if "tokenizer" not in parts:
        from wan_tpu.loading import hub

        if tokenizer is not None:
            parts["tokenizer"] = os.path.abspath(tokenizer)
        else:
            try:
                parts["tokenizer"] = hub.resolve_model(TOKENIZER_REPO, download)
            except WanInputError as e:
                raise WanInputError(f"single files carry no tokenizer: pass --tokenizer DIR (tokenizer=), or get "
                                    f"{TOKENIZER_REPO}'s — {e}") from None
    from wan_tpu.runtime.validate import check_tokenizer

    check_tokenizer(parts["tokenizer"])

    variant = _variant(cfg, dits.get("transformer_2"), "wan2.2" if vae_cfg.is_residual else "wan2.1", path)
    weights = {name: sum(int(np.prod(d.tensors.shape(n))) for n in d.tensors) for name, d in dits.items()}
    for slot, entries in names.items():
        weights[slot] = sum(int(np.prod(shape)) for n, (shape, _) in entries.items()
                            if not (slot == "text_encoder" and n in _EMBEDDINGS))
    formats_8bit = {formats.native_8bit(d) for d in dits.values()}
    native = formats_8bit.pop() if len(formats_8bit) == 1 else None
    return ModelFiles(layout, parts, variant, vae_cfg, weights, native, text_cfg)


def _check_experts(parts: dict[str, str]) -> None:
    """Refuse two expert files given the wrong way round, the same file twice, or one expert (by ComfyUI's
    names) without the other: each alone runs as a whole model and makes noise."""
    high, low = parts["transformer"], parts.get("transformer_2")
    if low is None:
        if _expert(high) is not None:
            raise WanInputError(f"{high} is one expert of a Wan 2.2 A14B model (its name says so), which needs both: pass "
                                "the high-noise file with --model and the low-noise one with --model-low FILE (transformer_2=)")
        return
    if os.path.samefile(high, low):
        raise WanInputError(f"--model and --model-low both name {high}; pass the low-noise expert with --model-low")
    if _expert(high) == "transformer_2" and _expert(low) == "transformer":
        raise WanInputError(f"--model {high} is the low-noise expert and --model-low {low} the high-noise one; swap them")


def _expert(path: str) -> str | None:
    """Which expert of Wan 2.2 A14B a DiT file's name says it is ("transformer": high noise), if any."""
    name = os.path.basename(path).lower().replace("_", "").replace("-", "")
    found = [expert for expert, marker in EXPERT_MARKERS.items() if marker in name]
    return found[0] if len(found) == 1 else None


def _comfy_dits(root: str) -> dict[str, str]:
    """The DiT of a ComfyUI root: its one DiT file, or the two experts of Wan 2.2 A14B (one high-noise and one
    low-noise file)."""
    found = _comfy_found(root, "dit", "dit")
    experts = {_expert(p): p for p in found}
    if len(found) == 2 and set(experts) == set(EXPERT_MARKERS):
        return experts
    return {"transformer": _comfy_pick(root, "dit", "dit", found=found)}


def _comfy_found(root: str, folder_slot: str, slot: str) -> list[str]:
    return [p for p in formats.comfy_candidates(root, folder_slot) if formats.file_slot(p) == slot]


def _comfy_pick(root: str, folder_slot: str, slot: str, required: bool = True, found=None) -> str | None:
    """The one file of `slot` among a ComfyUI root's candidates (files of other slots are passed over;
    `found`: those files, where already listed)."""
    found = _comfy_found(root, folder_slot, slot) if found is None else found
    if len(found) > 1:
        listed = ", ".join(os.path.relpath(p, root) for p in found)
        flag = ("--model FILE (Wan 2.2 A14B: --model HIGH_NOISE_FILE --model-low LOW_NOISE_FILE)" if slot == "dit"
                else COMPONENT_FLAGS[slot].split(" (")[0])
        raise WanInputError(f"{root} has several {formats.SLOTS[slot]} files ({listed}); pick one with {flag}")
    if not found and required:
        where = " or ".join(f"{f}/" for f in formats.COMFY_FOLDERS[folder_slot])
        raise WanInputError(f"{root} has no {formats.SLOTS[slot]} file in {where}; pass one with "
                            f"{'--model FILE' if slot == 'dit' else COMPONENT_FLAGS[slot]}")
    return found[0] if found else None


def _describe(cfg) -> str:
    return f"{cfg.num_layers} layers, width {cfg.inner_dim}, {cfg.in_channels} input channels"


def _vae_name(z_dim: int) -> str:
    return {16: "Wan 2.1 / A14B", 48: "Wan 2.2 TI2V-5B"}.get(z_dim, "no Wan VAE")


def _variant(cfg, dit_2, vae: str, path: str) -> WanVariant:
    cfg_2 = None if dit_2 is None else dit_2.config
    found = [v for v in VARIANTS.values() if v.transformer == cfg and v.transformer_2 == cfg_2 and v.vae == vae]
    # I2V 480P and 720P share one architecture; the folder or file name usually says which.
    named = [v for v in found if v.repo and v.repo.split("-")[-2].lower() in os.path.basename(os.path.abspath(path)).lower()]
    if found:
        return named[0] if len(named) == 1 else found[0]
    if cfg_2 is not None:
        raise WanInputError(f"{path}: two DiTs of {_describe(cfg)} are no Wan 2.2 A14B model wan_tpu runs; --model-low "
                            "(transformer_2=) takes the A14B's low-noise expert, other models one DiT file")
    raise WanInputError(f"{path}: the DiT's architecture ({_describe(cfg)}) is none of the Wan models wan_tpu runs; "
                        "for other sizes save a diffusers-format folder")


def runs_natively(mode: str, mesh=None) -> bool:
    """Whether the devices run `mode` ("fp8" / "int8") on their own matrix units (not the CPU's emulation):
    there a DiT stored in that format stays 8-bit; elsewhere it is dequantised exactly."""
    import jax

    from wan_tpu.wan.quantize import supported

    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    return all(d.platform != "cpu" and supported(d, mode)[0] for d in devices)
