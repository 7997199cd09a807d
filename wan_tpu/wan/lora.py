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
    writes (`lora_alpha`, `alpha_pattern`, `use_rslora`); without either, alpha = rank (scale 1). Also
    PEFT's `base_model.model.` / unmerged `lora_A.default.weight` (DiffSynth-Studio), bare `lora_A`,
    diffusers' older `lora.down.weight` / `to_q_lora.down.weight` / `lora_linear_layer.down.weight`.
  - original Wan (ComfyUI, ai-toolkit, lightx2v, CausVid): `diffusion_model.blocks.0.self_attn.q.lora_down.weight`
    + `lora_up` (+ `alpha`), or `lora_A` / `lora_B`.
  - kohya / musubi-tuner: `lora_unet_blocks_0_self_attn_q.lora_down.weight` (the same names with `_` for `.`);
    kohya on diffusers names `lora_transformer_blocks_0_attn1_to_q…`; SimpleTuner's LyCORIS `lycoris_…`.
  - full deltas, as step-distill LoRAs carry them: `….diff` (weight), `….diff_b` (bias), also on
    norms (`norm3`, `norm_q`, `norm_k`; LyCORIS `w_norm` / `b_norm`), the head and the modulation tables.
Module names may be Wan's (`self_attn.q`, `ffn.0`, `norm3`, `head.head`, `time_projection.1`, ...;
`wan_tpu.loading.wan_names.original_wan_to_diffusers`) or diffusers' (`attn1.to_q`,
`ffn.net.0.proj`, `norm2`, `proj_out`, ...) under any of the prefixes. Keys no layer takes are refused in
one line that names a few of them (the LoRA is for another model), except the image branch of a Wan 2.1
I2V LoRA on a DiT without one (Wan 2.2 I2V A14B: every other layer has 2.1 I2V 14B's shapes): those are
left out, with a one-line warning, and listed in `LoraInfo.skipped`. DoRA, LoHa, LoKr, LoCon are refused.
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

Quantised DiTs (`quantize="fp8"` / `"int8"`, or an fp8 checkpoint). A LoRA's pairs are not merged into the
8-bit kernels: each quantised block linear becomes a `LowRankQuantizedLinear`, its kernel and scales
untouched, adding x·down·up (float32 sums) to its quantised product; a further LoRA's factors are
concatenated to them. Merging into the dequantised weight and quantising again was measured less
accurate (`benchmarks/lora_quantized_error.py`, tiny DiT, rank 8, updates of 0.1·‖W‖, CPU, 2026-11-27:
output error against float32 with the LoRA merged exactly 3.58e-2 merged vs 2.80e-2 apart in fp8, where
the quantisation alone costs 2.70e-2; 8.75e-3 vs 6.58e-3 in int8; rank 32 at 0.5·‖W‖, fp8: 4.01e-2 vs
2.90e-2): re-rounding the sum adds a second quantisation error, the separate term none. The cost: the
module structure changes, so a compiled step traces again after the load and after the unload, and each
linear runs two rank-r matmuls more (2·r·(in + out) multiply-adds per token; rank 64 on a 14B block
linear: about 5% of its 8-bit product). Full `diff` deltas on a quantised kernel, not low-rank, are merged
into the dequantised weight and quantised again. Unloading puts the quantised linears back as they were
(bit for bit); a DiT quantised after its LoRAs were merged cannot undo them (their unquantised weights are
gone) and says so.

Restoring exactly. `round(W + d) - d` is not `W` in bfloat16, and keeping the deltas cannot undo a
rounding. So the touched parameters are restored from an exact source instead: a DiT loaded by
`load_transformer` re-reads them from the checkpoint's memory map (the loader's own code path, so the
same bits; no host memory is held between load and unload, and a file changed on disk since the load
is refused with an error); any other DiT (presets, random weights), and any quantised kernel a `diff`
changes (a checkpoint holds the unquantised weights), keeps a host copy of each touched parameter, taken
before its first change. Unloading re-places each parameter with its original
sharding, so it too causes no retrace.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import warnings
import weakref
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from wan_tpu.errors import WanInputError
from wan_tpu.layers.quantized import QuantizedLinear, quantize_weight
from wan_tpu.loading.wan_names import diffusers_to_original_wan
from wan_tpu.runtime import executable_cache
from wan_tpu.wan.weights import checkpoint_origin, param_sources

