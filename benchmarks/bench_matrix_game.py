"""Matrix-Game-2 on one GPU: the authors' pipeline and ours on the same random weights, in one call.

    # device (one H100/H200; the authors' checkout carried as third_party/Matrix-Game):
    python benchmarks/bench_matrix_game.py --ref third_party/Matrix-Game --workdir /tmp/mg_bench
    # device, without the authors' code: a converted folder with random weights (benchmarks/random_folders.py), ours only
    python benchmarks/bench_matrix_game.py --random --workdir /tmp/mg_bench --parts prepare,first-frame,ours
    # CPU smoke test (ours only, the matrix-game-tiny preset):
    python benchmarks/bench_matrix_game.py --config tiny --workdir /tmp/mg_tiny --latent-frames 9

Parts (`--parts`, default all; each in its own fresh process, results merged into WORKDIR/results.json,
so a later call can run the rest while the machine still holds WORKDIR):
- `prepare`: random weights made with the authors' classes (`CausalWanModel` from their universal
  config.json, `VideoVAE_`, the XLM-RoBERTa CLIP's visual tower) in the download's layout (DiT
  safetensors with their names, `Wan2.1_VAE.pth`, the CLIP `.pth`), bf16, then our converter. With
  `--random`: `random_folders.py matrix-game WORKDIR/converted` instead (the same files, names, shapes and
  dtypes, written by our code alone; about the time of writing 5 GB), so no `--ref` is needed.
- `theirs`: `CausalInferencePipeline.inference(profile=True)` of their code on those weights, as their
  `inference.py` sets it up (DiT bf16, decoder fp16 with `torch.compile(mode="max-autotune-no-cudagraphs")`,
  their tiled VAE encode of the image + 4·(N-1) gray frames, CLIP `encode_video`, `Bench_actions_universal`).
  Runtime patches, only where their code cannot run here: no flash-attn on the machine, so their
  `flash_attn_func` / `flash_attention` calls go to torch SDPA (same layout, same scale) and their
  `attention` takes its own SDPA fallback; where `torchvision` is absent, a stand-in for the one
  transform their CLIP runs (`Normalize`); our image preprocessing (the same centre crop + bilinear
  resize as their `_resizecrop` + `Resize`) feeds both pipelines.
- `ours`: `MatrixGamePipeline` on the converted folder (DiT bf16, VAE `--vae-dtype`), the same image,
  seed and actions, through a stream, with the compile cache warm from the first-frame runs when
  they ran first.
- `first-frame`: ours in a fresh process from `python` start to the first chunk's frames on the host,
  with an empty compile cache (cold) and again with it filled (warm, `--warm-runs` times), and where the
  time went (seconds from start): imports done, every load finished, the image prepared (condition, CLIP
  tokens, the DiT cache), the first frame; when each load and each compile ahead (`prepare`) finished,
  when each stored program's load began and ended, and how long the second chunk took.
- `startup` (after `first-frame`): a warm start's steps one after the other in a fresh process (imports,
  backend start, Mosaic GPU's runtime, the source hash, each stored program's load, each component's
  weights), so the concurrent start's overlap can be read against its parts.

Reported (printed as a table, theirs beside ours): DiT forward per chunk (ms, one forward of a
3-frame chunk over a full window, median of 10), per-chunk fps (video frames ÷ (denoise + decode),
median from chunk 2 on), whole-video fps (all frames ÷ the sum of all chunks, first chunks included),
time to the first frame, peak device memory (theirs: torch's peak allocated; ours: JAX's peak in use).
Needs on the device: diffusers and einops (their imports; pure Python wheels), torchax for our CLIP.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

CONFIGS = {"universal": dict(latent_frames=150, preset=None), "tiny": dict(latent_frames=9, preset="matrix-game-tiny")}
SEED = 0
T0 = "MG_BENCH_T0"  # a part's process start (time.time()), set by the parent just before the spawn


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- the authors' code, importable here -------------------------------------------------------


def import_reference(ref: str):
    """Their modules with runtime patches (see the module docstring); returns a namespace of them."""
    import torch

    class Normalize:  # the one torchvision transform their CLIP runs, where torchvision is absent
        def __init__(self, mean, std):
            self.mean, self.std = torch.tensor(mean), torch.tensor(std)

        def __call__(self, x):
            return (x - self.mean.to(x)[:, None, None]) / self.std.to(x)[:, None, None]

    tokenizers = {"HuggingfaceTokenizer": object}
    ref = harness.import_reference(
        os.path.join(ref, "Matrix-Game-2"),
        ("demo_utils.vae_block3", "pipeline.causal_inference", "utils.conditions", "utils.wan_wrapper",
         "wan.modules.attention", "wan.modules.model", "wan.vae.wanx_vae_src.clip", "wan.vae.wanx_vae_src.vae"),
        # What their modules import from diffusers, imported before the stand-ins exist: diffusers and
        # transformers probe for flash_attn and torchvision while importing.
        first=("diffusers.configuration_utils", "diffusers.models.modeling_utils", "diffusers.loaders.single_file_model",
               "diffusers.loaders.peft"),
        packages=("wan", "wan.modules", "wan.vae", "wan.vae.wanx_vae_src"),
        stubs={"flash_attn": {"flash_attn_func": harness.sdpa_flash_attn}, "wan.modules.tokenizers": tokenizers,
               "wan.vae.wanx_vae_src.tokenizers": tokenizers, "utils.visualize": {"process_video": None}},
        missing={"torchvision": {}, "torchvision.transforms": {"Normalize": Normalize}})
    ref.attention.FLASH_ATTN_2_AVAILABLE = ref.attention.FLASH_ATTN_3_AVAILABLE = False  # their own SDPA fallback
    ref.model.flash_attention = harness.sdpa_flash_attn
    ref.clip.flash_attention = harness.sdpa_flash_attn
    return ref


# ---- parts -------------------------------------------------------------------------------------


def prepare(args) -> dict:
    """Random weights in the download's layout, made with their classes, then our converter; with `--random`,
    the converted folder written directly by `random_folders.py` (no authors' code)."""
    if args.random:
        import random_folders

        start = time.perf_counter()
        random_folders.write("matrix-game", os.path.join(args.workdir, "converted"), overwrite=True, seed=SEED, log=log)
        return {"prepare": {"random_folder_s": time.perf_counter() - start}}
    import torch
    from safetensors.torch import save_file

    ref = import_reference(args.ref)
    src = os.path.join(args.workdir, "download")
    os.makedirs(os.path.join(src, "base_distilled_model"), exist_ok=True)
    device = harness.torch_device()
    start = time.perf_counter()
    torch.manual_seed(SEED)
    with torch.device(device):
        dit = ref.wan_wrapper.WanDiffusionWrapper(model_config=os.path.join(ref.root, "configs/distilled_model/universal"))
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in dit.state_dict().items()},
                  os.path.join(src, "base_distilled_model/base_distill.safetensors"))
        del dit
        vae = ref.vae.VideoVAE_(z_dim=16)
        torch.save({k: v.float() for k, v in vae.state_dict().items()}, os.path.join(src, "Wan2.1_VAE.pth"))
        del vae
        clip = ref.clip.clip_xlm_roberta_vit_h_14(pretrained=False, return_transforms=False)
        # The converter reads the visual tower only; the text tower (half the file) is left out.
        torch.save({k: v.half() for k, v in clip.state_dict().items() if k.startswith("visual.")},
                   os.path.join(src, "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"))
        del clip
    made = time.perf_counter() - start
    converted = harness.run_fresh([sys.executable, "-m", "wan_tpu.matrix_game.convert", src,
                                   os.path.join(args.workdir, "converted"), "--overwrite"], capture=False)
    if converted.rc:
        raise SystemExit(f"the converter failed (status {converted.rc})")
    return {"prepare": {"weights_s": made, "convert_s": converted.wall}}


