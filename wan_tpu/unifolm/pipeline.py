"""`UnifolmPipeline`: UnifoLM-WMA-0 (Unitree's world-model-action model) from observations to video and actions.

    pipe = UnifolmPipeline.from_pretrained("ckpt/unifolm-wma-0")       # or the preset "unifolm-tiny"
    pipe.prepare("decision")                                           # optional: loads and compiles ahead
    out = pipe.decide("pick up the cup", images, states)               # 16 frames + a 16-step action chunk
    out = pipe.predict(images, states, actions)                        # world model: frames + next states
    episode = pipe.interact("pick up the cup", image, state, iterations=3)   # decide, then predict, repeated
    video = pipe.generate("pick up the cup", image)                    # base checkpoints: text + image → video

`images` are the observed frames, (n_obs, H, W, 3) uint8 or (n_obs, 3, H, W) floats in [-1, 1] at the
model's size (320×512 for UnifoLM-WMA-0); `states` (n_obs, dof) and `actions` (16, dof) are in the
robot's units when the pipeline has the dataset's min-max table (`stats.safetensors` of the checkpoint
folder or `stats=`), normalised to [-1, 1] otherwise; fewer than n_obs observations are padded by
repeating the first, as the authors' queues do. Outputs come back in the same space, cut to the
robot's degrees of freedom (`.actions`, `.states`), beside the raw 16-d model outputs.

The stages are Wan's: encode conditions (OpenCLIP text, OpenCLIP image tokens and the VAE latent of
the last observed frame, then the model's step-invariant `prepare`: projectors, Resampler, action
tokens, observation encoders), sample (one compiled DDIM loop for video, actions and states), decode
(VAE, frame by frame). Randomness is JAX's: `seed` → the VAE posterior sample and the sampler's noise.
What the authors' scripts do, kept: decision-making uses the instruction and zeroed action
embeddings, the world model the empty prompt and the given actions; the interaction loop pushes the
predicted actions (masked to the robot's DoF) into the action queue, then the world model's frames
and states into the observation queues, and feeds back the decoded frames unclamped.

`from_pretrained(path_or_preset, *, mesh=None, dtype=float32, attention=None, compile_cache=True, stats=None,
encoder_dtype=float32)` is the constructor the three pipelines share (`WanPipeline`, `MatrixGamePipeline`).
The components (model, VAE, image and text encoder) load on first use; `prepare(mode)` instead starts
loading them all at once and, meanwhile, loading or compiling the stage programs of `mode` (prepare,
sampling, decode: `wan_tpu.runtime.executable_cache`) in background threads (`wan_tpu.runtime.compile_ahead.Warmup`),
from the model's and VAE's abstract modules (their configs alone) and the encoders' output shapes. The
calls then wait for what they need only, and run the very programs compiled ahead: results are
bit-identical with and without `prepare`. The pipeline's `compile_cache` choice applies to its own work
only (`wan_tpu.runtime.compile_cache.selected`).

Small devices: `offload="auto"` (the default; `set_offload`) parks the CLIP towers in host memory
(`wan_tpu.parallel.offload.park`) once a call's conditions are encoded, and brings each back when it next
encodes, where every component's weights and the sampling's working set (`sampling_bytes`) do not fit the
device together (`encoders_leave_device`). By that estimate UnifoLM-WMA-0 in float32 (13.5 GiB of weights,
3.6 of them the towers, + 3.9 GiB sampling) fits a 24 GB card whole, and a 16 GB one with its towers parked.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.parallel.offload import on_host, park, unpark
from wan_tpu.runtime import distributed, executable_cache, interrupt
from wan_tpu.runtime.compile_cache import in_pipeline_choice
from wan_tpu.unifolm import presets

PRESETS = tuple(presets.PRESETS)  # "unifolm-tiny", "unifolm-tiny-base"
FPS = 8  # the authors save every video at 8 fps
STATS_FILE = "stats.safetensors"
MODES = ("decision", "world", "interact", "generate")  # what `prepare(mode)` compiles for: decide, predict, both, generate
# DDIM steps of each mode unless given: the authors' (their scripts: 50 for the world model's modes, 16 for
# the base model's generation); the tiny presets' are fewer (`presets.TINY_STEPS`).
DEFAULT_STEPS = {"decision": 50, "world": 50, "interact": 50, "generate": 16}
# A step's programs where compile workers run (`set_sampling_programs`): the UNet in 4 pieces compiled at once in
# separate processes. UnifoLM-WMA-0 `--mode decision --steps 16` on an H200, same call, in turns (2026-11-29,
# `benchmarks/profile_compile.py unifolm --device`): first sampling 43.3 / 40.2 s cold vs 70.9 / 69.7 s for one
# program in one process, warm 10.9 / 9.9 vs 10.0 / 10.0 s. In another call 8 pieces in 8 workers: 48.6 s cold vs
# 46.2 s for 4 in 4 (docs/TRIED.md).
WORKER_SAMPLING_PROGRAMS = 4


@dataclass(frozen=True)
class MinMaxTable:
    """The dataset's min-max statistics (LeRobot `meta_data/stats.safetensors`): the robot's DoF and the
    maps to and from [-1, 1] of the authors' `Normalize` / `Unnormalize` (`data/normolize.py`)."""

    action_min: np.ndarray
    action_max: np.ndarray
    state_min: np.ndarray
    state_max: np.ndarray

    @classmethod
    def from_file(cls, path: str) -> MinMaxTable:
        from wan_tpu.loading.checkpoint import TensorSource

        if not os.path.isfile(path):
            raise WanInputError(f"stats file {path!r} does not exist; pass a LeRobot meta_data/stats.safetensors")
        src = TensorSource([path])
        keys = ("action/min", "action/max", "observation.state/min", "observation.state/max")
        missing = [k for k in keys if k not in src]
        if missing:
            raise WanInputError(f"{path}: no {missing[0]!r}; pass a stats.safetensors with action and observation.state min/max")
        return cls(*(np.asarray(src[k], np.float32).reshape(-1) for k in keys))

    def normalize(self, x, kind: str) -> np.ndarray:
        lo, hi = (self.action_min, self.action_max) if kind == "action" else (self.state_min, self.state_max)
        return ((np.asarray(x, np.float32) - lo) / (hi - lo + 1e-8)) * 2 - 1

    def unnormalize(self, y, kind: str) -> np.ndarray:
        lo, hi = (self.action_min, self.action_max) if kind == "action" else (self.state_min, self.state_max)
        return (np.asarray(y, np.float32) + 1) / 2 * (hi - lo) + lo


