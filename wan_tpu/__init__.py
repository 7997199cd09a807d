"""wan_tpu: a JAX/Pallas inference engine for the Wan video diffusion models and the world models built
on them (Matrix-Game-2, UnifoLM-WMA).

The public names are imported lazily so that `import wan_tpu` stays cheap (no jax, no torch, no model
code) until one is used.
"""

from wan_tpu.lazy import exports

__version__ = "0.1.0"

_EXPORTS = {
    "attention": "wan_tpu.layers.attention",
    "make_mesh": "wan_tpu.parallel.mesh",
    "load_transformer": "wan_tpu.wan.transformer_loading",
    "load_vae": "wan_tpu.vae.loading",
    "WanPipeline": "wan_tpu.wan.pipeline",
    "MatrixGamePipeline": "wan_tpu.matrix_game.pipeline",
    "UnifolmPipeline": "wan_tpu.unifolm.pipeline",
    "quantize_transformer": "wan_tpu.wan.quantize",
    "WanInputError": "wan_tpu.errors",
}

__all__ = sorted(_EXPORTS)
__getattr__ = exports(__name__, _EXPORTS)