# Prefixes a key may carry before the module name: PEFT, ComfyUI / original Wan, diffusers, kohya and
# musubi-tuner (`lora_unet_`, underscored), kohya on diffusers names (`lora_transformer_`), SimpleTuner's
# LyCORIS (`lycoris_`), DiffSynth-Studio (`pipe.dit.`).
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "lora_unet_",
             "lora_transformer_", "lycoris_", "pipe.dit.")
# Key suffix → role, as the tools write them (ComfyUI's `LoRAAdapter.load` reads all of these): PEFT /
# diffusers (`lora_A/B`, PEFT's unmerged `.default` adapter, mochi's bare `lora_A/B`), kohya
# (`lora_down/up`), older diffusers attention processors (`to_q_lora.down`, `lora.down`,
# `lora_linear_layer.down`), full deltas (`diff`, `diff_b`; LyCORIS norms `w_norm`, `b_norm`), `alpha`.
_SUFFIXES = dict(sorted({
    ".lora_A.weight": "down", ".lora_down.weight": "down", ".lora.down.weight": "down", "_lora.down.weight": "down",
    ".lora_linear_layer.down.weight": "down", ".lora_A.default.weight": "down", ".lora_A": "down",
    ".lora_B.weight": "up", ".lora_up.weight": "up", ".lora.up.weight": "up", "_lora.up.weight": "up",
    ".lora_linear_layer.up.weight": "up", ".lora_B.default.weight": "up", ".lora_B": "up",
    ".lora_B.bias": "up_bias", ".lora_up.bias": "up_bias", ".diff_b": "diff_b", ".b_norm": "diff_b",
    ".diff": "diff", ".w_norm": "diff", ".alpha": "alpha",
}.items(), key=lambda kv: -len(kv[0])))  # longest first: `.lora_B.weight` before `.lora_B`
# Entries of adapter kinds other than LoRA: refused by name.
_UNSUPPORTED = (("dora_scale", "DoRA"), (".hada_", "LoHa"), (".lokr_", "LoKr"), (".lora_mid.", "LoCon (lora_mid)"),
                (".set_weight", "weight replacement (set_weight)"), (".reshape_weight", "reshaped LoRA"),
                (".a1.weight", "GLoRA"))
# Modules of Wan 2.1's I2V image branch: a 2.1 I2V LoRA on a DiT without one (Wan 2.2 I2V A14B, whose other
# layers have the same shapes) leaves them out, reporting them, rather than refusing the file.
_IMAGE_BRANCH = re.compile(r"(^|[._])(k_img|v_img|norm_k_img|add_k_proj|add_v_proj|norm_added_k|img_emb|image_embedder)([._]|$)")


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
    skipped: tuple[str, ...] = ()  # keys of an image branch this DiT does not have

    def __str__(self):
        left_out = f", {len(self.skipped)} image-branch keys left out" if self.skipped else ""
        return f"{os.path.basename(self.path)} (scale {self.scale:g}): {self.tensors} layers changed{left_out}"


def _open(path) -> tuple:
    from wan_tpu.loading.checkpoint import TensorSource, read_metadata

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WanInputError(f"LoRA file {path!r} does not exist; pass the path of a .safetensors LoRA")
    if not path.endswith(".safetensors"):
        raise WanInputError(f"LoRA file {path} is not a .safetensors file; convert it (e.g. with safetensors' "
                            "save_file) — pickled .pt/.ckpt/.bin LoRAs are not loaded")
    return TensorSource([path]), read_metadata(path)


def _split_key(key: str) -> tuple[str, str] | None:
    """`key` → (module name without prefix, role); None for a key that is no LoRA entry."""
    kind = next((kind for marker, kind in _UNSUPPORTED if marker in key), None)
    if kind is not None:
        raise WanInputError(f"LoRA key {key!r} is a {kind} entry, which is not supported; use a plain LoRA")
    suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
    if suffix is None:
        return None
    module, role = key[: -len(suffix)], _SUFFIXES[suffix]
    module = module.replace(".processor.", ".")  # diffusers' old attention-processor LoRAs (`attn1.processor.to_q_lora`)
    for prefix in _PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):], role
    return module, role


