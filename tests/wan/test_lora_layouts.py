"""LoRA key layouts (`wan_tpu.wan.lora`): every public Wan LoRA layout merges to the weights the diffusers-format
LoRA gives; keys no layer takes are named in one line; Wan 2.1 I2V LoRAs on a DiT without the image branch
(Wan 2.2 A14B); LoRAs on FP8 / int8 DiTs.

Reference: a LoRA made by PEFT on a tiny diffusers `WanTransformer3DModel` (`add_adapter(LoraConfig(r=4,
lora_alpha=8))`, random A and B) and saved with diffusers' own `WanPipeline.save_lora_weights` (`transformer.`
names, alpha in `lora_adapter_metadata`); `tests/wan/test_lora.py` checks that file's merge against
diffusers' pipeline. The same factors are written in each other layout with the key names the tools write
(module names transcribed from diffusers' `_convert_non_diffusers_wan_lora_to_diffusers` /
`_convert_musubi_wan_lora_to_diffusers` and ComfyUI's `LoRAAdapter.load`); each merges, through our loader,
to the same parameters (float32, ≤ 1e-6 relative: the same float32 sums, alpha / rank applied at another
point). Quantised DiTs: the LoRA factors kept beside the untouched 8-bit kernels give the file's update (≤ 1e-5),
a full `diff` merged and quantised again lands within half a quantisation step of kernel · scale + ΔW;
unload restores the quantised linears bit for bit.
"""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from wan_tpu.errors import WanInputError
from wan_tpu.wan.transformer_loading import load_transformer

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=8, out_channels=4,
              text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, image_dim=20, added_kv_proj_dim=32)
RANK, ALPHA = 4, 8.0
# diffusers module (in a block) → original Wan module, as diffusers' converters pair them.
WAN_NAMES = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
             "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "attn2.add_k_proj": "cross_attn.k_img",
             "attn2.add_v_proj": "cross_attn.v_img", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(base transformer folder, PEFT LoRA file saved by diffusers, {diffusers module: (A, B)})."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    root = tmp_path_factory.mktemp("lora_layouts")
    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG).eval()
    model.save_pretrained(root / "transformer")
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(WAN_NAMES), init_lora_weights=False))
    state = get_peft_model_state_dict(model)
    WanPipeline.save_lora_weights(root / "peft", transformer_lora_layers=state,
                                  transformer_lora_adapter_metadata=model.peft_config["default"].to_dict())
    factors = {k[: -len(".lora_A.weight")]: (state[k], state[k.replace("lora_A", "lora_B")])
               for k in state if k.endswith("lora_A.weight")}
    return str(root / "transformer"), str(root / "peft" / "pytorch_lora_weights.safetensors"), factors


def flat(dit):
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(dit))}


def merged(base, path, scale=0.7):
    dit = load_transformer(base, jnp.float32)
    info = dit.load_lora(path, scale)
    return flat(dit), info


def ours(module: str) -> str:
    """Our parameter path (without the leaf) of a diffusers block module."""
    rest = module.split(".", 2)[2]
    return "blocks." + {"ffn.net.0.proj": "ffn.proj_in", "ffn.net.2": "ffn.proj_out"}.get(rest, rest).replace("to_out.0", "to_out")


def wan(module: str) -> str:
    block, rest = module.split(".", 2)[1], module.split(".", 2)[2]
    return f"blocks.{block}.{WAN_NAMES[rest]}"


