"""The checkpoints users have (`wan_tpu.loading.formats`, `wan_tpu.loading.gguf`, `wan_tpu.wan.model_files`):
official Wan folders, ComfyUI single files (bf16, fp16, fp8, fp8_scaled), GGUF, ComfyUI model roots, Wan 2.2
A14B as two expert files, and the one-line refusals of every wrong combination.

The reference is a tiny diffusers `WanTransformer3DModel` at the `tiny` preset's shapes, saved with
`save_pretrained` and loaded through our diffusers path. Every other layout is written here as its own
tools write it: the official layout under the authors' names and config.json (checked against
`tests/data/wan_official_layouts.json`, made by `scripts/make_golden_wan_layouts.py` from the authors'
`WanModel` and its own `save_pretrained`; diffusers' own original → diffusers converter agrees),
`safetensors.torch.save_file` with ComfyUI's prefix and torch's float8 tensors, and GGUF with the
`gguf` package's `GGUFWriter` and `gguf.quants.quantize` following city96's `tools/convert.py`
(1-D, small and `.modulation` tensors in F32, the 5-D patch embedding appended in F32).
Exact layouts give bit-identical parameters; fp8 and GGUF equal our own dequantisation of the file
bit for bit, and their error against the unquantised weights is printed. GGUF Q8_0 on the int8 path equals
`quantize_weight` jitted on the dequantised weights, bit for bit.
"""

import collections
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from flax import nnx
from safetensors.torch import save_file

from wan_tpu.configs.models import VARIANTS, config_to_json
from wan_tpu.errors import WanInputError
from wan_tpu.loading import formats
from wan_tpu.loading.wan_names import diffusers_to_original_wan
from wan_tpu.wan.transformer_loading import load_transformer

TINY = VARIANTS["tiny"].transformer
GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "wan_official_layouts.json")
PREFIX = "model.diffusion_model."
# GGUF tensors city96's converter keeps in F32: one-dimensional, at most this many elements, `.modulation`.
GGUF_F32_ELEMENTS = 1024


