"""`load_transformer`: a Wan DiT checkpoint in any layout users have (a diffusers `transformer/` folder,
an official Wan folder, a ComfyUI or GGUF file: `wan_tpu.loading.formats`, which reads each under
diffusers' names) → `WanTransformer`.

Every parameter of the (abstractly built) module is filled from the checkpoint: diffusers names are
mapped to ours (`to_out.0` → `to_out`, `ffn.net.0.proj` → `ffn.proj_in`, `ffn.net.2` → `ffn.proj_out`),
linear weights are transposed to (in, out), the patch-embedding Conv3d becomes a matmul kernel, and
per-layer tensors `blocks.{i}.…` are stacked on the leading layer axis. All names and shapes are
checked against the config (config.json, or the shapes) before any data is read. Block linears a file
stores in 8 bits go straight into the quantised layout when `quantize` asks for that format. Tensors stream one parameter at a time from
memory-mapped files, so the host holds at most one (stacked) parameter besides the mapping.
The name mapping is `wan_tpu.wan.weights.ParamSource` (names from `wan_tpu.loading.wan_names`); the
loaded DiT's `wan_tpu.wan.weights.checkpoint_origin(dit)` re-reads one parameter exactly as it was
loaded (how `wan_tpu.wan.lora` restores the weights a LoRA changed).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.layers.quantized import FORMATS
from wan_tpu.loading import stacking
from wan_tpu.loading.checkpoint import MappedSource
from wan_tpu.loading.params import TRANSPOSE, Layout, StoredParam, load_params
from wan_tpu.wan.quantize import BLOCK_LINEARS
from wan_tpu.wan.transformer import WanTransformer
from wan_tpu.wan.weights import CheckpointOrigin, ParamSource, record_checkpoint_origin

# Checkpoint tensors diffusers itself ignores (`_keys_to_ignore_on_load_unexpected`).
_IGNORED_SEGMENTS = ("norm_added_q",)


def load_transformer(path: str, dtype=jnp.float32, mesh=None, quantize: str | None = None,
                     offload: bool = False) -> WanTransformer:
    """Load a Wan DiT into a WanTransformer: a diffusers `transformer/` folder (config.json + safetensors),
    an official Wan folder (or one of its `high_noise_model/`, `low_noise_model/`), a single
    `.safetensors` file (ComfyUI's included: fp16, bf16, fp8, fp8_scaled) or a `.gguf` file; see
    `wan_tpu.loading.formats`.

    Parameters that diffusers keeps in float32 stay float32; the rest are cast to `dtype`. With a
    `mesh`, each parameter is placed sharded as it is read (`wan_tpu.parallel.sharding.place_param`) and the
    model's hooks are set for the mesh (`wan_tpu.parallel.sharding.shard_transformer`). `quantize="fp8"`
    (or "int8") then quantises the block linears on device (`wan_tpu.wan.quantize`); block linears the
    file already stores in that format (fp8 / fp8_scaled weights for "fp8", GGUF Q8_0 for "int8") are
    placed as stored, 8-bit, with the file's scales: no bf16 copy on the device. `offload=True`: the block
    stack is read straight into host memory, every block streamed (`WanTransformer.offload_blocks`; the
    device never holds the stack), quantised on the device one linear at a time.
    """
    from wan_tpu.loading.formats import open_dit
    from wan_tpu.wan.quantize import check_device, check_mode, install_quantized, quantize_transformer

    if check_mode(quantize):
        # Refuse before reading gigabytes of weights.
        check_device(quantize, None if mesh is None else list(mesh.devices.flat))
    ckpt = open_dit(path)
    cfg, tensors = ckpt.config, ckpt.tensors
    abstract = stacking.eval_shape(lambda: WanTransformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)

    sources = [ParamSource(tuple(str(p) for p in key), var.get_value(), cfg) for key, var in flat]
    for s in sources:
        s.check(tensors, path)
    expected = {n for s in sources for n in s.names}
    for name in tensors:
        if name not in expected and not any(seg in name.split(".") for seg in _IGNORED_SEGMENTS):
            raise WanInputError(
                f"{path}: unexpected tensor {name!r} (shape {tuple(tensors.shape(name))}) is not a parameter of the "
                f"transformer its config describes; check that the config (config.json) belongs to these weights"
            )

    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        place = lambda i, host, **where: place_param(mesh, "dit", paths[i], host,  # noqa: E731
                                                     num_heads=cfg.num_attention_heads, **where)
    stored = [s.stored(tensors, var.get_value().dtype) for s, (_, var) in zip(sources, flat)]
    paths = [s.path for s in sources]
    as_stored = _stored_8bit(sources, ckpt.low_precision, quantize) if quantize else {}
    for i, (kernel, scale) in as_stored.items():
        stored[i] = kernel
        stored.append(scale)
        paths.append(sources[i].path + "_scale")
    values = load_params(stored, place, streamed=[offload and p.startswith("blocks.") for p in paths])
    for i, (_, var) in enumerate(flat):
        var.set_value(values[i])
    dit = nnx.merge(graphdef, nnx.from_flat_state(flat))
    record_checkpoint_origin(dit, CheckpointOrigin(
        path, tensors, {s.path: s for s in sources},
        {s.path: np.dtype(var.get_value().dtype) for s, (_, var) in zip(sources, flat)}))

    if mesh is not None:
        from wan_tpu.parallel.sharding import shard_transformer

        shard_transformer(dit, mesh)
    if not as_stored:
        return quantize_transformer(dit, quantize, mesh)
    linears = {_linear(sources[i].path): (values[i], values[len(flat) + j]) for j, i in enumerate(as_stored)}
    quantize_transformer(dit, quantize, mesh, linears=[pn for pn in BLOCK_LINEARS if pn not in linears])
    return install_quantized(dit, quantize, linears)


def _linear(param_path: str) -> tuple[str, str]:
    """`blocks.attn1.to_q.kernel` → ("attn1", "to_q")."""
    _, parent, name, _ = param_path.split(".")
    return parent, name


def _stored_8bit(sources: list[ParamSource], low_precision: dict, mode: str) -> dict[int, tuple[StoredParam, StoredParam]]:
    """Source index → (8-bit kernel, float32 scales) to place as the file stores them, for every block
    linear whose layers are all stored in `mode`'s format (see `DitCheckpoint.low_precision`)."""
    dtype = np.dtype(FORMATS[mode].dtype)
    out = {}
    for i, s in enumerate(sources):
        if not (s.stacked and s.path.endswith(".kernel") and _linear(s.path) in BLOCK_LINEARS):
            continue
        if not all(low_precision.get(n, ("",))[0] == mode for n in s.names):
            continue
        made = {}
        for n in s.names:
            _, values, scales = low_precision[n]
            made[f"{n}:values"] = (s.source_shape, dtype, values)
            made[f"{n}:scales"] = (s.source_shape[:1], np.float32, scales)
        source = MappedSource(None, {}, made)
        out[i] = (StoredParam(source, [f"{n}:values" for n in s.names], TRANSPOSE, dtype, True),
                  StoredParam(source, [f"{n}:scales" for n in s.names], Layout(), np.dtype(np.float32), True))
    return out