@dataclass
class UnifolmOutput:
    """One sampling: `video` (T, H, W, 3) uint8; `actions` / `states` (16, dof) in the inputs' space
    (None where the mode predicts none); `video_raw` (3, T, H, W) decoded floats (unclamped) and
    `actions_raw` / `states_raw` (16, 16) normalised model outputs."""

    video: np.ndarray
    video_raw: np.ndarray
    actions: np.ndarray | None = None
    states: np.ndarray | None = None
    actions_raw: np.ndarray | None = None
    states_raw: np.ndarray | None = None


@dataclass
class Episode:
    """`interact`'s result: the world model's frames of every iteration one after the other, and each
    iteration's decision and world-model outputs."""

    video: np.ndarray
    decisions: list[UnifolmOutput] = field(default_factory=list)
    predictions: list[UnifolmOutput] = field(default_factory=list)


def to_uint8(video) -> np.ndarray:
    """(3, T, H, W) in [-1, 1] → (T, H, W, 3) uint8 as the authors' `save_results` (clamp, truncate)."""
    v = np.clip(np.asarray(video, np.float32), -1.0, 1.0)
    return ((v + 1.0) / 2.0 * 255).astype(np.uint8).transpose(1, 2, 3, 0)


class UnifolmPipeline:
    """A UnifoLM model ready to decide, predict, interact or generate; see the module docstring.

    `config` / `vae_config`: the model's and the VAE's; `loaders`: component name ("model", "vae",
    "image_encoder", "text_encoder") → a function loading it; `abstracts`: "model" / "vae" → a function
    building it without weights (`nnx.eval_shape`), what `prepare` compiles the stage programs for
    (default: `abstract_builds`, the modules the folder's and the presets' loaders fill); `default_steps`:
    mode → DDIM steps when a call gives none (default: `DEFAULT_STEPS`, the authors')."""

    COMPONENTS = ("model", "vae", "image_encoder", "text_encoder")

    def __init__(self, config, vae_config, loaders: dict, *, stats: MinMaxTable | None = None, name: str = "unifolm",
                 dtype=jnp.float32, mesh=None, attention: str | None = None, compile_cache: bool | None = None,
                 abstracts: dict | None = None, default_steps: dict | None = None):
        self.config = config
        self.default_steps = {**DEFAULT_STEPS, **(default_steps or {})}
        self.vae_config = vae_config
        self.stats = stats
        self.name = name
        self.dtype = dtype
        self.mesh = mesh
        self.attention_impl = attention
        # Whether this pipeline's own loads, compiles and calls read and write the compile cache and the
        # executable cache in it: applied around them only (`compile_cache.selected`), never process-wide.
        # None (built directly, not by `from_pretrained`): the process's own state.
        self.compile_cache = None if compile_cache is None else bool(compile_cache)
        h, w = self.config.latent_size
        self.height, self.width = h * vae_config.downscale, w * vae_config.downscale
        self._loaders = dict(loaders)
        # Default: the model and VAE the loaders fill (without a mesh), from the configs alone.
        self._abstracts = abstracts if abstracts is not None else abstract_builds(config, vae_config, dtype, attention)
        self._loaded: dict = {}
        self._warmup = None
        self.offload = "auto"  # `set_offload`'s choice
        self.sampling_programs = 1  # `set_sampling_programs`' choice
        self._text_cache: dict[str, jax.Array] = {}
        self.timer = None  # a `wan_tpu.runtime.profiling.StageTimer` to time the stages of every sampling
        # What determines the stage programs short of tracing them (`wan_tpu.runtime.executable_cache` adds
        # versions, devices, settings and this package's sources): the configs, the model dtype and the
        # attention setting, without a mesh. None (sharded: the attention hooks and kernel layout change
        # the programs too): the programs are traced in every process and not compiled ahead.
        self.program_key: tuple | None = None if mesh is not None else _program_key(config, vae_config, dtype, attention)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_preset: str, *, mesh=None, dtype=jnp.float32, attention: str | None = None,
                        compile_cache: bool = True, stats: str | None = None,
                        encoder_dtype=jnp.float32, offload: str = "auto",
                        sampling_programs: int | None = None) -> UnifolmPipeline:
        """A converted checkpoint folder (`wan-convert-unifolm` (`wan_tpu/unifolm/convert.py`)) or a preset name
        (`unifolm-tiny`, `unifolm-tiny-base`: random weights, seconds on a CPU).

        `mesh`: a device mesh to shard over (None: one device). `dtype`: the model's (UNet, heads,
        projectors; default float32, as the authors run it); the VAE runs in float32. `attention`: the
        attention kernel's name (default: the fastest for the backend). `compile_cache`: whether this
        pipeline's compiles read and write the persistent compilation cache (`wan_tpu.runtime.compile_cache`)
        and its executable cache (the default: a later process loads the compiled sampling instead of
        compiling it for minutes), or not; applied around its own work only. UnifoLM's options: `stats`, a
        LeRobot stats.safetensors (default: the folder's, when present); `encoder_dtype`: the CLIP towers'
        (float32 by default, as the authors; bfloat16 halves their memory; the presets' random towers stay
        float32). `offload`: "auto", "none" or "encoders" (`set_offload`); `sampling_programs`: the programs each
        sampling step runs as (`set_sampling_programs`). The configs are read now (a bad
        folder is a `WanInputError` at once); the components load on first use, or in the background after
        `prepare`."""
        table = None if stats is None else MinMaxTable.from_file(stats)
        if path_or_preset in PRESETS:
            return presets.PRESETS[path_or_preset](cls, dtype=dtype, mesh=mesh, attention=attention, stats=table,
                                                   compile_cache=bool(compile_cache)).set_offload(
                offload).set_sampling_programs(sampling_programs)
        path = os.fspath(path_or_preset)
        if not os.path.isdir(path):
            if os.path.isfile(path) and path.endswith((".ckpt", ".pt", ".pth", ".bin")):
                raise WanInputError(f"{path} is a pickle checkpoint; convert it first: wan-convert-unifolm {path} OUT_DIR")
            raise WanInputError(f"model {path!r} is neither a converted UnifoLM folder nor a preset; pass a folder made by "
                                f"wan-convert-unifolm or one of {', '.join(PRESETS)}")
        from wan_tpu.configs.autoencoder_kl import config_from_json as vae_config_from_json
        from wan_tpu.loading.checkpoint import read_config, require_file

        sub = functools.partial(os.path.join, path)
        config = _read_config(path)
        vae_config = vae_config_from_json(read_config(sub("vae"), "VAE"))
        require_file(sub("image_encoder"), "config.json", "image_encoder")
        require_file(sub("text_encoder"), "config.json", "text_encoder")
        require_file(sub("tokenizer"), "tokenizer_config.json", "tokenizer")

        def model():
            from wan_tpu.unifolm.loading import load_unifolm

            return load_unifolm(path, dtype=dtype, mesh=mesh, attention_impl=attention)

        def vae():
            from wan_tpu.unifolm.autoencoder_kl_loading import load_autoencoder_kl

            return load_autoencoder_kl(sub("vae"), mesh=mesh)

        def image_encoder():
            from wan_tpu.encoders.openclip import OpenCLIPImageEncoder

            return OpenCLIPImageEncoder.from_pretrained(sub("image_encoder"), dtype=encoder_dtype, mesh=mesh,
                                                        attention_impl=attention)

        def text_encoder():
            from wan_tpu.encoders.openclip import OpenCLIPTextEncoder

            return OpenCLIPTextEncoder.from_pretrained(sub("text_encoder"), sub("tokenizer"), dtype=encoder_dtype,
                                                       mesh=mesh)

        def abstract_image_encoder():
            from wan_tpu.encoders.openclip import OpenCLIPImageEncoder

            return OpenCLIPImageEncoder.abstract(sub("image_encoder"), dtype=encoder_dtype, attention_impl=attention)

        def abstract_text_encoder():
            from wan_tpu.encoders.openclip import OpenCLIPTextEncoder

            return OpenCLIPTextEncoder.abstract(sub("text_encoder"), sub("tokenizer"), dtype=encoder_dtype)

        if table is None and os.path.isfile(sub(STATS_FILE)):
            table = MinMaxTable.from_file(sub(STATS_FILE))
        loaders = {"model": model, "vae": vae, "image_encoder": image_encoder, "text_encoder": text_encoder}
        abstracts = {**abstract_builds(config, vae_config, dtype, attention), "image_encoder": abstract_image_encoder,
                     "text_encoder": abstract_text_encoder}
        return cls(config, vae_config, loaders, stats=table, name=config.name, dtype=dtype, mesh=mesh,
                   attention=attention, compile_cache=bool(compile_cache), abstracts=abstracts).set_offload(
            offload).set_sampling_programs(sampling_programs)

    def set_offload(self, offload: str = "auto") -> UnifolmPipeline:
        """What leaves the device between a call's stages: "auto" (the CLIP towers, where the components and
        the sampling do not fit the device together: `encoders_leave_device`), "none", or "encoders" (the
        towers always). Results are bit-identical whichever."""
        if offload not in ("auto", "none", "encoders"):
            raise WanInputError(f"offload {offload!r} is not one of auto, none, encoders; pass one of those")
        self.offload = offload
        return self

    def set_sampling_programs(self, programs: int | None = None) -> UnifolmPipeline:
        """The programs each DDIM step runs as (`wan_tpu.unifolm.sampling.sample`'s `programs`): 1, the whole
        sampling loop in one program; K > 1, the step's UNet blocks cut in K programs, which `prepare` compiles
        side by side and which serve every step count, run by a loop over the steps. None (default):
        `WORKER_SAMPLING_PROGRAMS` where compile worker processes run (`wan_tpu.runtime.compile_workers`, which
        compile the pieces at the same time), else 1. Results agree within float32 rounding (other fusions), not
        bit for bit."""
        from wan_tpu.runtime import compile_workers
        from wan_tpu.unifolm.unet import unit_count

        most = unit_count(self.config.unet)
        if programs is None:
            programs = min(WORKER_SAMPLING_PROGRAMS, most) if compile_workers.running() else 1
        if isinstance(programs, bool) or not isinstance(programs, int) or not 1 <= programs <= most:
            raise WanInputError(f"sampling programs must be a whole number from 1 to {most} (the UNet's blocks), "
                                f"got {programs!r}")
        self.sampling_programs = programs
        return self

    def encoders_leave_device(self, device_bytes: int | None = None) -> bool:
        """Whether the CLIP towers go to host memory once a call's conditions are encoded (`set_offload`):
        for "auto", whether the loaded components' weights (bytes per device) and `sampling_bytes` exceed
        `device_bytes` (default: the first device's memory limit; unknown, as on CPU: nothing leaves)."""
        if self.offload != "auto":
            return self.offload == "encoders"
        if device_bytes is None:
            device_bytes = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
        if device_bytes is None:
            return False
        weights = 0
        for name in self.COMPONENTS:
            module = self.component(name)
            for x in jax.tree.leaves(nnx.state(getattr(module, "model", module))):
                if not on_host(x):
                    weights += int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        return weights + sampling_bytes(self.config, self.dtype) > device_bytes

    @property
    def has_heads(self) -> bool:
        return self.config.has_heads

    # ---- components -----------------------------------------------------------------------------
    @in_pipeline_choice
    def component(self, name: str):
        """The component `name` ("model", "vae", "image_encoder", "text_encoder"), loaded on first use (or
        taken from `prepare`'s background load)."""
        if name not in self._loaded:
            loaded = self._warmup.take_load(name) if self._warmup is not None else None
            self._loaded[name] = loaded if loaded is not None else self._loaders[name]()
        return self._loaded[name]

    model = property(lambda self: self.component("model"))
    vae = property(lambda self: self.component("vae"))
    image_encoder = property(lambda self: self.component("image_encoder"))
    text_encoder = property(lambda self: self.component("text_encoder"))

    @in_pipeline_choice
    def prepare(self, mode: str | None = None, *, num_steps: int | None = None, eta: float = 1.0,
                keep_action_tokens: bool = True):
        """Start loading every component at once and, meanwhile, loading from the executable cache or
        compiling the stage programs a `mode` run needs ("decision": `decide`, "world": `predict`,
        "interact": both, "generate"; default: "decision", or "generate" for a base model) with
        `num_steps` DDIM steps (default: the mode's, `default_steps`) and `eta` (only whether it is 0 matters),
        in background threads; returns at once (a `wan_tpu.runtime.compile_ahead.Warmup`; as a context
        manager, leaving it waits for the threads, cancelling what has not started).

        The stage programs (prepare, sampling, decode) are compiled for the model's and VAE's abstract
        modules (from their configs: no wait for their weights) and the encoders' outputs' shapes (from
        abstract encoders for a folder; a preset's once loaded), each program's outputs giving the next one's
        inputs: the calls' own code traced (`jax.eval_shape`) with `executable_cache.ahead` (which compiles
        them side by side, a thread each, once each is lowered), so no stage program runs in these threads; then
        the calls' few operations outside them (the seed's keys, the last observed frame) run once on zeros, so
        that a call after `prepare` compiles nothing. The calls wait for them,
        then run the very programs compiled here: the results are bit-identical with and without
        `prepare`. A compile that fails is a warning and the call compiles on use. With a mesh only the
        loads run ahead. The threads run in this pipeline's `compile_cache` choice."""
        from wan_tpu.runtime.compile_ahead import Warmup

        mode = mode or ("decision" if self.has_heads else "generate")
        if mode not in MODES:
            raise WanInputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "generate" and self.has_heads:
            raise WanInputError(f"{self.name} has action/state heads; generate needs a base checkpoint; run decide / "
                                "predict (command line: --mode decision or world)")
        if mode != "generate":
            self._require_heads(mode)
        num_steps = self.default_steps[mode] if num_steps is None else num_steps
        _check_steps(self.config, num_steps)
        warmup = self._warmup = Warmup(compile_cache=self.compile_cache)
        stages = self.program_key is not None and {"model", "vae"} <= set(self._abstracts)
        # Set once the stage programs are traced (or their thread ends; at once on a warm start): till then the
        # model's load converts nothing on the host (`params.host_work_after`), its large tensors' puts and layout
        # compiles going on. Measured in `_load_after`.
        traced = threading.Event() if stages else None
        for name in self.COMPONENTS:
            if name not in self._loaded:
                load = self._loaders[name]
                warmup.start(name, functools.partial(_load_after, traced, load) if name == "model" and stages else load)
        if self.program_key is not None:  # after the loads start: its key waits for the device client
            warm = warmup.prefetch("unifolm", (self.program_key, mode, num_steps, eta != 0, keep_action_tokens))
            if warm and traced is not None:
                traced.set()  # the programs are read back, their short trace lowers nothing: no reason to wait
        if stages:
            # The encoders' weights only matter here through their outputs' shapes: built from their configs
            # where the pipeline can (no wait for their loads), else the loads themselves.
            encoders = [functools.partial(self._loaded.get, n) if n in self._loaded else self._abstracts[n]
                        if n in self._abstracts else warmup.loads[n].result for n in ("image_encoder", "text_encoder")]
            future = warmup.start("stages", self._compile_stages, warmup, encoders, mode, num_steps, eta,
                                  keep_action_tokens, traced, kind="compile")
            future.add_done_callback(lambda _: traced.set())  # whatever happened to the thread
        return warmup

    def _compile_stages(self, warmup, encoders, mode: str, num_steps: int, eta: float, keep_action_tokens: bool,
                        traced: threading.Event | None = None) -> None:
        """The stage programs of `prepare(mode)`, through the calls' own code (`_stages`) with
        `executable_cache.ahead`, traced by `jax.eval_shape` (no stage program runs here): inputs of
        the calls' shapes, the abstract model and VAE, and the encoders `encoders` (functions) give: abstract
        ones, or the loaded ones. Then the calls' operations outside the stage programs, once on zeros."""
        from wan_tpu.runtime.compile_ahead import Cancelled

        model, vae = self._abstracts["model"](), self._abstracts["vae"]()
        image_encoder, text_encoder = (get() for get in encoders)
        if warmup.cancelled.is_set():
            raise Cancelled()
        cfg, n, t = self.config, self.config.unet.n_obs_steps, self.config.unet.temporal_length
        parts = (model, vae, image_encoder, lambda prompt: text_encoder.encode([prompt]))
        run = functools.partial(self._stages, parts, timed=False)

        def stages(images, states, actions, key):
            if mode == "generate":
                return run("", images, None, None, None, num_steps, eta, key)
            if mode in ("decision", "interact"):
                _, actions, _ = run("", images, states, None, None, num_steps, eta, key,
                                    keep_action_tokens if mode == "decision" else True)
            if mode in ("world", "interact"):
                run("", images, states, actions, None, num_steps, eta, key)

        # As `check_images` / `check_vectors` make them: float32, (1, 3, n_obs, H, W), (1, rows, 16).
        spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        images = spec(1, 3, 1 if mode == "generate" else n, self.height, self.width)
        with executable_cache.ahead():
            jax.eval_shape(stages, images, spec(1, n, cfg.agent_state_dim), spec(1, t, cfg.agent_action_dim),
                           jax.eval_shape(jax.random.key, 0))
            if traced is not None:
                traced.set()  # the compiles, under way, need no interpreter: the model's load goes on
        # The calls' remaining work on the device outside the stage programs, the seed's keys and the last observed
        # frame, compiles small programs of its own (0.1-0.3 s each on an H200), which the first call compiled after
        # the loads: run once here on zeros of the inputs' shapes, so that it finds them compiled.
        jax.block_until_ready((_seed_keys(0), jnp.zeros(images.shape, images.dtype)[:, :, -1]))

    # ---- inputs ---------------------------------------------------------------------------------
    def check_images(self, images, n_obs: int | None = None) -> jax.Array:
        """Observed frames → (1, 3, n_obs, H, W) float32 in [-1, 1]; fewer frames repeat the first."""
        n_obs = n_obs or self.config.unet.n_obs_steps
        x = np.asarray(images)
        if x.ndim == 3:
            x = x[None]
        if x.ndim != 4 or not 1 <= x.shape[0] <= n_obs:
            count = "exactly 1 image" if n_obs == 1 else f"1 to {n_obs} images"
            raise WanInputError(f"{self.name} observes {count} (n, H, W, 3) or (n, 3, H, W); got shape {x.shape}")
        if x.dtype == np.uint8:
            if x.shape[-1] != 3:
                raise WanInputError(f"uint8 images must be (n, H, W, 3), got shape {x.shape}")
            x = x.transpose(0, 3, 1, 2).astype(np.float32) / 255 * 2 - 1  # the authors' (x / 255 - 0.5) * 2
        elif x.shape[1] != 3:
            raise WanInputError(f"float images must be (n, 3, H, W) in [-1, 1], got shape {x.shape}")
        if x.shape[2:] != (self.height, self.width):
            raise WanInputError(f"images are {x.shape[3]}x{x.shape[2]}; {self.name} takes {self.width}x{self.height} "
                                "(resize the short side and centre-crop, as the authors' data pipeline)")
        x = np.concatenate([np.repeat(x[:1], n_obs - x.shape[0], axis=0), x]).astype(np.float32)
        return jax.device_put(x.transpose(1, 0, 2, 3)[None])  # put as is: `jnp.asarray` compiled a program per shape

    def _dof(self, kind: str, given: int | None) -> int:
        if self.stats is not None:
            dof = len(self.stats.action_min if kind == "action" else self.stats.state_min)
            if given is not None and given != dof:
                raise WanInputError(f"{kind}s have {given} dims but the min-max table has {dof}; pass the robot's {dof}-d {kind}s")
            return dof
        return given

    def check_vectors(self, x, kind: str, rows: int, pad_rows: bool) -> tuple[jax.Array, int]:
        """States (n ≤ rows, dof) or actions (rows, dof) → normalised, zero-padded (1, rows, 16) and the DoF."""
        limit = self.config.agent_state_dim if kind == "state" else self.config.agent_action_dim
        x = np.asarray(x, np.float32)
        if x.ndim == 1:
            x = x[None]
        if x.ndim != 2 or not (1 <= x.shape[0] <= rows if pad_rows else x.shape[0] == rows) or not 1 <= x.shape[1] <= limit:
            want = f"(n ≤ {rows}, dof ≤ {limit})" if pad_rows else f"({rows}, dof ≤ {limit})"
            raise WanInputError(f"{kind}s must be {want}, got shape {x.shape}")
        dof = self._dof(kind, x.shape[1])
        if self.stats is not None:
            x = self.stats.normalize(x, kind)
        x = np.concatenate([np.repeat(x[:1], rows - x.shape[0], axis=0), x])
        return jax.device_put(np.pad(x, ((0, 0), (0, limit - dof)))[None].astype(np.float32)), dof

    def _out(self, y, kind: str, dof: int) -> np.ndarray:
        y = np.asarray(y, np.float32)[..., :dof]
        return self.stats.unnormalize(y, kind) if self.stats is not None else y

    # ---- stages ---------------------------------------------------------------------------------
    @in_pipeline_choice
    def encode_text(self, prompt: str) -> jax.Array:
        if prompt not in self._text_cache:  # the loop re-uses its two prompts every iteration
            unpark(self.text_encoder.model)  # where the last call parked it
            self._text_cache[prompt] = self.text_encoder.encode([prompt])
        return self._text_cache[prompt]

    @in_pipeline_choice
    def encode_conditions(self, prompt: str, images, states=None, actions=None, fs=None, key=None, noise=None,
                          keep_action_tokens: bool = True):
        """Stage 1: text, CLIP tokens and VAE latent of the last observed frame, then `model.prepare`.
        `images` (1, 3, n_obs, H, W) in [-1, 1]; `states`, `actions` normalised (1, ·, 16) or None.
        `noise` (1, 4, h, w) is the VAE posterior's (default: drawn from `key`)."""
        self._wait_compiled()
        text = self.encode_text(prompt)
        return self._encode_conditions(self.model, self.vae, self.image_encoder, text, images, states, actions, fs,
                                       key, noise, keep_action_tokens)

    def _encode_conditions(self, model, vae, image_encoder, text, images, states, actions, fs, key, noise,
                           keep_action_tokens):
        last = images[:, :, -1]
        # On the host: a device scalar made from a number compiled a program of its own (also in the ahead trace,
        # where a host value gives the programs the same signature).
        fs = np.asarray(self.config.unet.default_fs if fs is None else fs, np.int32)
        # Without `noise`, `key` draws it inside the program (`_prepare`).
        return _prepare_split(model, vae, text, image_encoder.encode(last), last, key if noise is None else noise,
                              images, states, actions, fs, keep_action_tokens=keep_action_tokens, key=self.program_key)

    @in_pipeline_choice
    def sample(self, cond, num_steps: int = 50, eta: float = 1.0, key=None, noise=None):
        """Stage 2: latents (1, 4, T, h, w), actions and states (1, 16, 16), normalised."""
        _check_steps(self.config, num_steps)
        self._wait_compiled()
        return self._sample(self.model, cond, num_steps, eta, key, noise)

    def _sample(self, model, cond, num_steps, eta, key, noise=None):
        from wan_tpu.unifolm.sampling import sample

        return sample(model, cond, num_steps=num_steps, eta=eta, key=key, noise=noise, program_key=self.program_key,
                      programs=self.sampling_programs)

    @in_pipeline_choice
    def decode(self, latents) -> jax.Array:
        """Stage 3: latents (B, 4, T, h, w) × scale_factor → video (B, 3, T, H, W), unclamped."""
        self._wait_compiled()
        return _decode_split(self.vae, latents, self.program_key)

    def _wait_compiled(self) -> None:
        """Before a stage program's first call: wait for `prepare`'s compiles (a failure warns)."""
        if self._warmup is not None:
            self._warmup.wait_compiled("stages")

    @contextlib.contextmanager
    def _stage(self, name: str):
        """A timed stage of a call, with a safe point for Ctrl-C / SIGTERM before and after it."""
        interrupt.check(name)
        with self.timer.stage(name) if self.timer is not None else contextlib.nullcontext():
            yield
        interrupt.check()

    def _stages(self, parts, prompt, images, states, actions, fs, num_steps, eta, seed, keep_action_tokens=True, *,
                timed: bool = True):
        """The three stages with `parts` (model, vae, image_encoder, a prompt's text encode) → (video
        (3, T, H, W), actions, states): what `_run` runs, and `prepare` ahead of it (`timed=False`: not
        in `self.timer`). `seed`: an int or a key."""
        model, vae, image_encoder, encode_text = parts
        stage = self._stage if timed else lambda name: contextlib.nullcontext()
        k_vae, k_sample = _seed_keys(seed)
        with stage("encode conditions"):
            cond = jax.block_until_ready(self._encode_conditions(model, vae, image_encoder, encode_text(prompt), images,
                                                                 states, actions, fs, k_vae, None, keep_action_tokens))
            if timed and self.encoders_leave_device():
                park(image_encoder.model)
                park(self.text_encoder.model)
        with stage("sample"):
            latents, act, st = jax.block_until_ready(self._sample(model, cond, num_steps, eta, k_sample))
        with stage("decode"):
            video = jax.block_until_ready(_decode_split(vae, latents, self.program_key))
            if isinstance(video, jax.Array) and not video.is_fully_addressable:  # spread over several processes
                video = distributed.to_host(video)
            video = np.asarray(video)[0]  # on the host: the device's indexing compiled a program of its own
        return video, act, st

    def _run(self, prompt, images, states, actions, fs, num_steps, eta, seed, keep_action_tokens=True):
        _check_steps(self.config, num_steps)
        with self._stage("load"):  # components not loaded yet (after `prepare`: its loads and programs)
            parts = (self.model, self.vae, self.image_encoder, self.encode_text)
            self.text_encoder
            self._wait_compiled()
            unpark(self.image_encoder.model)  # where the last call parked it
        return self._stages(parts, prompt, images, states, actions, fs, num_steps, eta, seed, keep_action_tokens)

    # ---- modes ----------------------------------------------------------------------------------
    def _require_heads(self, mode: str):
        if not self.has_heads:
            raise WanInputError(f"{self.name} is a base model (no action/state heads): {mode} needs a UnifoLM-WMA-0 checkpoint; "
                                "use generate (command line: --mode generate)")

    @in_pipeline_choice
    def decide(self, instruction: str, images, states, *, num_steps: int | None = None, eta: float = 1.0, seed=0,
               fs=None, keep_action_tokens: bool = True) -> UnifolmOutput:
        """Decision-making: instruction + observations → 16 frames and a 16-step action chunk.
        `keep_action_tokens=False` drops the (zeroed) action tokens, as the authors' real-robot server.
        `num_steps`: DDIM steps (default: `default_steps["decision"]`; likewise for the other modes)."""
        self._require_heads("decide")
        num_steps = self.default_steps["decision"] if num_steps is None else num_steps
        n = self.config.unet.n_obs_steps
        imgs = self.check_images(images, n)
        st, state_dof = self.check_vectors(states, "state", n, pad_rows=True)
        action_dof = self._dof("action", None) or state_dof
        video, act, _ = self._run(instruction, imgs, st, None, fs, num_steps, eta, seed, keep_action_tokens)
        act = np.asarray(act)[0]
        return UnifolmOutput(to_uint8(video), np.asarray(video), actions=self._out(act, "action", action_dof),
                             actions_raw=act)

    @in_pipeline_choice
    def predict(self, images, states, actions, *, num_steps: int | None = None, eta: float = 1.0, seed=0,
                fs=None) -> UnifolmOutput:
        """World model: observations + a 16-step action chunk → 16 frames and the next 16 states."""
        self._require_heads("predict")
        num_steps = self.default_steps["world"] if num_steps is None else num_steps
        n = self.config.unet.n_obs_steps
        imgs = self.check_images(images, n)
        st, state_dof = self.check_vectors(states, "state", n, pad_rows=True)
        act, _ = self.check_vectors(actions, "action", self.config.unet.temporal_length, pad_rows=False)
        video, _, st_out = self._run("", imgs, st, act, fs, num_steps, eta, seed)
        st_out = np.asarray(st_out)[0]
        return UnifolmOutput(to_uint8(video), np.asarray(video), states=self._out(st_out, "state", state_dof),
                             states_raw=st_out)

    @in_pipeline_choice
    def interact(self, instruction: str, image, state, iterations: int = 1, *, num_steps: int | None = None,
                 eta: float = 1.0, seed=0, fs=None, progress=None) -> Episode:
        """The authors' interaction loop (`world_model_interaction.py`): each iteration decides an action
        chunk, masks it to the robot's DoF, then lets the world model play it; the world model's frames
        and states become the next observations."""
        self._require_heads("interact")
        num_steps = self.default_steps["interact"] if num_steps is None else num_steps
        if iterations < 1:
            raise WanInputError(f"iterations must be ≥ 1, got {iterations}")
        cfg = self.config
        n, t = cfg.unet.n_obs_steps, cfg.unet.temporal_length
        imgs = self.check_images(image, n)
        st, state_dof = self.check_vectors(state, "state", n, pad_rows=True)
        action_dof = self._dof("action", None) or state_dof
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        episode = Episode(video=np.zeros((0, self.height, self.width, 3), np.uint8))
        clips = []
        for i in range(iterations):
            k_decide, k_predict = jax.random.split(jax.random.fold_in(key, i))
            video, act, _ = self._run(instruction, imgs, st, None, fs, num_steps, eta, k_decide)
            act = act.at[:, :, action_dof:].set(0.0)
            episode.decisions.append(UnifolmOutput(to_uint8(video), np.asarray(video), actions=self._out(act[0], "action", action_dof),
                                                   actions_raw=np.asarray(act[0])))
            video, _, st_out = self._run("", imgs, st, act, fs, num_steps, eta, k_predict)
            st_out = st_out.at[:, :, state_dof:].set(0.0)
            episode.predictions.append(UnifolmOutput(to_uint8(video), np.asarray(video), states=self._out(st_out[0], "state", state_dof),
                                                     states_raw=np.asarray(st_out[0])))
            clips.append(episode.predictions[-1].video)
            # The queues after pushing all 16 frames/states: the last n of each.
            imgs, st = video[None, :, t - n :], st_out[:, t - n :]
            if progress is not None:
                progress(i)
        episode.video = np.concatenate(clips)
        return episode

    @in_pipeline_choice
    def generate(self, prompt: str, image, *, num_steps: int | None = None, eta: float = 1.0, seed=0,
                 fs=None) -> UnifolmOutput:
        """Base model: text + first frame → 16 frames (`base_model_inference.py`)."""
        num_steps = self.default_steps["generate"] if num_steps is None else num_steps
        if self.has_heads:
            raise WanInputError(f"{self.name} has action/state heads; generate needs a base checkpoint; run decide / "
                                "predict (command line: --mode decision or world)")
        imgs = self.check_images(image, 1)
        video, _, _ = self._run(prompt, imgs, None, None, fs, num_steps, eta, seed)
        return UnifolmOutput(to_uint8(video), np.asarray(video))


