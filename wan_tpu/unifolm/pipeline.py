"""`UnifolmPipeline`: UnifoLM-WMA-0 (Unitree's world-model-action model) from observations to video and actions.

    pipe = UnifolmPipeline.from_pretrained("ckpt/unifolm-wma-0")       # or the preset "unifolm-tiny"
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
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.runtime import executable_cache
from wan_tpu.errors import WanInputError

PRESETS = ("unifolm-tiny", "unifolm-tiny-base")
FPS = 8  # the authors save every video at 8 fps
STATS_FILE = "stats.safetensors"


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
    def __init__(self, model, vae, image_encoder, text_encoder, stats: MinMaxTable | None = None, name: str = "unifolm"):
        self.model, self.vae, self.image_encoder, self.text_encoder = model, vae, image_encoder, text_encoder
        self.config = model.config
        self.stats = stats
        self.name = name
        h, w = self.config.latent_size
        self.height, self.width = h * vae.config.downscale, w * vae.config.downscale
        self._text_cache: dict[str, jax.Array] = {}
        self.timer = None  # a `wan_tpu.runtime.profiling.StageTimer` to time the stages of every sampling
        # What determines the stage programs short of tracing them (`wan_tpu.runtime.executable_cache` adds
        # versions, devices, settings and this package's sources): set by `from_pretrained` without a
        # mesh. None (a pipeline built by hand, or sharded): the programs are traced in every process.
        self.program_key: tuple | None = None

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_preset: str, dtype=jnp.float32, mesh=None, attention_impl=None,
                        stats: str | None = None, encoder_dtype=jnp.float32,
                        compile_cache: bool = True) -> UnifolmPipeline:
        """A converted checkpoint folder (`wan_tpu/unifolm/convert_cli.py`) or a preset name
        (`unifolm-tiny`, `unifolm-tiny-base`: random weights, seconds on a CPU). `dtype`: the model's
        (UNet, heads, projectors); `encoder_dtype`: the CLIP towers' (float32 by default, as the authors;
        bfloat16 halves their memory; the presets' random towers stay float32); the VAE runs in float32. `stats`: a LeRobot stats.safetensors
        (default: the folder's, when present). `compile_cache` turns the persistent compilation cache
        (`wan_tpu.runtime.compile_cache`) on (the default: a later process loads the compiled sampling instead of
        compiling it for minutes) or off for the whole process."""
        from wan_tpu.runtime import compile_cache as cache

        cache.enable() if compile_cache else cache.disable()
        table = None if stats is None else MinMaxTable.from_file(stats)
        if path_or_preset in PRESETS:
            from wan_tpu.unifolm.presets import tiny_pipeline

            pipe = tiny_pipeline(path_or_preset, dtype=dtype, attention_impl=attention_impl, stats=table)
            pipe.program_key = _program_key(pipe, dtype, attention_impl)
            return pipe
        path = os.fspath(path_or_preset)
        if not os.path.isdir(path):
            if os.path.isfile(path) and path.endswith((".ckpt", ".pt", ".pth", ".bin")):
                raise WanInputError(f"{path} is a pickle checkpoint; convert it first: python wan_tpu/unifolm/convert_cli.py {path} OUT_DIR")
            raise WanInputError(f"model {path!r} is neither a converted UnifoLM folder nor a preset ({', '.join(PRESETS)})")
        from wan_tpu.unifolm.autoencoder_kl_loading import load_autoencoder_kl
        from wan_tpu.unifolm.loading import load_unifolm
        from wan_tpu.encoders.openclip import OpenCLIPImageEncoder, OpenCLIPTextEncoder

        model = load_unifolm(path, dtype=dtype, mesh=mesh, attention_impl=attention_impl)
        vae = load_autoencoder_kl(os.path.join(path, "vae"), mesh=mesh)
        image_encoder = OpenCLIPImageEncoder.from_pretrained(os.path.join(path, "image_encoder"), dtype=encoder_dtype,
                                                             mesh=mesh, attention_impl=attention_impl)
        text_encoder = OpenCLIPTextEncoder.from_pretrained(os.path.join(path, "text_encoder"), os.path.join(path, "tokenizer"),
                                                           dtype=encoder_dtype, mesh=mesh)
        if table is None and os.path.isfile(os.path.join(path, STATS_FILE)):
            table = MinMaxTable.from_file(os.path.join(path, STATS_FILE))
        pipe = cls(model, vae, image_encoder, text_encoder, table, name=model.config.name)
        if mesh is None:  # sharded, the attention hooks and kernel layout change the programs too
            pipe.program_key = _program_key(pipe, dtype, attention_impl)
        return pipe

    @property
    def has_heads(self) -> bool:
        return self.config.has_heads

    # ---- inputs ---------------------------------------------------------------------------------
    def check_images(self, images, n_obs: int | None = None) -> jax.Array:
        """Observed frames → (1, 3, n_obs, H, W) float32 in [-1, 1]; fewer frames repeat the first."""
        n_obs = n_obs or self.config.unet.n_obs_steps
        x = np.asarray(images)
        if x.ndim == 3:
            x = x[None]
        if x.ndim != 4 or not 1 <= x.shape[0] <= n_obs:
            raise WanInputError(f"observed images must be (n, H, W, 3) or (n, 3, H, W) with 1 ≤ n ≤ {n_obs}, got shape {x.shape}")
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
        return jnp.asarray(x.transpose(1, 0, 2, 3)[None])

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
        return jnp.asarray(np.pad(x, ((0, 0), (0, limit - dof)))[None]), dof

    def _out(self, y, kind: str, dof: int) -> np.ndarray:
        y = np.asarray(y, np.float32)[..., :dof]
        return self.stats.unnormalize(y, kind) if self.stats is not None else y

    # ---- stages ---------------------------------------------------------------------------------
    def encode_text(self, prompt: str) -> jax.Array:
        if prompt not in self._text_cache:  # the loop re-uses its two prompts every iteration
            self._text_cache[prompt] = self.text_encoder.encode([prompt])
        return self._text_cache[prompt]

    def encode_conditions(self, prompt: str, images, states=None, actions=None, fs=None, key=None, noise=None,
                          keep_action_tokens: bool = True):
        """Stage 1: text, CLIP tokens and VAE latent of the last observed frame, then `model.prepare`.
        `images` (1, 3, n_obs, H, W) in [-1, 1]; `states`, `actions` normalised (1, ·, 16) or None.
        `noise` (1, 4, h, w) is the VAE posterior's (default: drawn from `key`)."""
        last = images[:, :, -1]
        if noise is None:
            h, w = self.config.latent_size
            noise = jax.random.normal(key, (last.shape[0], self.vae.config.latent_channels, h, w))
        fs = jnp.asarray(self.config.unet.default_fs if fs is None else fs, jnp.int32)
        return _prepare_split(self.model, self.vae, self.encode_text(prompt), self.image_encoder.encode(last), last, noise,
                              images, states, actions, fs, keep_action_tokens=keep_action_tokens, key=self.program_key)

    def sample(self, cond, num_steps: int = 50, eta: float = 1.0, key=None, noise=None):
        """Stage 2: latents (1, 4, T, h, w), actions and states (1, 16, 16), normalised."""
        from wan_tpu.unifolm.sampling import sample

        if num_steps < 1 or num_steps > self.config.num_train_timesteps:
            raise WanInputError(f"num_steps {num_steps} must be in 1..{self.config.num_train_timesteps}")
        return sample(self.model, cond, num_steps=num_steps, eta=eta, key=key, noise=noise, program_key=self.program_key)

    def decode(self, latents) -> jax.Array:
        """Stage 3: latents (B, 4, T, h, w) × scale_factor → video (B, 3, T, H, W), unclamped."""
        return _decode_split(self.vae, latents, self.program_key)

    def _stage(self, name: str):
        return self.timer.stage(name) if self.timer is not None else contextlib.nullcontext()

    def _run(self, prompt, images, states, actions, fs, num_steps, eta, seed, keep_action_tokens=True):
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        k_vae, k_sample = jax.random.split(key)
        with self._stage("encode conditions"):
            cond = jax.block_until_ready(self.encode_conditions(prompt, images, states, actions, fs, key=k_vae,
                                                                keep_action_tokens=keep_action_tokens))
        with self._stage("sample"):
            latents, act, st = jax.block_until_ready(self.sample(cond, num_steps, eta, key=k_sample))
        with self._stage("decode"):
            video = jax.block_until_ready(self.decode(latents))[0]
        return video, act, st

    # ---- modes ----------------------------------------------------------------------------------
    def _require_heads(self, mode: str):
        if not self.has_heads:
            raise WanInputError(f"{self.name} is a base model (no action/state heads): {mode} needs a UnifoLM-WMA-0 checkpoint; use generate")

    def decide(self, instruction: str, images, states, *, num_steps: int = 50, eta: float = 1.0, seed=0, fs=None,
               keep_action_tokens: bool = True) -> UnifolmOutput:
        """Decision-making: instruction + observations → 16 frames and a 16-step action chunk.
        `keep_action_tokens=False` drops the (zeroed) action tokens, as the authors' real-robot server."""
        self._require_heads("decide")
        n = self.config.unet.n_obs_steps
        imgs = self.check_images(images, n)
        st, state_dof = self.check_vectors(states, "state", n, pad_rows=True)
        action_dof = self._dof("action", None) or state_dof
        video, act, _ = self._run(instruction, imgs, st, None, fs, num_steps, eta, seed, keep_action_tokens)
        return UnifolmOutput(to_uint8(video), np.asarray(video), actions=self._out(act[0], "action", action_dof),
                             actions_raw=np.asarray(act[0]))

    def predict(self, images, states, actions, *, num_steps: int = 50, eta: float = 1.0, seed=0, fs=None) -> UnifolmOutput:
        """World model: observations + a 16-step action chunk → 16 frames and the next 16 states."""
        self._require_heads("predict")
        n = self.config.unet.n_obs_steps
        imgs = self.check_images(images, n)
        st, state_dof = self.check_vectors(states, "state", n, pad_rows=True)
        act, _ = self.check_vectors(actions, "action", self.config.unet.temporal_length, pad_rows=False)
        video, _, st_out = self._run("", imgs, st, act, fs, num_steps, eta, seed)
        return UnifolmOutput(to_uint8(video), np.asarray(video), states=self._out(st_out[0], "state", state_dof),
                             states_raw=np.asarray(st_out[0]))

    def interact(self, instruction: str, image, state, iterations: int = 1, *, num_steps: int = 50, eta: float = 1.0,
                 seed=0, fs=None, progress=None) -> Episode:
        """The authors' interaction loop (`world_model_interaction.py`): each iteration decides an action
        chunk, masks it to the robot's DoF, then lets the world model play it; the world model's frames
        and states become the next observations."""
        self._require_heads("interact")
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

    def generate(self, prompt: str, image, *, num_steps: int = 16, eta: float = 1.0, seed=0, fs=None) -> UnifolmOutput:
        """Base model: text + first frame → 16 frames (`base_model_inference.py`)."""
        if self.has_heads:
            raise WanInputError(f"{self.name} has action/state heads; generate needs a base checkpoint (use decide / predict)")
        imgs = self.check_images(image, 1)
        video, _, _ = self._run(prompt, imgs, None, None, fs, num_steps, eta, seed)
        return UnifolmOutput(to_uint8(video), np.asarray(video))


def _prepare(model, vae, text_emb, clip_tokens, last_frame, noise, images, states, actions, fs, keep_action_tokens):
    """One compiled function for the step-invariant work: the VAE latent of the last observed frame
    (scale_factor · posterior sample) and `model.prepare` (projectors, Resampler, action tokens,
    per-frame context, observation encoders)."""
    cond_latent = vae.config.scaling_factor * vae.encode(last_frame).sample(noise)
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


def _decode_split(vae, z, key: tuple | None):
    return executable_cache.cached_call("unifolm-decode", key, _decode_program, (*nnx.split(vae), z),
                                        static_argnums=(0,), key_names_statics=True)


def _program_key(pipe: UnifolmPipeline, dtype, attention_impl) -> tuple:
    """The model's and VAE's configs, the model dtype and the attention setting: with the arguments'
    shapes and dtypes (which `cached_call` adds) they determine every stage program."""
    return (pipe.config, pipe.vae.config, jnp.dtype(dtype).name, attention_impl)
