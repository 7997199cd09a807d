"""LoRA adapters for the Wan DiT: read a `.safetensors` LoRA, merge it into the weights on device,
and restore the weights bit-exactly.

    dit = wan_tpu.load_transformer("/ckpt/Wan2.1-T2V-14B-Diffusers/transformer", dtype=jnp.bfloat16)
    dit.load_lora("Wan21_T2V_14B_lightx2v_cfg_step_distill_lora_rank64.safetensors", scale=1.0)
    dit.load_lora("style.safetensors", scale=0.6)       # calls stack
    dit.unload_lora()                                   # every LoRA undone: the loaded weights, bit for bit

    pipe.load_lora_weights(path, scale=1.0, expert=None)  # WanPipeline: both A14B experts, or "high" / "low"

Formats (detected per key, so one file may mix them):
  - diffusers / PEFT: `transformer.blocks.0.attn1.to_q.lora_A.weight` + `lora_B.weight` (+ `lora_B.bias`);
    alpha from `….alpha` tensors or the `lora_adapter_metadata` that diffusers' `save_lora_weights`
    writes (`lora_alpha`, `alpha_pattern`, `use_rslora`); without either, alpha = rank (scale 1).
  - original Wan / kohya / musubi: `diffusion_model.blocks.0.self_attn.q.lora_down.weight` + `lora_up` + `alpha`.
  - ComfyUI: `lora_unet_blocks_0_self_attn_q.lora_down.weight` (the same names with `_` for `.`).
  - full deltas, as step-distill LoRAs carry them: `….diff` (weight), `….diff_b` (bias), also on
    norms (`norm3`, `norm_q`, `norm_k`), the head and the modulation tables.
Module names may be Wan's (`self_attn.q`, `ffn.0`, `norm3`, `head.head`, `time_projection.1`, ...;
`wan_tpu.loading.wan_names.original_wan_to_diffusers`) or diffusers' (`attn1.to_q`,
`ffn.net.0.proj`, `norm2`, `proj_out`, ...) under any of the prefixes.
A layer receives `W + scale · (alpha / rank) · B·A`, plus `scale · diff` and `scale · diff_b`
(PEFT's `lora_B.bias` belongs to `lora_B`: `scale · (alpha / rank) · bias`, as PEFT computes it).
diffusers ignores the blocks' `diff` entries and every norm entry (zero in the files it has seen);
here they are applied, as ComfyUI does.

Merging. The file's header is checked against the model first (names, shapes, pairs), so a bad file
changes nothing. Then every change is computed and added on device, in float32, one parameter at a
time and one layer at a time inside a compiled loop (`W[l] += D[l] @ U[l]`), with the parameter's
buffer donated on accelerators: the extra device memory is one layer's float32 update, never a second
copy of the DiT, and the host holds one parameter's LoRA factors at a time. The result keeps the
parameter's sharding, shape and dtype, so a compiled denoise step takes the merged weights without
retracing. The factors of all layers of one parameter go in one call, so a LoRA on every block
linear of a 14B model is 10 calls; full-weight deltas go one layer per call.

Restoring exactly. `round(W + d) - d` is not `W` in bfloat16, and keeping the deltas cannot undo a
rounding. So the touched parameters are restored from an exact source instead: a DiT loaded by
`load_transformer` re-reads them from the checkpoint's memory map (the loader's own code path, so the
same bits; no host memory is held between load and unload, and a file changed on disk since the load
is refused with an error); any other DiT (presets, random weights) keeps a host copy of each touched
parameter, taken before its first change. Unloading re-places each parameter with its original
sharding, so it too causes no retrace.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import weakref
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu.errors import WanInputError
from wan_tpu.loading.wan_names import diffusers_to_original_wan
from wan_tpu.wan.weights import checkpoint_origin, param_sources

# Prefixes a key may carry before the module name.
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "lora_unet_")
# Key suffix → role.
_SUFFIXES = {
    ".lora_A.weight": "down", ".lora_down.weight": "down",
    ".lora_B.weight": "up", ".lora_up.weight": "up",
    ".lora_B.bias": "up_bias", ".lora_up.bias": "up_bias", ".diff_b": "diff_b",
    ".diff": "diff", ".alpha": "alpha",
}


@dataclasses.dataclass(frozen=True)
class _Target:
    """One tensor of the checkpoint (diffusers layout) and where it lives among our parameters."""

    param: str  # our parameter path, e.g. "blocks.attn1.to_q.kernel"
    layer: int | None  # index on the stacked layer axis; None for unstacked parameters
    source_shape: tuple[int, ...]  # diffusers layout
    transform: object  # diffusers layout → ours, or None


def _module_table(dit) -> dict[str, dict[str, _Target]]:
    """Every accepted module name (Wan's and diffusers', dotted and ComfyUI-underscored) →
    {"weight": target, "bias": target}; bare parameters (modulation tables, pos_embed) have "weight" only."""
    modules: dict[str, dict[str, _Target]] = defaultdict(dict)
    for src in param_sources(dit):
        for i, name in enumerate(src.names):
            module, _, leaf = name.rpartition(".")
            if leaf not in ("weight", "bias"):  # a bare parameter: the tensor itself is the module
                module, leaf = name, "weight"
            modules[module][leaf] = _Target(src.path, i if src.stacked else None, tuple(src.source_shape),
                                            src.transform)
    table = {}
    for name, leaves in modules.items():
        for alias in (name, diffusers_to_original_wan(name)):
            table[alias] = table[alias.replace(".", "_")] = leaves
    return table


@dataclasses.dataclass(frozen=True)
class LoraInfo:
    """What one `load_lora` changed."""

    path: str
    scale: float
    tensors: int  # LoRA entries applied (a down/up pair counts once)
    parameters: tuple[str, ...]  # our parameter paths that changed

    def __str__(self):
        return f"{os.path.basename(self.path)} (scale {self.scale:g}): {self.tensors} layers changed"


def _open(path) -> tuple:
    from wan_tpu.loading.checkpoint import TensorSource, read_metadata

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WanInputError(f"LoRA file {path!r} does not exist; pass the path of a .safetensors LoRA")
    if not path.endswith(".safetensors"):
        raise WanInputError(f"LoRA file {path} is not a .safetensors file; convert it (e.g. with safetensors' "
                            "save_file) — pickled .pt/.ckpt/.bin LoRAs are not loaded")
    return TensorSource([path]), read_metadata(path)


def _split_key(key: str) -> tuple[str, str]:
    """`key` → (module name without prefix, role)."""
    suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
    if suffix is not None:
        module, role = key[: -len(suffix)], _SUFFIXES[suffix]
    else:
        if "dora_scale" in key or re.search(r"\.(hada|lokr|lora_mid)", key):
            kind = "DoRA" if "dora_scale" in key else "LyCORIS/LoHa/LoKr"
            raise WanInputError(f"LoRA key {key!r} is a {kind} entry, which is not supported; use a plain LoRA")
        raise WanInputError(f"LoRA key {key!r} is not a LoRA entry (lora_A/B, lora_down/up, alpha, diff, diff_b); "
                            "use a plain LoRA for the Wan DiT")
    for prefix in _PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):], role
    return module, role


class _PeftAlpha:
    """Alpha of diffusers/PEFT files without `.alpha` tensors: the `lora_adapter_metadata` LoraConfig."""

    def __init__(self, metadata: dict):
        cfg = {}
        if "lora_adapter_metadata" in metadata:
            raw = json.loads(metadata["lora_adapter_metadata"])
            cfg = {k.removeprefix("transformer."): v for k, v in raw.items()
                   if k.startswith("transformer.") or "." not in k}
        self.alpha = cfg.get("lora_alpha")
        self.patterns = cfg.get("alpha_pattern") or {}
        self.rslora = bool(cfg.get("use_rslora", False))

    def scale(self, module: str, rank: int, alpha: float | None) -> float:
        if alpha is None:
            # PEFT's alpha_pattern keys match a module name or its dotted suffix.
            alpha = next((v for k, v in self.patterns.items() if re.fullmatch(rf"(.*\.)?({k})", module)), self.alpha)
        if alpha is None:
            return 1.0
        return alpha / (math.sqrt(rank) if self.rslora else rank)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One change to one layer of a parameter, checked against the shapes; its data is read when applied."""

    layer: int | None
    keys: tuple[str, ...]  # (down, up) for a LoRA; (delta,) for diff / diff_b / PEFT's lora_B.bias
    scale: float
    transform: object  # for a delta: diffusers layout → ours, or None


