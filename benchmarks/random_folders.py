"""Converted model folders with random weights, written by this package alone (no authors' code, no download).

    python benchmarks/random_folders.py matrix-game DIR        # Matrix-Game-2 universal: DiT bf16, VAE fp32, CLIP fp16
    python benchmarks/random_folders.py unifolm DIR            # UnifoLM-WMA-0: UNet + heads, VAE, CLIP towers, fp32
    python benchmarks/random_folders.py matrix-game-tiny DIR --check   # the tiny presets' sizes, then loaded
    python benchmarks/random_folders.py unifolm-tiny DIR --check       # and run: one chunk / one sampling (CPU)

DIR is what the converters write (`wan-convert-matrix-game`, `wan-convert-unifolm`) and what
`MatrixGamePipeline.from_pretrained(DIR)` / `UnifolmPipeline.from_pretrained(DIR)` (and `--model DIR` of the
commands, `profile_compile.py --device`, `bench_play.py`) read: the same files, tensor names, shapes and
dtypes as a converted release, only the values are random. Speed and memory do not depend on the values;
compare no output with a real model's.

Names and shapes come from the loaders' own tables, applied to our model built abstractly from its config
(nothing is allocated on a device): Matrix-Game's DiT under the authors' names (`model.` + the original Wan
names of `wan_tpu.loading.wan_names`, the action module's as `wan_tpu.matrix_game.loading` maps them), the
VAEs under diffusers' names (`wan_tpu.vae.loading.diffusers_name`, `wan_tpu.unifolm.autoencoder_kl_loading`),
the CLIP towers under transformers' (`wan_tpu.encoders.clip_loading.checkpoint_names`), UnifoLM's UNet and
conditioning under the authors' (`wan_tpu.unifolm.loading.torch_name`). Files are written by the converters'
own writers (`wan_tpu.matrix_game.convert.write_vae`/`write_image_encoder`/`write_index`,
`wan_tpu.unifolm.convert.save_safetensors_shards`, `wan_tpu.encoders.openclip.write_tower`). UnifoLM's
tokenizer is OpenCLIP's BPE where open-clip-torch imports, else the small byte-level one (its ids are valid
for the 49408-row embedding; prompts tokenize differently, which no timing sees).

UnifoLM's kernels are written (out, in, *k) with our kernel's axes: where the authors' module has extra
size-1 axes (a Conv3d of kernel (3, 1, 1), a 1×1 convolution used as a linear) the stored shape lacks some,
which the loader reads alike (same bytes, same names).

Values: kernels N(0, 1/fan_in), norm weights 1, the rest N(0, 0.02²), cut from one seeded pool of normal
draws at a per-tensor offset (a copy and a scale per tensor, no drawing) and cast to the file's dtype; a
component's tensors are made on all cores, one component in memory at a time (the largest: UnifoLM's UNet,
9.3 GiB, written in 4 GiB shards; Matrix-Game's DiT, 3 GiB). Written under `DIR.partial`, renamed into
place when complete; an existing DIR is replaced only with `--overwrite`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import shutil
import sys
import time
import zlib

import numpy as np

KINDS = ("matrix-game", "matrix-game-tiny", "unifolm", "unifolm-tiny")
POOL = 1 << 22  # normal draws cut into every tensor (16 MB)


class Draws:
    """Random torch tensors of given names, shapes and dtypes at the usual scales, made in parallel."""

    def __init__(self, seed: int = 0, workers: int | None = None):
        self.seed = seed
        self.pool = np.random.default_rng(seed).standard_normal(POOL, dtype=np.float32)
        self.workers = workers or os.cpu_count() or 1

    def tensor(self, name: str, shape: tuple, dtype):
        import torch

        n = math.prod(shape)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("gamma", "running_var") or (len(shape) == 1 and leaf in ("weight", "scale")):
            flat = np.ones(n, np.float32)
        elif leaf == "running_mean":
            flat = np.zeros(n, np.float32)
        else:
            flat = np.empty(n, np.float32)
            start = int(np.random.default_rng([self.seed, zlib.crc32(name.encode())]).integers(POOL))
            done = 0
            while done < n:  # the pool from `start`, wrapping around
                m = min(n - done, POOL - start)
                flat[done : done + m] = self.pool[start : start + m]
                done, start = done + m, 0
            fan_in = math.prod(shape[1:])
            flat *= 1 / math.sqrt(fan_in) if leaf == "weight" and len(shape) >= 2 else 0.02
        return torch.from_numpy(flat.reshape(shape)).to(dtype)

    def tensors(self, specs: dict) -> dict:
        """{name: (shape, torch dtype)} → {name: tensor}."""
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            made = pool.map(lambda item: self.tensor(item[0], *item[1]), specs.items())
            return dict(zip(specs, made))


def _flat(abstract):
    """(path, shape) of every parameter of an abstract module, in `nnx.to_flat_state` order (path: the
    state's key, its block indices ints)."""
    from flax import nnx

    return [(tuple(key), tuple(var.get_value().shape))
            for key, var in nnx.to_flat_state(nnx.state(abstract))]


def _spatial_first(build):
    """`build()` traced abstractly with every convolution kernel spatial-first (*k, in, out), the layout the
    loaders' shape rules speak of, whatever the backend's default."""
    from flax import nnx

    from wan_tpu.layers.conv import kernel_layout

    with kernel_layout(False):
        return nnx.eval_shape(build)


def clip_specs(config, prefix: str, text: bool, dtype) -> dict:
    """A transformers CLIP tower's tensors (`clip_loading.checkpoint_names`), the vision `post_layernorm`
    (checked by the loader, not read) included."""
    from wan_tpu.encoders.clip import CLIPTextTransformer, CLIPVisionTransformer
    from wan_tpu.encoders.clip_loading import checkpoint_names

    build = (lambda: CLIPTextTransformer(config)) if text else (lambda: CLIPVisionTransformer(config))
    specs = {}
    for path, shape in _flat(_spatial_first(build)):
        path = tuple(str(k) for k in path)
        stacked = path[:2] == ("encoder", "layers")
        for name in checkpoint_names(prefix, path, config.num_hidden_layers):
            specs[name] = (shape[1:] if stacked else shape, dtype)
    if not text:
        specs.update({f"{prefix}post_layernorm.{k}": ((config.hidden_size,), dtype) for k in ("weight", "bias")})
    return specs


# ---- Matrix-Game-2 ---------------------------------------------------------------------------------


def matrix_game_dit_specs(cfg, dtype) -> dict:
    """The released DiT file's tensors: the authors' names (`model.` + original Wan names), their shapes."""
    from wan_tpu.loading.wan_names import diffusers_to_original_wan
    from wan_tpu.matrix_game.loading import PREFIX, _Param, abstract_transformer

    abstract = abstract_transformer(cfg)
    specs = {}
    for path, shape in _flat(abstract):
        param = _Param(path, shape, cfg, abstract.block_runs)
        for name in param.names:
            specs[PREFIX + diffusers_to_original_wan(name)] = (param.source_shape, dtype)
    return specs


def wan_vae_specs(config, dtype) -> dict:
    from wan_tpu.vae.loading import diffusers_name, diffusers_shape
    from wan_tpu.vae.model import WanVAE

    specs = {}
    for path, shape in _flat(_spatial_first(lambda: WanVAE(config, rngs=_rngs()))):
        name = diffusers_name(path, config.is_residual)
        specs[name] = (diffusers_shape(name, shape), dtype)
    return specs


def _rngs():
    from flax import nnx

    return nnx.Rngs(0)


def write_matrix_game(folder: str, tiny: bool, draws: Draws, log) -> None:
    import torch

    from wan_tpu.configs.matrix_game import get_variant
    from wan_tpu.configs.vae import TINY_VAE, VAE_PRESETS
    from wan_tpu.encoders.clip import CLIPVisionConfig
    from wan_tpu.matrix_game import convert
    from wan_tpu.matrix_game.pipeline import TINY_CLIP

    variant = get_variant("matrix-game-tiny" if tiny else "universal")
    dit_file = "dit/model.safetensors" if tiny else convert.DIT_FILES["universal"]
    # As the release holds them: the DiT in bfloat16, Wan2.1_VAE.pth in float32, the CLIP .pth in float16.
    dit = draws.tensors(matrix_game_dit_specs(variant.transformer, torch.bfloat16))
    log(f"DiT {variant.name}: {len(dit)} tensors, {_gib(dit):.2f} GiB → {dit_file}")
    os.makedirs(os.path.dirname(os.path.join(folder, dit_file)))
    from safetensors.torch import save_file

    save_file(dit, os.path.join(folder, dit_file), metadata={"format": "pt"})
    del dit

    vae_config = TINY_VAE if tiny else VAE_PRESETS["wan2.1"]
    vae = draws.tensors(wan_vae_specs(vae_config, torch.float32))
    log(f"VAE: {len(vae)} tensors, {_gib(vae):.2f} GiB → vae/")
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(vae_config).items()}
    del fields["clip_output"]  # ours, not a field of diffusers' AutoencoderKLWan
    convert.write_vae(os.path.join(folder, "vae"), {"_class_name": "AutoencoderKLWan", **fields}, vae)
    del vae

    if tiny:
        clip = CLIPVisionConfig(**TINY_CLIP)
    else:
        from wan_tpu.encoders.openclip import vision_config

        clip = vision_config(1280, 32, 16, 14)  # Wan's CLIP visual tower: ViT-H/14, all 32 blocks
    tensors = draws.tensors(clip_specs(clip, "vision_model.", False, torch.float16))
    log(f"CLIP: {len(tensors)} tensors, {_gib(tensors):.2f} GiB → image_encoder/")
    convert.write_image_encoder(os.path.join(folder, "image_encoder"), clip.to_json(), tensors)
    del tensors
    convert.write_index(folder, {variant.name: dit_file})