def _few(keys) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


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
    (tensors, {param path: [_Entry]}, entry count, image-branch keys left out)."""
    tensors, metadata = _open(path)
    table = _module_table(dit)
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    unknown, unplaced, skipped = [], [], []
    no_image_branch = dit.config.image_dim is None
    for key in tensors:
        parsed = _split_key(key)
        if parsed is None or parsed[0] not in table:
            (unknown if parsed is None else skipped if no_image_branch and _IMAGE_BRANCH.search(parsed[0])
             else unplaced).append(key)
            continue
        module, role = parsed
        if role in groups[module]:
            raise WanInputError(f"LoRA keys {groups[module][role]!r} and {key!r} in {path} are the same entry of "
                                f"layer {module!r}; keep one")
        groups[module][role] = key
    if unknown:
        more = f" (nor are {_few(unknown[1:])})" if len(unknown) > 1 else ""
        raise WanInputError(f"LoRA key {unknown[0]!r} in {path} is not a LoRA entry{more}: expected lora_A/B, "
                            "lora_down/up, alpha, diff or diff_b entries; use a plain LoRA for the Wan DiT")
    if unplaced:
        more = f", nor do {len(unplaced) - 1} more ({_few(unplaced[1:])})" if len(unplaced) > 1 else ""
        raise WanInputError(f"LoRA key {unplaced[0]!r} in {path} matches no layer of this transformer "
                            f"({dit.config.num_layers} blocks){more}; is the LoRA for another Wan model?")
    if skipped and not groups:
        raise WanInputError(f"LoRA {path} changes only an image branch ({_few(skipped)}), which this transformer "
                            "does not have; it is for a Wan 2.1 I2V model")
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
    return tensors, dict(plan), count, tuple(skipped)


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


def _add_quantized(kernel, kernel_scale, layers, a, b, *, fmt: str):
    """The merge into a quantised linear (`wan_tpu.layers.quantized`), layer by layer: the float32 weight
    kernel · scale, plus a[j] @ b[j] (b None: + a[j]), quantised again with new per-output-channel scales."""

    def body(j, carry):
        k, s = carry
        l = layers[j]
        delta = a[j] if b is None else jnp.matmul(a[j], b[j], precision=jax.lax.Precision.HIGHEST)
        w = jax.lax.dynamic_index_in_dim(k, l, 0, keepdims=False).astype(jnp.float32)
        w = w * jax.lax.dynamic_index_in_dim(s, l, 0, keepdims=True)
        wq, ws = quantize_weight(w + delta, fmt)
        return jax.lax.dynamic_update_index_in_dim(k, wq, l, 0), jax.lax.dynamic_update_index_in_dim(s, ws[None], l, 0)

    return jax.lax.fori_loop(0, layers.shape[0], body, (kernel, kernel_scale))


@functools.cache
def _add_fn(sharding, stacked: bool, fmt: str | None = None):
    # The merged weight must be placed exactly like the one it replaces. CPU cannot donate (and
    # warns), so only accelerators update in place.
    donate = () if jax.default_backend() == "cpu" else (0,) if fmt is None else (0, 1)
    placed = {} if sharding is None else {"out_shardings": sharding}
    # Run once per load, in the transformer's load thread beside the other loads: no autotuning (on an H200 the
    # 14B merge's programs compiled for 2.5 s on the cold start's path) and no CUDA graph.
    placed["compiler_options"] = executable_cache.run_once()
    if fmt is not None:
        return jax.jit(functools.partial(_add_quantized, fmt=fmt), donate_argnums=donate, **placed)
    return jax.jit(functools.partial(_add, stacked=stacked), donate_argnums=donate, **placed)


def _quantized_parent(dit, param: str):
    """The `QuantizedLinear` whose kernel `param` is, or None."""
    parent = functools.reduce(getattr, param.split(".")[:-1], dit)
    return parent if isinstance(parent, QuantizedLinear) and param.endswith(".kernel") else None


def _apply(var, tensors, entries: list[_Entry], quantized=None) -> None:
    """Add one parameter's entries to it on device; only this parameter's changes are read into host memory.
    `quantized`: the `QuantizedLinear` the parameter is the kernel of (merged and quantised again)."""
    value = var.get_value()
    stacked = entries[0].layer is not None
    if quantized is None:
        fn = _add_fn(_placement(value), stacked)
    else:
        scale_var = quantized.kernel_scale
        placements = (_placement(value), _placement(scale_var.get_value()))
        fn = _add_fn(None if None in placements else placements, stacked, quantized.fmt)
        value = (value, scale_var.get_value())
    by_rank = defaultdict(list)
    for e in entries:
        if len(e.keys) == 1:
            # Full deltas go one layer at a time: a stacked 14B FFN delta would be a full copy.
            delta = np.asarray(tensors[e.keys[0]], np.float32)
            delta = (delta if e.transform is None else e.transform(delta)) * np.float32(e.scale)
            value = fn(*_args(value), np.asarray([e.layer or 0], np.int32), delta[None], None)
            continue
        down, up = (np.asarray(tensors[k], np.float32) for k in e.keys)
        rank = down.shape[0]
        # W (out, in) += scale · up @ down, i.e. our kernel (in, out) += down.T @ (scale · up).T
        by_rank[rank].append((e.layer or 0, down.reshape(rank, -1).T, (up.reshape(-1, rank) * np.float32(e.scale)).T))
    for terms in by_rank.values():
        layers = np.asarray([l for l, _, _ in terms], np.int32)
        value = fn(*_args(value), layers, np.stack([d for _, d, _ in terms]), np.stack([u for _, _, u in terms]))
    if quantized is None:
        var.set_value(value)
    else:
        var.set_value(value[0])
        quantized.kernel_scale.set_value(value[1])


def _args(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


class LowRankQuantizedLinear(QuantizedLinear):
    """A `QuantizedLinear` whose LoRAs are kept beside its 8-bit product rather than merged into it:
    y = quantised(x) + (x · down) · up, the low-rank products accumulated in float32 and added in float32
    before the output cast. `down` (…, in, r) and `up` (…, r, out), the LoRA scale folded into `up`, in the
    layer's activation dtype; stacked like the kernel. The kernel and its scales stay as they were."""

    def __init__(self, base: QuantizedLinear, down, up):
        super().__init__(base.kernel[...], base.kernel_scale[...], None if base.bias is None else base.bias[...],
                         fmt=base.fmt, dtype=base.dtype)
        self.lora_down = nnx.Param(down)
        self.lora_up = nnx.Param(up)

    def __call__(self, x):
        y = super().__call__(x)
        down, up = self.lora_down[...], self.lora_up[...]
        h = jnp.einsum("...i,ir->...r", x.astype(down.dtype), down, preferred_element_type=jnp.float32)
        low_rank = jnp.einsum("...r,ro->...o", h.astype(up.dtype), up, preferred_element_type=jnp.float32)
        return (y.astype(jnp.float32) + low_rank).astype(y.dtype)


