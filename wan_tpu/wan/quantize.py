"""`quantize="fp8"` / `"int8"`: the DiT's block linears on the low-precision matrix units.

    dit = wan_tpu.load_transformer(path, dtype=jnp.bfloat16, quantize="fp8")
    pipe = wan_tpu.WanPipeline.from_pretrained(path, quantize="fp8")      # CLI: --quantize fp8
    quantize_transformer(dit, "int8")                                     # an already loaded DiT, in place

What is quantised: every linear layer inside the transformer blocks — self-attention q, k, v, out;
cross-attention q, k, v, out (and the I2V image k, v); the FFN's two projections: over 99% of the
DiT's matmul FLOPs. What stays in the load dtype: the patch embedding, the time/text/image
condition embedders and the modulation tables (they run once per forward, not per layer), the
output head, the norms, and attention itself (bf16 flash attention; FP8 attention would need
scaled P·V and is not done). The arithmetic is `wan_tpu.layers.quantized` (per-output-channel
weight scales computed here, per-token activation scales computed in the graph).

Weights are quantised on the device they live on, one stacked parameter at a time, and keep the
sharding of the bf16 weight they replace (the f8 kernel has the same shape, so the same
`wan_tpu/configs/sharding.py` rule; the scales follow the kernel's output dimension). Peak memory during
the conversion: the model plus one stacked bf16 kernel.

Where it runs: "fp8" on NVIDIA GPUs of compute capability ≥ 8.9 (Ada, Hopper, Blackwell:
cuBLASLt FP8 GEMMs) and TPU v7 (FP8 matrix units); "int8" on NVIDIA GPUs of compute capability
≥ 8.0 (Ampere on: cuBLASLt int8 GEMMs) and TPU v5e, v5p, v6e and v7 (int8 matrix units at twice
the bf16 rate; int8 × int8 → int32, exact accumulation). The CPU runs both emulated, for tests.
Anything else is refused with a `WanInputError` naming what would work (no matching matrix units:
the operands would be widened back to bf16 and run slower than bf16).

int8 or FP8 on a GPU (H200, random weights; docs/PERFORMANCE.md): XLA's int8 GEMMs
ran at 1,411–1,663 TOPS against FP8's 1,567–1,687 TFLOP/s, and int8 keeps ~7 bits at a token's scale
where e4m3 keeps 3: one forward moved by 1.47e-2 (1.3B) / 2.38e-2 (14B) against bf16 in int8,
5.97e-2 / 5.44e-2 in FP8. Its products come back in int32, twice the bytes of FP8's bf16: at 1.3B
(width 1,536) int8 linears were no faster than bf16; at 14B, with FP8 attention, 1.2% slower than FP8.

LoRA: loaded before quantising, adapters merge into the bf16 weights; loaded into a quantised DiT, they
stay beside the 8-bit products as low-rank terms (`wan_tpu.wan.lora.LowRankQuantizedLinear`, the more
accurate of the two ways measured there).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding

from wan_tpu.errors import WanInputError
from wan_tpu.layers.quantized import FORMATS, QuantizedLinear, quantize_weight
from wan_tpu.parallel import offload

MODES = tuple(FORMATS)
# The block linears, as (submodule, attribute) under `WanTransformer.blocks`.
BLOCK_LINEARS = (
    ("attn1", "to_q"), ("attn1", "to_k"), ("attn1", "to_v"), ("attn1", "to_out"),
    ("attn2", "to_q"), ("attn2", "to_k"), ("attn2", "to_v"), ("attn2", "to_out"),
    ("attn2", "add_k_proj"), ("attn2", "add_v_proj"),
    ("ffn", "proj_in"), ("ffn", "proj_out"),
)


def check_mode(mode) -> str | None:
    if mode is not None and mode not in MODES:
        raise WanInputError(f"quantize={mode!r} is not supported; choose one of {list(MODES)} or None (no quantisation)")
    return mode


_NEEDS = {"fp8": "FP8 matrix units (NVIDIA compute capability ≥ 8.9, or TPU v7)",
          "int8": "int8 matrix units faster than bf16 (NVIDIA compute capability ≥ 8.0, or TPU v5e, v5p, v6e, v7)"}


def supported(device, mode: str) -> tuple[bool, str]:
    """(whether `device` runs `mode` on matching matrix units or is the CPU, what it is)."""
    kind = getattr(device, "device_kind", "") or ""
    if device.platform == "cpu":
        return True, f"CPU ({mode} emulated)"
    if device.platform == "gpu":
        cc = str(getattr(device, "compute_capability", "0.0"))
        major, _, minor = cc.partition(".")
        ok = (int(major), int(minor or 0)) >= ((8, 9) if mode == "fp8" else (8, 0))
        return ok, f"{kind} (compute capability {cc})"
    if device.platform == "tpu":
        ok = kind.startswith("TPU7") or (mode == "int8" and kind.startswith(("TPU v5", "TPU v6")))
        return ok, kind
    return False, kind or device.platform


def check_device(mode: str, devices=None) -> None:
    for device in devices or jax.devices()[:1]:
        ok, what = supported(device, mode)
        if not ok:
            other = [m for m in MODES if m != mode and supported(device, m)[0]]
            hint = f"use --quantize {other[0]}" if other else "run without --quantize (bf16)"
            raise WanInputError(f"quantize={mode!r} needs {_NEEDS[mode]}; {what} has none — {hint}")


def ensure_unquantized(dit, action: str) -> None:
    """Refuse `action` (e.g. "merging a LoRA") on a DiT whose linears are already quantised."""
    if getattr(dit, "quantization", None):
        raise WanInputError(
            f"{action} needs the bf16 weights, but this DiT is already quantised to {dit.quantization}; "
            f"load it without quantize=, do that first, then call quantize_transformer (pipe.quantize)"
        )


@functools.cache
def _quantizer(mode: str, shardings=None):
    """`quantize_weight` compiled once per format and (kernel, scale) output sharding pair."""
    fn = functools.partial(quantize_weight, fmt=mode)
    return jax.jit(fn) if shardings is None else jax.jit(fn, out_shardings=shardings)


def _scale_sharding(mesh, path: str, shape, num_heads):
    from wan_tpu.parallel.sharding import param_spec

    return NamedSharding(mesh, param_spec(mesh, "dit", path, shape, num_heads))


def quantize_transformer(dit, mode: str = "fp8", mesh=None, linears=BLOCK_LINEARS):
    """Replace the block linears of a loaded `WanTransformer` with `QuantizedLinear`s, in place; returns it.

    `mesh`: the mesh the DiT was placed on (None: one device). `linears`: which of `BLOCK_LINEARS`
    ((parent, name) pairs; the others stay in the DiT's dtype). Quantising twice is an error.
    """
    unknown = set(linears) - set(BLOCK_LINEARS)
    if unknown:
        raise ValueError(f"not block linears: {sorted(unknown)}; choose from BLOCK_LINEARS")
    check_mode(mode)
    if mode is None:
        return dit
    ensure_unquantized(dit, f"quantize={mode!r}")
    devices = None if mesh is None else list(mesh.devices.flat)
    check_device(mode, devices)
    heads = dit.config.num_attention_heads
    for parent_name, name in linears:
        parent = getattr(dit.blocks, parent_name)
        linear = getattr(parent, name, None)
        if linear is None:
            continue
        # A block stack offloaded to host memory (`wan_tpu.parallel.offload`) is quantised on the device one
        # linear at a time and goes back: the device never holds the whole bf16 stack.
        streamed = offload.on_host(linear.kernel[...])
        kernel = offload.to_device(linear.kernel[...])
        scale_shape = kernel.shape[:-2] + kernel.shape[-1:]
        shardings = None
        if mesh is not None:
            path = f"blocks.{parent_name}.{name}.kernel_scale"
            shardings = (kernel.sharding, _scale_sharding(mesh, path, scale_shape, heads))
        quantized = _quantizer(mode, shardings)(kernel)
        install_quantized(dit, mode, {(parent_name, name): tuple(map(offload.to_host, quantized)) if streamed else quantized})
        del kernel, linear
    dit.quantization = mode
    if getattr(dit, "resident_blocks", None) is not None:  # resident copies of the quantised stack
        dit.offload_blocks(dit.resident_block_count)
    return dit


def install_quantized(dit, mode: str, linears: dict) -> object:
    """Put already quantised block linears in place: `linears` maps (parent, name) of `BLOCK_LINEARS` to
    (kernel (layers, in, out) in `mode`'s dtype, float32 scales (layers, out)), e.g. as a checkpoint stores
    them (`wan_tpu.wan.transformer_loading`); each keeps the bias and dtype of the linear it replaces."""
    for (parent_name, name), (wq, scale) in linears.items():
        parent = getattr(dit.blocks, parent_name)
        linear = getattr(parent, name)
        bias = None if linear.bias is None else linear.bias[...]
        setattr(parent, name, QuantizedLinear(wq, scale, bias, fmt=mode, dtype=linear.dtype or dit.dtype))
    dit.quantization = mode
    return dit


__all__ = ["BLOCK_LINEARS", "MODES", "check_device", "check_mode", "ensure_unquantized", "install_quantized",
           "quantize_transformer", "supported"]