def actions_for(frames: int):
    from wan_tpu.configs.matrix_game import get_variant
    from wan_tpu.matrix_game.actions import action_space, random_actions

    return random_actions(action_space(get_variant("universal")), frames, SEED)


def bench_image(size):
    """A fixed test image (there is no real photo on the machine), preprocessed as ours and theirs do."""
    import numpy as np

    h, w = size
    y, x = np.mgrid[0:h * 2, 0:w * 2]
    return np.stack([(x * 255 // (2 * w)), (y * 255 // (2 * h)), ((x + y) % 256)], -1).astype(np.uint8)


def theirs(args) -> dict:
    import torch

    ref = import_reference(args.ref)
    t0 = harness.process_start(T0)
    dev = torch.device("cuda")
    n_lat = args.latent_frames
    frames = 1 + 4 * (n_lat - 1)
    src = os.path.join(args.workdir, "download")
    yaml_path = os.path.join(ref.root, "configs/inference_yaml/inference_universal.yaml")
    config = _yaml_namespace(yaml_path)

    from safetensors.torch import load_file

    with torch.device(dev):  # built on the GPU: seconds instead of a minute of host-side init
        generator = ref.wan_wrapper.WanDiffusionWrapper(
            model_config=os.path.join(ref.root, "configs/distilled_model/universal"), timestep_shift=5.0, is_causal=True)
        clip_model = ref.clip.clip_xlm_roberta_vit_h_14(pretrained=False, return_transforms=False)
    del clip_model.textual  # encode_video runs the visual tower only
    decoder = ref.vae_block3.VAEDecoderWrapper()
    vae_state = torch.load(os.path.join(src, "Wan2.1_VAE.pth"), map_location="cpu", weights_only=True)
    decoder.load_state_dict({k: v for k, v in vae_state.items() if "decoder." in k or "conv2" in k})
    decoder.to(dev, torch.float16).requires_grad_(False).eval()
    if args.their_compile != "none":
        decoder.compile(mode=args.their_compile)
    pipe = ref.causal_inference.CausalInferencePipeline(config, generator=generator, vae_decoder=decoder)
    pipe.generator.load_state_dict(load_file(os.path.join(src, "base_distilled_model/base_distill.safetensors")))
    pipe = pipe.to(device=dev, dtype=torch.bfloat16)
    pipe.vae_decoder.to(torch.float16)
    wanx = ref.vae.WanVAE(z_dim=16)
    wanx.model.load_state_dict(vae_state)
    wanx = wanx.to(dev, torch.bfloat16)
    clip_state = torch.load(os.path.join(src, "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"),
                            map_location="cpu", weights_only=True)
    clip_model.load_state_dict(clip_state, strict=False)  # the prepared file holds the visual tower
    clip_model = clip_model.to(dev, torch.bfloat16).eval()
    load_s = time.time() - t0

    first = {}

    class FirstFrames(torch.nn.Module):
        """Their (compiled) decoder, noting when its first frames exist: process start → first frame.
        A wrapper around the module, not inside it, so torch.compile sees their forward unchanged."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *a):
            out = self.inner(*a)
            if "t" not in first:
                torch.cuda.synchronize()
                first["t"] = time.time() - t0
            return out

    pipe.vae_decoder = FirstFrames(pipe.vae_decoder)
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        start = time.time()
        image = torch.from_numpy(_our_preprocess(bench_image((352, 640)))).to(dev, torch.bfloat16)[:, :, None]
        video = torch.cat([image, torch.zeros_like(image).repeat(1, 1, frames - 1, 1, 1)], dim=2)
        cond = wanx.encode(video, device=dev, tiled=True, tile_size=[44, 80], tile_stride=[23, 38]).to(dev)
        mask = torch.ones_like(cond)
        mask[:, :, 1:] = 0
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
        clip_ns = types.SimpleNamespace(model=clip_model, dtype=torch.bfloat16, device=dev,
                                        transforms=types.SimpleNamespace(transforms=[ref.clip.T.Normalize(mean, std)]))
        visual = ref.clip.CLIPModel.encode_video(clip_ns, image)
        noise = torch.randn([1, 16, n_lat, 44, 80], device=dev, dtype=torch.bfloat16)
        keyboard, mouse = actions_for(frames)
        cond_dict = {"cond_concat": torch.cat([mask[:, :4], cond], dim=1).to(dev, torch.bfloat16),
                     "visual_context": visual.to(dev, torch.bfloat16),
                     "keyboard_cond": torch.from_numpy(keyboard)[None].to(dev, torch.bfloat16),
                     "mouse_cond": torch.from_numpy(mouse)[None].to(dev, torch.bfloat16)}
        torch.cuda.synchronize()
        prep_s = time.time() - start
        printed = io.StringIO()
        start = time.time()
        with contextlib.redirect_stdout(printed):
            videos = pipe.inference(noise=noise, conditional_dict=cond_dict, return_latents=False, mode="universal",
                                    profile=True)
        torch.cuda.synchronize()
        inference_s = time.time() - start
        chunk_ms = [float(v) for v in re.findall(r"diffusion_time: ([0-9.]+)", printed.getvalue())]
        chunk_frames = [v.shape[1] for v in videos]
        forward_ms = _their_forward_ms(ref, pipe, cond_dict, n_lat)
    return {"theirs": _summary(chunk_frames, [m / 1e3 for m in chunk_ms], forward_ms, first.get("t"),
                               torch.cuda.max_memory_allocated(), load_s=load_s, prep_s=prep_s, wall_s=inference_s)}


def _their_forward_ms(ref, pipe, cond_dict, n_lat):
    """One DiT forward of the last chunk over the full caches the run left (median of 10)."""
    import torch

    f = pipe.num_frame_per_block
    start_frame = n_lat - f
    x = torch.randn([1, 16, f, 44, 80], device="cuda", dtype=torch.bfloat16)
    t = torch.full([1, f], 1000, device="cuda", dtype=torch.int64)
    cond = ref.causal_inference.cond_current(cond_dict, start_frame, f, mode="universal")
    times = []
    for _ in range(12):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        pipe.generator(noisy_image_or_video=x, conditional_dict=cond, timestep=t, kv_cache=pipe.kv_cache1,
                       kv_cache_mouse=pipe.kv_cache_mouse, kv_cache_keyboard=pipe.kv_cache_keyboard,
                       crossattn_cache=pipe.crossattn_cache, current_start=start_frame * pipe.frame_seq_length)
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times[2:])


class StackSampler:
    """Where each thread is, every 5 ms (`--sample-stacks`): per thread, the segments (≥ 50 ms) in one
    function (the innermost frame of this package, jax or flax, else the innermost), and the sampler's
    own late wake-ups (≥ 30 ms: the GIL held that long by native code, named by the busiest stacks)."""

    def __init__(self, t0: float):
        import threading

        self.t0, self.segments, self.stalls = t0, {}, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    @staticmethod
    def _where(frame) -> str:
        first = None
        while frame is not None:
            name = frame.f_code.co_filename
            label = f"{os.path.basename(name)}:{frame.f_code.co_name}"
            first = first or label
            if any(part in name for part in ("/wan_tpu/", "/jax/", "/flax/", "/safetensors/")):
                return label
            frame = frame.f_back
        return first or "?"

    def _run(self):
        import threading

        last = time.time()
        names = {}
        while not self._stop.is_set():
            time.sleep(0.005)
            now = time.time()
            frames = sys._current_frames()
            for t in threading.enumerate():
                names[t.ident] = t.name
            where = {names.get(i, str(i)): self._where(f) for i, f in frames.items() if names.get(i) != "sampler"}
            if now - last >= 0.03:
                self.stalls.append((round(last - self.t0, 2), round(now - last, 2), where))
            for thread, label in where.items():
                segs = self.segments.setdefault(thread, [])
                if segs and segs[-1][2] == label:
                    segs[-1][1] = now - self.t0
                else:
                    segs.append([now - self.t0, now - self.t0, label])
            last = now

    def report(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"threads": {t: [(round(a, 2), round(b, 2), w) for a, b, w in segs if b - a >= 0.05]
                            for t, segs in self.segments.items()},
                "stalls": self.stalls}


def ours(args, first_frame_only=False) -> dict:
    """Our stream as the CLI runs it: `prepare` (every load and every program's compile start at once),
    then `stream` and `step`. Times are seconds from the process start (`T0`)."""
    t0 = harness.process_start(T0)
    sampler = StackSampler(t0) if first_frame_only and args.sample_stacks else None
    _enable_compile_cache(args.cache_dir)
    from wan_tpu.runtime.xla_defaults import apply_xla_defaults

    apply_xla_defaults()  # as the CLI's process does; a flag set in XLA_FLAGS wins
    import jax
    import jax.numpy as jnp

    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline
    from wan_tpu.runtime import executable_cache

    dtypes = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
    model = CONFIGS[args.config]["preset"] or os.path.join(args.workdir, "converted")
    startup_s = time.time() - t0  # the imports
    loading = {}  # each stored program's load: (start, end) in s from start
    load = executable_cache.load

    def timed_load(name, key):
        begin = time.time() - t0
        try:
            return load(name, key)
        finally:
            loading[name] = (begin, time.time() - t0)

    executable_cache.load = timed_load
    calling = {}  # each program's first call (dispatch, not its GPU time): (start, end) in s from start
    call = executable_cache.Programs.call

    def timed_call(self, name, dynamic, fallback):
        begin = time.time() - t0
        try:
            return call(self, name, dynamic, fallback)
        finally:
            calling.setdefault(name, (begin, time.time() - t0))

    executable_cache.Programs.call = timed_call
    pipe = MatrixGamePipeline.from_pretrained(model, dtype=dtypes[args.dtype], vae_dtype=dtypes[args.vae_dtype])
    warmup = pipe.prepare()
    ready = {}  # when each load / compile ahead finished (s from start)
    for kind, futures in (("load", warmup.loads), ("compile", warmup.compiles)):
        for name, future in futures.items():
            future.add_done_callback(lambda _, key=f"{kind} {name}": ready.setdefault(key, time.time() - t0))
    frames = 1 + 4 * (args.latent_frames - 1)
    keyboard, mouse = actions_for(frames)
    h, w = pipe.size
    start = time.time()
    session = pipe.stream(bench_image((h, w)), seed=SEED, max_frames=frames)
    jax.block_until_ready((session.condition.latents, session.cache))
    image_s, prep_s = time.time() - t0, time.time() - start
    begin, first = time.time(), None
    done = 0
    # The first-frame runs also make the second chunk: its time after the first, with one program for both.
    for k in range(2 if first_frame_only else args.latent_frames // pipe.frames_per_chunk):
        n = pipe.chunk_frames(k)
        session.step(keyboard[done : done + n], mouse[done : done + n])
        done += n
        first = first or time.time() - t0
    wall_s = time.time() - begin
    warmup.close()
    load_s = max(t for key, t in ready.items() if key.startswith("load "))
    if first_frame_only:
        return {"first_frame_s": first, "startup_s": startup_s, "load_s": load_s, "image_s": image_s, "prep_s": prep_s,
                "second_chunk_s": session.chunk_seconds[1], "ready": dict(sorted(ready.items(), key=lambda kv: kv[1])),
                "program_loads": dict(sorted(loading.items(), key=lambda kv: kv[1])),
                "first_calls": dict(sorted(calling.items(), key=lambda kv: kv[1])),
                "stacks": sampler.report() if sampler else None}
    forward_ms, profile = _our_forward_ms(pipe, session, keyboard, mouse, args.profile)
    stats = jax.devices()[0].memory_stats() or {}
    return {"ours": _summary(session.chunk_frames, session.chunk_seconds, forward_ms, first,
                             stats.get("peak_bytes_in_use"), load_s=load_s, prep_s=prep_s, wall_s=wall_s,
                             profile=profile)}


def _our_forward_ms(pipe, session, keyboard, mouse, profile=None):
    """One DiT forward (`MatrixGameTransformer.__call__`, jitted) of the last chunk over the full window;
    → (median ms, lines): with `profile` (a folder), one more forward traced there, and its GPU time
    by op class in the lines (printed under the table)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from wan_tpu.matrix_game.action_module import chunk_action_window

    model, f = pipe.transformer, pipe.frames_per_chunk
    k = session.chunk - 1
    latents = jnp.zeros((1, 16, f, *pipe.variant.latent_size), model.dtype)
    cond = jnp.zeros((1, model.config.in_dim - 16, f, *pipe.variant.latent_size), model.dtype)
    t = np.full((1, f), 1000.0, np.float32)
    windows = [jnp.asarray(chunk_action_window(a[: len(session.keyboard)], k, f)[None]) for a in (keyboard, mouse)]
    # 12 calls, the first 2 not counted
    times = harness.measure(lambda: model(latents, cond, t, *windows, session.cache, jnp.int32(k * f)),
                            jax.block_until_ready, warmup=2, iters=10)
    # The same forward as the chunk program runs it: the jitted pure function on a state split once, inputs
    # on the device (the module call above also splits the module and moves its inputs every call).
    from flax import nnx

    from wan_tpu.matrix_game.cache import valid_window_frames
    from wan_tpu.matrix_game.model import _forward_jit

    graphdef, state = nnx.split(model)
    t_dev, offset = jnp.asarray(t), jnp.int32(k * f)
    valid = valid_window_frames(model.config.window_frames, k * f + f)
    pure = harness.measure(lambda: _forward_jit(graphdef, state, latents, cond, t_dev, *windows, session.cache, offset,
                                                valid), jax.block_until_ready, warmup=2, iters=10)
    # Inside one program, as the chunk program runs its forwards: FORWARDS of them in a scan over different
    # timesteps (no call or argument dispatch between them), the program's time divided by FORWARDS.
    ts = jnp.asarray(np.linspace(1000.0, 100.0, FORWARDS, dtype=np.float32)[:, None, None].repeat(f, axis=2))
    args = (graphdef, state, latents, cond, ts, *windows, session.cache, offset, valid)
    forwards = jax.jit(_forwards, static_argnums=(0, 9))
    in_program = harness.measure(lambda: forwards(*args), jax.block_until_ready, iters=5).ms / FORWARDS
    lines = [f"DiT forward inside one program ({FORWARDS} in a scan, as the chunk program runs them): {in_program:.1f} ms; "
             f"one jitted call (a state split once, inputs on the device): {pure.ms:.1f} ms; "
             f"a module call (split and input transfers every call, the table's row): {times.ms:.1f} ms"]
    if profile:
        from wan_tpu.runtime.profiling import op_class_table, trace

        with trace(profile):
            jax.block_until_ready(model(latents, cond, t, *windows, session.cache, jnp.int32(k * f)))
        lines += op_class_table(profile, "Matrix-Game DiT forward", top=16)
    return times.ms, lines


FORWARDS = 10


def _forwards(graphdef, state, latents, cond, timesteps, keyboard, mouse, cache, offset, valid):
    """The DiT forward once per row of `timesteps` (F, B, frames), in a scan → the sum of the outputs' means."""
    import jax
    import jax.numpy as jnp

    from wan_tpu.matrix_game.model import forward

    def body(total, t):
        out = forward(graphdef, state, latents, cond, t, keyboard, mouse, cache, offset, valid)
        return total + jax.tree.leaves(out)[0].astype(jnp.float32).mean(), None

    return jax.lax.scan(body, jnp.float32(0), timesteps)[0]


def startup(args) -> dict:
    """A warm start taken apart (fresh process, the cache `first-frame` filled): each step alone, one after
    the other, in seconds: what the concurrent start of `first` overlaps."""
    t0 = harness.process_start(T0)
    steps, last = {"python start": time.time() - t0}, time.time()

    def mark(name):
        nonlocal last
        steps[name] = time.time() - last
        last = time.time()

    import jax

    mark("import jax")
    import flax.nnx  # noqa: F401

    mark("import flax.nnx")
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline
    from wan_tpu.runtime import compile_cache, executable_cache

    mark("import wan_tpu.matrix_game.pipeline")
    jax.devices()
    mark("backend start (jax.devices)")
    _enable_compile_cache(args.cache_dir)
    executable_cache._load_kernel_runtimes()
    mark("kernel runtimes (Mosaic GPU)")
    executable_cache.source_hash()
    mark("source hash")
    import jax.numpy as jnp

    dtypes = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
    model = CONFIGS[args.config]["preset"] or os.path.join(args.workdir, "converted")
    pipe = MatrixGamePipeline.from_pretrained(model, dtype=dtypes[args.dtype], vae_dtype=dtypes[args.vae_dtype])
    mark("from_pretrained")
    key = pipe.program_key()
    mark("program key")
    for name in ("encode-first", "start-latents", "gray-latents", "normalized", "clip", "cache", "key", "chunk-denoise",
                 "chunk-decode"):
        found = executable_cache.load(name, key) is not None
        mark(f"load program {name}" + ("" if found else " (MISSING)"))
    for name, loader in pipe._loaders.items():  # weights are placed asynchronously: wait for every array
        loader()
        jax.block_until_ready(jax.live_arrays())
        mark(f"load weights {name}")
    steps["total"] = time.time() - t0
    assert compile_cache.is_enabled()
    return {"startup": steps}


def first_frame(argv) -> dict:
    """Ours in fresh processes: an empty compile cache, then the filled one."""
    labels = ["cold", "warm", *(f"warm {i}" for i in range(2, warm_runs(argv) + 1))]
    return {"first_frame": {label: run_child("first", argv) for label in labels}}


def warm_runs(argv) -> int:
    return int(argv[argv.index("--warm-runs") + 1]) if "--warm-runs" in argv else 1


def run_child(part: str, argv) -> dict:
    """A part in a fresh process (`--parts _child:PART`), timed from just before its start."""
    result = harness.run_fresh([sys.executable, os.path.abspath(__file__), *argv, "--parts", f"_child:{part}"],
                               start_var=T0)
    if result.rc:
        log(result.stderr[-6000:])
        raise SystemExit(f"part {part} failed (status {result.rc})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _summary(chunk_frames, chunk_seconds, forward_ms, first_s, peak_bytes, **extra) -> dict:
    fps = [n / s for n, s in zip(chunk_frames, chunk_seconds)]
    steady = fps[2:] or fps
    return {"frames": int(sum(chunk_frames)), "chunks": len(fps), "dit_forward_ms": forward_ms,
            "chunk_fps_median": statistics.median(steady) if steady else None,
            "video_fps": sum(chunk_frames) / sum(chunk_seconds) if chunk_seconds else None,
            "first_chunk_s": chunk_seconds[0] if chunk_seconds else None, "first_frame_s": first_s,
            "peak_gib": None if peak_bytes is None else peak_bytes / 2**30, **extra}


def _enable_compile_cache(path):
    try:
        from wan_tpu.runtime import compile_cache
    except ImportError:
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        return
    compile_cache.enable(path)


def _our_preprocess(image):
    """`MatrixGamePipeline.preprocess_image` at 352×640 without loading a pipeline."""
    from wan_tpu.configs.matrix_game import get_variant
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline

    shell = MatrixGamePipeline.__new__(MatrixGamePipeline)
    shell.variant = get_variant("universal")
    return shell.preprocess_image(image)


def _yaml_namespace(path):
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    return types.SimpleNamespace(**data)


def table(results: dict) -> str:
    rows = [("DiT forward per chunk (ms)", "dit_forward_ms", "{:.1f}"), ("chunk fps (median, chunk 2 on)", "chunk_fps_median", "{:.1f}"),
            ("whole-video fps (all chunks)", "video_fps", "{:.1f}"), ("first chunk (s, incl. compile)", "first_chunk_s", "{:.2f}"),
            ("start → first frame (s)", "first_frame_s", "{:.1f}"), ("load (s)", "load_s", "{:.1f}"),
            ("data preparation (s)", "prep_s", "{:.2f}"), ("generation wall (s)", "wall_s", "{:.1f}"),
            ("peak device memory (GiB)", "peak_gib", "{:.2f}"), ("frames", "frames", "{}")]
    t, o = results.get("theirs", {}), results.get("ours", {})
    body = []
    for label, key, fmt in rows:
        a, b = t.get(key), o.get(key)
        ratio = f"{b / a:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else ""
        body.append((label, fmt.format(a) if a is not None else "-", fmt.format(b) if b is not None else "-", ratio))
    lines = [harness.table(("", "theirs", "ours", "ours/theirs"), body)]
    for label, r in results.get("first_frame", {}).items():
        lines.append(f"ours start → first frame, {label} compile cache: {r['first_frame_s']:.1f} s "
                     f"(from start: imports {r.get('startup_s', 0):.1f}, loads ready {r['load_s']:.1f}, "
                     f"image prepared {r.get('image_s', 0):.1f}, first frame {r['first_frame_s']:.1f})")
        if "ready" in r:
            lines.append("    ready at: " + ", ".join(f"{k} {t:.1f}" for k, t in r["ready"].items()))
        if r.get("program_loads"):
            lines.append("    stored programs loaded (from-to): " + ", ".join(
                f"{k} {a:.2f}-{b:.2f}" for k, (a, b) in r["program_loads"].items()))
        if r.get("first_calls"):
            lines.append("    programs' first calls, dispatch (from-to): " + ", ".join(
                f"{k} {a:.2f}-{b:.2f}" for k, (a, b) in r["first_calls"].items()))
        for thread, segs in ((r.get("stacks") or {}).get("threads") or {}).items():
            lines.append(f"    thread {thread}: " + "; ".join(f"{a:.2f}-{b:.2f} {w}" for a, b, w in segs))
        for at, gap, where in (r.get("stacks") or {}).get("stalls") or []:
            lines.append(f"    GIL stall at {at:.2f} for {gap:.2f} s: " + "; ".join(f"{t}={w}" for t, w in where.items()))
        if "second_chunk_s" in r:
            lines.append(f"    second chunk: {r['second_chunk_s']:.2f} s after the first")
    if "startup" in results:
        lines.append("ours warm start, each step alone (s): " + ", ".join(f"{k} {t:.2f}" for k, t in results["startup"].items()))
    lines += results.get("ours", {}).get("profile", [])
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", default=None, help="checkout of SkyworkAI/Matrix-Game (for prepare and theirs)")
    p.add_argument("--random", action="store_true",
                   help="prepare: write WORKDIR/converted with random_folders.py (no --ref; `theirs` then has no weights)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--config", choices=sorted(CONFIGS), default="universal")
    p.add_argument("--latent-frames", type=int, default=None, help="a multiple of 3 (default 150; tiny 9)")
    p.add_argument("--parts", default="prepare,first-frame,theirs,ours")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="our DiT and CLIP dtype")
    p.add_argument("--vae-dtype", default="bfloat16", choices=("bfloat16", "float32"), help="our VAE dtype")
    p.add_argument("--their-compile", default="max-autotune-no-cudagraphs", help="their decoder's torch.compile mode, or none")
    p.add_argument("--warm-runs", type=int, default=1, help="`first-frame`: fresh processes with the cache filled")
    p.add_argument("--sample-stacks", action="store_true", help="`first-frame`: where every thread is, sampled")
    p.add_argument("--profile", default=None, help="folder for a trace of our DiT forward (`ours`): op classes printed")
    args = p.parse_args(argv)
    args.latent_frames = args.latent_frames or CONFIGS[args.config]["latent_frames"]
    if args.latent_frames % 3:
        p.error("--latent-frames must be a multiple of 3")
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    args.cache_dir = os.path.join(args.workdir, "compile_cache")
    if args.parts.startswith("_child:"):
        child = {"prepare": prepare, "theirs": theirs, "ours": ours, "first": lambda a: ours(a, first_frame_only=True),
                 "startup": startup}
        print(json.dumps(child[args.parts[len("_child:"):]](args)))
        return 0
    harness.print_env()  # this process leaves the device to the parts' processes
    results_path = os.path.join(args.workdir, "results.json")
    results = {}
    if os.path.exists(results_path):
        with open(results_path) as f:
            results = json.load(f)
    for part in args.parts.split(","):
        if part == "prepare" and args.config == "tiny":
            continue  # the preset needs no weights
        if part == "prepare" and args.random:
            pass
        elif part in ("prepare", "theirs") and args.ref is None:
            log(f"skipping {part}: pass --ref (the authors' checkout)")
            continue
        if part == "theirs" and not harness.has_cuda():
            log("skipping theirs: their code needs CUDA")
            continue
        log(f"== {part}")
        start = time.time()
        if part == "first-frame":
            shutil.rmtree(args.cache_dir, ignore_errors=True)  # cold: nothing compiled yet
            results.update(first_frame(argv))
        else:
            results.update(run_child(part, argv))
        log(f"   {time.time() - start:.0f} s")
        with open(results_path, "w") as f:
            json.dump(results, f, indent=2)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
