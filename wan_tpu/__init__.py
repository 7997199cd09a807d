"""wan_tpu: a JAX/Pallas inference engine for the Wan video diffusion models.

The public names are imported lazily so that `import wan_tpu` stays cheap (no torch, no model code)
until one is used.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "attention": "wan_tpu.layers.attention",
    "make_mesh": "wan_tpu.mesh",
    "load_transformer": "wan_tpu.models.transformer_loading",
    "load_vae": "wan_tpu.models.vae_loading",
    "WanPipeline": "wan_tpu.pipeline",
    "MatrixGamePipeline": "wan_tpu.matrix_game",
    "quantize_transformer": "wan_tpu.quantize",
    "WanInputError": "wan_tpu.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'wan_tpu' has no attribute {name!r}")