# ---- UnifoLM-WMA -----------------------------------------------------------------------------------


def unifolm_specs(cfg, dtype) -> dict[str, dict]:
    """{"unet": ..., "conditioning": ...}: the converted files' tensors (`unifolm.loading.torch_name`), torch
    layout: a kernel (*k, in, out) stored (out, in, *k)."""
    import jax.numpy as jnp

    from wan_tpu.layers.conv import kernel_layout
    from wan_tpu.unifolm.loading import torch_name
    from wan_tpu.unifolm.model import abstract_unifolm

    with kernel_layout(False):
        abstract = abstract_unifolm(cfg, jnp.float32, None)
    specs = {"unet": {}, "conditioning": {}}
    for path, shape in _flat(abstract):
        component, name = torch_name(".".join(str(k) for k in path))
        if path[-1] == "kernel":
            shape = (shape[-1], shape[-2], *shape[:-2])
        specs[component][name] = (shape, dtype)
    return specs


def autoencoder_kl_specs(config, dtype) -> dict:
    from wan_tpu.unifolm.autoencoder_kl import AutoencoderKL
    from wan_tpu.unifolm.autoencoder_kl_loading import diffusers_name
    from wan_tpu.unifolm.model import KeyCounter

    specs = {}
    for path, shape in _flat(_spatial_first(lambda: AutoencoderKL(config, rngs=KeyCounter(0)))):
        if len(shape) == 4:
            shape = (shape[3], shape[2], *shape[:2])
        elif len(shape) == 2:
            shape = (shape[1], shape[0])
        specs[diffusers_name(path)] = (shape, dtype)
    return specs


