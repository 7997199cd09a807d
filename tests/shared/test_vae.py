"""WanVAE vs diffusers' AutoencoderKLWan (float32, CPU) on tiny random checkpoints of both structures.

Wan 2.1-style (`tiny`: 8× spatial, plain blocks) and Wan 2.2-style (`tiny-2.2`: residual blocks,
AvgDown3D/DupUp3D shortcuts, 2×2 patchify, 16× spatial). Every parameter is randomised, norms' gamma
included, at a scale that keeps activations O(1); the reference is saved with `save_pretrained` and
read back through `load_vae`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.video_processor import VideoProcessor
from flax import nnx

from wan_tpu.configs.vae import VAE_PRESETS, WanVAEConfig, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.vae import model as vae_module
from wan_tpu.vae.loading import load_vae
from wan_tpu.vae.model import WanVAE, frames_to_uint8

PARITY_TOL = 1e-5  # max |ours - diffusers| / max |diffusers|, float32
# (height, width) in pixels per variant: multiples of 16, not of 32
SIZES = {"tiny": (16, 48), "tiny-2.2": (48, 16)}


def save_random_vae(path, preset, seed=0):
    cfg = VAE_PRESETS[preset]
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "clip_output"}
    torch.manual_seed(seed)
    ref = AutoencoderKLWan(**{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "gamma" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(1, p[0].numel()) ** 0.5 if p.dim() > 1 else 0.05))
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="module", params=["tiny", "tiny-2.2"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = save_random_vae(path, request.param)
    return request.param, ref, load_vae(str(path))


def rel_err(ours, ref):
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else ref
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


def test_chunk_steps_trace_once_whatever_the_frame_count(pair, monkeypatch):
    name, _, vae = pair
    calls = {"stem": 0, "levels": 0, "encoder": 0}
    stem, levels, enc = type(vae.decoder).stem, type(vae.decoder).levels, type(vae.encoder).rest

    def count(key, fn):
        def wrapped(self, *a, **k):
            calls[key] += 1
            return fn(self, *a, **k)
        return wrapped

    monkeypatch.setattr(type(vae.decoder), "stem", count("stem", stem))
    monkeypatch.setattr(type(vae.decoder), "levels", count("levels", levels))
    monkeypatch.setattr(type(vae.encoder), "rest", count("encoder", enc))
    s = vae.config.scale_factor_spatial
    h, w = SIZES[name]
    jax.clear_caches()  # count from scratch; the parity test below reuses these compilations
    for frames in (5, 9, 13):
        vae.decode(jnp.ones((1, vae.config.z_dim, (frames - 1) // 4 + 1, h // s, w // s)) * 0.1, tiling=False)
        vae.encode(jnp.zeros((1, 3, frames, h, w)))
    # levels/encoder: one trace for the first chunk, one for the step shared by every later chunk and every
    # length; stem: one abstract trace for the shapes of its start caches, one for its single program
    assert calls == {"stem": 2, "levels": 2, "encoder": 2}


def test_decode_compiles_one_program_per_strip_width():
    """The stem is one program for every latent frame (given zero start caches); strips of one width share
    their programs (traced crop offsets): 2 strips → 2 strip programs (first frame, the rest), 4 strips →
    4 (outer and middle widths), as many as with one strip per width."""
    vae = WanVAE(VAE_PRESETS["tiny"], dtype=jnp.float32, rngs=nnx.Rngs(3))
    z = jnp.ones((1, vae.config.z_dim, 2, 3, 12 * vae.decoder.halos[0])) * 0.1  # no other test decodes this shape
    for strips, programs in ((2, 2), (4, 4)):
        strip, stem = vae_module._decode_strip._cache_size(), vae_module._decode_stem._cache_size()
        vae.decode(z, strips=strips)
        assert vae_module._decode_strip._cache_size() - strip == programs, strips
        assert vae_module._decode_stem._cache_size() - stem == (1 if strips == 2 else 0)


def test_compile_decode_leaves_nothing_big_to_compile():
    """`compile_decode` (abstract latents, e.g. from a background thread) compiles exactly what `decode` then
    runs: the decode itself compiles no stem or strip program."""
    vae = WanVAE(VAE_PRESETS["tiny"], dtype=jnp.float32, rngs=nnx.Rngs(4))
    shape = (1, vae.config.z_dim, 3, 3, 6 * vae.decoder.halos[0])
    out = vae.compile_decode(shape)
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiled.append(kw.get("fun_name"))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    video = vae.decode(jnp.full(shape, 0.1))
    assert (out.shape, out.dtype) == (video.shape, video.dtype)
    assert not {"jit(_decode_stem)", "jit(_decode_strip)"} & set(compiled), compiled


def test_compile_decode_on_a_mesh_leaves_nothing_to_compile_and_stops_when_asked():
    """On a 4-device mesh `compile_decode` walks the programs one after the other with their output
    placements: `decode` then compiles no stem or strip program, and gives what the walk said (shape,
    dtype, placement). With its stop set, the walk compiles nothing and raises `Cancelled`."""
    import threading

    from wan_tpu.parallel.mesh import make_mesh
    from wan_tpu.runtime.compile_ahead import Cancelled, SideBySide

    mesh = make_mesh(1, 4, 1, devices=jax.devices()[:4])
    vae = WanVAE(VAE_PRESETS["tiny"], dtype=jnp.float32, rngs=nnx.Rngs(5))
    shape = (1, vae.config.z_dim, 3, 2, 4 * vae.decoder.halos[0])
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled), SideBySide(stop) as compiles:
        vae.compile_decode(shape, mesh=mesh, compiles=compiles)
    out = vae.compile_decode(shape, mesh=mesh)
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiled.append(kw.get("fun_name"))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    video = vae.decode(jnp.full(shape, 0.1), mesh=mesh)
    assert not {"jit(_decode_stem)", "jit(_decode_strip)"} & set(compiled), compiled
    assert (out.shape, out.dtype, out.sharding) == (video.shape, video.dtype, video.sharding)
    assert np.isfinite(np.asarray(video)).all()  # values vs one device: test_width_sharded_decode_equals_unsharded


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_encode_and_decode_match_diffusers(pair, frames):
    name, ref, vae = pair
    h, w = SIZES[name]
    video = torch.rand(1, 3, frames, h, w, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    z = torch.randn(1, ref.config.z_dim, (frames - 1) // 4 + 1, h // vae.config.scale_factor_spatial,
                    w // vae.config.scale_factor_spatial, generator=torch.Generator().manual_seed(frames + 1))
    with torch.no_grad():
        mean = ref.encode(video).latent_dist.mode()
        sample = ref.decode(z).sample
    ours_mean = vae.encode(jnp.asarray(video.numpy()))
    ours_sample = vae.decode(jnp.asarray(z.numpy()), tiling=False)
    assert ours_mean.shape == tuple(mean.shape) and ours_sample.shape == tuple(sample.shape)
    assert rel_err(ours_mean, mean) <= PARITY_TOL
    assert rel_err(ours_sample, sample) <= PARITY_TOL


def test_tiled_decode_matches_diffusers_tiled_decode(pair):
    name, ref, vae = pair
    s = vae.config.scale_factor_spatial
    # 2.1-style: two rows of tiles (vertical blend); 2.2-style: two columns (horizontal blend, patchified)
    latent, size, stride = ((8, 2), (6 * s, 2 * s), (4 * s, 2 * s)) if name == "tiny" else ((2, 8), (2 * s, 6 * s), (2 * s, 4 * s))
    z = torch.randn(1, ref.config.z_dim, 2, *latent, generator=torch.Generator().manual_seed(3))
    ref.enable_tiling(size[0], size[1], stride[0], stride[1])
    try:
        with torch.no_grad():
            expected = ref.decode(z).sample
    finally:
        ref.disable_tiling()
    tiled = vae.decode(jnp.asarray(z.numpy()), tiling=True, tile_sample_size=size, tile_sample_stride=stride)
    # Random weights give every pixel the whole frame as context (mid-block attention, deep receptive
    # field), so tiles of a tiny latent are far from the untiled decode; diffusers' tiling is the reference.
    assert rel_err(tiled, expected) <= PARITY_TOL


TILED_TOL = 1e-2  # tiled vs untiled, max |Δ| / max |ref| and mean |Δ| / mean |ref|


def test_tiled_decode_is_close_to_untiled_for_a_local_decoder(tmp_path):
    """Tiling assumes what trained VAEs show: a pixel depends on its neighbourhood. Random weights break
    that twice, so this decoder is made local: the mid block's attention (global within a frame) gets a
    zero output projection, and every 3x3 spatial tap but the centre is scaled by `alpha`, so a pixel's
    dependence on one d pixels away falls like alpha^d. Pixels within a few of a tile's cut still differ,
    and diffusers' linear blend weighs them by their distance over the overlap: the error is ~alpha·depth/overlap."""
    alpha = 0.02
    ref = save_random_vae(tmp_path, "tiny", seed=1)
    with torch.no_grad():
        for name, p in ref.decoder.named_parameters():
            if name.startswith("mid_block.attentions.0.proj"):
                p.zero_()
            elif p.dim() >= 4 and p.shape[-2:] == (3, 3):
                centre = p[..., 1, 1].clone()
                p.mul_(alpha)
                p[..., 1, 1] = centre
    ref.save_pretrained(tmp_path)
    vae = load_vae(str(tmp_path))
    # 48x80 pixels in 3x3 tiles of 32x48 every 16x32: 16-pixel overlaps both ways
    z = torch.randn(1, ref.config.z_dim, 2, 6, 10, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        untiled = ref.decode(z).sample.numpy()
    tiled = np.asarray(vae.decode(jnp.asarray(z.numpy()), tiling=True, tile_sample_size=(32, 48), tile_sample_stride=(16, 32)))
    err = np.abs(tiled - untiled)
    assert err.max() / np.abs(untiled).max() <= TILED_TOL
    assert err.mean() / np.abs(untiled).mean() <= TILED_TOL


def test_strips_decode_exactly_like_diffusers(pair):
    """Strips are exact (halos cover every 3x3 conv after the mid block), unlike tiles: strips narrower
    than the halo included, the decode equals diffusers' untiled one."""
    name, ref, vae = pair
    z = torch.randn(1, ref.config.z_dim, 2, 2, 2 * max(vae.decoder.halos) + 3, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = ref.decode(z).sample
    # 3 strips: the middle one reads halos on both sides, the outer ones are clipped at the frame
    assert rel_err(vae.decode(jnp.asarray(z.numpy()), tiling=False, strips=3), expected) <= PARITY_TOL
    with pytest.raises(WanInputError, match="strips must be between 1 and"):
        vae.decode(jnp.asarray(z.numpy()), strips=z.shape[-1] + 1)


def test_decode_tiles_by_itself_only_when_memory_is_short(pair, monkeypatch):
    name, _, vae = pair
    s = vae.config.scale_factor_spatial
    z = jnp.ones((1, vae.config.z_dim, 2, *(n // s for n in SIZES[name]))) * 0.1
    need = vae._decode_bytes(z)
    tiled = []
    real = WanVAE._tiled_decode
    monkeypatch.setattr(WanVAE, "_tiled_decode", lambda self, *a: tiled.append(1) or real(self, *a))
    monkeypatch.setattr(vae_module, "_free_device_bytes", lambda: 2 * need)
    vae.decode(z)
    assert tiled == []
    monkeypatch.setattr(vae_module, "_free_device_bytes", lambda: need // 2)
    vae.decode(z)
    assert tiled == [1]
    # the estimate covers at least the carried caches and the output
    assert need > z.size * 4 * s * s * 4


def test_decode_takes_more_strips_before_tiles(pair, monkeypatch):
    """Short of memory, `decode` first narrows its exact strips; it tiles only when 8 strips don't fit."""
    name, _, vae = pair
    z = jnp.ones((1, vae.config.z_dim, 2, 2, 16 * vae.decoder.halos[0])) * 0.1
    used = []
    monkeypatch.setattr(WanVAE, "_decode", lambda self, z, wmesh, raw=False, strips=1: used.append(strips) or z)
    monkeypatch.setattr(WanVAE, "_tiled_decode", lambda self, *a: used.append("tiled") or z)
    need = {n: vae._decode_bytes(z, n) for n in (2, 3, 4, 6, 8)}
    assert need[2] > need[4] > need[8]
    fits = {n: 1.001 * b / 0.9 for n, b in need.items()}  # decode wants 10% of free memory spare
    for free, picked in [(None, 2), (fits[2], 2), (fits[4], 4), (fits[8], 8), (need[8] / 2, "tiled")]:
        monkeypatch.setattr(vae_module, "_free_device_bytes", lambda: free)
        vae.decode(z)
        assert used.pop() == picked, (free, picked)


def test_width_sharded_decode_equals_unsharded(pair):
    name, _, vae = pair
    if name == "tiny":
        pytest.skip("width sharding is checked on the 2.2 structure (patchify, residual shortcuts); one keeps CI fast")
    mesh = jax.make_mesh((8,), ("w",))
    z = jax.random.normal(jax.random.key(4), (1, vae.config.z_dim, 3, 2, 8))
    single = vae.decode(z, tiling=False)
    sharded = vae.decode(z, mesh=mesh)
    assert len(sharded.sharding.device_set) == 8
    assert rel_err(sharded, np.asarray(single)) <= 1e-5


def test_bad_inputs_raise_one_line_errors(pair):
    name, _, vae = pair
    s = vae.config.scale_factor_spatial
    cases = [
        (vae.encode, jnp.zeros((1, 3, 4, s, s)), "4n+1"),
        (vae.encode, jnp.zeros((1, 4, 5, s, s)), "(B, 3, T, H, W)"),
        (vae.encode, jnp.zeros((1, 3, 5, s, s + s // 2)), f"divisible by {s}"),
        (vae.decode, jnp.zeros((1, vae.config.z_dim + 1, 2, 2, 2)), f"(B, {vae.config.z_dim}, F, h, w)"),
        (lambda z: vae.decode(z, tiling=True, tile_sample_size=(s, s), tile_sample_stride=(2 * s, s)),
         jnp.zeros((1, vae.config.z_dim, 2, 2, 2)), "stride ≤ size"),
    ]
    for fn, x, words in cases:
        with pytest.raises(WanInputError, match=None) as info:
            fn(x)
        assert words in str(info.value) and "\n" not in str(info.value)


def test_latent_scaling_and_uint8_match_the_diffusers_pipeline(pair):
    name, ref, vae = pair
    z = torch.randn(1, ref.config.z_dim, 2, 3, 4)
    mean = torch.tensor(ref.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(ref.config.latents_std).view(1, -1, 1, 1, 1)
    np.testing.assert_allclose(vae.denormalize_latents(jnp.asarray(z.numpy())), (z / inv_std + mean).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(vae.normalize_latents(jnp.asarray(z.numpy())), ((z - mean) * inv_std).numpy(), rtol=1e-6, atol=1e-6)
    video = torch.rand(1, 3, 3, 4, 5) * 2.2 - 1.1
    expected = (VideoProcessor().postprocess_video(video, output_type="np") * 255).round().astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(frames_to_uint8(jnp.asarray(video.numpy()))), expected)


WAN22_JSON = {
    "_class_name": "AutoencoderKLWan", "_diffusers_version": "0.35.0.dev0", "attn_scales": [], "base_dim": 160,
    "clip_output": False, "decoder_base_dim": 256, "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "in_channels": 12,
    "is_residual": True, "latents_mean": list(VAE_PRESETS["wan2.2"].latents_mean),
    "latents_std": list(VAE_PRESETS["wan2.2"].latents_std), "num_res_blocks": 2, "out_channels": 12,
    "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True], "z_dim": 48,
}


def test_config_from_json():
    assert config_from_json(WAN22_JSON) == VAE_PRESETS["wan2.2"]
    wan21 = {**WAN22_JSON, "base_dim": 96, "decoder_base_dim": None, "in_channels": 3, "is_residual": False,
             "latents_mean": list(VAE_PRESETS["wan2.1"].latents_mean), "latents_std": list(VAE_PRESETS["wan2.1"].latents_std),
             "out_channels": 3, "patch_size": None, "scale_factor_spatial": 8, "z_dim": 16}
    del wan21["clip_output"]
    assert config_from_json(wan21) == VAE_PRESETS["wan2.1"]
    with pytest.raises(WanInputError, match="unknown fields.*'foo'"):
        config_from_json({**WAN22_JSON, "foo": 1})
    with pytest.raises(WanInputError, match="latents_mean"):
        config_from_json({**WAN22_JSON, "z_dim": 16})
    with pytest.raises(WanInputError, match="scale_factor_spatial"):
        WanVAEConfig(scale_factor_spatial=16)


def test_presets_build_like_diffusers():
    for name in ("wan2.1", "wan2.2"):
        cfg = VAE_PRESETS[name]
        kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "clip_output"}
        with torch.device("meta"):
            ref = AutoencoderKLWan(**{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()})
        ours = nnx.eval_shape(lambda c=cfg: WanVAE(c, rngs=nnx.Rngs(0)))
        assert sum(x.size for x in jax.tree.leaves(nnx.state(ours))) == sum(p.numel() for p in ref.parameters())


def test_caches_are_updated_in_place(pair):
    """The decoder's carried caches (three-slot rings, written before they are read) are updated in
    place inside the compiled strip step: XLA copies none of them. The earlier shift (read frames t-1
    and t, then replace) made XLA copy every cache once per frame, as much memory again as all of them."""
    import re

    name, _, vae = pair
    s = vae.config.scale_factor_spatial
    z = jnp.ones((1, vae.config.z_dim, 2, *(n // s for n in SIZES[name])), jnp.float32) * 0.1
    graphdef, state = nnx.split(vae)
    _, mid = vae_module._decode_stem(graphdef, state, z[:, :, :1], None, None)
    (lo, hi), widths, offsets = vae.decoder.strip_plan(z.shape[-1], 0, z.shape[-1])
    caches, _ = vae_module._decode_strip(graphdef, state, mid[:, :, :, lo:hi], None, None, False, widths, offsets)
    rings = {tuple(x.shape) for x in jax.tree.leaves(caches) if x.ndim == 4}
    assert rings, "no ring caches found"
    hlo = vae_module._decode_strip.lower(graphdef, state, mid[:, :, :, lo:hi], caches, None, False, widths, offsets).compile().as_text()
    copied = [m.group(1) for m in re.finditer(r"= f32\[([\d,]+)\]\{[^}]*\} copy\(", hlo)
              if tuple(int(d) for d in m.group(1).split(",")) in rings]
    assert not copied, f"caches copied: {copied}"


def test_decode_and_encode_steps_export_for_tpu(pair):
    """The compiled chunk steps (ring caches: dynamic in-place writes at channel offsets) lower for TPU."""
    name, _, vae = pair
    s = vae.config.scale_factor_spatial
    h, w = (n // s for n in SIZES[name])
    graphdef, state = nnx.split(vae)
    z = jnp.ones((1, vae.config.z_dim, 1, h, w))
    caches, mid = vae_module._decode_stem(graphdef, state, z, None, None)
    (lo, hi), widths, offsets = vae.decoder.strip_plan(w, 0, w)
    strip_caches, _ = vae_module._decode_strip(graphdef, state, mid, None, None, False, widths, offsets)
    video = jnp.zeros((1, vae.config.video_channels, 5, *SIZES[name]))
    enc_caches, _ = vae_module._encode_chunk(graphdef, state, video[:, :, :1], None, None)
    steps = {
        "stem": (lambda st, z, c: vae_module._decode_stem(graphdef, st, z, c, None), (state, z, caches)),
        "strip": (lambda st, m, c: vae_module._decode_strip(graphdef, st, m, c, None, False, widths, offsets),
                  (state, mid, strip_caches)),
        "encode": (lambda st, v, c: vae_module._encode_chunk(graphdef, st, v, c, None), (state, video[:, :, 1:], enc_caches)),
    }
    for step, (fn, args) in steps.items():
        exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args))
        assert exported.platforms == ("tpu",), step
        assert "dynamic_update_slice" in exported.mlir_module(), step
