"""`load_unifolm`: a converted UniFoLM checkpoint folder → `UnifolmWMA`.

Folder layout (written by `wan-convert-unifolm` (`wan_tpu/unifolm/convert.py`) from the authors' Lightning `.ckpt`):

    config.json                 configs.unifolm.config_to_json(cfg)
    unet.safetensors            `model.diffusion_model.*` with that prefix removed (UNet, action_unet,
                                state_unet, action_token_projector)
    conditioning.safetensors    `image_proj_model.*`, `state_projector.*`, `action_projector.*`,
                                `agent_action_pos_emb`, `agent_state_pos_emb` (names unchanged)
    (vae, text_encoder, image_encoder .safetensors: read by their own loaders)

Tensor names stay the authors' (torch layout); this module maps our parameter paths to them
(`torch_name`) and converts layouts: a `kernel` is torch's (out, in, *k) moved to (*k, in, out) — or to
(out, *k, in) for a convolution built out-first (`wan_tpu.layers.conv`, on GPUs) — and reshaped to
ours (Conv1d(k=1) → linear, Conv3d (3,1,1) → the 2-D temporal conv). Everything is
checked before any data is read, and all missing / unexpected / mis-shaped names are listed in one
line. Tensors stream one at a time from memory maps; with a `mesh` each lands sharded by the
"unifolm" rules of `wan_tpu/configs/sharding.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.unifolm import config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.layers.conv import kernel_layout, out_first_kernels
from wan_tpu.loading.checkpoint import open_component
from wan_tpu.loading.params import EarlyPuts, Layout, StoredParam, load_params
from wan_tpu.unifolm.model import UnifolmWMA, abstract_unifolm

# Our module path → the authors' (applied in order, each once, to the dotted module path).
_RULES = [
    (r"^(time_embed|fps_embedding)\.linear_1$", r"\1.0"),
    (r"^(time_embed|fps_embedding)\.linear_2$", r"\1.2"),
    (r"^init_attn\.", "init_attn.0."),
    (r"^out_norm$", "out.0"),
    (r"^out_conv$", "out.2"),
    # Perceivers (image Resampler, action-token projector).
    (r"(layers\.\d+)\.attn\.", r"\1.0."),
    (r"(layers\.\d+)\.ff\.norm$", r"\1.1.0"),
    (r"(layers\.\d+)\.ff\.proj_in$", r"\1.1.1"),
    (r"(layers\.\d+)\.ff\.proj_out$", r"\1.1.3"),
    # MLP projectors.
    (r"^(state|action)_projector\.linear_1$", r"\1_projector.projector.0"),
    (r"^(state|action)_projector\.linear_2$", r"\1_projector.projector.2"),
    # ResBlock and its temporal conv (their attribute is spelt `temopral_conv`).
    (r"\.in_norm$", ".in_layers.0"),
    (r"\.in_conv$", ".in_layers.2"),
    (r"\.emb_proj$", ".emb_layers.1"),
    (r"\.out_norm$", ".out_layers.0"),
    (r"\.out_conv$", ".out_layers.3"),
    (r"\.skip$", ".skip_connection"),
    (r"\.temporal_conv\.norm(\d)$", r".temopral_conv.conv\1.0"),
    (r"\.temporal_conv\.conv1$", ".temopral_conv.conv1.2"),
    (r"\.temporal_conv\.conv([234])$", r".temopral_conv.conv\1.3"),
    # Transformer blocks.
    (r"\.(attn\d)\.to_out$", r".\1.to_out.0"),
    (r"\.ff\.proj_in$", ".ff.net.0.proj"),
    (r"\.ff\.proj_out$", ".ff.net.2"),
    # Heads: observation encoder (ResNet18 as a Sequential of its children), 1-D UNet.
    (r"\.obs_encoder\.resnet\.conv1$", ".obs_encoder.key_model_map.image.0"),
    (r"\.obs_encoder\.resnet\.norm1$", ".obs_encoder.key_model_map.image.1"),
    (r"\.obs_encoder\.resnet\.layer(\d)\.", lambda m: f".obs_encoder.key_model_map.image.{int(m[1]) + 3}."),
    (r"(key_model_map\.image\.\d\.\d)\.norm(\d)$", r"\1.bn\2"),
    (r"(key_model_map\.image\.\d\.\d)\.downsample_conv$", r"\1.downsample.0"),
    (r"(key_model_map\.image\.\d\.\d)\.downsample_norm$", r"\1.downsample.1"),
    (r"\.diffusion_step_linear_1$", ".diffusion_step_encoder.1"),
    (r"\.diffusion_step_linear_2$", ".diffusion_step_encoder.3"),
    (r"\.final_conv$", ".final_conv.1"),
    (r"\.final_block\.", ".final_conv.0."),
    (r"(\.blocks\.\d|\.final_conv\.0)\.conv$", r"\1.block.0"),
    (r"(\.blocks\.\d|\.final_conv\.0)\.norm$", r"\1.block.1"),
    (r"\.cond_encoder$", ".cond_encoder.1"),
    (r"((down|up)_modules\.\d+)\.3$", r"\1.3.conv"),
    (r"\.proj_in_action_norm$", ".proj_in_action.1"),
    (r"\.proj_out_action_norm$", ".proj_out_action.0"),
    (r"\.proj_in_action$", ".proj_in_action.0"),
    (r"\.proj_out_action$", ".proj_out_action.1"),
]
_RULES = [(re.compile(p), r) for p, r in _RULES]

# Checkpoint tensors with no parameter of ours: spatial-softmax grids (recomputed from the feature
# size), the mirrored keypoint modules 4–8 (the same objects as 3, 3, 2, 1, 0 in theirs), the
# horizon projections their forward never uses (use_linear_act_proj) and the observation encoder's
# `_dummy_variable` (a device/dtype probe of their ModuleAttrMixin).
_IGNORED = re.compile(r"(\.pos_[xy]$|\.spatial_softmax_blocks\.[4-8]\.|\.proj_(in|out)_horizon\.|\._dummy_variable$)")
# A base (generation-only) checkpoint still carries the heads its config builds; they never run.
_HEADS = re.compile(r"^(action_unet|state_unet|action_token_projector)\.")


def torch_name(path: str) -> tuple[str, str]:
    """Our dotted parameter path → (component file, the authors' tensor name)."""
    *module, leaf = path.split(".")
    component = "conditioning"
    if module and module[0] == "diffusion_model":
        component, module = "unet", module[1:]
    name = ".".join(module)
    for regex, repl in _RULES:
        name = regex.sub(repl, name)
    leaf = "weight" if leaf == "kernel" else leaf
    return component, f"{name}.{leaf}" if name else leaf


def _layout(stored: tuple[int, ...], leaf: str, shape: tuple[int, ...], out_first: bool = False) -> Layout:
    """The stored tensor → `shape`: a torch convolution weight's (out, in, *k) order changed to the kernel's
    (`torch_to_kernel`), and size-1 dimensions dropped or added (`_fits` checked the rest agree). As one
    `Layout` (a reshape, then a transpose): the stored dimensions over 1 in their stored order, as many 1s
    as `shape` has, then each put where `shape` wants it."""
    n = len(stored)
    order = list(range(n))
    if leaf == "kernel" and n >= 2:
        order = [0, *range(2, n), 1] if out_first else [*range(2, n), 1, 0]
    big = [i for i in range(n) if stored[i] != 1]
    ones = sum(1 for d in shape if d == 1)
    reshaped = tuple(stored[i] for i in big) + (1,) * ones
    place = {i: k for k, i in enumerate(big)}
    wanted = iter(place[i] for i in order if stored[i] != 1)
    spare = iter(range(len(big), len(reshaped)))
    perm = tuple(next(spare) if d == 1 else next(wanted) for d in shape)
    assert tuple(reshaped[p] for p in perm) == shape, (stored, leaf, shape)
    return Layout(reshape=None if reshaped == stored else reshaped, perm=None if perm == tuple(range(len(perm))) else perm)


def _fits(src: tuple[int, ...], leaf: str, shape: tuple[int, ...], out_first: bool = False) -> bool:
    if leaf == "kernel" and len(src) >= 2:
        src = (src[0], *src[2:], src[1]) if out_first else (*src[2:], src[1], src[0])
    return int(np.prod(src)) == int(np.prod(shape)) and [d for d in src if d != 1] == [d for d in shape if d != 1]


def load_unifolm(path: str, dtype=jnp.float32, mesh=None, attention_impl=None) -> UnifolmWMA:
    """Load a converted UniFoLM folder. Norms and keypoint temperatures stay float32; the rest is cast
    to `dtype`. With a `mesh`, weights land sharded ("unifolm" rules) and attention hooks are set."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise WanInputError(f"{path}: no config.json; convert the checkpoint with wan-convert-unifolm")
    try:
        with open(cfg_path) as f:
            cfg = config_from_json(json.load(f))
    except json.JSONDecodeError as e:
        raise WanInputError(f"{cfg_path}: not valid JSON ({e}); re-convert the checkpoint") from None
    sources = {c: open_component(path, c) for c in ("unet", "conditioning")}
    # On one device the UNet's large tensors start for the device now, as stored, while the abstract build
    # below gives the parameter list (`EarlyPuts`).
    early = EarlyPuts(sources["unet"]) if mesh is None else None
    try:
        return _load(path, cfg, sources, early, dtype, mesh, attention_impl)
    finally:
        if early is not None:
            early.close()


def _load(path, cfg, sources, early, dtype, mesh, attention_impl) -> UnifolmWMA:
    # Sharded, the convolutions keep (*k, in, out), the layout the sharding rules name.
    with kernel_layout(False) if mesh is not None else contextlib.nullcontext():
        graphdef, state = abstract_unifolm(cfg, dtype, attention_impl, split=True)
    out_first = out_first_kernels(nnx.merge(graphdef, state))
    flat = nnx.to_flat_state(state)

    plan, missing, misshaped = [], [], []
    expected = {c: set() for c in sources}
    for key, var in flat:
        ours = ".".join(str(k) for k in key)
        component, name = torch_name(ours)
        leaf, shape = ours.rsplit(".", 1)[-1], tuple(var.get_value().shape)
        expected[component].add(name)
        src = sources[component]
        if name not in src:
            missing.append(f"{component}:{name}")
        elif not _fits(tuple(src.shape(name)), leaf, shape, ours in out_first):
            misshaped.append(f"{component}:{name} {tuple(src.shape(name))} (model needs {shape})")
        plan.append((ours, component, name, leaf, var))
    unused = lambda c, n: _IGNORED.search("." + n) or (not cfg.has_heads and c == "unet" and _HEADS.match(n))
    unexpected = [f"{c}:{n}" for c, src in sources.items() for n in src if n not in expected[c] and not unused(c, n)]
    if missing or unexpected or misshaped:
        parts = [f"{label} ({len(v)}): {', '.join(v[:8])}{' …' if len(v) > 8 else ''}"
                 for label, v in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if v]
        raise WanInputError(f"{path}: the weights do not match config.json ({cfg.name}): " + "; ".join(parts))

    # The shared placement path: parameters read a few at a time straight from the memory map, large ones
    # laid out and cast on the device; on a mesh of several processes each reads only its devices' slices.
    # (Converted one after another on the host, the 9.5 GB float32 UNet's load was a warm H200 start's
    # longest, 7.0 s.)
    stored = [StoredParam(sources[component], [name], _layout(tuple(sources[component].shape(name)), leaf,
                                                              tuple(var.get_value().shape), ours in out_first),
                          np.dtype(var.get_value().dtype))
              for ours, component, name, leaf, var in plan]
    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        place = lambda i, host: place_param(mesh, "unifolm", plan[i][0], host)  # noqa: E731
    for (*_, var), value in zip(plan, load_params(stored, place, early=early)):
        var.set_value(value)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if mesh is not None:
        from wan_tpu.unifolm.sharding import shard_unifolm

        shard_unifolm(model, mesh)
    return model