# Each layout: (key of a module's down, key of its up, alpha key or None) from the diffusers module name.
LAYOUTS = {
    "kohya / musubi-tuner": lambda m: (f"lora_unet_{wan(m).replace('.', '_')}.lora_down.weight",
                                       f"lora_unet_{wan(m).replace('.', '_')}.lora_up.weight",
                                       f"lora_unet_{wan(m).replace('.', '_')}.alpha"),
    "original Wan, lora_A/B (ComfyUI, ai-toolkit)": lambda m: (f"diffusion_model.{wan(m)}.lora_A.weight",
                                                                f"diffusion_model.{wan(m)}.lora_B.weight",
                                                                f"diffusion_model.{wan(m)}.alpha"),
    "original Wan, lora_down/up (lightx2v, CausVid)": lambda m: (f"diffusion_model.{wan(m)}.lora_down.weight",
                                                                 f"diffusion_model.{wan(m)}.lora_up.weight", None),
    "DiffSynth-Studio (PEFT default adapter)": lambda m: (f"{wan(m)}.lora_A.default.weight",
                                                          f"{wan(m)}.lora_B.default.weight", None),
    "kohya on diffusers names": lambda m: (f"lora_transformer_{m.replace('.', '_')}.lora_down.weight",
                                           f"lora_transformer_{m.replace('.', '_')}.lora_up.weight",
                                           f"lora_transformer_{m.replace('.', '_')}.alpha"),
    "SimpleTuner LyCORIS": lambda m: (f"lycoris_{m.replace('.', '_')}.lora_down.weight",
                                      f"lycoris_{m.replace('.', '_')}.lora_up.weight", f"lycoris_{m.replace('.', '_')}.alpha"),
    "diffusers lora.down/up": lambda m: (f"transformer.{m}.lora.down.weight", f"transformer.{m}.lora.up.weight", None),
    "PEFT bare lora_A/B": lambda m: (f"base_model.model.{m}.lora_A", f"base_model.model.{m}.lora_B", None),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_merges_as_the_diffusers_lora(made, tmp_path, layout):
    base, peft_file, factors = made
    assert set(load_file(peft_file)) == {f"transformer.{m}.lora_{ab}.weight" for m in factors for ab in "AB"}
    expected, reference_info = merged(base, peft_file)
    entries = {}
    for module, (a, b) in factors.items():
        down, up, alpha = LAYOUTS[layout](module)
        # Without an alpha entry the scale is 1: the factor alpha / rank = 2 goes into B (exactly: a power of two).
        entries |= {down: a, up: b if alpha else b * (ALPHA / RANK)}
        if alpha:
            entries[alpha] = torch.tensor(ALPHA)
    path = tmp_path / "lora.safetensors"
    save_file({k: v.contiguous() for k, v in entries.items()}, str(path))
    got, info = merged(base, path)
    assert info.tensors == reference_info.tensors == len(factors) and info.skipped == ()
    original = flat(load_transformer(base, jnp.float32))
    assert {k for k in got if not np.array_equal(got[k], original[k])} == set(reference_info.parameters)
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-6 * np.abs(expected[k]).max(), err_msg=k)


def test_distillation_layout_with_diffs(made, tmp_path):
    """lightx2v / CausVid: lora_down/up without alpha, `diff_b` on the linears' biases, `diff` on the norms and
    the modulation tables, `time_projection` and `head.head` entries; each lands where a float64 merge puts it."""
    base, _, factors = made
    g = torch.Generator().manual_seed(1)
    entries, expected = {}, flat(load_transformer(base, jnp.float32))
    scale = 0.5
    for module, (a, b) in list(factors.items())[:4]:
        key = f"diffusion_model.{wan(module)}"
        bias = torch.randn(b.shape[0], generator=g)
        entries |= {f"{key}.lora_down.weight": a, f"{key}.lora_up.weight": b, f"{key}.diff_b": bias}
    entries["diffusion_model.blocks.1.norm3.diff"] = torch.randn(32, generator=g)
    entries["diffusion_model.blocks.0.modulation.diff"] = torch.randn(1, 6, 32, generator=g)
    entries["diffusion_model.head.modulation.diff"] = torch.randn(1, 2, 32, generator=g)
    entries["diffusion_model.time_projection.1.diff_b"] = torch.randn(192, generator=g)
    path = tmp_path / "distill.safetensors"
    save_file({k: v.contiguous() for k, v in entries.items()}, str(path))
    got, info = merged(base, path, scale)
    assert info.tensors == 4 * 2 + 4
    layer = lambda k: int(k.split(".")[1])  # noqa: E731
    for module, (a, b) in list(factors.items())[:4]:
        p = ours(module)
        kernel = expected[f"{p}.kernel"][layer(module)].astype(np.float64) + scale * (b.double() @ a.double()).numpy().T
        np.testing.assert_allclose(got[f"{p}.kernel"][layer(module)], kernel, rtol=1e-6, atol=1e-6)
        bias = expected[f"{p}.bias"][layer(module)] + scale * entries[f"diffusion_model.{wan(module)}.diff_b"].numpy()
        np.testing.assert_allclose(got[f"{p}.bias"][layer(module)], bias, rtol=1e-6, atol=1e-6)
    modulation = entries["diffusion_model.blocks.0.modulation.diff"].numpy()[0]
    np.testing.assert_allclose(got["blocks.scale_shift_table"][0], expected["blocks.scale_shift_table"][0] + scale * modulation,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got["blocks.scale_shift_table"][1], expected["blocks.scale_shift_table"][1])