# The sampling's working set beyond the weights, in values of the model dtype per latent element and
# model channel (t · h · w · model_channels): the H100 bf16 decision run of docs/PERFORMANCE.md peaked at
# 9.45 GB over 6.88 GiB of weights, 1.92 GiB for 16 × 40 × 64 latents × 320 channels.
SAMPLING_VALUES = 79


def sampling_bytes(config, dtype) -> int:
    """Device bytes the sampling stage needs beside the weights (`SAMPLING_VALUES`)."""
    t, (h, w) = config.unet.temporal_length, config.latent_size
    return SAMPLING_VALUES * jnp.dtype(dtype).itemsize * t * h * w * config.unet.model_channels


def _prepare(model, vae, text_emb, clip_tokens, last_frame, noise, images, states, actions, fs, keep_action_tokens):
    """One compiled function for the step-invariant work: the VAE latent of the last observed frame
    (scale_factor · posterior sample) and `model.prepare` (projectors, Resampler, action tokens,
    per-frame context, observation encoders). `noise`: the posterior's, or a key it is drawn from here
    (drawn op by op before the program, it compiled a program of its own)."""
    posterior = vae.encode(last_frame)
    if jax.dtypes.issubdtype(noise.dtype, jax.dtypes.prng_key):
        noise = jax.random.normal(noise, posterior.mean.shape)
    cond_latent = vae.config.scaling_factor * posterior.sample(noise)
    return model.prepare(text_emb, clip_tokens, cond_latent, images, states, actions, fs=fs,
                         keep_action_tokens=keep_action_tokens)