def _plan(dit, path, scale: float):
    """Read a LoRA file's header and check it against `dit` (possibly abstract) without reading its data:
    (tensors, {param path: [_Entry]}, entry count)."""
    tensors, metadata = _open(path)
    table = _module_table(dit)
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    for key in tensors:
        module, role = _split_key(key)
        if module not in table:
            raise WanInputError(f"LoRA key {key!r} in {path} matches no layer of this transformer "
                                f"({dit.config.num_layers} blocks); is the LoRA for another Wan model?")
        if role in groups[module]:
            raise WanInputError(f"LoRA keys {groups[module][role]!r} and {key!r} in {path} are the same entry of "
                                f"layer {module!r}; keep one")
        groups[module][role] = key
    peft = _PeftAlpha(metadata)
    plan: dict[str, list[_Entry]] = defaultdict(list)
    count = 0
    for module, roles in groups.items():
        leaves, lora_scale = table[module], None
        if ("down" in roles) != ("up" in roles) or (("alpha" in roles or "up_bias" in roles) and "down" not in roles):
            have = ", ".join(sorted(roles))
            raise WanInputError(f"LoRA {path}: module {module!r} has {have} but not its pair; a LoRA layer needs "
                                "both down (lora_A) and up (lora_B)")
        if "down" in roles:
            t = leaves["weight"]
            down, up = tensors.shape(roles["down"]), tensors.shape(roles["up"])
            rank, fan_in, fan_out = (down or (0,))[0], math.prod(t.source_shape[1:]), t.source_shape[0]
            if math.prod(down) != rank * fan_in or not up or up[0] != fan_out or math.prod(up) != fan_out * rank:
                raise WanInputError(
                    f"LoRA {path}: {roles['down']!r} {down} and {roles['up']!r} {up} do not fit layer "
                    f"{module!r} of shape {t.source_shape} (need ({rank}, {fan_in}) and ({fan_out}, {rank})); "
                    "the LoRA is for another model size, or its rank is inconsistent")
            alpha = float(np.asarray(tensors[roles["alpha"]]).reshape(-1)[0]) if "alpha" in roles else None
            lora_scale = scale * peft.scale(module, rank, alpha)
            plan[t.param].append(_Entry(t.layer, (roles["down"], roles["up"]), lora_scale, None))
            count += 1
        # diff / diff_b are plain deltas; PEFT's lora_B.bias belongs to lora_B, scaled like it (alpha / rank).
        for role, leaf, s in (("diff", "weight", scale), ("diff_b", "bias", scale), ("up_bias", "bias", lora_scale)):
            if role not in roles:
                continue
            if leaf not in leaves:
                raise WanInputError(f"LoRA key {roles[role]!r} in {path}: layer {module!r} has no {leaf}")
            t = leaves[leaf]
            if tensors.shape(roles[role]) != t.source_shape:
                raise WanInputError(f"LoRA key {roles[role]!r} in {path} has shape {tensors.shape(roles[role])}, "
                                    f"but the layer's {leaf} has shape {t.source_shape}; the LoRA is for another "
                                    "model size")
            plan[t.param].append(_Entry(t.layer, (roles[role],), s, t.transform))
            count += role != "up_bias"
    return tensors, dict(plan), count


