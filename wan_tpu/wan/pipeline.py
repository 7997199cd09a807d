"""`WanPipeline`: text (and image) to video in three stages, from a checkpoint folder or a preset.

    pipe = wan_tpu.WanPipeline.from_pretrained("Wan2.1-T2V-1.3B-Diffusers")     # or "tiny"
    frames = pipe("a cat walks on the grass", seed=0)                              # (T, H, W, 3) uint8

`from_pretrained(path_or_id_or_preset, *, mesh=None, dtype=bfloat16, attention=None, compile_cache=True,
**options)` is the constructor the three pipelines share (`MatrixGamePipeline`, `UnifolmPipeline`).

Stages (each usable on its own, e.g. from a notebook or the stage scripts):
  1. `encode_prompt` (+ `encode_image` for I2V/TI2V): the conditioning arrays.
  2. `denoise`: initial noise from the seed → final latents (normalized, as diffusers returns them
     with `output_type="latent"`).
  3. `decode`: latents → uint8 frames.

A checkpoint is a diffusers-format folder (`model_index.json`, `transformer/` (+ `transformer_2/`
for Wan 2.2 A14B), `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`; for Wan 2.1 I2V also
`image_encoder/`, `image_processor/`) or a Hugging Face model id (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`)
found in the local HF cache; nothing is downloaded unless `download=True`. The variant comes from
the transformer's config.json and model_index.json (`boundary_ratio`, `expand_timesteps`).
`from_pretrained` checks every file the model will read (`wan_tpu.runtime.validate`) and the call checks its
inputs and that the run fits in memory (`wan_tpu.runtime.memory`) before anything is loaded: bad input is a
`WanInputError` within a second, not after minutes. Components load lazily, on first use, so a
stage only loads what it needs; `release(...)` drops one. `prepare(settings)`
instead reads them all at once and compiles the text encoder, the denoise step and the decode in background threads
(`wan_tpu.runtime.compile_ahead`), which is what `python -m wan_tpu.generate` does. The pipeline's
`compile_cache` choice applies to its own loads, compiles and calls only (`compile_cache.selected`).

Big models on small devices: `offload="auto"` (the default; `set_offload`) has the memory check choose, per
run, how many DiT blocks stay on the device and streams the others from host memory inside the compiled step
(`WanTransformer.offload_blocks`); where the components do not fit together, a call releases each after
its stage (the text encoder before the DiT, the DiT before the decode).

Same seed, same model, same settings, same devices and mesh → identical latents: the initial noise
is `jax.random.normal(jax.random.key(seed), (1, z, F, h, w), float32)`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import os
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from wan_tpu.configs.models import WanVariant, config_to_json
from wan_tpu.configs.vae import WanVAEConfig
from wan_tpu.errors import WanInputError
from wan_tpu.runtime import distributed, interrupt
from wan_tpu.runtime.compile_cache import in_pipeline_choice
from wan_tpu.runtime.profiling import scope
from wan_tpu.vae.model import frames_to_uint8
from wan_tpu.wan import conditioning, presets
from wan_tpu.wan.denoise import Conditioning, denoise
from wan_tpu.wan.schedulers import make_custom_scheduler, make_scheduler
from wan_tpu.wan.settings import RunSettings, model_parts, resolve_settings, resolve_variant
from wan_tpu.wan.transformer import set_attention

STAGES = ("text", "image", "denoise", "decode")
DITS = ("transformer", "transformer_2")


class WanPipeline:
    """A Wan model ready to generate; see the module docstring."""

    def __init__(self, variant: WanVariant, vae_config: WanVAEConfig, loaders: dict[str, Callable[[], object]], *,
                 name: str, dtype, mesh=None, vae_dtype=jnp.float32, attention: str | None = None,
                 weight_elements: dict[str, int] | None = None, check_memory: bool = True, text_encoder_config=None,
                 compile_cache: bool | None = None):
        self.variant = variant
        self.vae_config = vae_config
        self.name = name
        self.dtype = dtype
        self.vae_dtype = vae_dtype
        self.attention_impl = attention
        self.mesh = mesh
        # Whether this pipeline's own loads, compiles and calls read and write the compile cache (and the
        # executable cache in it): applied around them only (`compile_cache.selected`), never process-wide.
        # None (built directly, not by `from_pretrained`): the process's own state, as before.
        self.compile_cache = None if compile_cache is None else bool(compile_cache)
        # Component → weight element count (from the safetensors headers), for the memory checks.
        self.weight_elements = weight_elements
        self.check_memory = check_memory
        # The UMT5 config (`wan_tpu.encoders.umt5.UMT5Config`): lets `prepare` compile the text encoder from shapes.
        self.text_encoder_config = text_encoder_config
        self._loaders = dict(loaders)
        self._loaded: dict[str, object] = {}
        self._loras: list[tuple[str, float, tuple[str, ...]]] = []  # (path, scale, DiT component names)
        self.cache_stats = None  # the step cache's `CacheStats` of the last run that used one
        self.quantization = None  # "fp8"/"int8" once `quantize` was asked for
        self._warmup = None
        self._decode_beside_denoise = True  # set by `prepare` (`wan_tpu.wan.memory.decode_compiles_beside_denoise`)
        self.offload = "auto"  # `set_offload`'s choice: "auto", None (none) or the resident DiT block count
        self.offload_plan = None  # `wan_tpu.wan.memory.OffloadPlan` of the last checked run

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_preset: str, *, mesh=None, dtype=jnp.bfloat16, attention: str | None = None,
                        compile_cache: bool = True, vae_dtype=jnp.float32, download: bool = False,
                        check_memory: bool = True, quantize: str | None = None, vae=None, text_encoder=None,
                        image_encoder=None, tokenizer=None, offload="auto", transformer_2=None) -> WanPipeline:
        """A pipeline over a diffusers-format folder, a Hugging Face model id, or a preset name (`tiny`); or
        an official Wan folder, a DiT file (`.safetensors`, `.gguf`) with `vae=`, `text_encoder=` (and
        `image_encoder=`) files, or a ComfyUI `models/` folder (`wan_tpu.wan.model_files`). Wan 2.2 A14B as
        files: the high-noise DiT file, its low-noise one as `transformer_2=`.

        `mesh`: a device mesh (`wan_tpu.make_mesh`) to shard over, None for one device. `dtype` is the DiT
        and text encoder dtype (default bfloat16); the VAE runs in `vae_dtype` (float32 by default, as the
        official Wan code runs it). `attention` names the DiT's attention kernel (default: the fastest for
        the backend). `compile_cache`: whether this pipeline's compiles read and write the persistent
        compilation cache (the default) or not; applied around its own work only, other pipelines and
        the process keep theirs (see `wan_tpu.runtime.compile_cache`).
        Wan's options: a model id is looked up in the local HF cache (`HF_HUB_CACHE`/`HF_HOME`) and fetched
        only with `download=True`. `check_memory=False` skips the memory estimate that refuses runs too
        large for the devices (`wan_tpu.runtime.memory`). `quantize="fp8"` runs the DiT's block linears in
        FP8 (`wan_tpu.wan.quantize`; checked against the device now, applied as each DiT loads, after its
        LoRAs are merged). A DiT file whose block linears are all fp8 (or GGUF Q8_0) is quantised in that
        format by default where the device has its matrix units: its weights stay 8-bit.
        `tokenizer`: the UMT5 tokenizer folder for single files (default: `google/umt5-xxl` from the cache).
        `offload`: "auto" (default), "none", "blocks" or "blocks:N" (`set_offload`).
        """
        from wan_tpu.loading import hub
        from wan_tpu.runtime.validate import check_checkpoint
        from wan_tpu.wan import model_files

        components = dict(transformer_2=transformer_2, vae=vae, text_encoder=text_encoder, image_encoder=image_encoder)
        if path_or_preset in presets.PRESETS:
            if any(v is not None for v in components.values()):
                raise WanInputError(f"preset {path_or_preset} has its own components; drop "
                                    "--model-low/--vae/--text-encoder/--image-encoder")
            pipe = presets.PRESETS[path_or_preset](cls, dtype=dtype, mesh=mesh, attention=attention,
                                                   vae_dtype=vae_dtype)
            pipe.check_memory = check_memory
            pipe.compile_cache = bool(compile_cache)
            return pipe.quantize(quantize).set_offload(offload)
        path = os.fspath(path_or_preset)
        if not os.path.isfile(path):  # a file is no model id, even where its relative path reads org/name
            path = hub.resolve_model(path, download=download)
        if os.path.exists(path) and model_files.uses_files(path, **components):
            try:
                files = model_files.resolve_files(path, **components, tokenizer=tokenizer, download=download)
            except WanInputError as e:
                hint = hub.original_format_hint(path, str(e)) if os.path.isdir(path) else None
                raise (e if hint is None else WanInputError(hint)) from None
            if quantize is None and files.native_8bit and model_files.runs_natively(files.native_8bit, mesh):
                quantize = files.native_8bit
            return cls(files.variant, files.vae_config, _folder_loaders(path, files.parts, dtype, mesh, attention, vae_dtype),
                       name=os.path.abspath(path), dtype=dtype, mesh=mesh, vae_dtype=vae_dtype, attention=attention,
                       weight_elements=files.weights, check_memory=check_memory, text_encoder_config=files.text_config,
                       compile_cache=bool(compile_cache)).quantize(quantize).set_offload(offload)
        if not os.path.isdir(path):
            raise WanInputError(
                f"model {path!r} is neither a checkpoint folder, a Hugging Face model id (org/name) nor a preset; pass a "
                f"diffusers-format folder (e.g. Wan2.1-T2V-1.3B-Diffusers), a model id, or one of the presets: "
                f"{', '.join(presets.PRESETS)}"
            )
        hint = hub.original_format_hint(path)
        if hint is not None:
            raise WanInputError(hint)
        variant, vae_config = resolve_variant(path)
        parts = model_parts(variant)
        for part in parts.values():
            if not os.path.isdir(os.path.join(path, part)):
                raise WanInputError(
                    f"checkpoint {path} has no {part}/ folder, which {variant.name} needs; download the complete "
                    f"diffusers-format checkpoint ({variant.repo or 'model_index.json lists the parts'})"
                )
        weights = check_checkpoint(path, parts)
        from wan_tpu.encoders.umt5 import UMT5Config

        text_config = UMT5Config.from_folder(os.path.join(path, parts["text_encoder"]))
        if "text_encoder" in weights:  # its token embedding stays on the host (`UMT5Embedding`)
            weights["text_encoder"] = max(0, weights["text_encoder"] - text_config.vocab_size * text_config.d_model)
        return cls(variant, vae_config, _folder_loaders(path, parts, dtype, mesh, attention, vae_dtype),
                   name=os.path.abspath(path), dtype=dtype, mesh=mesh, vae_dtype=vae_dtype, attention=attention,
                   weight_elements=weights, check_memory=check_memory, text_encoder_config=text_config,
                   compile_cache=bool(compile_cache)).quantize(quantize).set_offload(offload)

    @in_pipeline_choice
    def quantize(self, mode: str | None) -> WanPipeline:
        """Quantise the DiT(s) (`"fp8"` or `"int8"`; None: no change): those loaded now, in place, and those
        loaded later as they load. Merge LoRAs before this: they need the bf16 weights."""
        from wan_tpu.wan.quantize import check_device, check_mode, quantize_transformer

        if check_mode(mode) is None:
            return self
        check_device(mode, None if self.mesh is None else list(self.mesh.devices.flat))
        self.quantization = mode
        for name in ("transformer", "transformer_2"):
            if name in self._loaded and not self._loaded[name].quantization:
                if self._loaded[name].offloaded:  # quantised on the device as it loads again
                    self.release(name)
                else:
                    quantize_transformer(self._loaded[name], mode, self.mesh)
        return self

    def set_offload(self, offload="auto") -> WanPipeline:
        """What leaves the device during a run: "auto" (the memory estimate chooses, per run, the fewest
        DiT blocks to stream from host memory, none when everything fits), "none", "blocks" (every block
        streamed) or "blocks:N" (N blocks resident, the rest streamed; `WanTransformer.offload_blocks`).
        With any offload but "none" each component also leaves the device when its stage is done."""
        from wan_tpu.wan.settings import parse_offload

        self.offload = parse_offload(offload)
        self.offload_plan = None
        return self

    def _resident_blocks(self) -> int | None:
        """DiT blocks to keep on the device (None: all): the explicit choice, else the last run's plan."""
        if isinstance(self.offload, int):
            return self.offload
        return None if self.offload_plan is None else self.offload_plan.resident

    def _place_dit(self, dit):
        """Offload (or bring back) the DiT's blocks as the plan says; a loaded DiT follows a new plan."""
        resident = self._resident_blocks()
        if resident is not None and resident < dit.config.num_layers:
            if not dit.offloaded or dit.resident_block_count != resident:
                dit.offload_blocks(resident)
        elif dit.offloaded:
            dit.restore_blocks()
        return dit

    def _release_stages(self) -> bool:
        """Whether components leave the device after their stage in a whole-pipeline call."""
        return self.offload is not None and (isinstance(self.offload, int) or
                                             (self.offload_plan is not None and self.offload_plan.release))

    @in_pipeline_choice
    def component(self, name: str):
        """The component `name`, loaded on first use (or taken from `prepare`'s background load)."""
        if name not in self._loaded:
            if name not in self._loaders:
                raise WanInputError(f"{self.variant.name} has no {name}; it is not part of this model")
            with scope(f"load_{name}"):
                loaded = self._warmup.take_load(name) if self._warmup is not None else None
                self._loaded[name] = loaded if loaded is not None else self._load(name)
            interrupt.check("load")
        if name in DITS:
            self._place_dit(self._loaded[name])
        elif name == "text_encoder":
            self._place_text_encoder(self._loaded[name])
        return self._loaded[name]

    def _place_text_encoder(self, encoder) -> None:
        """Stream the UMT5 blocks from host memory where the plan says the encoder alone does not fit."""
        resident = None if self.offload_plan is None else self.offload_plan.text_resident
        model = getattr(encoder, "model", None)
        if resident is not None and hasattr(model, "offload_blocks") and resident < model.config.num_layers:
            if not model.offloaded or model.resident_block_count != resident:
                encoder.offload_blocks(resident)

    def _load(self, name: str):
        """Component `name` read from its loader, with the LoRAs registered for it merged (and then, for
        the DiT, quantised if asked for: straight from the file's 8-bit weights when no LoRA is merged)."""
        loader = self._loaders[name]
        loras = [(path, scale) for path, scale, names in self._loras if name in names]
        quantizing = self.quantization and not loras and getattr(loader, "quantizes", False)
        options = {"quantize": self.quantization} if quantizing else {}
        resident = self._resident_blocks()
        if (name in DITS and resident is not None and resident < self.variant.transformer.num_layers and not loras
                and getattr(loader, "quantizes", False)):
            options["offload"] = True  # the block stack read straight into host memory (LoRAs merge on the device)
        plan = self.offload_plan
        if name == "text_encoder" and plan is not None and plan.text_streamed and getattr(loader, "offloads", False):
            options["offload"] = True  # UMT5's blocks too: the encoder alone may not fit the device
        component = loader(**options)
        for path, scale in loras:
            component.load_lora(path, scale)
        if self.quantization and name in ("transformer", "transformer_2") and not component.quantization:
            from wan_tpu.wan.quantize import quantize_transformer

            quantize_transformer(component, self.quantization, self.mesh)
        if name in DITS:
            self._place_dit(component)
        return component

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

    # ---- LoRA ---------------------------------------------------------------------------------

    @in_pipeline_choice
    def load_lora_weights(self, path, scale: float = 1.0, expert: str | None = None) -> None:
        """Merge a LoRA `.safetensors` into the DiT, on device (`wan_tpu.wan.lora`); calls stack.

        Wan 2.2 A14B: `expert="high"` targets the high-noise `transformer`, `"low"` the low-noise
        `transformer_2`, None both (each expert may take its own file and scale). The file is checked
        now; a DiT not loaded yet receives it when it loads (and again after a `release`).
        """
        from wan_tpu.wan.lora import check_lora
        from wan_tpu.wan.transformer import abstract_transformer

        experts = {"high": "transformer", "low": "transformer_2"}
        two = self.variant.boundary_ratio is not None
        if expert is None:
            names = ("transformer", "transformer_2") if two else ("transformer",)
        elif expert in experts and two:
            names = (experts[expert],)
        elif expert in experts:
            raise WanInputError(f"{self.variant.name} has one transformer, not two experts; load the LoRA without "
                                f"expert={expert!r} (--lora, not --lora-{expert})")
        else:
            raise WanInputError(f"expert must be 'high', 'low' or None (both), got {expert!r}")
        configs = {"transformer": self.variant.transformer, "transformer_2": self.variant.transformer_2}
        for name in names:
            check_lora(abstract_transformer(configs[name]), path, scale)
        self._loras.append((os.fspath(path), float(scale), names))
        for name in names:
            if name in self._loaded and self._loaded[name].offloaded:
                self.release(name)  # merged on the device as it loads again, before its blocks leave
            elif name in self._loaded:
                self._loaded[name].load_lora(path, scale)

    @in_pipeline_choice
    def unload_lora_weights(self) -> None:
        """Undo every `load_lora_weights`: the DiT weights as loaded, bit for bit."""
        for name in ("transformer", "transformer_2"):
            if name in self._loaded and self._loaded[name].offloaded:
                self.release(name)
            elif name in self._loaded:
                self._loaded[name].unload_lora()
        self._loras.clear()

    @property
    def model_id(self) -> dict:
        """What identifies this model in stage-file metadata (the variant and its architecture)."""
        return {"variant": self.variant.name, "transformer": config_to_json(self.variant.transformer),
                "vae": dataclasses.asdict(self.vae_config)}

    def settings(self, **kwargs) -> RunSettings:
        """Validated run settings; None values take the model's official defaults."""
        return resolve_settings(self.variant, self.vae_config, **kwargs)

    @in_pipeline_choice
    def prepare(self, settings: RunSettings | None = None, *, scheduler: str = "unipc", image: bool = False,
                sigmas=None, timesteps=None, cache=None, cache_threshold: float | None = None):
        """Start reading every component a run with `settings` needs and compiling its text encoder, denoise step
        and VAE decode, in background threads; returns at once (a `wan_tpu.runtime.compile_ahead.Warmup` of futures; as a
        context manager, leaving it waits for the threads, cancelling what has not started).

        `component()`, `denoise()` and `decode()` then wait for what they need only. `image`: the run
        conditions on an image (I2V/TI2V); `scheduler`, `sigmas`, `timesteps`, `cache`, `cache_threshold`:
        as the `denoise` call will get them (the step program depends on them). Results are bit-identical with and without it; see
        `wan_tpu.runtime.compile_ahead` for what runs when and what it does to peak memory. With a mesh, the programs
        compile once their component is read (on GPUs the first call then waits for all of them). The threads run in
        this pipeline's `compile_cache` choice.
        """
        from wan_tpu.runtime import compile_ahead
        from wan_tpu.runtime.compile_ahead import Warmup
        from wan_tpu.wan.memory import decode_compiles_beside_denoise, weights_fit

        s = settings or self.settings()
        sampling = self.sampling(s, scheduler, sigmas, timesteps, cache, cache_threshold,
                                 with_image=image and self.variant.expand_timesteps)
        warmup = self._warmup = Warmup(compile_cache=self.compile_cache)
        dits = [n for n in ("transformer", "transformer_2") if n in self._loaders]
        encoders = ["text_encoder"] + (["image_encoder"] if image and "image_encoder" in self._loaders else [])
        todo = [n for n in (*encoders, *dits, "vae") if n not in self._loaded]
        ahead = weights_fit(self._weight_bytes(), todo, self.mesh)
        streamed_text = self.offload_plan is not None and self.offload_plan.text_streamed
        if self.mesh is None and self.text_encoder_config is not None and not streamed_text:
            # From the config alone: compiles while the weights are read (one program per prompt count).
            warmup.start("text", self._compile_text, 2 if s.do_cfg else 1, kind="compile")
        for name in todo:
            if ahead or name not in dits:
                warmup.start(name, self._load, name)
        if self.mesh is not None:
            # On a mesh the programs compile ahead from the loaded modules (their weights' placements are the
            # loader's); the step and the decode place their inputs themselves, whatever the stage before gave.
            if "text_encoder" in self._loaders and not streamed_text:
                source = self._loaded["text_encoder"] if "text_encoder" in self._loaded else warmup.loads["text_encoder"]
                warmup.start("text", self._compile_loaded_text, source, 2 if s.do_cfg else 1, kind="compile")
            if ahead and cache is None:  # a step cache's carry takes its placement from the first step
                sources = [self._loaded[n] if n in self._loaded else warmup.loads[n] for n in dits]
                warmup.start("denoise", self._compile_denoise, warmup, s, sampling, image, sources, kind="compile")
            vae = self._loaded["vae"] if "vae" in self._loaded else warmup.loads["vae"]
            warmup.start("decode", self._compile_decode, warmup, s, vae, kind="compile")
            # A program of collectives first run while XLA autotunes on the same GPUs fails to set up its
            # communicators ("Failed to synchronize device activity", 14B 720p on 4 H200s in one process).
            warmup.exclusive = compile_ahead.autotunes_on_device()
            return warmup
        if ahead:
            sources = [self._loaded[n] if n in self._loaded else warmup.loads[n] for n in dits]
            warmup.start("denoise", self._compile_denoise, warmup, s, sampling, image, sources, kind="compile")
        vae = self._loaded["vae"] if "vae" in self._loaded else warmup.loads["vae"]
        warmup.start("decode", self._compile_decode, warmup, s, vae, kind="compile")
        # The decode's programs start at once, from the VAE's shapes, beside the loads; they go on beside the
        # denoise unless they would not fit it, or the first step is set to wait for a device's autotuning.
        waits = compile_ahead.WAIT_FOR_DEVICE_AUTOTUNING and compile_ahead.autotunes_on_device()
        self._decode_beside_denoise = decode_compiles_beside_denoise(self, s) and not waits
        return warmup

    def _wait_compiled(self, *names: str) -> None:
        """Wait for `prepare`'s compiles `names` (`Warmup.exclusive`: for all of them)."""
        for name in names if self._warmup is not None else ():
            self._warmup.wait_compiled(name)

    def _weight_bytes(self) -> dict[str, int]:
        """Component → device bytes of its weights (from the checkpoint's element counts; empty for presets)."""
        itemsize = {"vae": jnp.dtype(self.vae_dtype).itemsize, "image_encoder": 4}  # CLIP runs float32
        return {n: count * itemsize.get(n, jnp.dtype(self.dtype).itemsize)
                for n, count in (self.weight_elements or {}).items()}

    def _compile_text(self, batch: int) -> None:
        from wan_tpu.encoders.umt5_text import compile_encode

        compile_encode(self.text_encoder_config, self.dtype, batch)

    @staticmethod
    def _compile_loaded_text(source, batch: int) -> None:
        (source.result() if hasattr(source, "result") else source).compile(batch)

    def _compile_denoise(self, warmup, s: RunSettings, sampling, image: bool, sources) -> None:
        from wan_tpu.wan.denoise import compile_steps

        shape = self.latent_shape(s.height, s.width, s.num_frames)
        cond = self._abstract_conditioning(s, shape, image)
        if cond is None:
            return
        sched, step = sampling

        def compile_for(transformers, key):
            if warmup.cancelled.is_set():
                return
            compile_steps(transformers, shape, cond, sched, self.variant.boundary_ratio, mesh=self.mesh, cache=step,
                          program_key=key)

        # The noise sampler's programs (any seed: one) beside the step's.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=threading.current_thread().name) as pool:
            noise = pool.submit(self.prepare_latents, 0, s.height, s.width, s.num_frames)
            # From the DiTs' abstract modules, where the loads make those: the step is read from the executable
            # cache, or traced and compiled, while the weights are read (after them: 3.5 s more of a 1.3B cold
            # start on an H200, and a warm one traced and lowered it again, 1.5 s).
            abstract = self._abstract_dits(len(sources))
            key = None if abstract is None else self._step_key(abstract)
            if key is not None:
                compile_for(abstract, key)
            transformers = [src.result() if hasattr(src, "result") else src for src in sources]
            if key is None or self._step_key(transformers) != key:
                compile_for(transformers, None)  # not what their configs describe: through jit, as `denoise` runs it
        noise.result()

    def _abstract_dits(self, count: int) -> list | None:
        """The first `count` DiTs as their loaders make them, without weights (`stacking.eval_shape` of their
        constructor; once per process), or None where a load may make another module (quantised, streamed
        from host memory, given an attention kernel: hook objects of its own, or on a mesh)."""
        configs = [self.variant.transformer, self.variant.transformer_2][:count]
        resident = self._resident_blocks()
        if (self.mesh is not None or self.quantization or self.attention_impl is not None
                or (resident is not None and resident < min(c.num_layers for c in configs))):
            return None
        return [_abstract_dit(c, self.dtype) for c in configs]

    def _step_key(self, transformers) -> tuple | None:
        """What determines the denoise step's program for `transformers` besides its arguments' shapes
        (`denoise`'s `program_key`: the executable cache's key), where they are the DiTs their configs describe
        (`_abstract_dits` themselves, or loaded ones that `compile_ahead.serves`): the configs and the dtype.
        None otherwise: their step runs through jit."""
        from wan_tpu.runtime.compile_ahead import serves

        abstract = self._abstract_dits(len(transformers))
        if abstract is None or not all(t is a or serves(t, a) for t, a in zip(transformers, abstract)):
            return None
        return "wan-dit", tuple(a.config for a in abstract), jnp.dtype(self.dtype).name

    def _abstract_conditioning(self, s: RunSettings, shape, image: bool) -> Conditioning | None:
        """The shapes of what `_conditioning` builds for this run (None for Wan 2.1 I2V, whose CLIP token
        count comes from the image encoder's own config: that step compiles on use)."""
        from wan_tpu.encoders.umt5_text import MAX_SEQUENCE_LENGTH

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
        from wan_tpu.runtime.compile_ahead import SideBySide, serves
        from wan_tpu.vae import model as vae_lib
        from wan_tpu.vae.loading import abstract_vae
        from wan_tpu.wan.memory import free_bytes_after_release

        shape = self.latent_shape(s.height, s.width, s.num_frames)

        def compile_for(vae):
            with SideBySide(warmup.cancelled) as compiles:  # every decode program at once (`SideBySide`)
                video = vae.compile_decode(shape, free_bytes=free_bytes_after_release(vae), compiles=compiles)
                if video is not None:
                    compiles.add(vae_lib.to_uint8.lower(video))

        # From the VAE's abstract module (`load_vae`'s own): the programs compile while the weights are read.
        # On a mesh the loaded VAE's replicated placement is part of the program: it waits for the load.
        abstract = (abstract_vae(self.vae_config, self.vae_dtype)
                    if hasattr(source, "result") and self.mesh is None else None)
        if abstract is not None:
            compile_for(abstract)
        vae = source.result() if hasattr(source, "result") else source
        if abstract is None or not serves(vae, abstract):
            compile_for(vae)

    # ---- stage 1 ------------------------------------------------------------------------------

    @in_pipeline_choice
    def encode_prompt(self, prompt: str, negative_prompt: str | None = None, guidance_scale: float | None = None) -> dict:
        """`{"prompt_embeds": (1, 512, d), "negative_prompt_embeds": ... (only with CFG)}`.

        `negative_prompt=None` uses the official Wan negative prompt; `""` is a valid empty one.
        """
        from wan_tpu.encoders.umt5_text import WAN_NEGATIVE_PROMPT

        if negative_prompt is None:
            negative_prompt = WAN_NEGATIVE_PROMPT
        settings = self.settings(guidance_scale=guidance_scale)
        check_prompts(prompt, negative_prompt, settings.do_cfg)
        prompts = [prompt, negative_prompt] if settings.do_cfg else [prompt]
        encoder = self.text_encoder
        self._wait_compiled("text")
        with scope("text_encode"):
            embeds = jax.block_until_ready(encoder.encode(prompts))
        interrupt.check("encode")
        out = {"prompt_embeds": embeds[:1]}
        if settings.do_cfg:
            out["negative_prompt_embeds"] = embeds[1:]
        return out

    @in_pipeline_choice
    def encode_image(self, image, height: int | None = None, width: int | None = None,
                     num_frames: int | None = None) -> dict:
        """The image conditioning: `condition` (I2V) or `first_frame` (TI2V), plus `image_embeds` (CLIP)."""
        s = self.settings(height=height, width=width, num_frames=num_frames)
        if self.variant.task == "t2v":
            raise WanInputError(f"{self.variant.name} is a text-to-video model and takes no image; drop --image")
        pixels = conditioning.preprocess_image(image, s.height, s.width)
        self._wait_compiled("image")  # none of that name: waits only where no call may run beside a compile
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

    @in_pipeline_choice
    def prepare_latents(self, seed: int, height: int, width: int, num_frames: int) -> jax.Array:
        """The initial noise: float32 standard normal from `jax.random.key(seed)`."""
        return jax.random.normal(jax.random.key(seed), self.latent_shape(height, width, num_frames), jnp.float32)

    @in_pipeline_choice
    def denoise(self, embeds: dict, latents=None, seed: int = 0, height: int | None = None, width: int | None = None,
                num_frames: int | None = None, num_inference_steps: int | None = None,
                guidance_scale: float | None = None, guidance_scale_2: float | None = None,
                flow_shift: float | None = None, scheduler: str = "unipc", progress: bool = True,
                step_seconds: list | None = None, sigmas=None, timesteps=None, cache=None,
                cache_threshold: float | None = None, on_step=None) -> jax.Array:
        """Final latents `(1, z, F, h, w)` from stage-1 `embeds` (+ `encode_image` output for I2V/TI2V).

        `latents` overrides the seeded initial noise (e.g. to compare with another implementation).
        `sigmas` / `timesteps`: a given schedule (few-step sampling; see `make_custom_scheduler`), one
        value per step. `cache`: a step cache, "teacache", "magcache", "fbcache" or a config of
        `wan_tpu.wan.step_cache` (`cache_threshold` overrides its threshold); afterwards `self.cache_stats`
        says how many steps skipped the DiT blocks. `on_step(done, total)`: called after each step
        (`wan_tpu.wan.denoise.denoise`).
        """
        num_inference_steps = schedule_steps(num_inference_steps, sigmas, timesteps)
        s = self.settings(height=height, width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
                          guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, flow_shift=flow_shift)
        sched, step = self.sampling(s, scheduler, sigmas, timesteps, cache, cache_threshold,
                                    with_image="first_frame" in embeds)
        shape = self.latent_shape(s.height, s.width, s.num_frames)
        # First: `prepare` compiles the initial noise's program with the step's; drawing it before that
        # compile ends would compile it a second time here (seen under load).
        self._wait_compiled("denoise", *(() if self._decode_beside_denoise else ("decode",)))
        if latents is None:
            latents = self.prepare_latents(seed, s.height, s.width, s.num_frames)
        elif tuple(latents.shape) != shape:
            raise WanInputError(f"latents have shape {tuple(latents.shape)}, but this run needs {shape}")
        cond = self._conditioning(embeds, s, shape)
        experts = [self.transformer]
        guidance = [s.guidance_scale]
        if self.variant.boundary_ratio is not None:
            experts.append(self.transformer_2)
            guidance.append(s.guidance_scale_2)
        stats = []
        with scope("denoise"):
            # A prepared run's step is the one `prepare` read from (or wrote to) the executable cache.
            key = None if self._warmup is None else self._step_key(experts)
            out = denoise(experts, jnp.asarray(latents), cond, sched, guidance, self.variant.boundary_ratio,
                          mesh=self.mesh, progress=progress, step_seconds=step_seconds, cache=step, cache_stats=stats,
                          on_step=on_step, program_key=key)
        self.cache_stats = stats[0] if stats else None
        return out

    def sampling(self, s: RunSettings, scheduler: str = "unipc", sigmas=None, timesteps=None, cache=None,
                 cache_threshold: float | None = None, with_image: bool = False):
        """(scheduler, resolved step cache or None) of a run; `WanInputError` on bad choices, before any work."""
        from wan_tpu.wan import step_cache

        if sigmas is None and timesteps is None:
            sched = make_scheduler(scheduler, s.num_inference_steps, s.flow_shift)
        else:
            sched = make_custom_scheduler(scheduler, s.flow_shift, sigmas=sigmas, timesteps=timesteps)
        config = step_cache.make_cache(cache, cache_threshold)
        if config is None and cache_threshold is not None:
            raise WanInputError("a cache threshold needs a cache; pass --cache teacache|magcache|fbcache")
        return sched, None if config is None else step_cache.resolve(config, self.variant.name, with_image)

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

    @in_pipeline_choice
    def decode(self, latents) -> np.ndarray:
        """uint8 frames `(T, H, W, 3)` from normalized latents `(1, z, F, h, w)`."""
        vae = self.vae
        self._wait_compiled("decode")
        with scope("vae_decode"):
            z = vae.denormalize_latents(jnp.asarray(latents, jnp.float32)).astype(vae.dtype)
            video = jax.block_until_ready(vae.decode(z))
            interrupt.check("decode")
            frames = distributed.to_host(frames_to_uint8(video))  # gathered whole when it spans processes
        return frames[0]

    # ---- all stages ---------------------------------------------------------------------------

    @in_pipeline_choice
    def __call__(self, prompt: str, negative_prompt: str | None = None, height: int | None = None,
                 width: int | None = None, num_frames: int | None = None, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, flow_shift: float | None = None, seed: int = 0, image=None,
                 guidance_scale_2: float | None = None, latents=None, output_type: str = "np",
                 progress: bool = True, scheduler: str = "unipc", sigmas=None, timesteps=None, cache=None,
                 cache_threshold: float | None = None, on_step=None) -> np.ndarray:
        """Generate a video: uint8 frames `(T, H, W, 3)` (`output_type="latent"`: the final latents).

        None settings take the model's official defaults (Wan 2.1 T2V 1.3B: 480×832, 81 frames,
        50 steps, guidance 5.0, shift 5.0; see `wan_tpu.configs.models.VARIANTS`). `guidance_scale_2`
        is the low-noise expert's guidance (Wan 2.2 A14B; default: `guidance_scale` if that is given).
        `latents` replaces the seeded initial noise. `scheduler`, `sigmas`, `timesteps`, `cache`,
        `cache_threshold`, `on_step`: as `denoise` (`self.cache_stats` reports a step cache's skipped steps).
        """
        num_inference_steps = schedule_steps(num_inference_steps, sigmas, timesteps)
        s = self.settings(height=height, width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
                          guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, flow_shift=flow_shift)
        self.check_run(s, image, negative_prompt=negative_prompt, prompt=prompt)
        embeds = self.encode_prompt(prompt, negative_prompt, s.guidance_scale)
        if image is not None:
            embeds.update(self.encode_image(image, s.height, s.width, s.num_frames))
        if self._release_stages():  # each stage's peak its own (`set_offload`)
            self.release("text_encoder", "image_encoder")
        out = self.denoise(embeds, latents=latents, seed=seed, height=s.height, width=s.width,
                           num_frames=s.num_frames, num_inference_steps=s.num_inference_steps,
                           guidance_scale=s.guidance_scale, guidance_scale_2=s.guidance_scale_2,
                           flow_shift=s.flow_shift, progress=progress, scheduler=scheduler, sigmas=sigmas,
                           timesteps=timesteps, cache=cache, cache_threshold=cache_threshold, on_step=on_step)
        if output_type == "latent":
            return out
        if self._release_stages():
            self.release(*DITS)
        return self.decode(out)


    def check_run(self, s: RunSettings, image=None, *, prompt: str | None = None, negative_prompt: str | None = None,
                  stages=STAGES, keep_dit: bool = False, memory: bool = True) -> None:
        """Everything about a run of `stages` that can be checked before loading: the prompts, the image
        (readable, and wanted by this model), and that it fits in memory (`check_fits`)."""
        from wan_tpu.runtime.validate import check_image

        if prompt is not None:
            check_prompts(prompt, negative_prompt, s.do_cfg)
        if image is not None and self.variant.task == "t2v":
            raise WanInputError(f"{self.variant.name} is a text-to-video model and takes no image; drop --image")
        if image is None and self.variant.task == "i2v" and "image" in stages:
            raise WanInputError(f"{self.variant.name} is an image-to-video model; pass the first frame with --image PATH")
        check_image(image)
        if memory:
            self.check_fits(s, stages, keep_dit=keep_dit, image=image is not None)

    def check_fits(self, s: RunSettings, stages=STAGES, keep_dit: bool = False, image: bool = False) -> None:
        """Refuse (`WanInputError`) a run whose stages would not fit in memory, unless `check_memory` is
        off; `keep_dit`: the DiT stays loaded through decoding (several videos in one run)."""
        from wan_tpu.wan.memory import OffloadPlan, check_fits, plan_offload

        if not self.check_memory:
            resident = self.offload if isinstance(self.offload, int) else None
            self.offload_plan = OffloadPlan(resident, self.variant.transformer.num_layers, resident is not None)
            return
        if "denoise" in stages:
            plan = plan_offload(self, s, self.offload, self.attention_impl)
            if self.offload == "auto" and (plan.streamed or plan.text_streamed) and plan != self.offload_plan:
                print(plan.describe())  # once per choice, not once per video
            self.offload_plan = plan
        check_fits(self, s, stages, self.attention_impl, keep_dit=keep_dit, image=image)