def _diffusers_kwargs(cfg):
    kw = config_to_json(cfg)
    kw["patch_size"] = tuple(kw["patch_size"])
    return kw


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(diffusers state dict as float32 numpy, its save_pretrained folder, the float32 DiT loaded from it)."""
    torch.manual_seed(0)
    model = WanTransformer3DModel(**_diffusers_kwargs(TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("diffusers") / "transformer"
    model.save_pretrained(folder)
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    return state, folder, load_transformer(str(folder))


def _params(dit):
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(dit))}


def _assert_same_params(a, b):
    a, b = _params(a), _params(b)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _original(state, prefix=""):
    return {prefix + diffusers_to_original_wan(k): v for k, v in state.items()}


def _torch(state, dtype=torch.float32):
    return {k: torch.from_numpy(np.array(v)).to(dtype) for k, v in state.items()}


def _save_diffusers(state, folder, cfg=TINY):
    """A diffusers folder of `state` (numpy, diffusers names) as WanTransformer3DModel writes it."""
    model = WanTransformer3DModel(**_diffusers_kwargs(cfg))
    model.load_state_dict(_torch(state))
    model.save_pretrained(folder)
    return folder


def _inputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, TINY.in_channels, 2, 4, 4)), jnp.float32)
    t = jnp.asarray([500.0], jnp.float32)
    c = jnp.asarray(rng.standard_normal((1, 8, TINY.text_dim)), jnp.float32)
    return x, t, c


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- names and configs ---------------------------------------------------------------------------


GOLDEN_CONFIGS = {  # model → our config at the golden file's tiny widths
    "wan2.1-t2v": dict(in_channels=16, out_channels=16),
    "wan2.1-i2v": dict(in_channels=36, out_channels=16, image_dim=1280, added_kv_proj_dim=64),
    "wan2.2-ti2v": dict(in_channels=48, out_channels=48),
    "wan2.2-i2v": dict(in_channels=36, out_channels=16),
}


@pytest.mark.parametrize("model", list(GOLDEN_CONFIGS))
def test_renames_and_config_match_the_authors_layout(model):
    golden = json.load(open(GOLDEN))["models"][model]
    cfg = VARIANTS["tiny"].transformer.__class__(**{**config_to_json(TINY), "patch_size": (1, 2, 2),
                                                    **GOLDEN_CONFIGS[model]})
    with torch.device("meta"):
        ref = WanTransformer3DModel(**_diffusers_kwargs(cfg))
    ours = {diffusers_to_original_wan(k): list(v.shape) for k, v in ref.state_dict().items()}
    assert ours == {k: shape for k, (_, shape) in golden["tensors"].items()}
    # diffusers' own single-file converter takes the authors' names to exactly the diffusers model's.
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    converted = convert_wan_transformer_to_diffusers({PREFIX + k: 0 for k in golden["tensors"]})
    assert set(converted) == set(ref.state_dict())
    shapes = {k: tuple(shape) for k, (_, shape) in golden["tensors"].items()}
    assert formats.config_from_shapes(shapes, golden["config"]) == cfg


def _shapes_of(cfg):
    dim, patch = cfg.inner_dim, cfg.patch_size
    shapes = {"patch_embedding.weight": (dim, cfg.in_channels, *patch),
              "head.head.weight": (cfg.out_channels * int(np.prod(patch)), dim),
              "text_embedding.0.weight": (dim, cfg.text_dim), "time_embedding.0.weight": (dim, cfg.freq_dim)}
    shapes.update({f"blocks.{i}.ffn.0.weight": (cfg.ffn_dim, dim) for i in range(cfg.num_layers)})
    if cfg.image_dim:
        shapes["img_emb.proj.0.weight"] = (cfg.image_dim,)
    return shapes


def test_config_from_shapes_table():
    known = formats.known_configs()
    assert {c.inner_dim for c in known} >= {1536, 3072, 5120}
    for cfg in known:
        assert formats.config_from_shapes(_shapes_of(cfg)) == cfg
    odd = _shapes_of(TINY)
    odd["time_embedding.0.weight"] = (TINY.inner_dim, 48)
    with pytest.raises(WanInputError, match=r"no Wan model wan_tpu knows has these DiT shapes .*freq_dim=48.*config.json"):
        formats.config_from_shapes(odd)


# ---- exact layouts -------------------------------------------------------------------------------


def test_official_sharded_folder_loads_like_diffusers(reference, tmp_path):
    state, _, expected = reference
    golden = json.load(open(GOLDEN))["models"]["wan2.1-t2v"]
    folder = tmp_path / "Wan2.1-T2V-tiny"
    folder.mkdir()
    config = {**golden["config"], "dim": TINY.inner_dim, "num_heads": TINY.num_attention_heads}
    (folder / "config.json").write_text(json.dumps(config))
    original = _original(state)
    names = sorted(original)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in shards.items():
        save_file(_torch({k: original[k] for k in part}), folder / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    index = {"metadata": {"total_size": sum(v.nbytes for v in original.values())}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = formats.open_dit(str(folder))
    assert ckpt.layout == "official" and ckpt.config == TINY
    _assert_same_params(load_transformer(str(folder)), expected)


@pytest.mark.parametrize("naming,dtype,suffix", [("original", torch.bfloat16, ".safetensors"),
                                                 ("diffusers", torch.float16, ".safetensors"),
                                                 ("original", torch.bfloat16, ".pth")])
def test_comfy_single_file(reference, tmp_path, naming, dtype, suffix):
    """ComfyUI `diffusion_models/` files: the prefix, either naming, half precision, or a `torch.save`d state dict;
    the float32 load holds the file's values exactly (the diffusers copy saved in that precision gives the same
    parameters)."""
    state, _, _ = reference
    rounded = {k: torch.from_numpy(v).to(dtype).float().numpy() for k, v in state.items()}
    names = _original(state, PREFIX) if naming == "original" else {PREFIX + k: v for k, v in state.items()}
    path = tmp_path / f"wan_tiny{suffix}"
    tensors = _torch(dict(zip(names, state.values())), dtype)
    if suffix == ".pth":
        torch.save(tensors, path)
    else:
        save_file(tensors, path, metadata={"format": "pt"})
    expected = load_transformer(str(_save_diffusers(rounded, tmp_path / "rounded")))
    _assert_same_params(load_transformer(str(path)), expected)


def _fp8_scaled(state):
    """ComfyUI's fp8_scaled file of `state`: each 2-D weight as float8_e4m3fn with a float32 `scale_weight`
    scalar (amax / 448, as its scaled-fp8 conversions compute it), the rest bf16, the `scaled_fp8` marker."""
    out = {}
    for k, v in _original(state, PREFIX).items():
        t = torch.from_numpy(v)
        if k.endswith(".weight") and t.ndim == 2:
            scale = t.abs().max().float() / 448.0
            out[k] = (t / scale).to(torch.float8_e4m3fn)
            out[k[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[k] = t.to(torch.bfloat16)
    out[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def _dequantised_fp8(tensors):
    """Our own reading of an fp8_scaled file: weight × scale in float32, diffusers names."""
    out = {}
    for k, v in tensors.items():
        if k.endswith(("scale_weight", "scaled_fp8")):
            continue
        value = v.float().numpy()
        scale = k[: -len("weight")] + "scale_weight"
        if scale in tensors:
            value = value * tensors[scale].numpy()
        out[k[len(PREFIX):]] = value
    from wan_tpu.loading.wan_names import original_wan_to_diffusers

    return {original_wan_to_diffusers(k): v for k, v in out.items()}


def test_fp8_scaled_dequantised_exactly_and_kept_8bit(reference, tmp_path):
    state, _, full = reference
    tensors = _fp8_scaled(state)
    path = tmp_path / "wan_tiny_fp8_scaled.safetensors"
    save_file(tensors, path)
    ckpt = formats.open_dit(str(path))
    assert formats.native_8bit(ckpt) == "fp8"
    exact = load_transformer(str(_save_diffusers(_dequantised_fp8(tensors), tmp_path / "dequantised")))
    loaded = load_transformer(str(path))
    _assert_same_params(loaded, exact)
    x, t, c = _inputs()
    print(f"\nfp8_scaled (dequantised) vs float32 weights: rel. error {_rel(loaded(x, t, c), full(x, t, c)):.2e}")

    kept = load_transformer(str(path), quantize="fp8")
    linear = kept.blocks.attn1.to_q
    file_weight = np.stack([tensors[f"{PREFIX}blocks.{i}.self_attn.q.weight"].view(torch.uint8).numpy()
                            for i in range(TINY.num_layers)])
    np.testing.assert_array_equal(np.asarray(linear.kernel[...]).view(np.uint8), file_weight.transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(linear.kernel_scale[...])[:, 0],
                                  [tensors[f"{PREFIX}blocks.{i}.self_attn.q.scale_weight"].item()
                                   for i in range(TINY.num_layers)])
    assert kept.quantization == "fp8"
    err = _rel(kept(x, t, c), loaded(x, t, c))
    print(f"fp8_scaled kept 8-bit (fp8 activations) vs dequantised: rel. error {err:.2e}")
    assert err < 0.1


def test_plain_fp8_is_cast(reference, tmp_path):
    state, _, _ = reference
    tensors = {k: (torch.from_numpy(v).to(torch.float8_e4m3fn) if v.ndim == 2 else torch.from_numpy(v))
               for k, v in _original(state, PREFIX).items()}
    path = tmp_path / "wan_tiny_fp8_e4m3fn.safetensors"
    save_file(tensors, path)
    cast = {k[len(PREFIX):]: v.float().numpy() for k, v in tensors.items()}
    from wan_tpu.loading.wan_names import original_wan_to_diffusers

    expected = load_transformer(str(_save_diffusers({original_wan_to_diffusers(k): v for k, v in cast.items()},
                                                    tmp_path / "cast")))
    _assert_same_params(load_transformer(str(path)), expected)


# ---- GGUF ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf():
    return pytest.importorskip("gguf", reason="the gguf package (wan_tpu[gguf]) reads .gguf files")


def _write_gguf(gguf, state, path, qtype):
    """A Wan GGUF as city96's tools/convert.py (+ fix_5d_tensors.py for the patch embedding) writes it."""
    T = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    five_d = {}
    for k, v in _original(state).items():
        if v.ndim > 4:
            five_d[k] = v
            continue
        kind = T.F32 if v.ndim == 1 or v.size <= GGUF_F32_ELEMENTS or ".modulation" in k else qtype
        writer.add_tensor(k, gguf.quants.quantize(v, kind), raw_dtype=kind)
    for k, v in five_d.items():
        writer.add_tensor(k, gguf.quants.quantize(v, T.F32), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _dequantised_gguf(gguf, path):
    from wan_tpu.loading.wan_names import original_wan_to_diffusers

    reader = gguf.GGUFReader(str(path))
    return {original_wan_to_diffusers(t.name): gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(int(s) for s in reversed(t.shape))) for t in reader.tensors}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1"])
