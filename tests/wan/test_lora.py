"""LoRA adapters (`wan_tpu.wan.lora`): parity with diffusers, exact unload, no retrace, sharding, A14B experts.

Reference: diffusers 0.42 `WanPipeline.load_lora_weights` (+ PEFT) on a tiny random
`WanTransformer3DModel` with the I2V image branch, float32, CPU; ours loads the same `save_pretrained`
folder with `load_transformer` and merges the same file. Tolerance: max |ours − diffusers| ≤ 1e-5 ×
max |diffusers| on the forward output. Files: rank 4, alpha 8 (≠ rank), random factors, in each
format — original Wan / kohya (`diffusion_model.…lora_down/up` + `alpha` + `diff_b`, blocks and the
top-level layers diffusers converts), diffusers/PEFT (`transformer.…lora_A/B` + `lora_B.bias`, alpha
in `lora_adapter_metadata`), ComfyUI (`lora_unet_blocks_…`; diffusers' converter for these names
takes no `diff_b`, so ComfyUI `diff_b` is covered by the NumPy test below).
Entries diffusers drops (full `diff` on linear weights, norm and modulation deltas, the patch-embedding
Conv3d) are checked against a NumPy merge of the same file written back as a checkpoint
(tolerance 1e-6 relative: float32 vs float64 rounding of the sum).
"""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanPipeline as DiffusersWanPipeline
from diffusers import WanTransformer3DModel
from flax import nnx
from safetensors.torch import save_file

from wan_tpu.errors import WanInputError
from wan_tpu.wan.lora import loaded_loras
from wan_tpu.wan.transformer_loading import load_transformer

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=8, out_channels=4,
              text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, image_dim=20, added_kv_proj_dim=32)
