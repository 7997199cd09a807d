"""`load_transformer`: a diffusers-format `transformer/` folder → `WanTransformer`.

Every parameter of the (abstractly built) module is filled from the checkpoint: diffusers names are
mapped to ours (`to_out.0` → `to_out`, `ffn.net.0.proj` → `ffn.proj_in`, `ffn.net.2` → `ffn.proj_out`),
linear weights are transposed to (in, out), the patch-embedding Conv3d becomes a matmul kernel, and
per-layer tensors `blocks.{i}.…` are stacked on the leading layer axis. All names and shapes are
checked against config.json before any data is read. Tensors stream one parameter at a time from
memory-mapped files, so the host holds at most one (stacked) parameter besides the mapping.
The name mapping is `wan_tpu.wan.weights.ParamSource` (names from `wan_tpu.loading.wan_names`); the
loaded DiT's `wan_tpu.wan.weights.checkpoint_origin(dit)` re-reads one parameter exactly as it was
loaded (how `wan_tpu.wan.lora` restores the weights a LoRA changed).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.models import config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.loading import stacking
from wan_tpu.loading.checkpoint import open_checkpoint
from wan_tpu.loading.params import load_params
from wan_tpu.wan.transformer import WanTransformer
from wan_tpu.wan.weights import CheckpointOrigin, ParamSource, record_checkpoint_origin

# Checkpoint tensors diffusers itself ignores (`_keys_to_ignore_on_load_unexpected`).
_IGNORED_SEGMENTS = ("norm_added_q",)


def load_transformer(path: str, dtype=jnp.float32, mesh=None, quantize: str | None = None) -> WanTransformer:
    """Load a diffusers-format Wan transformer folder (config.json + safetensors) into a WanTransformer.

    Parameters that diffusers keeps in float32 stay float32; the rest are cast to `dtype`. With a
    `mesh`, each parameter is placed sharded as it is read (`wan_tpu.parallel.sharding.place_param`) and the
    model's hooks are set for the mesh (`wan_tpu.parallel.sharding.shard_transformer`). `quantize="fp8"`
    (or "int8") then quantises the block linears on device (`wan_tpu.wan.quantize`).
    """
    from wan_tpu.wan.quantize import check_device, check_mode, quantize_transformer

    if check_mode(quantize):
        # Refuse before reading gigabytes of weights.
        check_device(quantize, None if mesh is None else list(mesh.devices.flat))
    config, tensors = open_checkpoint(path, "transformer")
    cfg = config_from_json(config)
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
                f"transformer that config.json describes; check that config.json belongs to these weights"
            )

    place = None
    if mesh is not None:
        from wan_tpu.parallel.sharding import place_param

        place = lambda i, host: place_param(mesh, "dit", sources[i].path, host, num_heads=cfg.num_attention_heads)  # noqa: E731
    stored = [s.stored(tensors, var.get_value().dtype) for s, (_, var) in zip(sources, flat)]
    for (_, var), value in zip(flat, load_params(stored, place)):
        var.set_value(value)
    dit = nnx.merge(graphdef, nnx.from_flat_state(flat))
    record_checkpoint_origin(dit, CheckpointOrigin(
        path, tensors, {s.path: s for s in sources},
        {s.path: np.dtype(var.get_value().dtype) for s, (_, var) in zip(sources, flat)}))

    if mesh is not None:
        from wan_tpu.parallel.sharding import shard_transformer

        shard_transformer(dit, mesh)
    return quantize_transformer(dit, quantize, mesh)