def test_keys_no_layer_takes_are_named_in_one_line(made, tmp_path):
    base, _, factors = made
    a, b = next(iter(factors.values()))
    entries = {f"diffusion_model.blocks.{i}.self_attn.q.lora_{kind}.weight": t.clone()
               for i in (0, 5, 6, 7) for kind, t in (("down", a), ("up", b))}
    path = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in entries.items()}, str(path))
    dit = load_transformer(base, jnp.float32)
    before = flat(dit)
    with pytest.raises(WanInputError) as e:
        dit.load_lora(path)
    message = str(e.value)
    assert "\n" not in message and "matches no layer of this transformer (2 blocks)" in message
    assert "'diffusion_model.blocks.5.self_attn.q.lora_down.weight'" in message and "nor do 5 more" in message
    assert "and 2 more" in message  # a few named, the rest counted
    assert all(np.array_equal(v, before[k]) for k, v in flat(dit).items())
    junk = tmp_path / "junk.safetensors"
    save_file({"blocks.0.self_attn.q.weight": a.clone(), "foo": a.clone()}, str(junk))
    with pytest.raises(WanInputError, match="is not a LoRA entry \\(nor are 'foo'\\)"):
        dit.load_lora(junk)


def test_wan21_i2v_lora_on_a_dit_without_the_image_branch(tmp_path):
    """Wan 2.2 I2V A14B has Wan 2.1 I2V 14B's shapes but no image cross-attention: a 2.1 I2V LoRA merges into
    every layer it has, leaving out (and reporting) the image branch's keys."""
    from diffusers import WanTransformer3DModel

    config = {k: v for k, v in CONFIG.items() if k not in ("image_dim", "added_kv_proj_dim")}
    torch.manual_seed(0)
    folder = tmp_path / "a14b"
    WanTransformer3DModel(**config).save_pretrained(folder)
    g = torch.Generator().manual_seed(2)
    lora, shared = {}, {}
    for i in range(2):
        for name in ("self_attn.q", "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img"):
            entry = {f"diffusion_model.blocks.{i}.{name}.lora_down.weight": torch.randn(RANK, 32, generator=g),
                     f"diffusion_model.blocks.{i}.{name}.lora_up.weight": torch.randn(32, RANK, generator=g)}
            lora |= entry
            if "img" not in name:
                shared |= entry
        lora[f"diffusion_model.blocks.{i}.cross_attn.norm_k_img.diff"] = torch.randn(32, generator=g)
    lora["diffusion_model.img_emb.proj.1.diff_b"] = torch.randn(20, generator=g)
    full, common = tmp_path / "i2v.safetensors", tmp_path / "common.safetensors"
    save_file(lora, str(full))
    save_file(shared, str(common))
    dit = load_transformer(str(folder), jnp.float32)
    with pytest.warns(UserWarning, match="11 keys of an image branch this transformer does not have were left out") as w:
        info = dit.load_lora(full, 0.8)
    assert len(w) == 1 and "\n" not in str(w[0].message)
    assert len(info.skipped) == 11 and info.tensors == 4 and "11 image-branch keys left out" in str(info)
    expected = load_transformer(str(folder), jnp.float32)
    expected.load_lora(common, 0.8)
    reference = flat(expected)
    assert all(np.array_equal(v, reference[k]) for k, v in flat(dit).items())
    only_image = tmp_path / "only_image.safetensors"
    save_file({k: v for k, v in lora.items() if "img" in k}, str(only_image))
    with pytest.raises(WanInputError, match="changes only an image branch .* for a Wan 2.1 I2V model"):
        dit.load_lora(only_image)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_lora_on_a_quantized_dit(made, tmp_path, fmt):
    """LoRA pairs stay beside the 8-bit kernels (`LowRankQuantizedLinear`: kernels untouched, the factors'
    product is the LoRA's update); full `diff` deltas merge into the dequantised kernel and are quantised
    again; unload restores the quantised linears bit for bit."""
    from wan_tpu.layers.quantized import QuantizedLinear
    from wan_tpu.wan.lora import LowRankQuantizedLinear
    from wan_tpu.wan.quantize import quantize_transformer

    base, peft_file, factors = made
    dit = quantize_transformer(load_transformer(base, jnp.float32), fmt)
    before = flat(dit)
    g = torch.Generator().manual_seed(3)
    diff = torch.randn(48, 32, generator=g) * 0.05  # ffn.0 of block 1: (out, in)
    diff_path = tmp_path / "diff.safetensors"
    save_file({"diffusion_model.blocks.1.ffn.0.diff": diff}, str(diff_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dit.load_lora(peft_file, 0.7)
        dit.load_lora(peft_file, -0.2)  # a second LoRA: its factors concatenated
        dit.load_lora(diff_path, 0.5)
    got = flat(dit)
    for module, (a, b) in factors.items():
        layer, p = int(module.split(".")[1]), ours(module)
        linear = dit.blocks
        for attr in p.split(".")[1:]:
            linear = getattr(linear, attr)
        assert isinstance(linear, LowRankQuantizedLinear) and got[f"{p}.lora_down"].shape[-1] == 2 * RANK
        update = got[f"{p}.lora_down"][layer].astype(np.float64) @ got[f"{p}.lora_up"][layer]
        np.testing.assert_allclose(update, 0.5 * (ALPHA / RANK) * (b.double() @ a.double()).numpy().T, rtol=1e-5,
                                   atol=1e-6, err_msg=module)
        if module != "blocks.1.ffn.net.0.proj":
            assert np.array_equal(got[f"{p}.kernel"][layer], before[f"{p}.kernel"][layer]), module
    # The full delta: merged into block 1's dequantised FFN-in kernel, quantised again (within half a step).
    k, s = before["blocks.ffn.proj_in.kernel"][1], before["blocks.ffn.proj_in.kernel_scale"][1]
    target = k.astype(np.float64) * s[None] + 0.5 * diff.double().numpy().T
    # `quantize_weight`'s scales: the column's amax over the format's largest value.
    scale = np.maximum(np.abs(target.astype(np.float32)).max(0), 1e-12) / {"fp8": 448.0, "int8": 127.0}[fmt]
    np.testing.assert_allclose(got["blocks.ffn.proj_in.kernel_scale"][1], scale, rtol=1e-6)
    step = 2.0**-4 * np.abs(target) + scale * 2.0**-9 if fmt == "fp8" else 0.5 * scale + 0 * target
    error = np.abs(got["blocks.ffn.proj_in.kernel"][1].astype(np.float64) * got["blocks.ffn.proj_in.kernel_scale"][1] - target)
    assert np.all(error <= step * (1 + 1e-5))
    assert np.array_equal(got["blocks.ffn.proj_in.kernel"][0], before["blocks.ffn.proj_in.kernel"][0])
    # The layer computes quantised(x) + x·down·up.
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    plain = QuantizedLinear(jnp.asarray(k), jnp.asarray(s), None, fmt=fmt, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    down, up = rng.standard_normal((32, 3)).astype(np.float32), rng.standard_normal((3, 48)).astype(np.float32)
    low_rank = LowRankQuantizedLinear(plain, jnp.asarray(down), jnp.asarray(up))
    both = jax.jit(lambda x: (low_rank(x), plain(x)))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(both[0]), np.asarray(both[1]) + x @ down @ up, rtol=1e-5, atol=1e-5)
    dit.unload_lora()
    assert not isinstance(dit.blocks.attn1.to_q, LowRankQuantizedLinear)
    assert flat(dit).keys() == before.keys() and all(np.array_equal(v, before[k]) for k, v in flat(dit).items())
    if fmt != "fp8":
        return
    # A LoRA merged before quantising cannot be undone after: its unquantised weights are gone.
    late = load_transformer(base, jnp.float32)
    late.load_lora(peft_file)
    quantize_transformer(late, fmt)
    with pytest.raises(WanInputError, match="quantised after its LoRAs were merged"):
        late.unload_lora()


def test_peft_metadata_alpha_is_read(made):
    """The reference file carries alpha only in diffusers' `lora_adapter_metadata` (no `.alpha` tensors)."""
    from safetensors import safe_open

    _, peft_file, _ = made
    with safe_open(peft_file, "np") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
        assert not any(k.endswith(".alpha") for k in f.keys())
    assert config["transformer.lora_alpha"] == ALPHA and config["transformer.r"] == RANK
