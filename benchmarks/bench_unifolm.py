"""UnifoLM-WMA speed and memory: the authors' code and ours, in one process, on the same random weights.

    # device (H100/H200): the authors' checkout carried as third_party/ (ignored by git)
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_unifolm.py --ref third_party/unifolm-world-model-action \
        --workdir /tmp/unifolm-bench --variants theirs-fp32,ours-bf16,ours-fp32 --steps 50,16
    # torch.compile compiles for minutes: its comparison in a second call (same converted weights)
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_unifolm.py --ref third_party/unifolm-world-model-action \
        --workdir /tmp/unifolm-bench --variants theirs-bf16-compile,ours-bf16 --steps 16
    # device, without the authors' code: ours on a converted folder of random weights (benchmarks/random_folders.py)
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_unifolm.py --random --size real --workdir /tmp/unifolm-bench \
        --variants ours-bf16,ours-bf16-fresh,ours-fp32 --steps 50,16
    # CPU smoke test (reduced configs, 2 steps, no torch.compile)
    python benchmarks/bench_unifolm.py --ref third_party/unifolm-world-model-action --size tiny --steps 2 \
        --variants theirs-fp32,theirs-bf16,ours-fp32,ours-bf16

Variants: `theirs-fp32` is their code as shipped (float32), except that xformers (not installed on the
device) is replaced by `torch.nn.functional.scaled_dot_product_attention` with the same additive
bias (and, on newer diffusers, three typing names their lr_scheduler.py imports from
`diffusers.optimization` are put back); `theirs-bf16-compile` adds `torch.autocast(bfloat16)` and `torch.compile` of the UNet (the
first speed-ups a user of their code would try); `ours-fp32` / `ours-bf16` are `UnifolmPipeline` with the UNet and heads in
that dtype (VAE float32, the CLIP towers `--encoder-dtype`, float32 by default); `ours-bf16-fresh` is
`ours-bf16` again in a new process after the first `ours-*` filled the compile cache (a fresh folder per
run of this script), as a user's second run: its first sampling loads the compiled programs, and its peak
memory holds no compile-time autotuning (JAX's peak is cumulative over a process). `--size real` builds their model from
their `configs/inference/world_model_interaction.yaml` (OpenCLIP ViT-H-14 created without downloading:
random weights), converts its state dict with `wan_tpu.unifolm.convert` and loads ours from that
folder, so both run the same weights; with `--random` (ours-* variants only, no `--ref`), the folder is
written by `random_folders.py unifolm` instead, by our code alone (the same files, names, shapes and
dtypes). `--size tiny` uses the reduced configs of the golden tests
(their CLIP towers replaced by random embeddings, ours the `unifolm-tiny` preset: timings only).

Measured per variant (batch 1, 2 observed frames, 16 frames, eta 1, uniform_trailing): model load;
one decision-making sampling at each `--steps` (first call, which compiles, and the median of
`--repeats` warm calls) and s/step = sampling / steps; VAE decode of the 16 latents; one interaction
iteration (decide + world model, encoders and decodes included) at the first `--steps`; peak device
memory (torch: `max_memory_allocated` per variant; JAX: `peak_bytes_in_use`, cumulative over the
process, so `ours-bf16` runs before `ours-fp32`; for ours also the memory in use after the load, the
weights, the peak by then, and the peak when each stage (encode, sampling, decode; each mode) first
finishes, which shows the stage that set the peak; the fresh process's row also gives the time from its start to the end of
its first sampling). Everything prints as one table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import typing

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("theirs-fp32", "theirs-bf16-compile", "ours-bf16", "ours-bf16-fresh", "ours-fp32")
T0 = "UNIFOLM_BENCH_T0"  # the fresh process's start (time.time()), set by the parent just before the spawn


def install_stubs(ref: str):
    """Their code (`ref`/src) importable, with the imports it needs that the device lacks: xformers (→ SDPA),
    and on a bare CPU box cv2 / decord / pytorch_lightning placeholders (and torchvision without its C ops)."""
    import torch

    class LightningModule(torch.nn.Module):
        @property
        def device(self):
            return next(self.parameters()).device

    harness.import_reference(
        os.path.join(ref, "src"),
        first=("diffusers.optimization", "open_clip", "transformers"),  # before the stubs: they probe optional modules
        stubs={"xformers": {}, "xformers.ops": {"memory_efficient_attention": harness.sdpa_xformers}},
        missing={"cv2": {}, "decord": {},
                 "pytorch_lightning": {"LightningModule": LightningModule, "seed_everything": torch.manual_seed},
                 "pytorch_lightning.utilities": {"rank_zero_only": lambda f: f}})
    import diffusers.optimization

    # Their lr_scheduler.py imports typing names through diffusers.optimization, which newer diffusers
    # no longer re-exports (0.30.2 did); the scheduler code itself is unchanged.
    for name, value in (("Union", typing.Union), ("Optional", typing.Optional), ("Optimizer", torch.optim.Optimizer)):
        if not hasattr(diffusers.optimization, name):
            setattr(diffusers.optimization, name, value)


def build_theirs(ref: str, size: str, device):
    """Their `LatentVisualDiffusion` with random weights (no download), on `device`, eval mode (after
    `install_stubs`, which puts their code on the path)."""
    import open_clip
    from omegaconf import OmegaConf

    if size == "tiny":
        spec = importlib.util.spec_from_file_location("golden", os.path.join(REPO, "scripts", "make_golden_unifolm.py"))
        golden = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(golden)
        meta = os.path.join(tempfile.mkdtemp(), "meta.json")
        with open(meta, "w") as f:
            json.dump({"obs": {"image": {"shape": [3, 128, 128], "type": "rgb"},
                               "agent_pos": {"shape": [16], "type": "low_dim"}}, "action": {"shape": [16]}}, f)
        model = golden.build(ref, meta, base=False)
    else:
        create = open_clip.create_model_and_transforms
        open_clip.create_model_and_transforms = lambda arch, device=None, pretrained=None, **kw: create(arch, device=device)
        from unifolm_wma.utils.utils import instantiate_from_config

        cfg = OmegaConf.load(os.path.join(ref, "configs", "inference", "world_model_interaction.yaml"))
        cfg.model.params.wma_config.params.use_checkpoint = False
        model = instantiate_from_config(cfg.model)
        model.perframe_ae = True
    return model.eval().to(device)


class Theirs:
    """Their sampling glue (`image_guided_synthesis_sim_mode` of world_model_interaction.py), batch 1."""

    def __init__(self, model, size, device, dtype=None):
        import torch

        self.model, self.size, self.device, self.autocast = model, size, device, dtype
        u = model.model.diffusion_model
        self.d = model.global_emb_dim
        h, w = model.image_size
        self.noise_shape = [1, u.out_channels, 16, h, w]
        self.frame = (h * 8, w * 8)
        g = torch.Generator().manual_seed(0)
        self.images = (torch.rand(1, 3, 2, *self.frame, generator=g) * 2 - 1).to(device)
        self.states = (torch.rand(1, 2, 16, generator=g) * 2 - 1).to(device)
        self.actions = (torch.rand(1, 16, 16, generator=g) * 2 - 1).to(device)

    def _ctx(self):
        import torch

        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def sample(self, steps: int, world: bool):
        import torch
        from einops import rearrange, repeat
        from unifolm_wma.models.samplers.ddim import DDIMSampler

        m = self.model
        with torch.no_grad(), self._ctx():
            img = self.images.permute(0, 2, 1, 3, 4)
            last = rearrange(img, "b o c h w -> (b o) c h w")[-1:]
            if self.size == "tiny":  # their CLIP towers are not in the reduced model: random embeddings
                img_emb = m.image_proj_model(torch.randn(1, 257, 32, device=self.device))
                text = torch.randn(1, 77, self.d, device=self.device)
            else:
                img_emb = m.image_proj_model(m.embedder(last))
                text = m.get_learned_conditioning(["" if world else "pick up the cup"])
            z = m.encode_first_stage(self.images)
            cond = {"c_concat": [repeat(z[:, :, -1:], "b c t h w -> b c (repeat t) h w", repeat=16)]}
            state = m.state_projector(self.states) + m.agent_state_pos_emb
            action = m.action_projector(self.actions) + m.agent_action_pos_emb
            if not world:
                action = torch.zeros_like(action)
            cond["c_crossattn"] = [torch.cat([state, action, text, img_emb], dim=1)]
            cond["c_crossattn_action"] = [self.images[:, :, -m.n_obs_steps_acting:], self.states[:, -m.n_obs_steps_acting:], world, False]
            fs = torch.tensor([7], dtype=torch.long, device=self.device)
            sampler = DDIMSampler(m)
            if self.device.type != "cuda":  # theirs moves its schedule buffers to CUDA unconditionally
                sampler.register_buffer = lambda name, attr: setattr(sampler, name, attr)
            samples, actions, states, _ = sampler.sample(
                S=steps, conditioning=cond, batch_size=1, shape=self.noise_shape[1:], verbose=False,
                unconditional_guidance_scale=1.0, unconditional_conditioning=None, eta=1.0, cfg_img=None, mask=None,
                x0=None, fs=fs, timestep_spacing="uniform_trailing", guidance_rescale=0.7,
                unconditional_conditioning_img_nonetext=None)
        return samples, actions, states

    def decode(self, samples):
        import torch

        with torch.no_grad(), self._ctx():
            return self.model.decode_first_stage(samples)

    def sync(self, x=None):
        return harness.torch_sync(x)


class Ours:
    def __init__(self, pipe):
        import jax

        self.pipe, self.jax = pipe, jax
        rng = np.random.default_rng(0)
        self.images = jax.numpy.asarray(rng.uniform(-1, 1, (1, 3, 2, pipe.height, pipe.width)).astype(np.float32))
        self.states = jax.numpy.asarray(rng.uniform(-1, 1, (1, 2, 16)).astype(np.float32))
        self.actions = jax.numpy.asarray(rng.uniform(-1, 1, (1, 16, 16)).astype(np.float32))
        self.peaks = {}

    def _peak(self, stage: str, out):
        """The process's peak device memory when `stage` first finishes (JAX's peak only grows, so the
        first stage whose row jumps is the one that set it)."""
        label = f"peak after first {stage} (GB)"
        if label not in self.peaks:
            self.jax.block_until_ready(out)
            self.peaks[label] = (self.jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", float("nan")) / 1e9
        return out

    def sample(self, steps: int, world: bool):
        p, key = self.pipe, self.jax.random.key(0)
        mode = "world-model" if world else "decision"
        cond = self._peak(f"{mode} encode", p.encode_conditions("" if world else "pick up the cup", self.images,
                                                                 self.states, self.actions if world else None, 7, key=key))
        return self._peak(f"{mode} sampling", p.sample(cond, steps, 1.0, key=key))

    def decode(self, samples):
        return self._peak("decode", self.pipe.decode(samples))

    def sync(self, x=None):
        return self.jax.block_until_ready(x)


def measure(runner, steps_list, repeats: int) -> dict:
    row = {}
    for steps in steps_list:
        sample = lambda steps=steps: runner.sample(steps, world=False)  # noqa: E731
        out, first = harness.timed(lambda sample=sample: runner.sync(sample()))
        row.setdefault("_first_done", time.time())
        warm = harness.measure(sample, runner.sync, warmup=0, iters=repeats)
        row[f"first sampling {steps} (s)"] = first
        row[f"sampling {steps} (s)"] = warm.median
        row[f"s/step @{steps}"] = warm.median / steps
    samples = out[0]
    row["VAE decode 16 frames (s)"] = harness.measure(lambda: runner.decode(samples), runner.sync, iters=repeats).median

    def iteration():
        s, _, _ = runner.sample(steps_list[0], world=False)
        runner.sync(runner.decode(s))
        s, _, _ = runner.sample(steps_list[0], world=True)
        return runner.sync(runner.decode(s))

    # the warm-up call: the world-model trace compiles here
    row[f"interaction iteration @{steps_list[0]} (s)"] = harness.measure(iteration, None, iters=1).median
    return row


def fresh_process_row(args, folder) -> dict:
    """`ours-bf16` in a new process of this script, its compile cache the one this process filled."""
    cmd = [sys.executable, os.path.abspath(__file__), "--size", args.size, "--steps", args.steps,
           "--variants", "ours-bf16", "--repeats", str(args.repeats), "--encoder-dtype", args.encoder_dtype, "--json"]
    cmd += ["--ref", args.ref] if args.ref else ["--random"]
    cmd += ["--workdir", folder] if folder else []
    result = harness.run_fresh(cmd, start_var=T0)
    rows = result.results()
    if result.rc or not rows:
        raise SystemExit(f"ours-bf16-fresh failed (status {result.rc}):\n{result.stderr[-4000:]}")
    return rows[-1]["ours-bf16"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=None, help="the authors' checkout (e.g. third_party/unifolm-world-model-action)")
    ap.add_argument("--random", action="store_true",
                    help="ours-* only, no --ref: --size real's folder written by random_folders.py (random weights)")
    ap.add_argument("--size", choices=("real", "tiny"), default="real")
    ap.add_argument("--steps", default="50,16", help="comma-separated DDIM step counts (first: the interaction's)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=1, help="warm repetitions (median)")
    ap.add_argument("--encoder-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="our CLIP towers' dtype (ours-* variants)")
    ap.add_argument("--json", action="store_true", help="also print the rows as one RESULT line of JSON")
    ap.add_argument("--workdir", default=None,
                    help="where the converted checkpoint goes (default: a temp folder); an existing one is reused, "
                         "and with only ours-* variants their model is not even built")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
    # ours as a command line runs it (wan_tpu.runtime.xla_defaults); a flag set in XLA_FLAGS wins
    from wan_tpu.runtime.xla_defaults import apply_xla_defaults

    apply_xla_defaults()
    # A compile cache of this run's own: the first ours-* compiles (cold), ours-bf16-fresh loads (warm).
    os.environ.setdefault("WAN_TPU_CACHE_DIR", tempfile.mkdtemp(prefix="unifolm-bench-cache-"))
    steps_list = [int(s) for s in args.steps.split(",")]
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS) - {"theirs-bf16"})
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {VARIANTS} (theirs-bf16: autocast without compile)")
    if args.random and any(v.startswith("theirs") for v in variants):
        ap.error("--random runs ours-* variants only (their code needs their weights); leave theirs-* out")
    if not args.random and args.ref is None:
        ap.error("pass --ref (the authors' checkout), or --random for ours-* on random weights")

    if not args.json:  # the fresh process of ours-bf16-fresh: its parent printed it
        harness.print_env()
    import jax
    import jax.numpy as jnp
    import torch

    torch.set_grad_enabled(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results, notes = {}, []
    folder = args.workdir if args.size == "real" else None
    reuse = folder is not None and os.path.isfile(os.path.join(folder, "config.json"))
    model = None
    # Their model: for their variants, and to convert its weights for ours (unless converted already).
    if any(v.startswith("theirs") for v in variants) or (args.size == "real" and not reuse and not args.random):
        cwd = os.getcwd()
        os.chdir(args.ref)  # their obs encoder reads configs/train/meta.json from the working directory
        try:
            install_stubs(os.path.abspath("."))
            torch.manual_seed(0)  # their init runs on the CPU: the same weights in every run (and --workdir reuse)
            model, load_theirs = harness.timed(lambda: build_theirs(os.path.abspath("."), args.size, device))
            notes.append("their load = instantiate + .to(device) (random init; a .ckpt read would add torch.load)")
        finally:
            os.chdir(cwd)
    if reuse:
        notes.append(f"ours loaded the converted folder {folder} of an earlier run (the same weights as that run's)")

    if args.size == "real" and not reuse and args.random:
        import random_folders

        folder = args.workdir or tempfile.mkdtemp(prefix="unifolm-bench-")
        if os.path.isdir(folder) and os.listdir(folder):
            raise SystemExit(f"--workdir {folder} holds files but no config.json; pass a new or empty folder")
        # an empty folder (the temp one) is replaced
        written = harness.timed(lambda: random_folders.write("unifolm", folder, overwrite=True))[1]
        notes.append(f"ours loaded a folder of random weights written by random_folders.py ({written:.0f} s to write)")
    elif args.size == "real" and not reuse:
        from wan_tpu.configs.unifolm import CONFIGS, config_to_json
        from wan_tpu.unifolm.convert import (
            save_safetensors_shards,
            split_components,
            write_image_encoder,
            write_text_encoder,
            write_tokenizer,
            write_vae,
        )

        folder = args.workdir or tempfile.mkdtemp(prefix="unifolm-bench-")
        os.makedirs(folder, exist_ok=True)
        parts = split_components({k: v.detach().cpu() for k, v in model.state_dict().items()})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config_to_json(CONFIGS["unifolm-wma-0"]), f)
        save_safetensors_shards(parts["unet"], folder, "unet")
        save_safetensors_shards(parts["conditioning"], folder, "conditioning")
        write_vae(os.path.join(folder, "vae"), parts["vae"], 0.18215)
        write_image_encoder(os.path.join(folder, "image_encoder"), parts["image"])
        write_text_encoder(os.path.join(folder, "text_encoder"), parts["text"])
        write_tokenizer(os.path.join(folder, "tokenizer"), parts["text"]["token_embedding.weight"].shape[0])
        del parts

    for variant in variants:
        if variant == "ours-bf16-fresh":
            row = fresh_process_row(args, folder)
        elif variant.startswith("theirs"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            runner = Theirs(model, args.size, device, dtype=None if variant == "theirs-fp32" else torch.bfloat16)
            if variant == "theirs-bf16-compile":
                model.model.diffusion_model = torch.compile(model.model.diffusion_model)
            row = measure(runner, steps_list, args.repeats)
            row.pop("_first_done")
            row["model load (s)"] = load_theirs
            if device.type == "cuda":
                row["peak memory (GB)"] = torch.cuda.max_memory_allocated() / 1e9
        else:
            from wan_tpu.unifolm.pipeline import UnifolmPipeline

            dtype = jnp.float32 if variant == "ours-fp32" else jnp.bfloat16
            pipe, load = harness.timed(lambda: UnifolmPipeline.from_pretrained(folder or "unifolm-tiny", dtype=dtype,
                                                                       encoder_dtype=jnp.dtype(args.encoder_dtype)))
            loaded = jax.devices()[0].memory_stats() or {}  # what the weights hold, and the load's own peak
            runner = Ours(pipe)
            row = measure(runner, steps_list, args.repeats)
            row.update({k: v for k, v in runner.peaks.items() if v == v})  # none on a CPU
            for label, key in (("in use after load (GB)", "bytes_in_use"), ("peak by the end of load (GB)", "peak_bytes_in_use")):
                if key in loaded:
                    row[label] = loaded[key] / 1e9
            row["model load (s)"] = load
            if T0 in os.environ:  # a fresh process (ours-bf16-fresh): its start to here
                row["process start → first sampling done (s)"] = row.pop("_first_done") - harness.process_start(T0)
            row.pop("_first_done", None)
            stats = jax.devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                row["peak memory (GB)"] = stats["peak_bytes_in_use"] / 1e9
            del pipe
        results[variant] = row
        print(f"{variant}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)

    keys = list(dict.fromkeys(k for row in results.values() for k in row))
    print(f"\nUnifoLM-WMA ({args.size})")
    print(harness.table(("", *results), ((k, *(f"{results[v].get(k, float('nan')):.3f}" for v in results)) for k in keys)))
    for note in notes:
        print("note:", note)
    if args.json:
        harness.emit_result(results)


if __name__ == "__main__":
    main()