# Module-level, so every pipeline (and every preset rebuilt in one process) shares the compiled code.
# Weights go in as split state and only the results come out: `nnx.jit` would also return every weight
# of the modules it is given (to carry mutations back), a copy of the whole model held at the peak.
@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("keep_action_tokens",))
def _prepare_program(model_graph, vae_graph, model_state, vae_state, *args, keep_action_tokens):
    return _prepare(nnx.merge(model_graph, model_state), nnx.merge(vae_graph, vae_state), *args, keep_action_tokens)


@functools.partial(jax.jit, static_argnums=0)
def _decode_program(vae_graph, vae_state, z):
    return nnx.merge(vae_graph, vae_state).decode_video(z)


def _prepare_split(model, vae, *args, keep_action_tokens: bool, key: tuple | None):
    (model_graph, model_state), (vae_graph, vae_state) = nnx.split(model), nnx.split(vae)
    return executable_cache.cached_call(
        "unifolm-prepare", None if key is None else (*key, keep_action_tokens), _prepare_program,
        (model_graph, vae_graph, model_state, vae_state, *args), {"keep_action_tokens": keep_action_tokens},
        static_argnums=(0, 1), static_argnames=("keep_action_tokens",), key_names_statics=True)


def _load_after(traced: threading.Event, load):
    """`load()` converting nothing on the host before `traced` is set (`prepare`). UnifoLM-WMA-0's cold start is
    bound by the interpreter lock until its step's pieces compile (1-5 of an H200 host's 16 cores busy): the UNet's
    2,030 small host conversions took turns with the stage programs' trace, whose end the pieces' compiles, and so
    the first sampling, wait for. Cold, decision, 16 steps, in turns (2026-11-30, `profile_compile.py unifolm
    --device --runs 1`, two rounds): the trace 4.9 / 6.0 s instead of 5.6 / 7.0, first sampling 17.58 / 20.42 s
    instead of 18.40 / 22.15, with the UNet's large tensors put while its abstract build runs (`EarlyPuts`, which
    alone gained nothing: docs/TRIED.md)."""
    from wan_tpu.loading.params import host_work_after

    with host_work_after(traced):
        return load()


