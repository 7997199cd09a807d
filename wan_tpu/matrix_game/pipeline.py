"""`MatrixGamePipeline`: Matrix-Game-2, the action-driven streaming world model on Wan, from one image.

    import wan_tpu
    pipe = wan_tpu.MatrixGamePipeline.from_pretrained("matrix-game-2-wan-tpu")       # or "matrix-game-tiny"
    video = pipe("start.png", keyboard=K, mouse=M, seed=0)      # K (frames, keys), M (frames, 2): uint8 (T, H, W, 3)

    session = pipe.stream("start.png", seed=0)                 # interactive: one chunk per call
    frames = session.step(keyboard=[1, 0, 0, 0], mouse=[0, 0.1])   # 9 frames first, then 12 per chunk

`from_pretrained(path_or_preset, *, mesh=None, dtype=bfloat16, attention=None, compile_cache=True,
variant=None, vae_dtype=float32)` (the constructor the three pipelines share) takes a folder made by
`wan_tpu/matrix_game/convert.py` from the Skywork/Matrix-Game-2.0 download, and `variant` (universal,
gta_drive, templerun; default: universal if present, else the only one), or the `matrix-game-tiny`
preset (random weights, CPU, seconds).
Actions are per video frame (see `wan_tpu.matrix_game.actions`; `mouse=None` for templerun); a
video of N frames has N = 12n - 3 (n chunks of 3 latent frames; the first latent frame gives one
video frame, every later one four). `step` also takes a single action row, held for the whole chunk
as the authors' streaming script does.

As the authors' `inference.py`: the image is centre-cropped to the video's aspect, resized (bilinear)
and scaled to [-1, 1]; the VAE encodes it followed by gray frames (the condition latents, with a
4-channel mask on the first latent frame), CLIP encodes it (its first n-1 of n blocks). The gray
frames' latents stop changing once the image has left the encoder's causal receptive field: they are
encoded until the encoder's state repeats exactly (34 latent frames for Wan 2.1's VAE) and reused from
there, instead of encoding 4·(N-1) gray frames up front, and only as the video reaches them (one run of
3 latent frames before each chunk, so the first frame does not wait for the other ten); they are held
padded to `CONDITION_FRAMES`, so the chunk programs' inputs have one shape whatever the image.

`pipe.prepare()` reads the three components at once and, meanwhile, loads every program a stream runs
(image preparation, the caches, the chunk programs) from the executable cache or compiles it from the
components' configs (`wan_tpu.matrix_game.compile_ahead`, `wan_tpu.runtime.executable_cache`);
`stream()` encodes the image with the VAE and CLIP in the order their weights arrive, while the DiT
may still load (not on a GPU, where a program's first run must not overlap other CUDA work: see
`_wait_compiled`). Without `prepare`, each program compiles on its first call. With a `mesh` (the DiT
sharded over it, VAE and CLIP replicated) every program compiles on its first call, from the sharded
arguments; `prepare` then only reads ahead. The pipeline's `compile_cache` choice applies to its own
loads, compiles and calls only.

Each chunk is two compiled programs (`wan_tpu.matrix_game.programs`): the DiT's whole chunk (its denoising
steps, re-noising, the clean cache-update pass: `chunk_denoise_program`), then the VAE's streaming decode of
the chunk (`chunk_decode_program`), caches carried and donated, uint8 frames out; one compilation of each
serves every chunk, the first included (its attention window, which holds only its own frames, and the VAE's
special first latent frame are chosen inside the programs by the traced chunk index). A stream
and a one-shot call with the same image, seed and actions give identical frames: the one-shot call
is a stream. Noise: chunk k draws its initial noise and its re-noising from `fold_in(key(seed), k)`.
Live play splits each chunk in two programs (`session.begin_step` / `end_step`, compiled ahead by
`prepare(live=True)`): the denoising and the first latent frame's decode, then the cache pass and the other
frames' decode; the first frames show that much sooner, and the frames are bitwise the same.

Trace scopes (`--profile`) follow the authors' PROFILING_TAGS_GUIDE: host regions `1_Data_Preparation`
(`1.1_Image_Loading_Resize`, `1.2_VAE_Encode_FirstFrame`, `1.4_CLIP_Visual_Context`,
`1.5_Noise_Sampling`, `1.6_Action_Conditions_Setup`; the mask and condition slicing of `1.3` happen
inside the chunk programs), `2_Pipeline_Inference`,
`2.1_KV_Cache_Initialization`, `2.3_Block_{i}` per chunk, `3_Video_Postprocessing`, `4_Video_Export`;
inside the compiled chunk (one pair of programs serves every chunk, so names carry no chunk index):
`2.3_Denoise` (the DiT's steps and cache update), `2.3_VAE_Decode` → `VAE_Decode_Frame` (the scanned
frames; `VAE_Decode_Frame_0`: the first chunk's first frame), `VAE_Decode_Postprocessing`.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.matrix_game import MATRIX_GAME_VARIANTS, MatrixGameVariant, get_variant
from wan_tpu.errors import WanInputError
from wan_tpu.matrix_game import actions
from wan_tpu.matrix_game.condition import CONDITION_FRAMES, ImageCondition  # noqa: F401
from wan_tpu.matrix_game.programs import (  # noqa: F401
    MASK_CHANNELS,
    action_windows,
    cache_program,
    chunk_args,
    chunk_decode_program,
    chunk_denoise_program,
    chunk_head_program,
    chunk_tail_program,
    decode_args,
    denoise_args,
    seed_of,
    stream_key,
)
from wan_tpu.runtime import compile_cache
from wan_tpu.runtime.compile_cache import in_pipeline_choice
from wan_tpu.runtime.profiling import scope

PRESET = "matrix-game-tiny"
INDEX_FILE = "matrix_game.json"
# The tiny preset's CLIP vision tower (its width is the tiny DiT's image_dim).
TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
                 patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5)


class MatrixGamePipeline:
    """A Matrix-Game-2 model ready to play; see the module docstring."""

    def __init__(self, variant: MatrixGameVariant, loaders: dict, *, name: str, dtype, vae_dtype,
                 abstracts: dict | None = None, configs=None, attention: str | None = None,
                 compile_cache: bool | None = None, mesh=None):
        self.variant = variant
        self.name = name
        self.dtype = dtype
        self.vae_dtype = vae_dtype
        # The device mesh the loaders put the components on (the DiT sharded, VAE and CLIP replicated), or
        # None. On a mesh the programs are compiled on first use, from the calls' sharded arguments.
        self.mesh = mesh
        # Whether this pipeline's own loads, compiles and calls read and write the compile cache and the
        # executable cache in it: applied around them only (`compile_cache.selected`), never process-wide.
        # None (built directly, not by `from_pretrained`): the process's own state, as before.
        self.compile_cache = None if compile_cache is None else bool(compile_cache)
        self._loaders = loaders
        # name → the component's module without weights (`nnx.eval_shape`), from its config alone: what
        # `prepare` compiles the programs for (`wan_tpu.matrix_game.compile_ahead`).
        self._abstracts = abstracts or {}
        # () → each component's config, read without a tensor: with the dtypes and settings, what determines
        # every compiled program (`program_key`, the executable cache's key).
        self._configs = configs
        self.attention_impl = attention
        from wan_tpu.runtime.executable_cache import Programs

        self._programs = Programs()  # what `prepare` loaded or compiled, by name; calls fall back to jit
        self._loaded: dict = {}
        self._warmup = None
        from wan_tpu.matrix_game.sampling import chunk_schedule

        v = variant
        self.schedule = chunk_schedule(v.denoising_step_list, v.timestep_shift, v.warp_denoising_step, v.context_noise)
        self.action_space = actions.action_space(v)

    @classmethod
    def from_pretrained(cls, path_or_preset: str, *, mesh=None, dtype=jnp.bfloat16, attention: str | None = None,
                        compile_cache: bool = True, variant: str | None = None,
                        vae_dtype=jnp.float32) -> MatrixGamePipeline:
        """A converted Matrix-Game-2 folder (`wan_tpu/matrix_game/convert.py`) or `matrix-game-tiny`.

        `mesh`: a device mesh (`wan_tpu.make_mesh`), or None for one device: the DiT is sharded over it
        (`shard_matrix_game`: tokens over `dp`/`sp`, heads over `tp`), the VAE and CLIP are replicated on
        its devices, and each chunk program is partitioned from those (frames equal one device's to within
        summation order); `prepare` then reads the components ahead but compiles nothing (the programs
        compile on first use). `dtype`: the DiT and CLIP dtype (default bfloat16, as the authors run it);
        `attention`: the attention kernel's name (default: the fastest for the backend). `compile_cache`:
        whether this pipeline's compiles read and write the persistent compilation cache
        (`wan_tpu.runtime.compile_cache`) and the executable cache `prepare` keeps in it
        (`wan_tpu.runtime.executable_cache`), the default, or not; applied around its own work only.
        Matrix-Game's options: `variant` (universal, gta_drive, templerun; default: universal if present,
        else the only one); `vae_dtype`: the VAE's (float32 by default; the authors decode in float16).
        Components load on first use."""
        if path_or_preset == PRESET:
            if variant not in (None, PRESET):
                raise WanInputError(f"the {PRESET} preset has no variant {variant!r}; leave --variant out")
            return _tiny(dtype, vae_dtype, attention, bool(compile_cache), mesh)
        path = os.fspath(path_or_preset)
        index = _read_index(path)
        names = list(index["variants"])
        if variant is None:
            variant = "universal" if "universal" in names else names[0] if len(names) == 1 else None
            if variant is None:
                raise WanInputError(f"{path} holds the variants {', '.join(names)}; choose one with variant=/--variant")
        if variant not in index["variants"]:
            raise WanInputError(f"{path} has no {variant!r} model (it holds {', '.join(names)}); choose one of those "
                                f"or convert a download that has it")
        v = get_variant(variant)

        def transformer():
            from wan_tpu.matrix_game.loading import load_matrix_game_transformer

            return load_matrix_game_transformer(os.path.join(path, index["variants"][variant]), v.name, dtype=dtype,
                                                mesh=mesh, attention_impl=attention)

        def vae():
            from wan_tpu.vae.loading import load_vae

            return replicate(load_vae(os.path.join(path, index["vae"]), dtype=vae_dtype), mesh)

        def image_encoder():
            from wan_tpu.encoders.clip_image import CLIPImageEncoder

            return replicate(CLIPImageEncoder.from_pretrained(os.path.join(path, index["image_encoder"]), None,
                                                              dtype=dtype), mesh)

        def abstract_transformer():
            from wan_tpu.matrix_game.loading import abstract_transformer, transformer_config

            return abstract_transformer(transformer_config(os.path.join(path, index["variants"][variant]), v.name),
                                        dtype, attention)

        def abstract_vae():
            from wan_tpu.vae.loading import abstract_vae, vae_config

            return abstract_vae(vae_config(os.path.join(path, index["vae"])), vae_dtype)

        def abstract_image_encoder():
            from wan_tpu.encoders.clip_loading import abstract_clip_vision, clip_vision_config

            # The penultimate hidden state: `CLIPImageEncoder.from_pretrained` keeps all blocks but the last.
            return abstract_clip_vision(clip_vision_config(os.path.join(path, index["image_encoder"]), -1), dtype)

        def configs():
            from wan_tpu.encoders.clip_loading import clip_vision_config
            from wan_tpu.matrix_game.loading import transformer_config
            from wan_tpu.vae.loading import vae_config

            return {"transformer": transformer_config(os.path.join(path, index["variants"][variant]), v.name),
                    "vae": vae_config(os.path.join(path, index["vae"])),
                    "image_encoder": clip_vision_config(os.path.join(path, index["image_encoder"]), -1)}

        loaders = {"transformer": transformer, "vae": vae, "image_encoder": image_encoder}
        abstracts = {"transformer": abstract_transformer, "vae": abstract_vae, "image_encoder": abstract_image_encoder}
        return cls(v, loaders, name=os.path.abspath(path), dtype=dtype, vae_dtype=vae_dtype, abstracts=abstracts,
                   configs=configs, attention=attention, compile_cache=bool(compile_cache), mesh=mesh)

    @in_pipeline_choice
    def prepare(self, live: bool = False):
        """Start reading every component at once, and compiling every program a stream runs, in background
        threads; returns at once (a `wan_tpu.runtime.compile_ahead.Warmup`; as a context manager, leaving it waits for
        the threads). `component()` then waits for the one it needs only, and the first call that runs a
        program for the programs (`_wait_compiled`). The weights of one come off the disk while another's
        are placed, and the programs are loaded from the executable cache, or compiled from the
        components' configs, meanwhile, so a first
        frame waits for the slowest load, not for their sum and the compiles after it
        (`wan_tpu.matrix_game.compile_ahead`). A program whose compile ahead fails is a warning and compiles on use.
        On a mesh only the components are read ahead. The threads run in this pipeline's `compile_cache`
        choice. `live`: the chunk's two programs of live play (`begin_step`, `end_step`) instead of its one."""
        from wan_tpu.matrix_game.compile_ahead import compile_ahead
        from wan_tpu.runtime.compile_ahead import Warmup

        warmup = self._warmup = Warmup(compile_cache=self.compile_cache)
        for name, loader in self._loaders.items():
            if name not in self._loaded:
                warmup.start(name, loader)
        if self.program_key() is not None:  # after the loads start: its key waits for the device client
            warmup.prefetch("matrix-game", (self.program_key(), live))
        compile_ahead(self, warmup, live=live)
        return warmup

    @functools.cached_property
    def configs(self) -> dict:
        """Each component's config ("transformer", "vae", "image_encoder"), read without loading a tensor."""
        return self._configs() if self._configs is not None else {}

    def program_key(self) -> tuple:
        """What determines every program a stream runs, short of tracing one: the variant (sizes, steps),
        the components' configs, dtypes and attention setting (`wan_tpu.runtime.executable_cache` adds versions,
        devices and this package's sources). None without the configs, or on a mesh (the programs follow the
        arguments' shardings): nothing is stored or found then."""
        if self.mesh is not None or not self.configs:
            return None
        dtypes = tuple(jnp.dtype(d).name for d in (self.dtype, self.vae_dtype))
        return (self.variant, tuple(sorted(self.configs.items())), dtypes, self.attention_impl)

    def _wait_compiled(self, name: str) -> None:
        """Before running the program(s) `name`: wait for every program `prepare` started (a failure warns),
        not only `name`'s, and on a GPU for every component's load too. XLA records a program's first run
        on a GPU as a CUDA graph, and cuDNN captures one while it builds a fused kernel's plan on its first
        run, even in a program without graphs; CUDA work from other threads meanwhile (a program's kernels
        loading or autotuning, weights being placed) breaks that capture: `cudaErrorStreamCaptureUnjoined`,
        seen on an H100 in the VAE's first encode while the DiT still loaded, and in `cache_program` beside
        the chunk programs' compiles."""
        from wan_tpu.matrix_game.compile_ahead import captures_graphs

        if self._warmup is None:
            return
        for pending in [name, *self._warmup.compiles]:
            self._warmup.wait_compiled(pending)
        if captures_graphs():
            for component in self._loaders:
                self.component(component)
            self._warmup.first_transfer.join()

    @in_pipeline_choice
    def component(self, name: str):
        if name not in self._loaded:
            with scope(f"load_{name}"):
                loaded = self._warmup.take_load(name) if self._warmup is not None else None
                self._loaded[name] = loaded if loaded is not None else self._loaders[name]()
        return self._loaded[name]

    def split(self, name: str):
        """`nnx.split` of a component, made once: a new split is a new static argument of the compiled
        chunk programs, which would trace and compile them again for every stream."""
        key = f"{name}/split"
        if key not in self._loaded:
            self._loaded[key] = nnx.split(self.component(name))
        return self._loaded[key]

    transformer = property(lambda self: self.component("transformer"))
    vae = property(lambda self: self.component("vae"))
    image_encoder = property(lambda self: self.component("image_encoder"))

    @property
    def frames_per_chunk(self) -> int:
        return self.variant.num_frame_per_block

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the video."""
        h, w = self.variant.latent_size
        return 8 * h, 8 * w

    def chunk_frames(self, chunk: int) -> int:
        return actions.chunk_frames(chunk, self.frames_per_chunk)

    def action_row(self, words=(), mouse=None) -> tuple[np.ndarray, np.ndarray | None]:
        """One frame's action from words of the interactive grammar held at once (`actions.parse_line`: "w",
        "a", "j", "mouse left", ...) plus `mouse` ([vertical, horizontal], e.g. a pointer's motion, added to the
        words' camera motion) → (keyboard (keys,), mouse (2,) or None), checked as `step` checks its actions."""
        keyboard, moved = actions.parse_line(" ".join(words), self.action_space)
        if mouse is not None and moved is None:
            raise WanInputError("this variant has no mouse input; pass mouse=None")
        if mouse is not None:
            moved = moved + np.asarray(mouse, np.float32).reshape(2)
        keyboard, moved = actions.check_actions(keyboard[None], None if moved is None else moved[None], self.action_space)
        return keyboard[0], None if moved is None else moved[0]

    # ---- data preparation ---------------------------------------------------------------------

    def preprocess_image(self, image) -> np.ndarray:
        """(1, 3, H, W) float32 in [-1, 1]: `inference.py`'s `_resizecrop` (centre crop to the video's
        aspect), then a bilinear resize to the video size (torchvision `Resize` on a PIL image)."""
        from PIL import Image

        from wan_tpu.runtime.images import load_image

        th, tw = self.size
        pil = load_image(image)
        w, h = pil.size
        if h / w > th / tw:
            new_w, new_h = int(w), int(int(w) * th / tw)
        else:
            new_h, new_w = int(h), int(int(h) * tw / th)
        pil = pil.crop(((w - new_w) / 2, (h - new_h) / 2, (w + new_w) / 2, (h + new_h) / 2))
        if pil.size != (tw, th):
            pil = pil.resize((tw, th), Image.BILINEAR)
        x = np.asarray(pil, np.float32) / np.float32(255)
        return ((x - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)[None]

    @in_pipeline_choice
    def encode_image(self, image: np.ndarray, frames: int | None = None) -> ImageCondition:
        """The condition latents of `image` (from `preprocess_image`) followed by gray frames, up to where
        they repeat, whatever the video's length: so every stream of this model runs the same compiled
        chunk programs (the latents are one of their inputs) and a one-shot call equals a stream. `frames`:
        encode only what the first `frames` latent frames need now (`ImageCondition.cover` the rest)."""
        from wan_tpu.matrix_game.model import MAX_FRAMES

        split = self.split("vae")
        self._wait_compiled("condition")
        return ImageCondition.encode(self.vae, split, image, MAX_FRAMES, self._programs, frames=frames)

    @in_pipeline_choice
    def encode_clip(self, image: np.ndarray) -> jax.Array:
        """CLIP tokens (1, N, image_dim) of `image` (from `preprocess_image`), as the authors' `encode_video`."""
        from wan_tpu.encoders.clip_image import preprocess_tensor

        encoder = self.image_encoder
        pixels = preprocess_tensor(image, encoder.config.image_size)
        self._wait_compiled("clip")
        return self._programs.call("clip", (nnx.state(encoder.model), pixels),
                                   lambda: encoder.encode_pixels(pixels))

    # ---- generation ---------------------------------------------------------------------------

    @in_pipeline_choice
    def stream(self, image, seed: int = 0, max_frames: int | None = None) -> MatrixGameSession:
        """A new stream from `image` (a path, PIL image or uint8 (H, W, 3) array); `max_frames` bounds the
        video (default: as long as the model's position table allows)."""
        from wan_tpu.matrix_game.model import MAX_FRAMES

        f = self.frames_per_chunk
        max_latents = MAX_FRAMES // f * f
        if max_frames is not None:
            max_latents = min(max_latents, f * actions.check_frames(max_frames, f))
        with scope("1_Data_Preparation"):
            with scope("1.1_Image_Loading_Resize"):
                pixels = self.preprocess_image(image)
            # The VAE's and CLIP's encodes in the order their weights arrive (after `prepare`, the DiT is
            # still loading meanwhile: the session's cache waits for it).
            order = ("vae", "image_encoder")
            for name in order if self._warmup is None else self._warmup.as_loaded(order, self._loaded):
                if name == "vae":
                    with scope("1.2_VAE_Encode_FirstFrame"):
                        condition = self.encode_image(pixels, frames=f)
                else:
                    with scope("1.4_CLIP_Visual_Context"):
                        visual = self.encode_clip(pixels)
        return MatrixGameSession(self, condition, visual, seed, max_latents)

    @in_pipeline_choice
    def __call__(self, image, keyboard, mouse=None, seed: int = 0, progress: bool = False) -> np.ndarray:
        """The whole video for per-frame actions → uint8 (T, H, W, 3), T = len(keyboard) = 12n - 3."""
        keyboard, mouse = actions.check_actions(keyboard, mouse, self.action_space)
        chunks = actions.check_frames(len(keyboard), self.frames_per_chunk)
        session = self.stream(image, seed=seed, max_frames=len(keyboard))
        videos, start = [], 0
        steps = range(chunks)
        if progress:
            from tqdm import tqdm

            steps = tqdm(steps, desc="chunks", unit="chunk")
        for k in steps:
            n = self.chunk_frames(k)
            videos.append(session.step(keyboard[start : start + n], None if mouse is None else mouse[start : start + n]))
            start += n
        return np.concatenate(videos)


class MatrixGameSession:
    """A stream in progress: `step(keyboard, mouse)` → the next chunk's uint8 frames (n, H, W, 3).

    `chunk_seconds` holds each chunk's wall time (denoise + decode, frames on the host), and
    `chunk_frames` their frame counts; `fps` is frames over time per chunk."""

    def __init__(self, pipe: MatrixGamePipeline, condition: ImageCondition, visual_context, seed: int, max_latents: int):
        self.pipe = pipe
        self.condition = condition
        self.max_latents = max_latents
        self.chunk = 0
        space = pipe.action_space
        self.keyboard = np.zeros((0, space.keyboard_dim), np.float32)
        self.mouse = np.zeros((0, 2), np.float32) if space.mouse else None
        self.chunk_seconds: list[float] = []
        self.chunk_frames: list[int] = []
        self._open = self._head = None  # a chunk `begin_step` began: (start, args, kwargs, x0, x), its frames
        with scope("1.5_Noise_Sampling"):
            pipe._wait_compiled("key")
            self.key = pipe._programs.call("key", (seed_of(seed),), lambda: stream_key(seed))
        with scope("2.1_KV_Cache_Initialization"):
            self._dit, self._vae = pipe.split("transformer"), pipe.split("vae")
            pipe._wait_compiled("cache")
            self.cache, self.vae_caches = pipe._programs.call(
                "cache", (self._dit[1], self._vae[1], visual_context), lambda: cache_program(
                    *self._dit, *self._vae, visual_context, tuple(pipe.variant.latent_size), pipe.frames_per_chunk))

    def _chunk_args(self, keyboard_window, mouse_window, chunk_index):
        return chunk_args(self.pipe, self._dit, self._vae, self.cache, self.vae_caches, self.condition,
                          (keyboard_window, mouse_window), chunk_index, self.key)

    @property
    def fps(self) -> list[float]:
        return [n / s for n, s in zip(self.chunk_frames, self.chunk_seconds)]

    def step(self, keyboard, mouse=None) -> np.ndarray:
        """The next chunk from its actions: one row per video frame of the chunk (9 for the first chunk,
        12 after), or one row held for the whole chunk."""
        with compile_cache.selected(self.pipe.compile_cache):
            return self._step(keyboard, mouse)

    def begin_step(self, keyboard, mouse=None) -> np.ndarray:
        """`step` in two parts, for live play: the chunk's first frames (its first latent frame's: 1 for the
        first chunk, 4 after) as soon as they are decoded; `end_step()` then gives the rest. Together they
        are bitwise `step`'s frames, and the stream goes on as after `step`. The two programs
        (`chunk_head_program`, `chunk_tail_program`) are compiled ahead by `prepare(live=True)`."""
        with compile_cache.selected(self.pipe.compile_cache):
            return self._begin(keyboard, mouse)

    def end_step(self) -> np.ndarray:
        """The rest of the chunk `begin_step` began (its cache pass and the decode of its other frames)."""
        if self._open is None:
            raise WanInputError("no chunk is open: call begin_step first")
        with compile_cache.selected(self.pipe.compile_cache):
            return self._end()

    def _windows(self, keyboard, mouse):
        """The chunk's action windows, its rows appended to the stream's; checks that the stream goes on."""
        from wan_tpu.matrix_game.action_module import chunk_action_window

        pipe, k = self.pipe, self.chunk
        f = pipe.frames_per_chunk
        if self._open is not None:
            raise WanInputError("a chunk is open: call end_step before the next chunk")
        if f * (k + 1) > self.max_latents:
            raise WanInputError(f"this stream is at its end ({self.max_latents} latent frames); start a new one")
        n = pipe.chunk_frames(k)
        with scope("1.6_Action_Conditions_Setup"):
            keyboard, mouse = _chunk_rows(keyboard, mouse, n, pipe.action_space)
            self.keyboard = np.concatenate([self.keyboard, keyboard])
            windows = [chunk_action_window(self.keyboard, k, f)[None]]
            if self.mouse is not None:
                self.mouse = np.concatenate([self.mouse, mouse])
                windows.append(chunk_action_window(self.mouse, k, f)[None])
            else:
                windows.append(None)
        return windows

    def _done(self, start: float, frames: np.ndarray) -> np.ndarray:
        self.chunk_seconds.append(time.perf_counter() - start)
        self.chunk_frames.append(len(frames))
        self.chunk += 1
        return frames

    def _opening(self, keyboard, mouse, name: str):
        """A chunk's checks and action windows, the wait for program `name` (first chunk), its gray frames
        → (chunk index, start time, the program's arguments, keywords)."""
        k = self.chunk
        windows = self._windows(keyboard, mouse)
        start = time.perf_counter()
        if k == 0:
            self.pipe._wait_compiled(name)
        self.condition.cover(self.pipe.frames_per_chunk * (k + 1))  # this chunk's gray frames, until they repeat
        return (k, start, *self._chunk_args(*windows, np.int32(k)))

    def _call(self, name: str, program, args, kwargs, graphs: tuple = (0, 2)):
        # Less the graphdefs (static, as `schedule` and `frames_per_chunk`): at `graphs` in `args`.
        dynamic = tuple(a for i, a in enumerate(args) if i not in graphs)
        return self.pipe._programs.call(name, dynamic, lambda: program(*args, **kwargs))

    def _step(self, keyboard, mouse) -> np.ndarray:
        k, start, args, kwargs = self._opening(keyboard, mouse, "chunk-denoise")
        with scope(f"2.3_Block_{k}"):
            x0, self.cache = self._call("chunk-denoise", chunk_denoise_program, denoise_args(args), kwargs, (0,))
            frames, self.vae_caches = self._call("chunk-decode", chunk_decode_program, decode_args(args, x0), {}, (0,))
            with scope("3_Video_Postprocessing"):
                frames = np.asarray(frames)[0, -self.pipe.chunk_frames(k):]  # the first chunk's first 3 are padding
        return self._done(start, frames)

    def _begin(self, keyboard, mouse) -> np.ndarray:
        k, start, args, kwargs = self._opening(keyboard, mouse, "chunk-head")
        with scope(f"2.3_Block_{k}_head"):
            frames, x0, x, self.cache, self.vae_caches = self._call("chunk-head", chunk_head_program, args, kwargs)
            self._open = (start, args, kwargs, x0, x)
            frames = np.asarray(frames)[0, 3 if k == 0 else 0:]  # the first chunk's first 3 are padding
        self._head = frames
        return frames

    def _end(self) -> np.ndarray:
        start, args, kwargs, x0, x = self._open
        args = (*args[:4], self.cache, self.vae_caches, *args[6:], x0, x)  # the caches the head gave
        with scope(f"2.3_Block_{self.chunk}_tail"):
            frames, self.cache, self.vae_caches = self._call("chunk-tail", chunk_tail_program, args, kwargs)
            frames = np.asarray(frames)[0]
        head, self._open, self._head = self._head, None, None
        self._done(start, np.concatenate([head, frames]))
        return frames


def _chunk_rows(keyboard, mouse, n: int, space: actions.ActionSpace):
    keyboard = np.asarray(keyboard, np.float32)
    if keyboard.ndim == 1:
        keyboard = np.repeat(keyboard[None], n, axis=0)
        if mouse is not None and np.ndim(mouse) == 1:
            mouse = np.repeat(np.asarray(mouse, np.float32)[None], n, axis=0)
    keyboard, mouse = actions.check_actions(keyboard, mouse, space, frames=n)
    return keyboard, mouse


def _read_index(path: str) -> dict:
    if not os.path.isdir(path):
        raise WanInputError(f"model {path!r} is neither a folder nor the preset {PRESET}; pass a folder made by "
                            f"wan-convert-matrix-game or --model {PRESET}")
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index_path):
        hint = ("it looks like the Skywork/Matrix-Game-2.0 download: convert it once with "
                f"wan-convert-matrix-game {path} DST") if os.path.isfile(
            os.path.join(path, "Wan2.1_VAE.pth")) else "pass a folder made by wan-convert-matrix-game"
        raise WanInputError(f"{path} has no {INDEX_FILE}; {hint}")
    try:
        with open(index_path) as f:
            index = json.load(f)
        variants = dict(index["variants"])
        index["vae"], index["image_encoder"]  # noqa: B018 - presence check
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise WanInputError(f"{index_path} is damaged ({type(e).__name__}); convert the download again") from None
    unknown = sorted(set(variants) - set(MATRIX_GAME_VARIANTS))
    if unknown or not variants:
        raise WanInputError(f"{index_path} names unknown variants {unknown}; convert the download again")
    return index


def replicate(component, mesh):
    """`component` (a module, or an encoder holding one as `.model`) with its weights on every device of
    `mesh`, in place; unchanged without a mesh."""
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        from wan_tpu.parallel.sharding import reshard

        module = getattr(component, "model", component)
        replicated = NamedSharding(mesh, PartitionSpec())
        nnx.update(module, jax.tree.map(lambda x: reshard(x, replicated), nnx.state(module)))
    return component


@functools.lru_cache(maxsize=4)
def _tiny(dtype, vae_dtype, attention, compile_cache: bool | None = None, mesh=None) -> MatrixGamePipeline:
    """The `matrix-game-tiny` preset: random weights from fixed seeds (see `wan_tpu.loading.random_init.random_module`).
    One pipeline per setting (the compile-cache choice and mesh included) and process, so its compiled
    chunk programs serve every later request."""
    from wan_tpu.configs.vae import TINY_VAE
    from wan_tpu.encoders.clip import CLIPVisionConfig, CLIPVisionTransformer, random_clip
    from wan_tpu.loading.random_init import TINY_SEED, random_module
    from wan_tpu.matrix_game.model import MatrixGameTransformer
    from wan_tpu.runtime import executable_cache
    from wan_tpu.vae.model import WanVAE

    variant = get_variant(PRESET)
    # The penultimate hidden state: the tower without its last block.
    clip = CLIPVisionConfig(**{**TINY_CLIP, "num_hidden_layers": TINY_CLIP["num_hidden_layers"] - 1})
    builds = {
        "transformer": lambda: MatrixGameTransformer(variant.transformer, dtype=dtype, rngs=nnx.Rngs(0),
                                                     attention_impl=attention),
        "vae": lambda: WanVAE(TINY_VAE, dtype=vae_dtype, rngs=nnx.Rngs(0)),
        "image_encoder": lambda: CLIPVisionTransformer(clip, dtype, attention),
    }

    # Abstract modules and random weights kept in the executable cache: a warm start neither traces the
    # constructors nor draws the weights again.
    keys = {"transformer": ("matrix-game-transformer", variant.transformer, jnp.dtype(dtype).name, attention),
            "vae": ("wan-vae", TINY_VAE, jnp.dtype(vae_dtype).name)}
    abstracts = {name: functools.partial(executable_cache.cached_abstract, f"{PRESET}-{name}", keys[name], builds[name])
                 for name in keys}
    abstracts["image_encoder"] = functools.partial(nnx.eval_shape, builds["image_encoder"])

    def transformer():
        from wan_tpu.matrix_game.loading import shard_matrix_game

        model = random_module(None, TINY_SEED, abstract=abstracts["transformer"](), key=keys["transformer"])
        return model if mesh is None else shard_matrix_game(model, mesh)

    def image_encoder():
        from wan_tpu.encoders.clip_image import CLIPImageEncoder

        return replicate(CLIPImageEncoder(random_clip(builds["image_encoder"], TINY_SEED + 2)), mesh)

    loaders = {"transformer": transformer, "image_encoder": image_encoder,
               "vae": lambda: replicate(random_module(None, TINY_SEED + 1, abstract=abstracts["vae"](), key=keys["vae"]),
                                        mesh)}
    return MatrixGamePipeline(variant, loaders, name=PRESET, dtype=dtype, vae_dtype=vae_dtype, abstracts=abstracts,
                              configs=lambda: {"transformer": variant.transformer, "vae": TINY_VAE, "image_encoder": clip},
                              attention=attention, compile_cache=compile_cache, mesh=mesh)