def write_unifolm(folder: str, tiny: bool, draws: Draws, log) -> None:
    import json

    import torch

    from wan_tpu.configs.autoencoder_kl import AUTOENCODER_KL_CONFIGS
    from wan_tpu.configs.autoencoder_kl import config_to_json as vae_json
    from wan_tpu.configs.unifolm import CONFIGS, config_to_json
    from wan_tpu.encoders.openclip import text_config, vision_config, write_tower
    from wan_tpu.errors import WanInputError
    from wan_tpu.unifolm import convert
    from wan_tpu.unifolm.presets import preset_config

    cfg = preset_config("unifolm-tiny") if tiny else CONFIGS["unifolm-wma-0"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_to_json(cfg), f, indent=1)
    # The authors' checkpoint is float32 throughout, and the converter keeps its dtypes.
    for component, specs in unifolm_specs(cfg, torch.float32).items():
        tensors = draws.tensors(specs)
        log(f"{component}: {len(tensors)} tensors, {_gib(tensors):.2f} GiB")
        convert.save_safetensors_shards(tensors, folder, component)
        del tensors

    vae_config = dataclasses.replace(AUTOENCODER_KL_CONFIGS["tiny" if tiny else "unifolm"], scaling_factor=cfg.scale_factor)
    tensors = draws.tensors(autoencoder_kl_specs(vae_config, torch.float32))
    log(f"vae: {len(tensors)} tensors, {_gib(tensors):.2f} GiB")
    os.makedirs(os.path.join(folder, "vae"))
    with open(os.path.join(folder, "vae", "config.json"), "w") as f:
        json.dump(vae_json(vae_config), f, indent=1)
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(folder, "vae", "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    del tensors

    from wan_tpu.encoders.clip_tokenizer import tiny_hf_clip_tokenizer

    width = cfg.resampler.embedding_dim
    # OpenCLIP ViT-H-14: image tower 1280 wide, 32 blocks, heads of 80; text tower 1024 wide, 24 blocks of
    # which the converter keeps 23 (the "penultimate" output), heads of 64, 49408 tokens.
    towers = {"image_encoder": (vision_config(width, 1, max(width // 16, 1), 14) if tiny else
                                vision_config(width, 32, width // convert.VISION_HEAD_WIDTH, 14), "vision_model.", False),
              "text_encoder": (text_config(cfg.unet.context_dim, 1, max(cfg.unet.context_dim // 16, 1),
                                           len(tiny_hf_clip_tokenizer())) if tiny else
                               text_config(cfg.unet.context_dim, 23, cfg.unet.context_dim // convert.TEXT_HEAD_WIDTH),
                               "text_model.", True)}
    for name, (config, prefix, text) in towers.items():
        tensors = draws.tensors(clip_specs(config, prefix, text, torch.float32))
        log(f"{name}: {len(tensors)} tensors, {_gib(tensors):.2f} GiB")
        write_tower(os.path.join(folder, name), config, tensors)
        del tensors
    vocab = towers["text_encoder"][0].vocab_size
    try:
        convert.write_tokenizer(os.path.join(folder, "tokenizer"), vocab)
    except WanInputError:  # no open-clip-torch: the byte-level tokenizer, whose ids the embedding holds too
        log("tokenizer: open-clip-torch is not installed; the byte-level CLIP tokenizer instead")
        tiny_hf_clip_tokenizer().save_pretrained(os.path.join(folder, "tokenizer"))


def _gib(tensors: dict) -> float:
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30


def write(kind: str, folder: str, overwrite: bool = False, seed: int = 0, log=print) -> str:
    """Write the random folder `kind` (one of `KINDS`) at `folder`; returns `folder`."""
    from wan_tpu.errors import WanInputError

    if kind not in KINDS:
        raise WanInputError(f"unknown folder kind {kind!r}; choose one of {', '.join(KINDS)}")
    folder = os.path.abspath(folder)
    if os.path.exists(folder) and not overwrite:
        raise WanInputError(f"{folder} already exists; pass --overwrite to replace it")
    work = folder.rstrip(os.sep) + ".partial"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    start = time.perf_counter()
    try:
        writer = write_matrix_game if kind.startswith("matrix-game") else write_unifolm
        writer(work, kind.endswith("-tiny"), Draws(seed), log)
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"wrote {folder} ({kind}, random weights) in {time.perf_counter() - start:.1f} s")
    return folder


def check(kind: str, folder: str, log=print) -> None:
    """Load `folder` through the pipeline users run and generate from it: one chunk (Matrix-Game) or one
    2-step decision sampling (UnifoLM), float32 at the tiny sizes, bfloat16 at the real ones."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.float32 if kind.endswith("-tiny") else jnp.bfloat16
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    if kind.startswith("matrix-game"):
        from wan_tpu.matrix_game.actions import random_actions
        from wan_tpu.matrix_game.pipeline import MatrixGamePipeline

        pipe = MatrixGamePipeline.from_pretrained(folder, dtype=dtype, vae_dtype=dtype)
        session = pipe.stream(rng.integers(0, 256, (*pipe.size, 3), dtype=np.uint8), seed=0)
        frames = session.step(*random_actions(pipe.action_space, pipe.chunk_frames(0), seed=0))
        log(f"check: {folder} generated a chunk of {frames.shape} {frames.dtype} in {time.perf_counter() - start:.1f} s")
        return
    from wan_tpu.unifolm.pipeline import UnifolmPipeline

    pipe = UnifolmPipeline.from_pretrained(folder, dtype=dtype)
    images = jnp.asarray(rng.uniform(-1, 1, (1, 3, 2, pipe.height, pipe.width)).astype(np.float32))
    states = jnp.asarray(rng.uniform(-1, 1, (1, 2, 16)).astype(np.float32))
    key = jax.random.key(0)
    cond = pipe.encode_conditions("pick up the cup", images, states, None, 7, key=key)
    latents = jax.block_until_ready(pipe.sample(cond, 2, 1.0, key=key))[0]
    log(f"check: {folder} sampled latents of {latents.shape} in {time.perf_counter() - start:.1f} s")


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from wan_tpu.runtime.cli import CliParser, add_overwrite, run_cli

    p = CliParser(prog="random_folders.py", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=KINDS)
    p.add_argument("folder", help="the folder to write (a converted folder: --model FOLDER reads it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="then load it and generate one chunk / sampling")
    add_overwrite(p, "replace an existing folder")

    def run(args):
        write(args.kind, args.folder, args.overwrite, args.seed)
        if args.check:
            check(args.kind, args.folder)

    return run_cli(run, p, argv)


if __name__ == "__main__":
    sys.exit(main())
