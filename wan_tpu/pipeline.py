"""`WanPipeline`: text (and image) to video in three stages, from a checkpoint folder or a preset.

    pipe = wan_tpu.WanPipeline.from_pretrained("Wan2.1-T2V-1.3B-Diffusers")     # or "tiny"
    frames = pipe("a cat walks on the grass", seed=0)                              # (T, H, W, 3) uint8

Stages (each usable on its own, e.g. from a notebook or the stage scripts):
  1. `encode_prompt` (+ `encode_image` for I2V/TI2V): the conditioning arrays.
  2. `denoise`: initial noise from the seed → final latents (normalized, as diffusers returns them
     with `output_type="latent"`).
  3. `decode`: latents → uint8 frames.

A checkpoint is a diffusers-format folder (`model_index.json`, `transformer/` (+ `transformer_2/`
for Wan 2.2 A14B), `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`; for Wan 2.1 I2V also
`image_encoder/`, `image_processor/`). The variant comes from the transformer's config.json and
model_index.json (`boundary_ratio`, `expand_timesteps`). Nothing is downloaded. Components load
lazily, on first use, so a stage only loads what it needs; `release(...)` drops one. `prepare(settings)`
instead reads them all at once and compiles the denoise step and the decode in background threads
(`wan_tpu.warmup`), which is what `python -m wan_tpu.generate` does.

Same seed, same model, same settings, same devices and mesh → identical latents: the initial noise
is `jax.random.normal(jax.random.key(seed), (1, z, F, h, w), float32)`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu import conditioning
from wan_tpu.configs.models import WanVariant, config_to_json
from wan_tpu.configs.vae import WanVAEConfig
from wan_tpu.denoise import Conditioning, denoise
from wan_tpu.errors import WanInputError
from wan_tpu.models.vae import frames_to_uint8
from wan_tpu.profiling import scope
from wan_tpu.schedulers import make_scheduler
from wan_tpu.settings import RunSettings, model_parts, resolve_settings, resolve_variant


class WanPipeline:
    """A Wan model ready to generate; see the module docstring."""

    def __init__(self, variant: WanVariant, vae_config: WanVAEConfig, loaders: dict[str, Callable[[], object]], *,
                 name: str, dtype, mesh=None, weight_bytes: dict[str, int] | None = None):
        self.variant = variant
        self.vae_config = vae_config
        self.name = name
        self.dtype = dtype
        self.mesh = mesh
        self.weight_bytes = weight_bytes or {}  # component → bytes of its weight files (prepare's memory check)
        self._loaders = {n: _one_torch_load_at_a_time(f) if n in TORCH_COMPONENTS else f for n, f in loaders.items()}
        self._loaded: dict[str, object] = {}
        self._warmup = None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_preset: str, mesh=None, dtype=jnp.bfloat16, attention_impl: str | None = None,
                        vae_dtype=jnp.float32, compile_cache: bool = True) -> WanPipeline:
        """A pipeline over a diffusers-format folder or a built-in preset name (`tiny`).

        `dtype` is the DiT and text encoder dtype; the VAE runs in `vae_dtype` (float32 by default,
        as the official Wan code runs it). `attention_impl` names the DiT's attention kernel
        (default: the fastest for the backend). `compile_cache` turns the persistent compilation
        cache on (the default) or off for the whole process (see `wan_tpu.compile_cache`).
        """
        from wan_tpu import compile_cache as cache
        from wan_tpu import presets

        cache.enable() if compile_cache else cache.disable()

        if path_or_preset in presets.PRESETS:
            return presets.PRESETS[path_or_preset](dtype=dtype, mesh=mesh, attention_impl=attention_impl,
                                                   vae_dtype=vae_dtype)
        path = os.fspath(path_or_preset)
        if not os.path.isdir(path):
            raise WanInputError(
                f"model {path!r} is neither a checkpoint folder nor a preset; pass a diffusers-format folder "
                f"(e.g. Wan2.1-T2V-1.3B-Diffusers) or one of the presets: {', '.join(presets.PRESETS)}"
            )
        variant, vae_config = resolve_variant(path)
        parts = model_parts(variant)
        for part in parts.values():
            if not os.path.isdir(os.path.join(path, part)):
                raise WanInputError(
                    f"checkpoint {path} has no {part}/ folder, which {variant.name} needs; download the complete "
                    f"diffusers-format checkpoint ({variant.repo or 'model_index.json lists the parts'})"
                )
        from wan_tpu.warmup import folder_bytes

        return cls(variant, vae_config, _folder_loaders(path, parts, dtype, mesh, attention_impl, vae_dtype),
                   name=os.path.abspath(path), dtype=dtype, mesh=mesh,
                   weight_bytes={n: folder_bytes(os.path.join(path, part)) for n, part in parts.items()})

    def component(self, name: str):
        """The component `name`, loaded on first use (or taken from `prepare`'s background load)."""
        if name not in self._loaded:
            if name not in self._loaders:
                raise WanInputError(f"{self.variant.name} has no {name}; it is not part of this model")
            with scope(f"load_{name}"):
                loaded = self._warmup.take_load(name) if self._warmup is not None else None
                self._loaded[name] = loaded if loaded is not None else self._loaders[name]()
        return self._loaded[name]

    def release(self, *names: str) -> None:
        """Drop loaded components, freeing their device memory (unless the caller still holds them)."""
        for name in names:
            self._loaded.pop(name, None)
            if self._warmup is not None:
                self._warmup.loads.pop(name, None)
        # The encoders keep jitted bound methods of themselves: a reference cycle only the cyclic
        # collector frees, and 11 GB of UMT5 weights should not wait for it.
        gc.collect()

    transformer = property(lambda self: self.component("transformer"))
    transformer_2 = property(lambda self: self.component("transformer_2"))
    vae = property(lambda self: self.component("vae"))
    text_encoder = property(lambda self: self.component("text_encoder"))
    image_encoder = property(lambda self: self.component("image_encoder"))

    @property
    def model_id(self) -> dict:
        """What identifies this model in stage-file metadata (the variant and its architecture)."""
        return {"variant": self.variant.name, "transformer": config_to_json(self.variant.transformer),
                "vae": dataclasses.asdict(self.vae_config)}

    def settings(self, **kwargs) -> RunSettings:
        """Validated run settings; None values take the model's official defaults."""
        return resolve_settings(self.variant, self.vae_config, **kwargs)

    def prepare(self, settings: RunSettings | None = None, *, scheduler: str = "unipc", image: bool = False):
        """Start reading every component a run with `settings` needs and compiling its denoise step and VAE
        decode, in background threads; returns at once (a `wan_tpu.warmup.Warmup` of futures; as a
        context manager, leaving it waits for the threads, cancelling what has not started).

        `component()`, `denoise()` and `decode()` then wait for what they need only. `image`: the run
        conditions on an image (I2V/TI2V). Results are bit-identical with and without it; see
        `wan_tpu.warmup` for what runs when and what it does to peak memory. With a mesh, components
        are read ahead but compile on first use.
        """
        from wan_tpu.warmup import Warmup, weights_fit

        s = settings or self.settings()
        warmup = self._warmup = Warmup()
        dits = [n for n in ("transformer", "transformer_2") if n in self._loaders]
        encoders = ["text_encoder"] + (["image_encoder"] if image and "image_encoder" in self._loaders else [])
        todo = [n for n in (*encoders, *dits, "vae") if n not in self._loaded]
        ahead = weights_fit(self.weight_bytes, todo, self.mesh)
        for name in todo:
            if ahead or name not in dits:
                warmup.start(name, self._loaders[name])
        if self.mesh is not None:
            # On a mesh the calls' arguments carry shardings that only the previous stage decides (the
            # text encoder's output, the sharded latents): a program compiled ahead from shapes would
            # not be the one they run. Loading ahead still helps.
            return warmup
        if ahead:
            sources = [self._loaded[n] if n in self._loaded else warmup.loads[n] for n in dits]
            warmup.start("denoise", self._compile_denoise, warmup, s, scheduler, image, sources, kind="compile")
        vae = self._loaded["vae"] if "vae" in self._loaded else warmup.loads["vae"]
        warmup.start("decode", self._compile_decode, warmup, s, vae, kind="compile")
        return warmup

    def _compile_denoise(self, warmup, s: RunSettings, scheduler: str, image: bool, sources) -> None:
        from wan_tpu.denoise import compile_steps

        shape = self.latent_shape(s.height, s.width, s.num_frames)
        cond = self._abstract_conditioning(s, shape, image)
        if cond is None:
            return
        transformers = [src.result() if hasattr(src, "result") else src for src in sources]
        if warmup.cancelled.is_set():
            return
        self.prepare_latents(0, s.height, s.width, s.num_frames)  # compiles the noise sampler (any seed: one program)
        compile_steps(transformers, shape, cond, make_scheduler(scheduler, s.num_inference_steps, s.flow_shift),
                      self.variant.boundary_ratio, mesh=self.mesh)

    def _abstract_conditioning(self, s: RunSettings, shape, image: bool) -> Conditioning | None:
        """The shapes of what `_conditioning` builds for this run (None for Wan 2.1 I2V, whose CLIP token
        count comes from the image encoder's own config: that step compiles on use)."""
        from wan_tpu.text_encoder import MAX_SEQUENCE_LENGTH

        if self.variant.uses_clip_image:
            return None
        text = jax.ShapeDtypeStruct((1, MAX_SEQUENCE_LENGTH, self.variant.transformer.text_dim), self.dtype)
        _, z, f, h, w = shape
        cond = Conditioning(prompt_embeds=text, negative_prompt_embeds=text if s.do_cfg else None)
        if self.variant.task == "i2v":
            temporal = self.vae_config.scale_factor_temporal
            cond = cond._replace(condition=jax.ShapeDtypeStruct((1, temporal + z, f, h, w), jnp.float32))
        if self.variant.expand_timesteps:
            cond = cond._replace(first_frame_mask=conditioning.ti2v_mask(shape, conditioned=image),
                                 first_frame=jax.ShapeDtypeStruct((1, z, 1, h, w), jnp.float32) if image else None)
        return cond

    def _compile_decode(self, warmup, s: RunSettings, source) -> None:
        from wan_tpu.models import vae as vae_lib
        from wan_tpu.warmup import free_bytes_after_release

        vae = source.result() if hasattr(source, "result") else source
        shape = self.latent_shape(s.height, s.width, s.num_frames)
        video = vae.compile_decode(shape, free_bytes=free_bytes_after_release(vae), stop=warmup.cancelled)
        if video is not None:
            vae_lib._to_uint8.lower(video).compile()

    # ---- stage 1 ------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, negative_prompt: str | None = None, guidance_scale: float | None = None) -> dict:
        """`{"prompt_embeds": (1, 512, d), "negative_prompt_embeds": ... (only with CFG)}`.

        `negative_prompt=None` uses the official Wan negative prompt; `""` is a valid empty one.
        """
        from wan_tpu.text_encoder import WAN_NEGATIVE_PROMPT

        if negative_prompt is None:
            negative_prompt = WAN_NEGATIVE_PROMPT
        settings = self.settings(guidance_scale=guidance_scale)
        check_prompts(prompt, negative_prompt, settings.do_cfg)
        prompts = [prompt, negative_prompt] if settings.do_cfg else [prompt]
        with scope("text_encode"):
            embeds = self.text_encoder.encode(prompts)
        out = {"prompt_embeds": embeds[:1]}
        if settings.do_cfg:
            out["negative_prompt_embeds"] = embeds[1:]
        return out

    def encode_image(self, image, height: int | None = None, width: int | None = None,
                     num_frames: int | None = None) -> dict:
        """The image conditioning: `condition` (I2V) or `first_frame` (TI2V), plus `image_embeds` (CLIP)."""
        s = self.settings(height=height, width=width, num_frames=num_frames)
        if self.variant.task == "t2v":
            raise WanInputError(f"{self.variant.name} is a text-to-video model and takes no image; drop --image")
        pixels = conditioning.preprocess_image(image, s.height, s.width)
        out = {}
        with scope("image_encode"):
            if self.variant.uses_clip_image:
                out["image_embeds"] = self.image_encoder.encode([conditioning.load_image(image)])
            if self.variant.expand_timesteps:
                out["first_frame"] = conditioning.ti2v_condition(self.vae, pixels, self.vae.dtype)
            else:
                out["condition"] = conditioning.i2v_condition(self.vae, pixels, s.num_frames, self.vae.dtype)
        return out

    # ---- stage 2 ------------------------------------------------------------------------------

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        v = self.vae_config
        return (1, v.z_dim, (num_frames - 1) // v.scale_factor_temporal + 1, height // v.scale_factor_spatial,
                width // v.scale_factor_spatial)

    def prepare_latents(self, seed: int, height: int, width: int, num_frames: int) -> jax.Array:
        """The initial noise: float32 standard normal from `jax.random.key(seed)`."""
        return jax.random.normal(jax.random.key(seed), self.latent_shape(height, width, num_frames), jnp.float32)

    def denoise(self, embeds: dict, latents=None, seed: int = 0, height: int | None = None, width: int | None = None,
                num_frames: int | None = None, num_inference_steps: int | None = None,
                guidance_scale: float | None = None, guidance_scale_2: float | None = None,
                flow_shift: float | None = None, scheduler: str = "unipc", progress: bool = True,
                step_seconds: list | None = None) -> jax.Array:
        """Final latents `(1, z, F, h, w)` from stage-1 `embeds` (+ `encode_image` output for I2V/TI2V).

        `latents` overrides the seeded initial noise (e.g. to compare with another implementation).
        """
        s = self.settings(height=height, width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
                          guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, flow_shift=flow_shift)
        shape = self.latent_shape(s.height, s.width, s.num_frames)
        if latents is None:
            latents = self.prepare_latents(seed, s.height, s.width, s.num_frames)
        elif tuple(latents.shape) != shape:
            raise WanInputError(f"latents have shape {tuple(latents.shape)}, but this run needs {shape}")
        cond = self._conditioning(embeds, s, shape)
        sched = make_scheduler(scheduler, s.num_inference_steps, s.flow_shift)
        experts = [self.transformer]
        guidance = [s.guidance_scale]
        if self.variant.boundary_ratio is not None:
            experts.append(self.transformer_2)
            guidance.append(s.guidance_scale_2)
        if self._warmup is not None:
            self._warmup.wait_compiled("denoise")
        with scope("denoise"):
            return denoise(experts, jnp.asarray(latents), cond, sched, guidance, self.variant.boundary_ratio,
                           mesh=self.mesh, progress=progress, step_seconds=step_seconds)

    def _conditioning(self, embeds: dict, s: RunSettings, shape) -> Conditioning:
        needs_image = self.variant.task == "i2v"
        if s.do_cfg and "negative_prompt_embeds" not in embeds:
            raise WanInputError(f"guidance {s.guidance_scale} > 1 needs negative_prompt_embeds; encode the prompt "
                                "with the same guidance (stage 1 --guidance)")
        if needs_image and "condition" not in embeds:
            raise WanInputError(f"{self.variant.name} is image-to-video; pass an input image (--image PATH)")
        if self.variant.uses_clip_image and "image_embeds" not in embeds:
            raise WanInputError(f"{self.variant.name} needs CLIP image_embeds; encode the image (stage 1 --image)")
        first_frame = embeds.get("first_frame")
        mask = None
        if self.variant.expand_timesteps:
            mask = conditioning.ti2v_mask(shape, conditioned=first_frame is not None)
            first_frame = None if first_frame is None else jnp.asarray(first_frame, jnp.float32)
        return Conditioning(
            prompt_embeds=jnp.asarray(embeds["prompt_embeds"]),
            negative_prompt_embeds=jnp.asarray(embeds["negative_prompt_embeds"]) if s.do_cfg else None,
            image_embeds=jnp.asarray(embeds["image_embeds"]) if self.variant.uses_clip_image else None,
            condition=jnp.asarray(embeds["condition"], jnp.float32) if needs_image else None,
            first_frame=first_frame,
            first_frame_mask=mask,
        )

    # ---- stage 3 ------------------------------------------------------------------------------

    def decode(self, latents) -> np.ndarray:
        """uint8 frames `(T, H, W, 3)` from normalized latents `(1, z, F, h, w)`."""
        vae = self.vae
        if self._warmup is not None:
            self._warmup.wait_compiled("decode")
        with scope("vae_decode"):
            z = vae.denormalize_latents(jnp.asarray(latents, jnp.float32)).astype(vae.dtype)
            video = vae.decode(z)
            frames = np.asarray(frames_to_uint8(video))
        return frames[0]

    # ---- all stages ---------------------------------------------------------------------------

    def __call__(self, prompt: str, negative_prompt: str | None = None, height: int | None = None,
                 width: int | None = None, num_frames: int | None = None, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, flow_shift: float | None = None, seed: int = 0, image=None,
                 guidance_scale_2: float | None = None, latents=None, output_type: str = "np",
                 progress: bool = True) -> np.ndarray:
        """Generate a video: uint8 frames `(T, H, W, 3)` (`output_type="latent"`: the final latents).

        None settings take the model's official defaults (Wan 2.1 T2V 1.3B: 480×832, 81 frames,
        50 steps, guidance 5.0, shift 5.0; see `wan_tpu.configs.models.VARIANTS`). `guidance_scale_2`
        is the low-noise expert's guidance (Wan 2.2 A14B; default: `guidance_scale` if that is given).
        `latents` replaces the seeded initial noise.
        """
        s = self.settings(height=height, width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
                          guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, flow_shift=flow_shift)
        embeds = self.encode_prompt(prompt, negative_prompt, s.guidance_scale)
        if image is not None:
            embeds.update(self.encode_image(image, s.height, s.width, s.num_frames))
        out = self.denoise(embeds, latents=latents, seed=seed, height=s.height, width=s.width,
                           num_frames=s.num_frames, num_inference_steps=s.num_inference_steps,
                           guidance_scale=s.guidance_scale, guidance_scale_2=s.guidance_scale_2,
                           flow_shift=s.flow_shift, progress=progress)
        if output_type == "latent":
            return out
        return self.decode(out)


# Loading a transformers model sets process-wide torch state for a while (the default dtype, meta-device
# initialisation, the RNG of the tiny preset): two such loads in parallel threads (`prepare`) would see
# each other's, so they take turns.
TORCH_COMPONENTS = ("text_encoder", "image_encoder")
_TORCH_LOADING = threading.Lock()


def _one_torch_load_at_a_time(loader):
    @functools.wraps(loader)
    def load():
        with _TORCH_LOADING:
            return loader()

    return load


def check_prompts(prompt: str, negative_prompt: str, do_cfg: bool) -> None:
    if not isinstance(prompt, str):
        raise WanInputError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt.strip() and (not do_cfg or not negative_prompt.strip()):
        raise WanInputError("the prompt is empty and there is no negative prompt to guide against; pass --prompt TEXT")


def _folder_loaders(path, parts, dtype, mesh, attention_impl, vae_dtype) -> dict:
    # Imports stay inside the loaders: a run that fails validation never pays for (or hears from)
    # transformers and torch.
    sub = functools.partial(os.path.join, path)

    def dit(folder):
        from wan_tpu.models.transformer_loading import load_transformer

        return set_attention(load_transformer(sub(folder), dtype=dtype, mesh=mesh), attention_impl, mesh)

    def vae():
        from wan_tpu.models.vae_loading import load_vae

        return load_vae(sub(parts["vae"]), dtype=vae_dtype, mesh=mesh)

    def text_encoder():
        from wan_tpu.text_encoder import UMT5TextEncoder

        return UMT5TextEncoder.from_pretrained(sub(parts["text_encoder"]), sub(parts["tokenizer"]), dtype=dtype,
                                               mesh=mesh)

    def image_encoder():
        from wan_tpu.image_encoder import CLIPImageEncoder

        return CLIPImageEncoder.from_pretrained(sub(parts["image_encoder"]), sub(parts["image_processor"]),
                                                dtype=jnp.float32, mesh=mesh)

    loaders = {"transformer": functools.partial(dit, parts["transformer"]), "vae": vae, "text_encoder": text_encoder}
    if "transformer_2" in parts:
        loaders["transformer_2"] = functools.partial(dit, parts["transformer_2"])
    if "image_encoder" in parts:
        loaders["image_encoder"] = image_encoder
    return loaders


def set_attention(dit, impl: str | None, mesh):
    """Point the DiT's attention hooks at kernel `impl` (None: the backend's fastest), mesh-aware if a mesh is given."""
    if mesh is not None:
        from wan_tpu.sharding import shard_transformer

        return shard_transformer(dit, mesh, **({} if impl is None else {"impl": impl}))
    if impl is not None:
        from wan_tpu.layers import attention as attention_lib

        dit.self_attention = functools.partial(attention_lib.attention, impl=impl)
        dit.cross_attention = functools.partial(attention_lib.attention, impl=impl)
    return dit

