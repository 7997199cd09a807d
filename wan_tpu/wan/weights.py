"""How the Wan DiT's parameters map to checkpoint tensors, and where a loaded DiT's weights came from.

`param_sources(dit)` maps each parameter of a (possibly abstract) `WanTransformer` to its diffusers
tensor names, stored shape and layout change (`ParamSource`); `wan_tpu.wan.transformer_loading`
reads a checkpoint through them and records the result with `record_checkpoint_origin`, and
`checkpoint_origin(dit)` then re-reads one parameter exactly as it was loaded (how `wan_tpu.wan.lora`
restores the weights a LoRA changed). Names follow `wan_tpu.loading.wan_names.diffusers_name`.
"""

from __future__ import annotations

import os
import weakref

import jax
import numpy as np
from flax import nnx

from wan_tpu.configs.models import WanTransformerConfig
from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import TensorSource
from wan_tpu.loading.params import TRANSPOSE, Layout, StoredParam
from wan_tpu.loading.wan_names import diffusers_name


class ParamSource:
    """How one of our parameters is read: checkpoint names (one per layer if stacked) and a layout fix.

    `names`: the diffusers tensor names (`blocks.{i}.…` per layer when `stacked`); `source_shape`: one
    of them as stored (diffusers layout); `transform`: that layout → ours (None: the same).
    """

    def __init__(self, path: tuple[str, ...], target: jax.ShapeDtypeStruct, cfg: WanTransformerConfig):
        *module, leaf = path
        self.path = ".".join(path)
        self.stacked = bool(module) and module[0] == "blocks"
        layer_shape = target.shape[1:] if self.stacked else target.shape
        base = diffusers_name(tuple(module))
        self.layout = Layout()
        if leaf == "kernel" and base == "patch_embedding":
            # Conv3d (out, in, pt, ph, pw) with stride == kernel is a matmul over flattened (in, pt, ph, pw).
            self.source_shape = (cfg.inner_dim, cfg.in_channels, *cfg.patch_size)
            self.layout = Layout(reshape=layer_shape[::-1], perm=(1, 0))
        elif leaf == "kernel":
            self.source_shape = layer_shape[::-1]
            self.layout = TRANSPOSE
        else:
            self.source_shape = layer_shape
        name = f"{base}.weight" if leaf == "kernel" else f"{base}.{leaf}" if base else leaf
        if self.stacked:
            rest = name[len("blocks."):]
            self.names = [f"blocks.{i}.{rest}" for i in range(cfg.num_layers)]
        else:
            self.names = [name]

    def check(self, tensors: TensorSource, folder: str):
        for n in self.names:
            if n not in tensors:
                raise WanInputError(
                    f"{folder}: tensor {n!r} (shape {self.source_shape}) is missing; the weights do not match "
                    f"config.json — re-download or re-save the transformer"
                )
            if tuple(tensors.shape(n)) != tuple(self.source_shape):
                raise WanInputError(
                    f"{folder}: tensor {n!r} has shape {tuple(tensors.shape(n))}, but config.json implies "
                    f"{self.source_shape}; the weights do not match config.json"
                )

    @property
    def transform(self):
        """The layout change as a function of one layer's array (None: none), for deltas in stored layout (LoRA)."""
        return None if self.layout.identity else self.layout.apply

    def stored(self, tensors: TensorSource, dtype) -> StoredParam:
        return StoredParam(tensors, self.names, self.layout, np.dtype(dtype), self.stacked)

    def read(self, tensors: TensorSource, dtype) -> np.ndarray:
        return self.stored(tensors, dtype).read_host()


def param_sources(module: nnx.Module) -> list[ParamSource]:
    """How every parameter of a (possibly abstract, `nnx.eval_shape`) `WanTransformer` maps to diffusers tensor names."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return [ParamSource(tuple(str(p) for p in key), var.get_value(), module.config) for key, var in flat]


class CheckpointOrigin:
    """Where a loaded DiT's weights came from, so that one parameter can be read again exactly as loaded.

    The files' sizes and modification times are noted at load time: a file replaced since then
    cannot give back the loaded values, and `read` says so instead of returning other weights.
    """

    def __init__(self, path: str, tensors: TensorSource, sources: dict[str, ParamSource], dtypes: dict[str, np.dtype]):
        self.path, self._tensors, self._sources, self._dtypes = path, tensors, sources, dtypes
        self._stamps = {f: _stamp(f) for f in tensors.files}

    def read(self, param_path: str) -> np.ndarray:
        """The host array that `load_transformer` placed for `param_path` (same dtype, same bits)."""
        for f, stamp in self._stamps.items():
            if _stamp(f) != stamp:
                raise WanInputError(f"{f} changed on disk since the transformer was loaded, so its weights cannot be "
                                    "restored exactly; load the transformer again")
        return self._sources[param_path].read(self._tensors, self._dtypes[param_path])


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


# DiT → CheckpointOrigin; weak, so that a dropped model frees its entry. A side table rather than an
# attribute: attributes of an nnx module are part of its graphdef, which keys compiled code.
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_checkpoint_origin(dit: nnx.Module, origin: CheckpointOrigin) -> None:
    """Note that `dit` was loaded from `origin` (`wan_tpu.wan.transformer_loading.load_transformer` does)."""
    _ORIGINS[dit] = origin


def checkpoint_origin(dit: nnx.Module) -> CheckpointOrigin | None:
    """The checkpoint `dit` was loaded from by `load_transformer` (None for models built otherwise)."""
    return _ORIGINS.get(dit)
