"""WanPipeline vs diffusers' WanPipeline / WanImageToVideoPipeline: latents after 3 steps, float32, CPU.

Both load the same tiny random checkpoint, saved in the diffusers layout by
`wan_tpu.wan.presets.save_diffusers_checkpoint` (diffusers' own `save_pretrained`), and start from the
same initial noise (`latents=`). Compared: `output_type="latent"`. Tolerance: max |ours − diffusers|
≤ 1e-4 × max |diffusers| (float32 everywhere; the difference is reduction order).
Cases: T2V with CFG; T2V without CFG (guidance 1); Wan 2.2 A14B two experts (boundary 0.9, so the
switch happens inside the 3 steps); Wan 2.1 I2V (36-channel input + CLIP tokens); TI2V
(`expand_timesteps`, Wan 2.2 VAE, first frame held at t=0).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image

from wan_tpu.configs.models import VARIANTS, WanTransformerConfig
from wan_tpu.configs.vae import TINY_VAE, VAE_PRESETS
from wan_tpu.errors import WanInputError
from wan_tpu.wan.pipeline import WanPipeline
from wan_tpu.wan.presets import save_diffusers_checkpoint

TOL = 1e-4
HEIGHT, WIDTH, FRAMES, STEPS, SHIFT = 32, 32, 5, 3, 3.0
PROMPT, NEGATIVE = "a cat walks on the grass", "blurry, static"
T2V = VARIANTS["tiny"].transformer
# Wan 2.2 VAE structure (16x spatial) with 8 latent channels; the DiT consumes them.
TINY_VAE_22 = VAE_PRESETS["tiny-2.2"]
CASES = {
    "t2v": dict(transformer=T2V, vae=TINY_VAE),
    "a14b": dict(transformer=T2V, transformer_2=dataclasses.replace(T2V), vae=TINY_VAE, boundary_ratio=0.9),
    "i2v": dict(transformer=dataclasses.replace(T2V, in_channels=36, image_dim=32, added_kv_proj_dim=64), vae=TINY_VAE),
    "ti2v": dict(transformer=dataclasses.replace(T2V, in_channels=8, out_channels=8), vae=TINY_VAE_22,
                 expand_timesteps=True),
}


def clip_config():
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=32, patch_size=8, hidden_act="gelu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for name, kwargs in CASES.items():
        path = tmp_path_factory.mktemp(name)
        extra = {"image_encoder": clip_config()} if name == "i2v" else {}
        save_diffusers_checkpoint(str(path), flow_shift=SHIFT, seed=1, **kwargs, **extra)
        paths[name] = str(path)
    return paths


def image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))


def reference(path, name, noise, guidance, image_in=None):
    import diffusers
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module

    if not hasattr(i2v_module, "ftfy"):
        # diffusers' I2V prompt cleaning calls ftfy unguarded; ftfy (not installed here) leaves ASCII as is.
        i2v_module.ftfy = type("ftfy", (), {"fix_text": staticmethod(lambda text: text)})
    cls = diffusers.WanImageToVideoPipeline if image_in is not None else diffusers.WanPipeline
    pipe = cls.from_pretrained(path, dtype=torch.float32)
    kwargs = {} if image_in is None else {"image": image_in}
    with torch.no_grad():
        out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                   num_inference_steps=STEPS, guidance_scale=guidance, latents=torch.from_numpy(noise),
                   output_type="latent", max_sequence_length=512, return_dict=False, **kwargs)[0]
    return out.numpy()


def ours(path, noise, guidance, image_in=None):
    pipe = WanPipeline.from_pretrained(path, dtype=jnp.float32)
    out = pipe(PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
               num_inference_steps=STEPS, guidance_scale=guidance, flow_shift=SHIFT, image=image_in,
               latents=jnp.asarray(noise), output_type="latent")
    return np.asarray(out)


@pytest.mark.parametrize("name,guidance,with_image", [
    ("t2v", 5.0, False), ("t2v", 1.0, False), ("a14b", 4.0, False), ("i2v", 5.0, True), ("ti2v", 5.0, True),
])
def test_latents_match_diffusers(checkpoints, name, guidance, with_image):
    path = checkpoints[name]
    pipe = WanPipeline.from_pretrained(path, dtype=jnp.float32)
    noise = np.random.default_rng(2).standard_normal(pipe.latent_shape(HEIGHT, WIDTH, FRAMES)).astype(np.float32)
    img = image() if with_image else None
    ref = reference(path, name, noise, guidance, img)
    out = ours(path, noise, guidance, img)
    assert out.shape == ref.shape
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= TOL, f"{name}: max rel. error {err:.2e} > {TOL}"
    # The loop did something: the result is far from the starting noise.
    assert np.abs(ref - noise).max() > 0.1


def few_step_scheduler(kind, sigmas, timesteps):
    """diffusers' scheduler whose `set_timesteps` (called by WanPipeline with the step count) takes the
    given schedule, as pipelines with `retrieve_timesteps(..., sigmas=, timesteps=)` pass it."""
    import diffusers

    base = diffusers.UniPCMultistepScheduler if kind == "unipc" else diffusers.FlowMatchEulerDiscreteScheduler

    class Given(base):
        def set_timesteps(self, num_inference_steps=None, device=None, **_):
            if kind == "unipc":
                super().set_timesteps(device=device, sigmas=np.asarray(sigmas))
            else:
                super().set_timesteps(device=device, sigmas=sigmas, timesteps=timesteps)

    if kind == "unipc":
        return Given(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=5.0)
    return Given(shift=5.0)


@pytest.mark.parametrize("kind,sigmas,timesteps", [
    ("euler", [1.0, 0.75, 0.5, 0.25], None),  # lightx2v's 4-step list as sigmas, shifted by 5
    ("euler", None, [1000.0, 750.0, 500.0, 250.0]),  # given timesteps: the model sees them unshifted
    ("unipc", [1.0, 0.75, 0.5, 0.25], None),
])
def test_few_step_latents_with_a_given_schedule_match_diffusers(checkpoints, kind, sigmas, timesteps):
    """4 steps, guidance 1 (no uncond pass): WanPipeline with the schedule given to its scheduler, as above."""
    import diffusers

    path = checkpoints["t2v"]
    pipe = WanPipeline.from_pretrained(path, dtype=jnp.float32)
    noise = np.random.default_rng(4).standard_normal(pipe.latent_shape(HEIGHT, WIDTH, FRAMES)).astype(np.float32)
    ref_pipe = diffusers.WanPipeline.from_pretrained(path, dtype=torch.float32)
    ref_pipe.scheduler = few_step_scheduler(kind, sigmas, timesteps)
    with torch.no_grad():
        ref = ref_pipe(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=4,
                       guidance_scale=1.0, latents=torch.from_numpy(noise), output_type="latent",
                       max_sequence_length=512, return_dict=False)[0].numpy()
    out = np.asarray(pipe(PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, guidance_scale=1.0, flow_shift=5.0,
                          scheduler=kind, sigmas=sigmas, timesteps=timesteps, latents=jnp.asarray(noise),
                          output_type="latent", progress=False))
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= TOL, f"{kind}: max rel. error {err:.2e} > {TOL}"
    assert np.abs(ref - noise).max() > 0.1


def test_guidance_one_runs_one_forward_per_step():
    """Without CFG the DiT batch is the latents alone: no unconditional pass, no negative prompt encoded."""
    from wan_tpu.wan import denoise as denoise_lib

    pipe = WanPipeline.from_pretrained("tiny", dtype=jnp.float32)
    embeds = pipe.encode_prompt(PROMPT, NEGATIVE, guidance_scale=1.0)
    assert set(embeds) == {"prompt_embeds"}
    seen = []
    original = denoise_lib.forward

    def spy(graphdef, state, x, *args):
        seen.append(x.shape[0])
        return original(graphdef, state, x, *args)

    denoise_lib.forward = spy
    try:
        denoise_lib._step_jit.clear_cache()
        pipe.denoise(embeds, num_inference_steps=2, guidance_scale=1.0, progress=False)
    finally:
        denoise_lib.forward = original
        denoise_lib._step_jit.clear_cache()
    assert seen == [1]  # traced once, batch 1 (with CFG it is 2)


def test_a14b_switches_experts_inside_the_run(checkpoints):
    from wan_tpu.wan.denoise import expert_switch_index
    from wan_tpu.wan.schedulers import make_scheduler

    timesteps = make_scheduler("unipc", STEPS, SHIFT).timesteps
    assert expert_switch_index(timesteps, 0.9) == 1  # t = 999 on the high-noise expert, 857 and 600 on the low
    pipe = WanPipeline.from_pretrained(checkpoints["a14b"], dtype=jnp.float32)
    assert pipe.variant.boundary_ratio == 0.9 and "transformer_2" in pipe._loaders


def test_same_seed_same_latents_and_seed_matters():
    pipe = WanPipeline.from_pretrained("tiny", dtype=jnp.float32)
    kwargs = dict(num_inference_steps=2, output_type="latent")
    a = np.asarray(pipe(PROMPT, seed=7, **kwargs))
    b = np.asarray(pipe(PROMPT, seed=7, **kwargs))
    c = np.asarray(pipe(PROMPT, seed=8, **kwargs))
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)


def test_variant_is_found_from_the_folder(checkpoints):
    t2v = WanPipeline.from_pretrained(checkpoints["t2v"])
    assert t2v.variant.name == "tiny" and not t2v._loaded  # components load on first use
    i2v = WanPipeline.from_pretrained(checkpoints["i2v"])
    assert (i2v.variant.task, i2v.variant.uses_clip_image) == ("i2v", True)
    ti2v = WanPipeline.from_pretrained(checkpoints["ti2v"])
    assert ti2v.variant.expand_timesteps and ti2v.variant.fps == 24


def test_missing_part_names_the_folder(checkpoints, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["i2v"], broken)
    shutil.rmtree(broken / "image_encoder")
    with pytest.raises(WanInputError, match="image_encoder/"):
        WanPipeline.from_pretrained(str(broken))


def test_i2v_without_image_is_a_user_error(checkpoints):
    pipe = WanPipeline.from_pretrained(checkpoints["i2v"], dtype=jnp.float32)
    with pytest.raises(WanInputError, match="--image"):
        pipe(PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=1)


def test_new_transformer_config_is_a_custom_variant(tmp_path):
    from wan_tpu.wan.settings import resolve_variant

    cfg = WanTransformerConfig(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64,
                               num_layers=1)
    save_diffusers_checkpoint(str(tmp_path), cfg, TINY_VAE)
    variant, vae = resolve_variant(str(tmp_path))
    assert variant.name == "custom" and variant.transformer == cfg and vae.z_dim == 16


def test_official_defaults():
    """Defaults of the official generate.py per model (Wan2.1 / Wan2.2 repos); Wan 2.1 shift by size."""
    from wan_tpu.configs.vae import VAE_PRESETS
    from wan_tpu.wan.settings import resolve_settings

    def settings(name, **kw):
        return resolve_settings(VARIANTS[name], VAE_PRESETS["wan2.2" if "ti2v" in name else "wan2.1"], **kw)

    s = settings("wan2.1-t2v-1.3b")
    assert (s.width, s.height, s.num_frames, s.num_inference_steps, s.guidance_scale, s.flow_shift) == (
        832, 480, 81, 50, 5.0, 3.0)
    assert settings("wan2.1-t2v-14b").flow_shift == 5.0  # 720p
    assert settings("wan2.1-t2v-14b", width=832, height=480).flow_shift == 3.0
    assert settings("wan2.1-i2v-14b-480p").flow_shift == 3.0  # I2V at 480p
    assert settings("wan2.1-i2v-14b-480p", width=1280, height=720).flow_shift == 5.0
    assert settings("wan2.1-i2v-14b-480p").num_inference_steps == 40
    a14b = settings("wan2.2-t2v-a14b")
    assert (a14b.guidance_scale, a14b.guidance_scale_2, a14b.flow_shift) == (4.0, 3.0, 12.0)
    assert settings("wan2.2-t2v-a14b", guidance_scale=6.0).guidance_scale_2 == 6.0  # diffusers' rule
    with pytest.raises(WanInputError, match="multiple of 32"):
        settings("wan2.2-ti2v-5b", width=1280, height=720)  # Wan 2.2 VAE stride 16 x patch 2