def _low_rank_factors(tensors, entries: list[_Entry], kernel) -> tuple[np.ndarray, np.ndarray]:
    """One LoRA's pairs for a stacked quantised kernel (layers, in, out) → down (layers, in, r), up (layers, r, out),
    scale folded into up; layers it does not touch get zeros (r: the largest rank summed over one layer's entries)."""
    per_layer = defaultdict(list)
    for e in entries:
        down, up = (np.asarray(tensors[k], np.float32) for k in e.keys)
        rank = down.shape[0]
        per_layer[e.layer or 0].append((down.reshape(rank, -1).T, (up.reshape(-1, rank) * np.float32(e.scale)).T))
    width = max(sum(d.shape[1] for d, _ in terms) for terms in per_layer.values())
    layers, fan_in, fan_out = kernel.shape
    down = np.zeros((layers, fan_in, width), np.float32)
    up = np.zeros((layers, width, fan_out), np.float32)
    for layer, terms in per_layer.items():
        down[layer] = np.pad(np.concatenate([d for d, _ in terms], 1), ((0, 0), (0, width - sum(d.shape[1] for d, _ in terms))))
        up[layer] = np.pad(np.concatenate([u for _, u in terms], 0), ((0, width - sum(u.shape[0] for _, u in terms)), (0, 0)))
    return down, up


def _add_low_rank(dit, param: str, linear: QuantizedLinear, tensors, entries: list[_Entry]) -> None:
    """Put one LoRA's pairs for `param` (a quantised kernel) beside it: the linear becomes (or stays) a
    `LowRankQuantizedLinear`, a further LoRA's factors concatenated to the ones already there."""
    dtype = jnp.dtype(linear.dtype or jnp.float32)
    down, up = _low_rank_factors(tensors, entries, linear.kernel.get_value())
    if isinstance(linear, LowRankQuantizedLinear):
        down = np.concatenate([np.asarray(jax.device_get(linear.lora_down[...]), np.float32), down], -1)
        up = np.concatenate([np.asarray(jax.device_get(linear.lora_up[...]), np.float32), up], -2)
    kernel = linear.kernel.get_value()
    # Small (rank × width per layer): replicated on the kernel's mesh, or left uncommitted like it.
    place = (lambda a: jax.device_put(a, NamedSharding(kernel.sharding.mesh, PartitionSpec()))) if (
        kernel.committed and isinstance(kernel.sharding, NamedSharding)) else jnp.asarray
    *modules, name, _ = param.split(".")
    setattr(functools.reduce(getattr, modules, dit), name,
            LowRankQuantizedLinear(linear, place(down.astype(dtype)), place(up.astype(dtype))))


