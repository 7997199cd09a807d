"""`wan_tpu.quantize`: FP8 block linears on a tiny random DiT (CPU; FP8 emulated there).

- Every block linear becomes an `Fp8Linear` (f8 kernel, per-output float32 scales); embeddings,
  modulation and the head stay as loaded.
- Whole-forward sanity: the FP8 forward is within 5e-2 (relative Frobenius) of the unquantised one
  on the tiny random model (measured 2.5e-2 float32, 2.8e-2 bfloat16; the device figure for the
  real models comes from scripts/bench_dit.py). Not a performance test.
- On a (dp, sp, tp) = (2, 1, 4) mesh of the simulated CPU devices the f8 kernels keep their bf16
  kernels' shardings and the scales follow the output dimension.
- The device check, the loader / pipeline options and the LoRA rule.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import wan_tpu
from wan_tpu.configs.models import WanTransformerConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers.fp8 import F8, Fp8Linear
from wan_tpu.models.transformer import WanTransformer
from wan_tpu.quantize import BLOCK_LINEARS, ensure_unquantized, fp8_supported, quantize_transformer
from wan_tpu.sharding import shard_transformer

CFG = WanTransformerConfig(num_attention_heads=4, attention_head_dim=32, text_dim=32, freq_dim=32, ffn_dim=128,
                           num_layers=2, in_channels=8, out_channels=4, image_dim=24, added_kv_proj_dim=128)
TOL = 5e-2


def _inputs(batch=1):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (batch, 8, 3, 8, 8))
    c = jax.random.normal(keys[1], (batch, 7, 32))
    img = jax.random.normal(keys[2], (batch, 5, 24))
    return x, jnp.linspace(900.0, 300.0, batch), c, img


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantised_forward_close_to_unquantised(dtype):
    dit = WanTransformer(CFG, dtype=dtype, rngs=nnx.Rngs(0))
    inputs = _inputs()
    ref = dit(*inputs).astype(jnp.float32)
    patch = dit.patch_embedding.kernel[...]
    assert quantize_transformer(dit, "fp8") is dit and dit.quantization == "fp8"
    for parent, name in BLOCK_LINEARS:
        layer = getattr(getattr(dit.blocks, parent), name)
        assert isinstance(layer, Fp8Linear), (parent, name)
        assert layer.kernel.dtype == F8 and layer.kernel_scale.shape == (CFG.num_layers, layer.kernel.shape[-1])
        assert layer.bias.dtype == dtype
    assert isinstance(dit.patch_embedding, nnx.Linear) and dit.patch_embedding.kernel[...] is patch
    assert isinstance(dit.proj_out, nnx.Linear) and isinstance(dit.condition_embedder.time_proj, nnx.Linear)
    out = dit(*inputs)
    assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out.astype(jnp.float32), ref) <= TOL


def test_sharded_quantisation_keeps_the_weight_layout():
    mesh = wan_tpu.make_mesh(2, 1, 4)
    dit = shard_transformer(WanTransformer(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh)
    inputs = _inputs(batch=2)
    ref = dit(*inputs).astype(jnp.float32)
    before = {(p, n): getattr(getattr(dit.blocks, p), n).kernel[...].sharding.spec for p, n in BLOCK_LINEARS}
    quantize_transformer(dit, "fp8", mesh)
    for (parent, name), spec in before.items():
        layer = getattr(getattr(dit.blocks, parent), name)
        assert layer.kernel[...].sharding.spec == spec, (parent, name)
        # Column-parallel layers split their output (and so their scales) over tp; row-parallel ones don't.
        expected = jax.sharding.PartitionSpec(None, "tp") if spec[2] == "tp" else jax.sharding.PartitionSpec()
        assert layer.kernel_scale[...].sharding.spec == expected, (parent, name)
    assert _rel(dit(*inputs).astype(jnp.float32), ref) <= TOL


def _device(platform, kind="", cc=None):
    return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=cc)


@pytest.mark.parametrize("device, ok", [
    (_device("cpu"), True),
    (_device("gpu", "NVIDIA H200", "9.0"), True),
    (_device("gpu", "NVIDIA L4", "8.9"), True),
    (_device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), False),
    (_device("tpu", "TPU7x"), True),
    (_device("tpu", "TPU v6 lite"), False),
    (_device("tpu", "TPU v5p"), False),
])
def test_fp8_needs_fp8_matrix_units(device, ok):
    assert fp8_supported(device)[0] is ok


def test_refusals():
    dit = WanTransformer(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with pytest.raises(WanInputError, match="not supported"):
        quantize_transformer(dit, "int4")
    ensure_unquantized(dit, "merging a LoRA")
    quantize_transformer(dit, "fp8")
    with pytest.raises(WanInputError, match="already quantised"):
        ensure_unquantized(dit, "merging a LoRA")
    with pytest.raises(WanInputError, match="already quantised"):
        quantize_transformer(dit, "fp8")


def test_pipeline_option_quantises_as_the_dit_loads():
    pipe = wan_tpu.WanPipeline.from_pretrained("tiny", quantize="fp8")
    assert "transformer" not in pipe._loaded  # still lazy
    assert pipe.transformer.quantization == "fp8"
    assert isinstance(pipe.transformer.blocks.ffn.proj_in, Fp8Linear)
    with pytest.raises(WanInputError, match="not supported"):
        wan_tpu.WanPipeline.from_pretrained("tiny", quantize="fp16")