def test_gguf_dequantised_exactly(gguf, reference, tmp_path, qtype):
    state, _, full = reference
    path = tmp_path / f"wan_tiny-{qtype}.gguf"
    _write_gguf(gguf, state, path, getattr(gguf.GGMLQuantizationType, qtype))
    expected = load_transformer(str(_save_diffusers(_dequantised_gguf(gguf, path), tmp_path / "dequantised")))
    loaded = load_transformer(str(path))
    _assert_same_params(loaded, expected)
    x, t, c = _inputs()
    print(f"\nGGUF {qtype} (dequantised) vs float32 weights: rel. error {_rel(loaded(x, t, c), full(x, t, c)):.2e}")


def test_gguf_q8_0_onto_the_int8_path(gguf, reference, tmp_path):
    """Q8_0 block linears go to int8 kernels with one scale per output channel, computed on the host: the
    bits `quantize_transformer` computes on a device from the dequantised weights."""
    from wan_tpu.wan.quantize import quantize_transformer

    state, _, _ = reference
    path = tmp_path / "wan_tiny-Q8_0.gguf"
    _write_gguf(gguf, state, path, gguf.GGMLQuantizationType.Q8_0)
    assert formats.native_8bit(formats.open_dit(str(path))) == "int8"
    direct = load_transformer(str(path), quantize="int8")
    on_device = quantize_transformer(load_transformer(str(path)), "int8")
    _assert_same_params(direct, on_device)
    assert direct.quantization == "int8" and direct.blocks.ffn.proj_in.kernel.dtype == jnp.int8