def _seed_keys(seed) -> tuple:
    """A call's (VAE posterior key, sampling key) from `seed` (an int or a key)."""
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    k_vae, k_sample = jax.random.split(key)
    return k_vae, k_sample


def _decode_split(vae, z, key: tuple | None):
    return executable_cache.cached_call("unifolm-decode", key, _decode_program, (*nnx.split(vae), z),
                                        static_argnums=(0,), key_names_statics=True)


def _program_key(config, vae_config, dtype, attention) -> tuple:
    """The model's and VAE's configs, the model dtype and the attention setting: with the arguments'
    shapes and dtypes (which `cached_call` adds) they determine every stage program."""
    return (config, vae_config, jnp.dtype(dtype).name, attention)


def abstract_builds(config, vae_config, dtype, attention) -> dict:
    """"model" / "vae" → a function building it without weights (`nnx.eval_shape`, read back from the
    executable cache when it holds it): the modules the loaders fill (without a mesh), what `prepare`
    compiles the stage programs for."""

    def model():
        from wan_tpu.unifolm.model import abstract_unifolm

        return abstract_unifolm(config, dtype, attention)

    def vae():
        from wan_tpu.unifolm.autoencoder_kl_loading import abstract_autoencoder_kl

        return abstract_autoencoder_kl(vae_config)

    return {"model": model, "vae": vae}


def _read_config(path: str):
    """The model's config.json (`load_unifolm` reads it again, with the weights)."""
    import json

    from wan_tpu.configs.unifolm import config_from_json

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise WanInputError(f"{path}: no config.json; convert the checkpoint with wan-convert-unifolm")
    try:
        with open(cfg_path) as f:
            return config_from_json(json.load(f))
    except json.JSONDecodeError as e:
        raise WanInputError(f"{cfg_path}: not valid JSON ({e}); re-convert the checkpoint") from None


def _check_steps(config, num_steps: int) -> None:
    if num_steps < 1 or num_steps > config.num_train_timesteps:
        raise WanInputError(f"num_steps {num_steps} must be in 1..{config.num_train_timesteps}")
