"""Offload (`wan_tpu.parallel.offload`, `WanTransformer.offload_blocks`, `wan_tpu.wan.memory.plan_offload`).

- Streamed and resident DiT give bit-identical outputs: the same block program, only where the weights
  live differs. The CPU backend has host memory kinds (`pinned_host`) but computes from host RAM either
  way, so XLA lowers the in-program copy to nothing here: what runs on CPU is the streamed program
  itself (the double-buffered scan, dynamic slices of the host stack, resident blocks first), and the
  copy it asks for is checked in its CUDA lowering and the TPU export below (`annotate_device_placement`
  to "device" on a dynamic slice of a `pinned_host` argument). Also bf16, int8 and fp8 (emulated on CPU), a step cache's
  block ranges, FSDP shards on a mesh of the simulated CPU devices, and the loader reading a
  diffusers-saved checkpoint's blocks straight into host memory.
- The UMT5 encoder's blocks stream the same way (bit-identical embeddings; the pipeline streams its text
  encoder as the plan says, its loader reading the blocks straight into host memory: no block parameter is
  ever put into device memory, alone or on a mesh), and the plan streams them where the encoder alone does
  not fit (UMT5-XXL beside the 1.3B DiT at 8 GiB).
- The compiled step decides where the estimate is short (`plan_offload(measure=)`: resident blocks drop
  until XLA's own count fits; `compiled_device_bytes` leaves the host stack out).
- The estimate: for an injected device size below the weights it streams the fewest blocks that fit
  (14B 480p 81 frames CFG), and refuses in one line when even a fully streamed DiT or the host RAM is
  too small.
- The streamed 14B int8 step lowers for TPU (`jax.export`) on a simulated one-chip 16 GiB budget: the
  device-resident arguments and the estimated activations fit in it.
- The pipeline: `offload="blocks:1"` gives the resident pipeline's latents bit for bit and releases the
  text encoder after encoding and the DiT before decoding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.configs.models import VARIANTS, WanTransformerConfig
from wan_tpu.configs.vae import TINY_VAE
from wan_tpu.errors import WanInputError
from wan_tpu.loading.random_init import random_module
from wan_tpu.parallel import offload
from wan_tpu.parallel.mesh import make_mesh
from wan_tpu.wan import memory
from wan_tpu.wan.pipeline import WanPipeline
from wan_tpu.wan.settings import parse_offload
from wan_tpu.wan.transformer import WanTransformer, forward

GiB = 2**30
CFG = WanTransformerConfig(num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32, ffn_dim=128,
                           num_layers=4)


def _inputs():
    k = jax.random.split(jax.random.key(1), 2)
    return (jax.random.normal(k[0], (2, 16, 3, 8, 8)), jnp.array([900.0, 300.0]),
            jax.random.normal(k[1], (2, 7, 32)))


def _model():
    """The 4-block DiT with seeded weights drawn on the host (no per-op dispatch of an eager init)."""
    return random_module(lambda: WanTransformer(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), 0)


@pytest.fixture(scope="module")
def dit():
    return _model()


def _run_blocks(model, start, stop):
    def run(graphdef, state, x, t, c):
        m = nnx.merge(graphdef, state)
        inputs = m.embed(x, t, c)
        return m.run_blocks(inputs, inputs.tokens, start, stop)

    return np.asarray(jax.jit(run, static_argnums=0)(*nnx.split(model), *_inputs()), np.float32)


def _kinds(module):
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(nnx.state(module))}


def test_streamed_blocks_are_bit_identical(dit):
    ref = np.asarray(dit(*_inputs()), np.float32)
    blocks = _run_blocks(dit, 1, 3)  # a step cache's range of blocks
    dit.offload_blocks(0)
    assert dit.offloaded and dit.resident_block_count == 0 and dit.resident_blocks is None
    assert _kinds(dit.blocks) == {offload.host_memory_kind()} == {"pinned_host"}
    np.testing.assert_array_equal(np.asarray(dit(*_inputs()), np.float32), ref)
    dit.offload_blocks(2)  # again, from the host stack
    assert dit.resident_block_count == 2 and _kinds(dit.resident_blocks) == {"device"}
    assert _kinds(dit.blocks) == {"pinned_host"}
    np.testing.assert_array_equal(_run_blocks(dit, 1, 3), blocks)  # block 1 resident, block 2 streamed
    # For a GPU the program asks for each streamed parameter's copy to the device (here a no-op), at the
    # first streamed block and in the loop.
    cuda = jax.jit(forward, static_argnums=0).trace(*nnx.split(dit), *_inputs()).lower(lowering_platforms=("cuda",))
    assert cuda.as_text().count("annotate_device_placement") == 2 * len(jax.tree.leaves(nnx.state(dit.blocks)))
    with pytest.raises(WanInputError, match="changes the weights on the device"):
        dit.load_lora("unused.safetensors")
    dit.restore_blocks()
    assert not dit.offloaded and _kinds(dit.blocks) == {"device"} and dit.resident_blocks is None
    with pytest.raises(WanInputError, match="pass a count from 0 to 4"):
        dit.offload_blocks(5)


def _values(module):
    return {k: (np.asarray(v.get_value()).view(np.uint8), v.get_value().dtype)
            for k, v in nnx.to_flat_state(nnx.state(module))}


def _assert_same(a, b):
    va, vb = _values(a), _values(b)
    assert va.keys() == vb.keys()
    for k in va:
        assert va[k][1] == vb[k][1], k
        np.testing.assert_array_equal(va[k][0], vb[k][0], err_msg=str(k))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantised_streamed_blocks_are_bit_identical(mode):
    from wan_tpu.wan.quantize import quantize_transformer

    resident = quantize_transformer(_model(), mode)
    # Quantised while its stack lives in host memory (as the loader leaves it): one linear at a time on
    # the device, and back to host memory.
    streamed = quantize_transformer(_model().offload_blocks(2), mode)
    assert _kinds(streamed.blocks) == {"pinned_host"} and streamed.resident_block_count == 2
    _assert_same(streamed.blocks, resident.blocks)
    _assert_same(streamed.resident_blocks, jax.tree.map(lambda a: a[:2], resident.blocks))
    if mode == "int8":  # the streamed scan over quantised blocks (fp8: the same scan, its weights checked above)
        np.testing.assert_array_equal(np.asarray(streamed(*_inputs()), np.float32),
                                      np.asarray(resident(*_inputs()), np.float32))


def test_fsdp_shards_stream_per_device():
    from wan_tpu.parallel.sharding import shard_transformer

    mesh = make_mesh(dp=1, sp=2, tp=2, devices=jax.devices()[:4])
    model = shard_transformer(_model(), mesh, impl="reference")
    specs = {k: v.get_value().sharding.spec for k, v in nnx.to_flat_state(nnx.state(model.blocks))}
    ref = np.asarray(model(*_inputs()), np.float32)
    model.offload_blocks(1)
    for k, v in nnx.to_flat_state(nnx.state(model.blocks)):
        sharding = v.get_value().sharding
        assert sharding.memory_kind == "pinned_host" and sharding.spec == specs[k], k
    np.testing.assert_array_equal(np.asarray(model(*_inputs()), np.float32), ref)


def test_loader_reads_the_blocks_into_host_memory(tmp_path):
    """A diffusers-saved checkpoint (`save_pretrained`) loads with its block stack in host memory."""
    import torch
    from diffusers import WanTransformer3DModel

    from wan_tpu.configs.models import config_to_json
    from wan_tpu.wan.transformer_loading import load_transformer

    torch.manual_seed(0)
    WanTransformer3DModel(**config_to_json(CFG)).save_pretrained(tmp_path / "transformer")
    resident = load_transformer(str(tmp_path / "transformer"), dtype=jnp.bfloat16)
    streamed = load_transformer(str(tmp_path / "transformer"), dtype=jnp.bfloat16, offload=True)
    assert streamed.offloaded and streamed.resident_block_count == 0 and _kinds(streamed.blocks) == {"pinned_host"}
    assert _kinds(streamed.patch_embedding) == {"device"}
    _assert_same(streamed, resident)  # the forward of such a DiT: test_streamed_blocks_are_bit_identical
    # On a mesh each block parameter lands in host memory with its FSDP spec, each device's slice put there.
    from wan_tpu.parallel.sharding import param_spec

    mesh = make_mesh(dp=1, sp=2, tp=2, devices=jax.devices()[:4])
    sharded = load_transformer(str(tmp_path / "transformer"), dtype=jnp.bfloat16, mesh=mesh, offload=True)
    for key, var in nnx.to_flat_state(nnx.state(sharded.blocks)):
        value = var.get_value()
        spec = param_spec(mesh, "dit", ".".join(("blocks", *map(str, key))), value.shape, CFG.num_attention_heads)
        assert value.sharding.memory_kind == "pinned_host" and value.sharding.spec == spec, key
    _assert_same(sharded, resident)


def _pipe(name="wan2.1-t2v-14b", quantization=None):
    pipe = WanPipeline(VARIANTS[name], TINY_VAE, {}, name=name, dtype=jnp.bfloat16)
    pipe.quantization = quantization
    return pipe, pipe.settings(height=480, width=832, num_frames=81)


@pytest.mark.parametrize("quantization, device_gib", [(None, 24), (None, 16), ("int8", 16), ("int8", 24)])
def test_auto_streams_the_fewest_blocks_that_fit(quantization, device_gib):
    pipe, s = _pipe(quantization=quantization)
    weights = memory.dit_device_bytes(pipe, None)
    free = device_gib * GiB
    plan = memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=free, host_free=64 * GiB)
    need = [memory.stage_bytes(pipe, s, ("denoise",), "splash_exp2", resident=n)["denoise"][0] for n in range(41)]
    assert weights > free * (0.5 if quantization else 1) and plan.streamed
    assert need[plan.resident] <= free < need[plan.resident + 1]
    line = plan.describe()
    assert "\n" not in line and f"blocks:{plan.resident} " in line and "streamed from host memory" in line
    assert f"{memory.dit_host_bytes(pipe) / GiB:.1f} GiB" in line and f"{device_gib:.1f} GiB of device memory" in line
    roomy = memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=80 * GiB, host_free=64 * GiB)
    assert roomy.resident is None and not roomy.streamed


def test_refusals_are_one_line():
    pipe, s = _pipe()
    with pytest.raises(WanInputError, match="even with every DiT block streamed") as err:
        memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=8 * GiB, host_free=64 * GiB)
    assert "\n" not in str(err.value) and "--size" in str(err.value)
    with pytest.raises(WanInputError, match="needs about 26.2 GiB of host RAM but 10.0 GiB is free") as err:
        memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=16 * GiB, host_free=10 * GiB)
    assert "\n" not in str(err.value)
    with pytest.raises(WanInputError, match="pass a count from 0 to 40"):
        memory.plan_offload(pipe, s, 41, "splash_exp2", device_free=16 * GiB, host_free=64 * GiB)
    assert memory.plan_offload(pipe, s, None, device_free=1, host_free=1).resident is None  # none: as today
    assert [parse_offload(v) for v in ("auto", "none", "blocks", "blocks:12", 3)] == ["auto", None, 0, 12, 3]
    for bad in ("blocks:x", "all", "blocks:-1", -2):
        with pytest.raises(WanInputError, match="offload"):
            parse_offload(bad)


def test_cli_refuses_a_bad_offload(tmp_path, capsys):
    from wan_tpu.wan.cli import main

    assert main(["--prompt", "a cat", "--offload", "some", "--output", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--offload 'some'" in err, err


def test_streamed_14b_step_exports_for_tpu_within_16_gib():
    """The int8 14B DiT's whole denoise step (480p, 81 frames, CFG) with the blocks `plan_offload` picks
    for a 16 GiB chip resident and the rest in host memory, lowered for TPU; shapes only."""
    from wan_tpu.wan import denoise
    from wan_tpu.wan.quantize import quantize_transformer
    from wan_tpu.wan.schedulers import make_scheduler
    from wan_tpu.wan.transformer import set_attention

    pipe, s = _pipe(quantization="int8")
    budget = 16 * GiB
    plan = memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=budget, host_free=64 * GiB)
    cfg = VARIANTS["wan2.1-t2v-14b"].transformer
    model = nnx.eval_shape(lambda: quantize_transformer(
        WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), "int8"))
    set_attention(model, "splash_exp2", None)
    chip = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("chip",))  # one chip
    host = jax.sharding.NamedSharding(chip, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
    on_device = jax.sharding.NamedSharding(chip, jax.sharding.PartitionSpec())
    block_graph, block_state = nnx.split(model.blocks)
    prefix = jax.tree.map(lambda a: jax.ShapeDtypeStruct((plan.resident, *a.shape[1:]), a.dtype, sharding=on_device),
                          block_state)
    nnx.update(model.blocks, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host), block_state))
    model.resident_blocks = nnx.data(nnx.merge(block_graph, prefix))
    sched = make_scheduler("unipc", 2, s.flow_shift)
    latents = jax.ShapeDtypeStruct(pipe.latent_shape(s.height, s.width, s.num_frames), jnp.float32)
    text = jax.ShapeDtypeStruct((1, 512, cfg.text_dim), jnp.bfloat16)
    cond = denoise.Conditioning(prompt_embeds=text, negative_prompt_embeds=text)
    _, experts, cond, fields, _ = denoise._loop_setup([model], cond, sched, None)
    graphdef, params = experts[0]
    state = jax.eval_shape(sched.init_state, latents)
    step = jax.jit(denoise._step, static_argnums=denoise._STATIC)
    exported = jax.export.export(step, platforms=("tpu",))(
        type(sched), graphdef, cfg.patch_size, None, params, fields, state, latents,
        jax.ShapeDtypeStruct((), jnp.int32), cond, jax.ShapeDtypeStruct((), jnp.float32), None)
    text = exported.mlir_module()
    assert "annotate_device_placement" in text and '_xla_buffer_placement = "device"' in text
    assert "stablehlo.while" in text and "tpu_custom_call" in text  # the scans; the splash kernel
    sizes = {True: 0, False: 0}
    for aval in exported.in_avals:
        sizes[aval.memory_space == jax.memory.Space.Host] += aval.size * aval.dtype.itemsize
    assert sizes[True] == memory.dit_bytes(cfg, "bfloat16", "int8")[1] * cfg.num_layers
    activations = memory.stage_bytes(pipe, s, ("denoise",), "splash_exp2", resident=0)["denoise"][0] \
        - memory.dit_device_bytes(pipe, 0)
    assert sizes[False] + 2 * memory.dit_bytes(cfg, "bfloat16", "int8")[1] + activations <= budget
    assert sizes[True] + sizes[False] > budget  # all resident would not fit


def test_pipeline_streams_and_releases_each_stage(capsys):
    resident = WanPipeline.from_pretrained("tiny", offload="none")
    ref = resident("a cat", num_inference_steps=2, output_type="latent", progress=False)
    assert set(resident._loaded) == {"text_encoder", "transformer"}  # nothing released without offload
    pipe = WanPipeline.from_pretrained("tiny", offload="blocks:1")
    seen = []
    pipe.decode = lambda latents: seen.append(set(pipe._loaded)) or latents
    out = pipe("a cat", num_inference_steps=2, progress=False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert seen == [set()]  # the text encoder left after encoding, the DiT before decoding
    dit = pipe.transformer
    assert dit.offloaded and dit.resident_block_count == 1
    pipe.set_offload("none")
    assert not pipe.transformer.offloaded  # a loaded DiT follows a new choice
    auto = WanPipeline.from_pretrained("tiny")
    assert auto.offload == "auto"
    auto.check_fits(auto.settings())
    assert auto.offload_plan.resident is None  # CPU: device memory is host RAM, nothing to stream to
    assert dataclasses.replace(auto.offload_plan, resident=1).streamed


def test_umt5_streamed_blocks_are_bit_identical():
    """The text encoder's stacked blocks stream as the DiT's do: the same embeddings, bit for bit."""
    from wan_tpu.encoders.umt5 import UMT5Encoder
    from wan_tpu.wan.presets import tiny_umt5_config

    cfg = dataclasses.replace(tiny_umt5_config(32), num_layers=3)
    model = random_module(lambda: UMT5Encoder(cfg, jnp.bfloat16), 0)
    embed = jax.random.normal(jax.random.key(0), (2, 16, 32), jnp.bfloat16)
    mask = jnp.ones((2, 16), jnp.int32).at[1, 9:].set(0)
    ref = np.asarray(model(embed, mask), np.float32)
    for resident in (0, 2):
        model.offload_blocks(resident)
        assert model.offloaded and model.resident_block_count == resident and _kinds(model.blocks) == {"pinned_host"}
        np.testing.assert_array_equal(np.asarray(model(embed, mask), np.float32), ref)
    model.restore_blocks()
    assert not model.offloaded and _kinds(model.blocks) == {"device"}


def _record_placements(monkeypatch) -> list[tuple[tuple, str]]:
    """(shape, memory kind) of every array the loaders put from the host (`jax.device_put`,
    `jax.make_array_from_callback`: what `load_params` and `place_param` call) or make on the device (the
    layout programs)."""
    from wan_tpu.loading import params

    seen = []

    def recording(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen.extend((leaf.shape, leaf.sharding.memory_kind) for leaf in jax.tree.leaves(out))
            return out
        return call

    monkeypatch.setattr(jax, "device_put", recording(jax.device_put))
    monkeypatch.setattr(jax, "make_array_from_callback", recording(jax.make_array_from_callback))
    monkeypatch.setattr(params, "_layout_program", recording(params._layout_program))
    return seen


def test_umt5_loader_reads_the_blocks_into_host_memory(tmp_path, monkeypatch):
    """A transformers-saved UMT5 (`save_pretrained`) loads with its block stack straight in host memory, alone
    and FSDP-sharded on a mesh: no block parameter is ever put into device memory (an encoder larger than
    the device loads), every other one is; weights and embeddings bit-identical to the resident load."""
    import torch
    from transformers import UMT5EncoderModel

    from wan_tpu.encoders.umt5_loading import load_umt5
    from wan_tpu.parallel.sharding import param_spec
    from wan_tpu.wan.presets import hf_umt5_config, tiny_umt5_config

    cfg = dataclasses.replace(tiny_umt5_config(32), num_layers=3)
    torch.manual_seed(0)
    UMT5EncoderModel(hf_umt5_config(cfg)).save_pretrained(tmp_path)
    resident, _ = load_umt5(tmp_path, jnp.bfloat16)
    blocks = {k: v.get_value().shape for k, v in nnx.to_flat_state(nnx.state(resident.blocks))}
    mesh = make_mesh(dp=1, sp=2, tp=2, devices=jax.devices()[:4])
    seen = _record_placements(monkeypatch)
    streamed, _ = load_umt5(tmp_path, jnp.bfloat16, offload=True)
    sharded, _ = load_umt5(tmp_path, jnp.bfloat16, mesh=mesh, offload=True)
    monkeypatch.undo()
    block_puts = [kind for shape, kind in seen if shape in set(blocks.values())]
    assert sorted(block_puts) == sorted(2 * len(blocks) * [offload.host_memory_kind()]), seen
    assert {kind for shape, kind in seen if shape not in set(blocks.values())} == {"device"}
    assert streamed.offloaded and streamed.resident_block_count == 0 and _kinds(streamed.final_layer_norm) == {"device"}
    _assert_same(streamed, resident)
    for key, var in nnx.to_flat_state(nnx.state(sharded.blocks)):
        value = var.get_value()
        spec = param_spec(mesh, "umt5", ".".join(("blocks", *map(str, key))), value.shape)
        assert value.sharding.memory_kind == "pinned_host" and value.sharding.spec == spec, key
    _assert_same(sharded, resident)
    embed = jax.random.normal(jax.random.key(0), (2, 16, 32), jnp.bfloat16)
    mask = jnp.ones((2, 16), jnp.int32).at[1, 9:].set(0)
    np.testing.assert_array_equal(np.asarray(streamed.offload_blocks(1)(embed, mask), np.float32),
                                  np.asarray(resident(embed, mask), np.float32))


def test_text_stage_streams_where_the_encoder_alone_does_not_fit():
    """1.3B at 8 GiB: the DiT fits, UMT5-XXL (9 GiB of blocks in bf16) does not; the plan streams its blocks."""
    from wan_tpu.encoders.umt5 import UMT5Config

    xxl = UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
    pipe, s = _pipe("wan2.1-t2v-1.3b")
    pipe.text_encoder_config = xxl
    plan = memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=8 * GiB, host_free=64 * GiB)
    r = plan.text_resident
    assert not plan.streamed and plan.text_streamed and plan.release and 0 < r < 24
    assert memory.text_device_bytes(xxl, "bfloat16", r) <= 8 * GiB < memory.text_device_bytes(xxl, "bfloat16", r + 1)
    assert memory.text_device_bytes(xxl, "bfloat16", None) > 8 * GiB
    line = plan.describe()
    assert "\n" not in line and f"text encoder: blocks:{r} ({r} of 24 UMT5 blocks" in line
    pipe.offload_plan = plan
    need, what = memory.stage_bytes(pipe, s, ("text",), "splash_exp2")["text encode"]
    assert need <= 8 * GiB and f"{r} of 24 blocks resident" in what
    # Weights alone: 24 blocks of 4·4096² + 3·4096·10240 bf16 values; the embedding stays on the host.
    assert memory.umt5_bytes(xxl, "bfloat16")[1] == (4 * 4096 * 4096 + 3 * 4096 * 10240 + 4096 * 2 + 32 * 64) * 2
    roomy = memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=40 * GiB, host_free=64 * GiB)
    assert roomy.text_resident is None and not roomy.text_streamed


def test_pipeline_streams_its_text_encoder_as_planned():
    pipe = WanPipeline.from_pretrained("tiny", offload="none")
    ref = np.asarray(pipe.encode_prompt("a cat")["prompt_embeds"], np.float32)
    pipe.release("text_encoder")
    asked = []
    random_weights = pipe._loaders["text_encoder"]

    def loader(offload=False):  # a folder's loader reads the blocks into host memory when asked (`load_umt5`)
        asked.append(offload)
        return random_weights()

    loader.offloads = True
    pipe._loaders["text_encoder"] = loader
    pipe.offload_plan = memory.OffloadPlan(None, 2, True, text_resident=0, text_layers=pipe.text_encoder_config.num_layers)
    assert pipe.text_encoder.model.offloaded and pipe.text_encoder.model.resident_block_count == 0
    np.testing.assert_array_equal(np.asarray(pipe.encode_prompt("a cat")["prompt_embeds"], np.float32), ref)
    pipe.release("text_encoder")
    pipe.offload_plan = None
    pipe.text_encoder
    assert asked == [True, False]


def test_the_compiled_step_decides_where_the_estimate_is_short():
    """`measure=`: XLA's own count of the compiled step overrides the formula; on a GPU the int8 stack's
    transposed copy is counted per resident block."""
    pipe, s = _pipe(quantization="int8")
    free = 16 * GiB
    formula = memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=free, host_free=64 * GiB)
    block = memory.dit_bytes(VARIANTS["wan2.1-t2v-14b"].transformer, "bfloat16", "int8")[1]
    seen = []

    def measure(resident):  # temporaries 1 GiB per resident block beyond the estimate
        seen.append(resident)
        return memory.stage_bytes(pipe, s, ("denoise",), "splash_exp2", resident=resident)["denoise"][0] \
            + (40 if resident is None else resident) * GiB

    plan = memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=free, host_free=64 * GiB, measure=measure)
    assert seen[0] == formula.resident and plan.resident < formula.resident and plan.measured <= free
    assert plan.measured == measure(plan.resident) and "the compiled step needs" in plan.describe()
    with pytest.raises(WanInputError, match="the compiled denoise step needs") as err:
        memory.plan_offload(pipe, s, "auto", "splash_exp2", device_free=free, host_free=64 * GiB,
                            measure=lambda r: 2 * free)
    assert "\n" not in str(err.value)
    gpu = memory.Layout(platform="gpu")
    assert memory.int8_layout_copy_bytes(pipe, 11, gpu) == 11 * block
    assert memory.int8_layout_copy_bytes(pipe, 11, memory.Layout(platform="tpu")) == 0


def test_compiled_device_bytes_counts_device_arguments_and_temporaries():
    """The streamed forward's device memory from its compiled program: the host stack does not count."""
    model = _model().offload_blocks(1)
    graphdef, state = nnx.split(model)
    args = (state, *_inputs())
    program = jax.jit(forward, static_argnums=0).trace(graphdef, *args).lower().compile()
    analysis = program.memory_analysis()
    device = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args) if not offload.on_host(x))
    host = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args) if offload.on_host(x))
    assert host > 0 and analysis.temp_size_in_bytes > 0
    assert memory.compiled_device_bytes(program, args) == (analysis.temp_size_in_bytes + analysis.output_size_in_bytes
                                                           - analysis.alias_size_in_bytes + device)