DIM, FFN, RANK, ALPHA = 32, 48, 4, 8.0
TOL = 1e-5
# (Wan module name, diffusers module name, (out, in)) inside a block — transcribed from diffusers'
# `_convert_non_diffusers_wan_lora_to_diffusers`.
BLOCK_LINEARS = [(f"self_attn.{w}", f"attn1.{d}", (DIM, DIM)) for w, d in
                 zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"])]
BLOCK_LINEARS += [(f"cross_attn.{w}", f"attn2.{d}", (DIM, DIM)) for w, d in
                  zip(["q", "k", "v", "o", "k_img", "v_img"], ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"])]
BLOCK_LINEARS += [("ffn.0", "ffn.net.0.proj", (FFN, DIM)), ("ffn.2", "ffn.net.2", (DIM, FFN))]
TOP_LINEARS = [("time_projection.1", "condition_embedder.time_proj", (6 * DIM, DIM)),
               ("head.head", "proj_out", (16, DIM)),
               ("text_embedding.0", "condition_embedder.text_embedder.linear_1", (DIM, 24)),
               ("time_embedding.2", "condition_embedder.time_embedder.linear_2", (DIM, DIM)),
               ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj", (20, 20))]


def rng_tensor(g, *shape, std=0.2):
    return torch.randn(*shape, generator=g) * std


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("base") / "transformer"
    model.save_pretrained(folder)
    return str(folder)


def make_lora(path, fmt, seed, diff_b=True, top=True):
    """A random rank-4 LoRA over every block linear (and, for kohya/PEFT, top-level layers) in `fmt`."""
    g = torch.Generator().manual_seed(seed)
    entries, metadata = {}, None
    modules = [(f"blocks.{i}.{w}", f"blocks.{i}.{d}", shape) for i in range(2) for w, d, shape in BLOCK_LINEARS]
    if top:
        modules += TOP_LINEARS
    for wan, dif, (out, inp) in modules:
        down, up, bias = rng_tensor(g, RANK, inp), rng_tensor(g, out, RANK), rng_tensor(g, out)
        if fmt == "peft":
            k = f"transformer.{dif}"
            entries |= {f"{k}.lora_A.weight": down, f"{k}.lora_B.weight": up}
            if diff_b:
                entries[f"{k}.lora_B.bias"] = bias
            continue
        k = f"diffusion_model.{wan}" if fmt == "kohya" else f"lora_unet_{wan.replace('.', '_')}"
        entries |= {f"{k}.lora_down.weight": down, f"{k}.lora_up.weight": up}
        if wan.startswith("blocks."):  # diffusers' converter reads alpha only inside blocks
            entries[f"{k}.alpha"] = torch.tensor(ALPHA)
        if diff_b:
            entries[f"{k}.diff_b"] = bias
    if fmt == "peft":
        targets = sorted({k.split(".lora_")[0].removeprefix("transformer.") for k in entries})
        config = {"r": RANK, "lora_alpha": ALPHA, "target_modules": targets, "lora_bias": diff_b}
        metadata = {"format": "pt", "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    save_file({k: v.contiguous() for k, v in entries.items()}, str(path), metadata=metadata)
    return str(path)


def inputs():
    g = torch.Generator().manual_seed(3)
    # 512 text tokens: diffusers' I2V attention takes everything before the last 512 context tokens as image tokens.
    return (torch.randn(1, 8, 2, 4, 4, generator=g), torch.tensor([500.0]), torch.randn(1, 512, 24, generator=g),
            torch.randn(1, 5, 20, generator=g))


def diffusers_output(folder, loras):
    model = WanTransformer3DModel.from_pretrained(folder).eval()
    pipe = DiffusersWanPipeline(tokenizer=None, text_encoder=None, transformer=model, vae=None, scheduler=None)
    names = []
    for i, (path, _) in enumerate(loras):
        pipe.load_lora_weights(path, adapter_name=f"a{i}")
        names.append(f"a{i}")
    pipe.set_adapters(names, [s for _, s in loras])
    with torch.no_grad():
        return model(*inputs()[:3], encoder_hidden_states_image=inputs()[3]).sample.numpy()


def our_output(dit):
    return np.asarray(dit(*(jnp.asarray(a.numpy()) for a in inputs())))


def flat(dit):
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(dit))}


def rel_err(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("fmt", ["kohya", "peft", "comfy"])
def test_each_format_matches_diffusers(base, tmp_path, fmt):
    path = make_lora(tmp_path / f"{fmt}.safetensors", fmt, seed=1, diff_b=fmt != "comfy", top=fmt != "comfy")
    ref = diffusers_output(base, [(path, 0.8)])
    dit = load_transformer(base, jnp.float32)
    plain = our_output(dit)
    info = dit.load_lora(path, scale=0.8)
    out = our_output(dit)
    assert rel_err(out, ref) <= TOL, f"{fmt}: {rel_err(out, ref):.2e}"
    assert rel_err(plain, ref) > 1e-2  # the LoRA changes the output
    # kohya: a LoRA and a diff_b per layer; PEFT's lora_B.bias is part of its LoRA.
    assert info.tensors == (2 * len(BLOCK_LINEARS) + (0 if fmt == "comfy" else len(TOP_LINEARS))) * (1 + (fmt == "kohya"))


def test_two_stacked_loras_with_scales_match_diffusers(base, tmp_path):
    a = make_lora(tmp_path / "a.safetensors", "kohya", seed=2)
    b = make_lora(tmp_path / "b.safetensors", "peft", seed=3)
    ref = diffusers_output(base, [(a, 0.7), (b, -1.3)])
    dit = load_transformer(base, jnp.float32)
    dit.load_lora(a, 0.7)
    dit.load_lora(b, -1.3)
    assert rel_err(our_output(dit), ref) <= TOL


def test_merge_programs_compile_without_autotuning_on_gpus(base, tmp_path, monkeypatch):
    """The merge runs once per load: on a GPU its programs compile with autotuning off and no CUDA graph. Here
    the GPU's options are given on the CPU (XLA takes them): the programs carry them and the merged weights are
    those of the merge compiled without them, bit for bit."""
    from wan_tpu.runtime import executable_cache
    from wan_tpu.wan import lora as lora_lib

    a = make_lora(tmp_path / "a.safetensors", "kohya", seed=5)
    assert executable_cache.run_once() is None  # on the CPU: no options
    lora_lib._add_fn.cache_clear()
    plain = load_transformer(base, jnp.float32)
    plain.load_lora(a, 0.6)
    seen, jit = [], lora_lib.jax.jit

    def recording_jit(fn, **kwargs):
        if getattr(fn, "func", None) in (lora_lib._add, lora_lib._add_quantized):
            seen.append(kwargs.get("compiler_options"))
        return jit(fn, **kwargs)

    monkeypatch.setattr(executable_cache, "run_once", lambda: executable_cache.RUN_ONCE)
    monkeypatch.setattr(lora_lib.jax, "jit", recording_jit)
    lora_lib._add_fn.cache_clear()
    try:
        tuned = load_transformer(base, jnp.float32)
        tuned.load_lora(a, 0.6)
    finally:
        lora_lib._add_fn.cache_clear()
    assert seen and all(options == executable_cache.RUN_ONCE for options in seen)
    for k, v in flat(tuned).items():
        np.testing.assert_array_equal(v, flat(plain)[k], err_msg=k)


def test_unload_restores_the_weights_bit_exactly(base, tmp_path):
    a = make_lora(tmp_path / "a.safetensors", "kohya", seed=4)
    for dtype in (jnp.float32, jnp.bfloat16):
        original = flat(load_transformer(base, dtype))
        dit = load_transformer(base, dtype)
        dit.load_lora(a, 1.0)
        dit.load_lora(a, 0.37)
        assert [(i.path, i.scale) for i in loaded_loras(dit)] == [(a, 1.0), (a, 0.37)]
        assert any(not np.array_equal(v, original[k]) for k, v in flat(dit).items())
        dit.unload_lora()
        assert loaded_loras(dit) == []
        for k, v in flat(dit).items():
            assert v.dtype == original[k].dtype and np.array_equal(v, original[k]), k


def test_unload_refuses_a_checkpoint_changed_since_the_load(base, tmp_path):
    import os
    import shutil

    folder = tmp_path / "transformer"
    shutil.copytree(base, folder)
    dit = load_transformer(str(folder), jnp.float32)
    dit.load_lora(make_lora(tmp_path / "a.safetensors", "kohya", seed=7), 1.0)
    weights = folder / "diffusion_pytorch_model.safetensors"
    os.utime(weights, ns=(0, 0))
    with pytest.raises(WanInputError, match="changed on disk since the transformer was loaded"):
        dit.unload_lora()
    assert len(loaded_loras(dit)) == 1


def test_unload_is_exact_for_a_model_not_loaded_from_a_checkpoint(tmp_path):
    """Presets and random models have no file to re-read: their touched weights are kept on the host."""
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.loading.random_init import random_module
    from wan_tpu.wan.transformer import WanTransformer

    cfg = VARIANTS["tiny"].transformer
    dit = random_module(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), 0)
    original = flat(dit)
    g = torch.Generator().manual_seed(0)
    d = cfg.inner_dim
    path = tmp_path / "l.safetensors"
    save_file({"diffusion_model.blocks.1.ffn.0.lora_down.weight": rng_tensor(g, 4, d),
               "diffusion_model.blocks.1.ffn.0.lora_up.weight": rng_tensor(g, cfg.ffn_dim, 4),
               "diffusion_model.blocks.1.ffn.0.alpha": torch.tensor(2.0)}, str(path))
    dit.load_lora(path)
    changed = flat(dit)["blocks.ffn.proj_in.kernel"]
    assert np.array_equal(changed[0], original["blocks.ffn.proj_in.kernel"][0])  # layer 0 untouched
    assert not np.array_equal(changed[1], original["blocks.ffn.proj_in.kernel"][1])
    dit.unload_lora()
    for k, v in flat(dit).items():
        assert np.array_equal(v, original[k]), k


def numpy_expected(base, entries, scale, tmp_path):
    """The checkpoint with W + scale·(alpha/r)·up@down, + scale·diff, + scale·diff_b applied in float64."""
    model = WanTransformer3DModel.from_pretrained(base)
    sd = {k: v.double() for k, v in model.state_dict().items()}
    for target, kind, tensors in entries:
        if kind == "lora":
            down, up, alpha = tensors
            r = down.shape[0]
            delta = (up.reshape(up.shape[0], r).double() @ down.reshape(r, -1).double()) * (alpha / r)
            sd[f"{target}.weight"] += scale * delta.reshape(sd[f"{target}.weight"].shape)
        else:
            sd[target] += scale * tensors.double()
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    folder = tmp_path / "expected"
    model.save_pretrained(folder)
    return flat(load_transformer(str(folder), jnp.float32))


def test_diff_norm_and_conv_entries_match_a_numpy_merge(base, tmp_path):
    """`diff` / `diff_b` on linears, norms, modulation tables, the head; a Conv3d LoRA; ComfyUI names with diff_b."""
    g = torch.Generator().manual_seed(5)
    file, entries = {}, []

    def add(key, target, kind, *tensors):
        for suffix, t in zip(("diff",) if kind == "diff" else ("diff_b",) if kind == "diff_b" else
                             ("lora_down.weight", "lora_up.weight", "alpha"), tensors):
            file[f"{key}.{suffix}"] = t
        if kind == "lora":
            entries.append((target, "lora", (tensors[0], tensors[1], float(tensors[2]))))
        else:
            entries.append((f"{target}.{'weight' if kind == 'diff' else 'bias'}", kind, tensors[0]))

    add("diffusion_model.blocks.0.self_attn.q", "blocks.0.attn1.to_q", "diff", rng_tensor(g, DIM, DIM))
    add("diffusion_model.blocks.0.self_attn.q", "blocks.0.attn1.to_q", "diff_b", rng_tensor(g, DIM))
    add("diffusion_model.blocks.1.norm3", "blocks.1.norm2", "diff", rng_tensor(g, DIM))
    add("diffusion_model.blocks.1.norm3", "blocks.1.norm2", "diff_b", rng_tensor(g, DIM))
    add("diffusion_model.blocks.0.self_attn.norm_q", "blocks.0.attn1.norm_q", "diff", rng_tensor(g, DIM))
    add("diffusion_model.blocks.1.cross_attn.norm_k_img", "blocks.1.attn2.norm_added_k", "diff", rng_tensor(g, DIM))
    file["diffusion_model.blocks.1.modulation.diff"] = m = rng_tensor(g, 1, 6, DIM)
    entries.append(("blocks.1.scale_shift_table", "diff", m))
    file["diffusion_model.head.modulation.diff"] = m = rng_tensor(g, 1, 2, DIM)
    entries.append(("scale_shift_table", "diff", m))
    add("diffusion_model.head.head", "proj_out", "diff", rng_tensor(g, 16, DIM))
    add("diffusion_model.patch_embedding", "patch_embedding", "lora", rng_tensor(g, RANK, 8, 1, 2, 2),
        rng_tensor(g, DIM, RANK, 1, 1, 1), torch.tensor(ALPHA))
    add("lora_unet_blocks_1_cross_attn_k_img", "blocks.1.attn2.add_k_proj", "lora", rng_tensor(g, RANK, DIM),
        rng_tensor(g, DIM, RANK), torch.tensor(ALPHA))
    add("lora_unet_blocks_1_cross_attn_k_img", "blocks.1.attn2.add_k_proj", "diff_b", rng_tensor(g, DIM))
    add("transformer.blocks.0.ffn.net.2", "blocks.0.ffn.net.2", "diff", rng_tensor(g, DIM, FFN))
    path = tmp_path / "mixed.safetensors"
    save_file({k: v.contiguous() for k, v in file.items()}, str(path))

    expected = numpy_expected(base, entries, 0.6, tmp_path)
    dit = load_transformer(base, jnp.float32)
    dit.load_lora(path, 0.6)
    got = flat(dit)
    original = flat(load_transformer(base, jnp.float32))
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-6 * np.abs(expected[k]).max(), err_msg=k)
    changed = {k for k in got if not np.array_equal(got[k], original[k])}
    assert changed == {k for k in expected if not np.array_equal(expected[k], original[k])}


@pytest.mark.parametrize("entries,match", [
    ({"diffusion_model.blocks.5.self_attn.q.lora_down.weight": (RANK, DIM),
      "diffusion_model.blocks.5.self_attn.q.lora_up.weight": (DIM, RANK)}, "blocks.5.self_attn.q.lora_down.weight' .* matches no layer"),
    ({"diffusion_model.blocks.0.self_attn.qq.diff": (DIM, DIM)}, "self_attn.qq.diff' .* matches no layer"),
    ({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": (RANK, DIM),
      "diffusion_model.blocks.0.self_attn.q.lora_up.weight": (DIM, RANK + 1)}, "lora_down.weight.* do not fit layer"),
    ({"diffusion_model.blocks.0.ffn.0.lora_down.weight": (RANK, DIM + 1),
      "diffusion_model.blocks.0.ffn.0.lora_up.weight": (FFN, RANK)}, "ffn.0.lora_down.weight.* do not fit layer"),
    ({"diffusion_model.blocks.0.ffn.0.lora_down.weight": (RANK, DIM)}, "'blocks.0.ffn.0' has down but not its pair"),
    ({"diffusion_model.blocks.0.norm3.diff": (DIM + 2,)}, "norm3.diff' .* has shape \\(34,\\)"),
    ({"diffusion_model.blocks.0.self_attn.q.dora_scale": (1, DIM)}, "dora_scale' is a DoRA entry"),
])
def test_bad_lora_files_raise_one_line_errors_naming_the_key(base, tmp_path, entries, match):
    path = tmp_path / "bad.safetensors"
    save_file({k: torch.zeros(s) for k, s in entries.items()}, str(path))
    dit = load_transformer(base, jnp.float32)
    original = flat(dit)
    with pytest.raises(WanInputError, match=match) as e:
        dit.load_lora(path)
    assert "\n" not in str(e.value)
    for k, v in flat(dit).items():  # nothing was changed by a rejected file
        assert np.array_equal(v, original[k])


def test_non_safetensors_files_are_refused(base, tmp_path):
    dit = load_transformer(base, jnp.float32)
    pt = tmp_path / "lora.pt"
    torch.save({"a": torch.zeros(2)}, pt)
    with pytest.raises(WanInputError, match="lora.pt is not a .safetensors file"):
        dit.load_lora(pt)
    fake = tmp_path / "fake.safetensors"
    fake.write_bytes(pt.read_bytes())
    with pytest.raises(WanInputError, match="fake.safetensors: corrupt safetensors header"):
        dit.load_lora(fake)
    with pytest.raises(WanInputError, match="does not exist"):
        dit.load_lora(tmp_path / "missing.safetensors")
    with pytest.raises(WanInputError, match="scale must be a finite number"):
        dit.load_lora(make_lora(tmp_path / "ok.safetensors", "kohya", seed=0), scale=math.nan)


def test_loading_reuses_the_compiled_denoise_step(tmp_path):
    """A merged LoRA changes values only: the compiled step runs again without a retrace; unload is exact."""
    from wan_tpu.wan import denoise as denoise_lib
    from wan_tpu.wan.pipeline import WanPipeline

    pipe = WanPipeline.from_pretrained("tiny", dtype=jnp.float32)
    d = pipe.variant.transformer.inner_dim
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "l.safetensors"
    save_file({"diffusion_model.blocks.0.cross_attn.o.lora_down.weight": rng_tensor(g, 4, d, std=1.0),
               "diffusion_model.blocks.0.cross_attn.o.lora_up.weight": rng_tensor(g, d, 4, std=1.0),
               "diffusion_model.blocks.0.cross_attn.o.diff_b": rng_tensor(g, d)}, str(path))
    kwargs = dict(num_inference_steps=2, output_type="latent", progress=False)
    before = np.asarray(pipe("a cat", **kwargs))
    compiled = denoise_lib._step_jit._cache_size()
    pipe.load_lora_weights(path, scale=1.0)
    with_lora = np.asarray(pipe("a cat", **kwargs))
    pipe.unload_lora_weights()
    after = np.asarray(pipe("a cat", **kwargs))
    assert denoise_lib._step_jit._cache_size() == compiled
    assert not np.allclose(with_lora, before)
    assert np.array_equal(after, before)


def test_merged_weights_keep_their_sharding(base, tmp_path):
    import wan_tpu

    path = make_lora(tmp_path / "a.safetensors", "kohya", seed=6)
    mesh = wan_tpu.make_mesh(2, 2, 2)
    sharded = load_transformer(base, jnp.float32, mesh=mesh)
    plain = load_transformer(base, jnp.float32)
    shardings = {".".join(map(str, k)): v.get_value().sharding for k, v in nnx.to_flat_state(nnx.state(sharded))}
    sharded.load_lora(path, 0.9)
    plain.load_lora(path, 0.9)
    expected = flat(plain)
    for k, v in nnx.to_flat_state(nnx.state(sharded)):
        name = ".".join(map(str, k))
        assert v.get_value().sharding == shardings[name], name
        np.testing.assert_allclose(np.asarray(v.get_value()), expected[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert rel_err(our_output(sharded), our_output(plain)) <= TOL
    sharded.unload_lora()
    original = flat(load_transformer(base, jnp.float32))
    for k, v in nnx.to_flat_state(nnx.state(sharded)):
        name = ".".join(map(str, k))
        assert v.get_value().sharding == shardings[name] and np.array_equal(np.asarray(v.get_value()), original[name])


def test_a14b_takes_one_lora_per_expert(tmp_path):
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.wan.pipeline import WanPipeline
    from wan_tpu.wan.presets import save_diffusers_checkpoint

    cfg = VARIANTS["tiny"].transformer
    folder = tmp_path / "a14b"
    save_diffusers_checkpoint(str(folder), transformer=cfg, transformer_2=cfg, vae=TINY_VAE, boundary_ratio=0.9)
    g = torch.Generator().manual_seed(0)
    d = cfg.inner_dim

    def lora(name, block):
        path = tmp_path / name
        save_file({f"diffusion_model.blocks.{block}.self_attn.v.lora_down.weight": rng_tensor(g, 4, d),
                   f"diffusion_model.blocks.{block}.self_attn.v.lora_up.weight": rng_tensor(g, d, 4)}, str(path))
        return path

    high, low, both = lora("high.safetensors", 0), lora("low.safetensors", 1), lora("both.safetensors", 1)
    pipe = WanPipeline.from_pretrained(str(folder), dtype=jnp.float32)
    pipe.load_lora_weights(high, scale=0.5, expert="high")  # before the experts load: applied when they do
    pipe.load_lora_weights(low, scale=1.5, expert="low")
    pipe.load_lora_weights(both, scale=0.3)
    expected = {}
    for name, loras in (("transformer", [(high, 0.5), (both, 0.3)]), ("transformer_2", [(low, 1.5), (both, 0.3)])):
        dit = load_transformer(str(folder / name), jnp.float32)
        for path, scale in loras:
            dit.load_lora(path, scale)
        expected[name] = flat(dit)
    for name in ("transformer", "transformer_2"):
        got = flat(pipe.component(name))
        for k in got:
            assert np.array_equal(got[k], expected[name][k]), (name, k)
    pipe.unload_lora_weights()
    for name in ("transformer", "transformer_2"):
        original = flat(load_transformer(str(folder / name), jnp.float32))
        assert all(np.array_equal(v, original[k]) for k, v in flat(pipe.component(name)).items())
    with pytest.raises(WanInputError, match="expert must be 'high', 'low' or None"):
        pipe.load_lora_weights(high, expert="middle")
    t2v = WanPipeline.from_pretrained("tiny")
    with pytest.raises(WanInputError, match="has one transformer"):
        t2v.load_lora_weights(high, expert="low")