def test_q8_0_rescale_gives_the_device_bits(gguf, tmp_path, monkeypatch):
    """`GGUFSource.int8_rows` (host, row chunks in threads) against `quantize_weight` jitted on the dequantised
    weight, on bytes no quantiser tunes: blocks whose largest value is not ±127, -128, all-zero rows, zero and
    subnormal block scales, negative scales, a ragged last chunk."""
    import jax

    from wan_tpu.layers.quantized import quantize_weight
    from wan_tpu.loading import gguf as ours

    rng = np.random.default_rng(0)
    rows, blocks = 203, 3
    values = rng.integers(-128, 128, (rows, blocks, 32)).astype(np.int8)
    scales = (rng.standard_normal((rows, blocks, 1)) * 1e-2).astype(np.float16)
    values[0] = 0
    scales[1] = 0
    scales[2] = np.float16(6e-8)
    data = np.concatenate([scales.view(np.uint8), values.view(np.uint8)], axis=-1).reshape(rows, -1)
    writer = gguf.GGUFWriter(str(tmp_path / "q8.gguf"), arch="wan")
    writer.add_tensor("w", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(ours, "ROW_CHUNK_BYTES", 5 * blocks * 32)  # 5 rows a chunk: 41 chunks, the last of 3
    source = ours.GGUFSource(str(tmp_path / "q8.gguf"))
    scales_only = source.int8_rows("w", values=False)[1]
    q, scale = source.int8_rows("w")
    kernel, device_scale = jax.jit(lambda w: quantize_weight(w, "int8"))(jnp.asarray(source["w"].T))
    np.testing.assert_array_equal(q, np.asarray(kernel).T)
    np.testing.assert_array_equal(scale, np.asarray(device_scale))
    np.testing.assert_array_equal(scales_only, scale)
    np.testing.assert_array_equal(source.int8_rows("w", values=False)[1], scale)  # kept from the values' read


# ---- refusals ------------------------------------------------------------------------------------


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


COMPONENTS = os.path.join(os.path.dirname(__file__), "..", "data", "wan_components.safetensors")


def _component(kind):
    """The authors' tiny `kind` of `scripts/make_golden_wan_components.py`, original names: "t5" as stored, "vae21" /
    "vae22" random values in the names and shapes the file's metadata records."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if kind == "t5":
        return {k[len(kind) + 1:]: v for k, v in load_file(COMPONENTS).items() if k.startswith(kind + ".")}
    with safe_open(COMPONENTS, "pt") as f:
        shapes = json.loads(f.metadata()[kind])
    g = torch.Generator().manual_seed(0)
    return {k: (1.0 if k.endswith("gamma") else 0.0) + 0.1 * torch.randn(shape, generator=g) for k, shape in shapes.items()}


def _vae_file(path, kind="vae21"):
    """A Wan VAE file: `.pth` as the official download stores it (`torch.save` of the state dict), else
    safetensors as ComfyUI's `vae/` holds it."""
    (torch.save if str(path).endswith(".pth") else save_file)(_component(kind), path)
    return path


def _t5_file(path):
    (torch.save if str(path).endswith(".pth") else save_file)(_component("t5"), path)
    return path


def test_wrong_files_for_their_slots(reference, tmp_path):
    state, _, _ = reference
    dit = tmp_path / "dit.safetensors"
    save_file(_torch(_original(state, PREFIX), torch.bfloat16), dit)
    vae, t5 = _vae_file(tmp_path / "vae.safetensors"), _t5_file(tmp_path / "t5.safetensors")
    with pytest.raises(WanInputError) as e:
        load_transformer(str(vae))
    assert "holds a Wan VAE, not a Wan DiT" in _one_line(e)
    with pytest.raises(WanInputError) as e:
        formats.check_slot(str(dit), "vae", "--vae")
    assert "holds a Wan DiT (diffusion model), not a Wan VAE; pass a Wan VAE file with --vae" in _one_line(e)
    with pytest.raises(WanInputError) as e:
        formats.check_slot(str(t5), "image_encoder", "--image-encoder")
    assert "holds a UMT5 text encoder, not a CLIP image encoder" in _one_line(e)


def test_truncated_and_unsupported_files(gguf, reference, tmp_path):
    state, _, _ = reference
    dit = tmp_path / "dit.safetensors"
    save_file(_torch(_original(state, PREFIX), torch.bfloat16), dit)
    data = dit.read_bytes()
    dit.write_bytes(data[: len(data) - 100])
    with pytest.raises(WanInputError) as e:
        load_transformer(str(dit))
    assert "truncated download" in _one_line(e)

    path = tmp_path / "wan.gguf"
    _write_gguf(gguf, state, path, gguf.GGMLQuantizationType.Q8_0)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(WanInputError) as e:
        load_transformer(str(cut))
    assert "re-download" in _one_line(e)

    T = gguf.GGMLQuantizationType
    block, size = gguf.GGML_QUANT_SIZES[T.IQ4_NL]
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), arch="wan")
    writer.add_tensor("blocks.0.ffn.0.weight", np.zeros((4, 64 // block * size), np.uint8), raw_dtype=T.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WanInputError) as e:
        load_transformer(str(tmp_path / "iq.gguf"))
    assert "stored as IQ4_NL, which wan_tpu does not read" in _one_line(e)


def test_pickle_that_needs_more_than_weights(tmp_path):
    torch.save({"conv2.weight": torch.zeros(2), "optimizer": collections.OrderedDict(step=torch.nn.Linear(1, 1))},
               tmp_path / "Wan2.1_VAE.pth")
    with pytest.raises(WanInputError) as e:
        formats.check_slot(str(tmp_path / "Wan2.1_VAE.pth"), "vae", "--vae FILE")
    assert "only weights-only pickles are loaded" in _one_line(e)


# ---- the pipeline over files ---------------------------------------------------------------------


def _tokenizer(folder):
    """A tokenizer folder of the tiny preset's UMT5 tokenizer, as a diffusers folder holds one."""
    from wan_tpu.encoders.tokenizers import tiny_hf_tokenizer

    tiny_hf_tokenizer().save_pretrained(str(folder))
    return folder


def test_pipeline_from_files_and_comfy_root(reference, tmp_path):
    from wan_tpu.wan.pipeline import WanPipeline

    state, _, expected = reference
    root = tmp_path / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (root / sub).mkdir(parents=True)
    dit = root / "diffusion_models" / "wan_tiny_bf16.safetensors"
    save_file(_torch(_original(state, PREFIX)), dit)
    vae = _vae_file(root / "vae" / "wan_2.1_vae.safetensors")
    t5 = _t5_file(root / "text_encoders" / "umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    tokenizer = _tokenizer(tmp_path / "tokenizer")

    pipe = WanPipeline.from_pretrained(str(dit), vae=vae, text_encoder=t5, tokenizer=tokenizer, dtype=jnp.float32)
    assert pipe.variant.name == "tiny" and pipe.vae_config.z_dim == 16
    _assert_same_params(pipe.transformer, expected)
    assert WanPipeline.from_pretrained(str(root), tokenizer=tokenizer).variant.name == "tiny"

    with pytest.raises(WanInputError) as e:
        WanPipeline.from_pretrained(str(dit), text_encoder=t5, tokenizer=tokenizer)
    assert "needs a Wan VAE file; pass --vae FILE" in _one_line(e)
    with pytest.raises(WanInputError) as e:
        WanPipeline.from_pretrained(str(dit), vae=_vae_file(tmp_path / "wan2.2_vae.safetensors", "vae22"), text_encoder=t5,
                                    tokenizer=tokenizer)
    assert "has 48 latent channels (Wan 2.2 TI2V-5B) but the DiT" in _one_line(e)
    save_file(_torch(_original(state, PREFIX)), root / "diffusion_models" / "wan_tiny_copy.safetensors")
    with pytest.raises(WanInputError) as e:
        WanPipeline.from_pretrained(str(root), tokenizer=tokenizer)
    assert ("has several a Wan DiT (diffusion model) files (diffusion_models/wan_tiny_bf16.safetensors, "
            "diffusion_models/wan_tiny_copy.safetensors); pick one with --model FILE") in _one_line(e)


def test_official_folder_pipeline(reference, tmp_path):
    """An official Wan download as it is: the DiT and its config.json at the top, `Wan2.1_VAE.pth`,
    `models_t5_umt5-xxl-enc-bf16.pth` and the `google/umt5-xxl/` tokenizer; the DiT equals the diffusers copy."""
    from wan_tpu.wan.pipeline import WanPipeline

    state, _, expected = reference
    folder = tmp_path / "Wan2.1-T2V-tiny"
    folder.mkdir()
    golden = json.load(open(GOLDEN))["models"]["wan2.1-t2v"]["config"]
    (folder / "config.json").write_text(json.dumps({**golden, "dim": TINY.inner_dim, "num_heads": TINY.num_attention_heads}))
    save_file(_torch(_original(state)), folder / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    _vae_file(folder / "Wan2.1_VAE.pth")
    _t5_file(folder / "models_t5_umt5-xxl-enc-bf16.pth")
    _tokenizer(folder / "google" / "umt5-xxl")
    pipe = WanPipeline.from_pretrained(str(folder), dtype=jnp.float32)
    assert pipe.variant.name == "tiny" and pipe.vae_config.z_dim == 16
    _assert_same_params(pipe.transformer, expected)
    assert pipe.vae.config == pipe.vae_config
    assert pipe.text_encoder.config.d_model == TINY.text_dim


def test_cli_refuses_a_dit_file_without_its_vae(reference, tmp_path):
    import subprocess
    import sys

    state, _, _ = reference
    dit = tmp_path / "wan_tiny.safetensors"
    save_file(_torch(_original(state, PREFIX), torch.bfloat16), dit)
    out = subprocess.run([sys.executable, "-m", "wan_tpu.generate", "--model", str(dit), "--prompt", "a cat",
                          "--output", str(tmp_path / "v.mp4")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("needs a Wan VAE file; pass --vae FILE (vae=)")
    assert not (tmp_path / "v.mp4").exists()


def test_official_a14b_parts(tmp_path):
    """Wan 2.2 A14B downloads: the high-noise expert is `transformer` (used first), the low-noise one `transformer_2`."""
    for expert in formats.EXPERTS:
        (tmp_path / expert).mkdir()
    for name in ("Wan2.1_VAE.pth", formats.OFFICIAL_T5):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / formats.OFFICIAL_T5_TOKENIZER).mkdir(parents=True)
    assert formats.is_official(str(tmp_path))
    parts = formats.official_parts(str(tmp_path))
    assert parts["transformer"] == str(tmp_path / "high_noise_model")
    assert parts["transformer_2"] == str(tmp_path / "low_noise_model")
    assert parts["vae"] == str(tmp_path / "Wan2.1_VAE.pth") and "image_encoder" not in parts


# ---- Wan 2.2 A14B as two expert files ------------------------------------------------------------


@pytest.fixture
def two_experts(monkeypatch):
    """A two-expert model (the A14B's switch) at the tiny DiT's shapes, in the table for this test only: the
    file path finds the A14B by its experts' architecture, and no real A14B fits a test."""
    import dataclasses

    a14b = VARIANTS["wan2.2-t2v-a14b"]
    variant = dataclasses.replace(VARIANTS["tiny"], name="tiny-a14b", transformer_2=TINY,
                                  boundary_ratio=a14b.boundary_ratio, guidance_scale_2=a14b.guidance_scale_2)
    monkeypatch.setitem(VARIANTS, variant.name, variant)
    return variant


def _expert_files(state, folder):
    """ComfyUI's two expert files (float32 here, so that the load is exact); the low-noise weights are the
    high-noise ones negated, so that each expert is seen to come from its own file."""
    high = folder / "wan2.2_t2v_high_noise_14B_fp16.safetensors"
    low = folder / "wan2.2_t2v_low_noise_14B_fp16.safetensors"
    save_file(_torch(_original(state, PREFIX)), high)
    save_file(_torch(_original({k: -v for k, v in state.items()}, PREFIX)), low)
    return high, low


def test_a14b_from_two_expert_files_and_a_comfy_root(reference, tmp_path, two_experts, monkeypatch):
    from wan_tpu.wan.model_files import resolve_files
    from wan_tpu.wan.pipeline import WanPipeline

    state, _, expected = reference
    root = tmp_path / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (root / sub).mkdir(parents=True)
    high, low = _expert_files(state, root / "diffusion_models")
    _vae_file(root / "vae" / "wan_2.1_vae.safetensors")
    _t5_file(root / "text_encoders" / "umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    _tokenizer(root / "tokenizer")
    monkeypatch.chdir(root)  # relative paths, as typed on a command line
    pipe = WanPipeline.from_pretrained("diffusion_models/" + high.name, transformer_2="diffusion_models/" + low.name,
                                       vae="vae/wan_2.1_vae.safetensors", tokenizer="tokenizer", dtype=jnp.float32,
                                       text_encoder="text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    assert pipe.variant == two_experts
    _assert_same_params(pipe.transformer, expected)
    high_params, low_params = _params(pipe.transformer), _params(pipe.transformer_2)
    for k in high_params:
        np.testing.assert_array_equal(low_params[k], -high_params[k], err_msg=k)

    files = resolve_files(str(root), tokenizer=str(root / "tokenizer"))
    assert files.variant == two_experts
    assert (files.parts["transformer"], files.parts["transformer_2"]) == (str(high), str(low))


def test_a14b_expert_files_refused_in_one_line(reference, tmp_path, two_experts, monkeypatch):
    import dataclasses

    from wan_tpu.wan.model_files import resolve_files

    state, _, _ = reference
    high, low = _expert_files(state, tmp_path)
    parts = dict(vae=_vae_file(tmp_path / "vae.safetensors"), text_encoder=_t5_file(tmp_path / "t5.safetensors"),
                 tokenizer=_tokenizer(tmp_path / "tokenizer"))

    def refused(path, **kw):
        with pytest.raises(WanInputError) as e:
            resolve_files(str(path), **{**parts, **kw})
        return _one_line(e)

    assert "is one expert of a Wan 2.2 A14B model (its name says so), which needs both" in refused(high)
    assert "is the low-noise expert and --model-low" in refused(low, transformer_2=high) and "swap them" in refused(
        low, transformer_2=high)
    assert "--model and --model-low both name" in refused(high, transformer_2=high)
    assert "holds a Wan VAE, not a Wan DiT (diffusion model); pass a Wan DiT (diffusion model) file with --model-low" \
        in refused(high, transformer_2=parts["vae"])
    assert "goes with its high-noise DiT file in --model, but" in refused(tmp_path, transformer_2=low)
    monkeypatch.delitem(VARIANTS, two_experts.name)
    assert "two DiTs of 2 layers, width 64, 16 input channels are no Wan 2.2 A14B model" in refused(high, transformer_2=low)

    # Experts of two architectures: a one-block DiT (registered like the pair) as the low-noise file.
    one_block = dataclasses.replace(TINY, num_layers=1)
    monkeypatch.setitem(VARIANTS, "tiny-1", dataclasses.replace(VARIANTS["tiny"], name="tiny-1", transformer=one_block))
    short = tmp_path / "wan_low_noise_1_block.safetensors"
    save_file(_torch({k: v for k, v in _original(state, PREFIX).items() if ".blocks.1." not in k}), short)
    assert ("(1 layers, width 64, 16 input channels) and the high-noise DiT" in refused(high, transformer_2=short)
            and "pass the two experts of one Wan 2.2 A14B model" in refused(high, transformer_2=short))
    # A ComfyUI root with more than one pair names its files and both flags.
    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    for file in (high, low, short):
        os.link(file, root / "diffusion_models" / file.name)
    assert "--model HIGH_NOISE_FILE --model-low LOW_NOISE_FILE" in refused(root, vae=None, text_encoder=None)


def test_cli_takes_model_low(reference, tmp_path, two_experts):
    """`--model HIGH --model-low LOW` reaches `from_pretrained(..., transformer_2=LOW)` (nothing is loaded yet)."""
    from wan_tpu.wan.cli import build_parser, load_pipeline, resolve_defaults

    state, _, _ = reference
    high, low = _expert_files(state, tmp_path)
    args = build_parser().parse_args([
        "--model", str(high), "--model-low", str(low), "--vae", str(_vae_file(tmp_path / "vae.safetensors")),
        "--text-encoder", str(_t5_file(tmp_path / "t5.safetensors")), "--tokenizer", str(_tokenizer(tmp_path / "tok")),
        "--prompt", "a cat"])
    resolve_defaults(args)
    pipe = load_pipeline(args)
    assert pipe.variant == two_experts and "transformer_2" in pipe._loaders