def schedule_steps(num_inference_steps, sigmas, timesteps):
    """The step count of a run with a given schedule: its length (a different `num_inference_steps` is an error)."""
    given = sigmas if sigmas is not None else timesteps
    if given is None:
        return num_inference_steps
    if not hasattr(given, "__len__"):
        raise WanInputError(f"sigmas / timesteps must be a list of numbers, one per step, got {given!r}")
    if num_inference_steps is not None and num_inference_steps != len(given):
        raise WanInputError(f"{len(given)} sigmas/timesteps but {num_inference_steps} steps; drop --steps or give one "
                            "value per step")
    return len(given)


def check_prompts(prompt: str, negative_prompt: str | None, do_cfg: bool) -> None:
    """An empty prompt is fine with CFG against a non-empty negative prompt (None: the official one)."""
    if not isinstance(prompt, str):
        raise WanInputError(f"prompt must be a string, got {type(prompt).__name__}")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise WanInputError(f"negative prompt must be a string, got {type(negative_prompt).__name__}")
    if not prompt.strip() and (not do_cfg or not (negative_prompt is None or negative_prompt.strip())):
        raise WanInputError("the prompt is empty and there is no negative prompt to guide against; pass --prompt TEXT")


@functools.cache
def _abstract_dit(config, dtype):
    """`WanPipeline._abstract_dits`' module: the loaders' constructor, shapes only (one per config and dtype)."""
    from flax import nnx

    from wan_tpu.loading import stacking
    from wan_tpu.wan.transformer import WanTransformer

    return stacking.eval_shape(lambda: WanTransformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


def _folder_loaders(path, parts, dtype, mesh, attention, vae_dtype) -> dict:
    # Imports stay inside the loaders: a run that fails validation never pays for (or hears from)
    # transformers and torch.
    sub = functools.partial(os.path.join, path)

    def dit(folder, quantize=None, offload=False):
        from wan_tpu.wan.transformer_loading import load_transformer

        return set_attention(load_transformer(sub(folder), dtype=dtype, mesh=mesh, quantize=quantize, offload=offload),
                             attention, mesh)

    def vae():
        from wan_tpu.vae.loading import load_vae

        return load_vae(sub(parts["vae"]), dtype=vae_dtype, mesh=mesh)

    def text_encoder(offload=False):
        from wan_tpu.encoders.umt5_text import UMT5TextEncoder

        return UMT5TextEncoder.from_pretrained(sub(parts["text_encoder"]), sub(parts["tokenizer"]), dtype=dtype, mesh=mesh,
                                               offload=offload)

    text_encoder.offloads = True  # takes `offload=` (`WanPipeline._load`)

    def image_encoder():
        from wan_tpu.encoders.clip_image import CLIPImageEncoder

        # A single CLIP file has no image_processor/: `from_pretrained` gives it the default preprocessing.
        processor = sub(parts["image_processor"]) if "image_processor" in parts else None
        return CLIPImageEncoder.from_pretrained(sub(parts["image_encoder"]), processor, dtype=jnp.float32, mesh=mesh)

    loaders = {"transformer": functools.partial(dit, parts["transformer"]), "vae": vae, "text_encoder": text_encoder}
    if "transformer_2" in parts:
        loaders["transformer_2"] = functools.partial(dit, parts["transformer_2"])
    for name in ("transformer", "transformer_2"):
        if name in loaders:
            loaders[name].quantizes = True  # takes `quantize=` and `offload=` (`WanPipeline._load`)
    if "image_encoder" in parts:
        loaders["image_encoder"] = image_encoder
    return loaders
