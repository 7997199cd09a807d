"""Wan 2.1 / 2.2 (T2V, I2V, TI2V, A14B): the DiT, LoRAs, quantisation, schedulers, step caches, the
pipeline, presets, stage files and the `generate` command line."""

from wan_tpu.lazy import exports

_EXPORTS = {"WanPipeline": "wan_tpu.wan.pipeline", "WanTransformer": "wan_tpu.wan.transformer",
            "load_transformer": "wan_tpu.wan.transformer_loading"}

__all__ = sorted(_EXPORTS)
__getattr__ = exports(__name__, _EXPORTS)