# ---- per-DiT bookkeeping ------------------------------------------------------------------------------


@dataclasses.dataclass
class _State:
    loaded: list  # LoraInfo of every load, in order
    # param path → (host copy or None to re-read from the checkpoint, `_placement`, whether it was quantised)
    originals: dict
    # module path → the quantised linear a `LowRankQuantizedLinear` replaced
    modules: dict = dataclasses.field(default_factory=dict)


# DiT → _State. A side table rather than an attribute: attributes of an nnx module are part of its
# graphdef, which keys compiled code (an attribute would retrace every compiled step).
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _variable(dit, path: str):
    *modules, leaf = path.split(".")
    return getattr(functools.reduce(getattr, modules, dit), leaf)


def load_lora(dit, path, scale: float = 1.0) -> LoraInfo:
    """Merge the LoRA at `path` into `dit`'s weights with `scale` (see the module docstring); calls stack.
    Keys of an image branch `dit` lacks (a Wan 2.1 I2V LoRA on Wan 2.2 I2V A14B) are left out with a warning."""
    scale = _check_scale(scale)
    tensors, plan, count, skipped = _plan(dit, path, scale)
    state = _STATES.setdefault(dit, _State([], {}))
    from_checkpoint = checkpoint_origin(dit) is not None
    for param, entries in plan.items():
        var, quantized = _variable(dit, param), _quantized_parent(dit, param)
        # A quantised kernel keeps its LoRA pairs apart (`LowRankQuantizedLinear`); full deltas merge into it.
        pairs = [e for e in entries if len(e.keys) == 2] if quantized is not None else []
        merged = [e for e in entries if quantized is None or len(e.keys) == 1]
        if merged:
            touched = [(param, var)] + ([] if quantized is None else [(param + "_scale", quantized.kernel_scale)])
            for name, v in touched:
                if name not in state.originals:
                    value = v.get_value()
                    # Quantised weights cannot be re-read from a checkpoint (it holds the unquantised ones): kept.
                    keep = quantized is not None or not from_checkpoint
                    state.originals[name] = (np.asarray(jax.device_get(value)) if keep else None, _placement(value),
                                             quantized is not None)
            _apply(var, tensors, merged, quantized)
        if pairs:
            module = param.rpartition(".")[0]
            state.modules.setdefault(module, quantized)
            _add_low_rank(dit, param, _quantized_parent(dit, param), tensors, pairs)
    info = LoraInfo(os.fspath(path), scale, count, tuple(sorted(plan)), skipped)
    if skipped:
        warnings.warn(f"LoRA {os.path.basename(info.path)}: {len(skipped)} keys of an image branch this transformer "
                      f"does not have were left out ({_few(skipped)})", stacklevel=2)
    state.loaded.append(info)
    return info


def loaded_loras(dit) -> list[LoraInfo]:
    """The LoRAs merged into `dit`, in load order."""
    state = _STATES.get(dit)
    return list(state.loaded) if state else []


def unload_lora(dit) -> None:
    """Undo every `load_lora` on `dit`: each touched parameter gets back its exact original bits and sharding."""
    state = _STATES.get(dit)
    if state is None:
        return
    if any(was != (_quantized_parent(dit, p) is not None) for p, (_, _, was) in state.originals.items()
           if not p.endswith("_scale")):
        raise WanInputError("the DiT was quantised after its LoRAs were merged, so their unquantised weights are gone; "
                            "reload the DiT to undo them")
    for module, linear in state.modules.items():
        *parents, name = module.split(".")
        setattr(functools.reduce(getattr, parents, dit), name, linear)
    origin = checkpoint_origin(dit)
    for param, (host, sharding, _) in state.originals.items():
        if host is None:
            host = origin.read(param)
        _variable(dit, param).set_value(jax.device_put(host, sharding))
    # Forgotten only once every parameter is back: after a failed read the LoRAs are still on record.
    del _STATES[dit]