def check_lora(dit, path, scale: float = 1.0) -> int:
    """Check, without loading the weights, that a LoRA file fits a DiT; its entry count. An abstract DiT is
    enough: `check_lora(wan_tpu.wan.transformer.abstract_transformer(config), path)`."""
    return _plan(dit, path, _check_scale(scale))[2]


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise WanInputError(f"LoRA scale must be a finite number, got {scale!r}")
    return float(scale)


# ---- merging on device --------------------------------------------------------------------------------


def _add(param, layers, a, b, *, stacked: bool):
    """param[layers[j]] += a[j] @ b[j] (b None: += a[j]) in float32, layer by layer (one layer's update in memory)."""
    p = param if stacked else param[None]

    def body(j, p):
        l = layers[j]
        delta = a[j] if b is None else jnp.matmul(a[j], b[j], precision=jax.lax.Precision.HIGHEST)
        cur = jax.lax.dynamic_index_in_dim(p, l, 0, keepdims=False).astype(jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(p, (cur + delta).astype(p.dtype), l, 0)

    p = jax.lax.fori_loop(0, layers.shape[0], body, p)
    return p if stacked else p[0]


def _placement(value):
    """What must be kept for a compiled step to take a new value without retracing: the sharding of a
    committed array; None for an uncommitted one (which must stay uncommitted)."""
    return value.sharding if value.committed else None


@functools.cache
def _add_fn(sharding, stacked: bool):
    # The merged weight must be placed exactly like the one it replaces. CPU cannot donate (and
    # warns), so only accelerators update in place.
    donate = () if jax.default_backend() == "cpu" else (0,)
    placed = {} if sharding is None else {"out_shardings": sharding}
    return jax.jit(functools.partial(_add, stacked=stacked), donate_argnums=donate, **placed)


def _apply(var, tensors, entries: list[_Entry]) -> None:
    """Add one parameter's entries to it on device; only this parameter's changes are read into host memory."""
    value = var.get_value()
    stacked = entries[0].layer is not None
    fn = _add_fn(_placement(value), stacked)
    by_rank = defaultdict(list)
    for e in entries:
        if len(e.keys) == 1:
            # Full deltas go one layer at a time: a stacked 14B FFN delta would be a full copy.
            delta = np.asarray(tensors[e.keys[0]], np.float32)
            delta = (delta if e.transform is None else e.transform(delta)) * np.float32(e.scale)
            value = fn(value, np.asarray([e.layer or 0], np.int32), delta[None], None)
            continue
        down, up = (np.asarray(tensors[k], np.float32) for k in e.keys)
        rank = down.shape[0]
        # W (out, in) += scale · up @ down, i.e. our kernel (in, out) += down.T @ (scale · up).T
        by_rank[rank].append((e.layer or 0, down.reshape(rank, -1).T, (up.reshape(-1, rank) * np.float32(e.scale)).T))
    for terms in by_rank.values():
        layers = np.asarray([l for l, _, _ in terms], np.int32)
        value = fn(value, layers, np.stack([d for _, d, _ in terms]), np.stack([u for _, _, u in terms]))
    var.set_value(value)


# ---- per-DiT bookkeeping ------------------------------------------------------------------------------


@dataclasses.dataclass
class _State:
    loaded: list  # LoraInfo of every load, in order
    originals: dict  # param path → (host copy or None to re-read from the checkpoint, `_placement`)


# DiT → _State. A side table rather than an attribute: attributes of an nnx module are part of its
# graphdef, which keys compiled code (an attribute would retrace every compiled step).
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _variable(dit, path: str):
    *modules, leaf = path.split(".")
    return getattr(functools.reduce(getattr, modules, dit), leaf)


def load_lora(dit, path, scale: float = 1.0) -> LoraInfo:
    """Merge the LoRA at `path` into `dit`'s weights with `scale` (see the module docstring); calls stack."""
    from wan_tpu.wan.quantize import ensure_unquantized

    ensure_unquantized(dit, "merging a LoRA")
    scale = _check_scale(scale)
    tensors, plan, count = _plan(dit, path, scale)
    state = _STATES.setdefault(dit, _State([], {}))
    from_checkpoint = checkpoint_origin(dit) is not None
    for param, entries in plan.items():
        var = _variable(dit, param)
        if param not in state.originals:
            value = var.get_value()
            state.originals[param] = (None if from_checkpoint else np.asarray(jax.device_get(value)), _placement(value))
        _apply(var, tensors, entries)
    info = LoraInfo(os.fspath(path), scale, count, tuple(sorted(plan)))
    state.loaded.append(info)
    return info


def loaded_loras(dit) -> list[LoraInfo]:
    """The LoRAs merged into `dit`, in load order."""
    state = _STATES.get(dit)
    return list(state.loaded) if state else []


def unload_lora(dit) -> None:
    """Undo every `load_lora` on `dit`: each touched parameter gets back its exact original bits and sharding."""
    from wan_tpu.wan.quantize import ensure_unquantized

    state = _STATES.get(dit)
    if state is None:
        return
    ensure_unquantized(dit, "unloading a LoRA")
    origin = checkpoint_origin(dit)
    for param, (host, sharding) in state.originals.items():
        if host is None:
            host = origin.read(param)
        _variable(dit, param).set_value(jax.device_put(host, sharding))
    # Forgotten only once every parameter is back: after a failed read the LoRAs are still on record.
    del _STATES[dit]
