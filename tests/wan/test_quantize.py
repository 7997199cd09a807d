"""`wan_tpu.wan.quantize`: FP8 and int8 block linears on a tiny random DiT (CPU; emulated there).

- Every block linear becomes a `QuantizedLinear` (f8 / int8 kernel, per-output float32 scales);
  embeddings, modulation and the head stay as loaded.
- Whole-forward sanity: the quantised forward is within 8e-2 (relative Frobenius) of the
  unquantised one on this tiny random I2V model (measured: fp8 3.6e-2 float32, 5.0e-2 bfloat16;
  int8 1.4e-2 bfloat16 — e4m3 keeps 3 mantissa bits, int8 ~7 bits at a row's scale; random weights
  without a dominant residual stream are a worst case). The figure for the real models comes from
  benchmarks/bench_dit.py on the device. Not a performance test.
- TPU readiness: the int8 DiT forward exports for TPU (`jax.export`), its dots int8 × int8 → int32.
- On a (dp, sp, tp) = (2, 1, 4) mesh of the simulated CPU devices the f8 kernels keep their bf16
  kernels' shardings and the scales follow the output dimension.
- The device check and the loader / pipeline options (LoRAs on quantised DiTs: tests/wan/test_lora_layouts.py).
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
from wan_tpu.layers.quantized import FORMATS, QuantizedLinear
from wan_tpu.parallel.sharding import shard_transformer
from wan_tpu.wan.quantize import BLOCK_LINEARS, ensure_unquantized, quantize_transformer, supported
from wan_tpu.wan.transformer import WanTransformer, forward

CFG = WanTransformerConfig(num_attention_heads=4, attention_head_dim=32, text_dim=32, freq_dim=32, ffn_dim=128,
                           num_layers=2, in_channels=8, out_channels=4, image_dim=24, added_kv_proj_dim=128)
TOL = 8e-2


def _inputs(batch=1):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (batch, 8, 3, 8, 8))
    c = jax.random.normal(keys[1], (batch, 7, 32))
    img = jax.random.normal(keys[2], (batch, 5, 24))
    return x, jnp.linspace(900.0, 300.0, batch), c, img


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("mode, dtype", [("fp8", jnp.float32), ("fp8", jnp.bfloat16), ("int8", jnp.bfloat16)])
def test_quantised_forward_close_to_unquantised(mode, dtype):
    dit = WanTransformer(CFG, dtype=dtype, rngs=nnx.Rngs(0))
    inputs = _inputs()
    ref = dit(*inputs).astype(jnp.float32)
    patch = dit.patch_embedding.kernel[...]
    assert quantize_transformer(dit, mode) is dit and dit.quantization == mode
    for parent, name in BLOCK_LINEARS:
        layer = getattr(getattr(dit.blocks, parent), name)
        assert isinstance(layer, QuantizedLinear), (parent, name)
        assert layer.kernel.dtype == FORMATS[mode].dtype
        assert layer.kernel_scale.shape == (CFG.num_layers, layer.kernel.shape[-1])
        assert layer.bias.dtype == dtype
    assert isinstance(dit.patch_embedding, nnx.Linear) and dit.patch_embedding.kernel[...] is patch
    assert isinstance(dit.proj_out, nnx.Linear) and isinstance(dit.condition_embedder.time_proj, nnx.Linear)
    out = dit(*inputs)
    assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out.astype(jnp.float32), ref) <= TOL


def test_a_subset_of_linears_is_quantised_and_the_rest_kept():
    """`linears=`: only those become `QuantizedLinear`s (benchmarks/fp8_error.py compares such recipes); the
    others keep their kernels. A name outside `BLOCK_LINEARS` is refused."""
    dit = WanTransformer(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ffn = tuple(p for p in BLOCK_LINEARS if p[0] == "ffn")
    kept = {p: getattr(getattr(dit.blocks, p[0]), p[1]).kernel[...] for p in BLOCK_LINEARS if p not in ffn}
    quantize_transformer(dit, "fp8", linears=ffn)
    for parent, name in BLOCK_LINEARS:
        layer = getattr(getattr(dit.blocks, parent), name)
        assert isinstance(layer, QuantizedLinear) == ((parent, name) in ffn), (parent, name)
        if (parent, name) in kept:
            assert layer.kernel[...] is kept[parent, name]
    with pytest.raises(ValueError, match="not block linears"):
        quantize_transformer(WanTransformer(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0)), "fp8",
                             linears=(("ffn", "gate"),))


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


@pytest.mark.parametrize("device, fp8, int8", [
    (_device("cpu"), True, True),
    (_device("gpu", "NVIDIA H200", "9.0"), True, True),
    (_device("gpu", "NVIDIA L4", "8.9"), True, True),
    (_device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), False, True),
    (_device("gpu", "Tesla V100-SXM2-16GB", "7.0"), False, False),
    (_device("tpu", "TPU7x"), True, True),
    (_device("tpu", "TPU v6 lite"), False, True),
    (_device("tpu", "TPU v5p"), False, True),
    (_device("tpu", "TPU v5 lite"), False, True),
    (_device("tpu", "TPU v4"), False, False),
])
def test_each_mode_needs_its_matrix_units(device, fp8, int8):
    assert supported(device, "fp8")[0] is fp8 and supported(device, "int8")[0] is int8


def test_refusal_names_the_mode_that_would_run():
    """An A100 has int8 tensor cores but no FP8 ones; a V100 neither."""
    from wan_tpu.wan.quantize import check_device

    with pytest.raises(WanInputError, match="use --quantize int8"):
        check_device("fp8", [_device("gpu", "NVIDIA A100-SXM4-80GB", "8.0")])
    check_device("int8", [_device("gpu", "NVIDIA A100-SXM4-80GB", "8.0")])
    with pytest.raises(WanInputError, match=r"run without --quantize \(bf16\)"):
        check_device("int8", [_device("gpu", "Tesla V100-SXM2-16GB", "7.0")])


def test_int8_forward_exports_for_tpu():
    dit = quantize_transformer(WanTransformer(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), "int8")
    graphdef, state = nnx.split(dit)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _inputs()]
    exported = jax.export.export(jax.jit(forward, static_argnums=0), platforms=("tpu",))(graphdef, state, *args)
    dots = [line for line in exported.mlir_module().splitlines() if "stablehlo.dot_general" in line and "xi8>" in line]
    assert len(dots) == 12 and all("xi32>" in line.split("->")[-1] for line in dots)


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
    assert isinstance(pipe.transformer.blocks.ffn.proj_in, QuantizedLinear)
    with pytest.raises(WanInputError, match="not supported"):
        wan_tpu.WanPipeline.from_pretrained("tiny", quantize="fp16")
