"""Wan 2.1 14B, 720p, 81 frames, CFG: one DiT step on 1 GPU and on 4, one process or four, beside diffusers'
context parallelism; and what that predicts past 4 GPUs.

    python benchmarks/bench_multigpu.py                       # a 4-GPU host: the table, then the prediction
    python benchmarks/bench_multigpu.py --only ours           # (or --only diffusers) half of the rows
    python benchmarks/bench_multigpu.py --tiny                # CPU: the tiny model, 4 host devices, minutes
    python benchmarks/bench_multigpu.py --predict-only --t1-ms 9800 --t4-ms 2700   # the model alone

Rows (random bf16 weights, the (cond, uncond) pair as batch 2, 512 text tokens, latent 21×90×160 =
75,600 tokens; each a fresh process, the median of `--iters` steps after a warm-up that compiles):
- ours on 1 GPU (no mesh); on 4 GPUs in one process with meshes dp2×sp2 and sp4 (`wan_tpu.make_mesh`,
  `shard_transformer`: FSDP weights, context-parallel attention); and sp4 as 4 processes × 1 GPU under JAX's
  multi-controller runtime (`wan_tpu.runtime.distributed`, `--coordinator localhost:PORT`);
- diffusers' `WanTransformer3DModel` on 1 GPU and with `ContextParallelConfig` (Ulysses, ring) under
  `torchrun` 4 processes, attention backend `_native_cudnn` (CPU: `native`, gloo). Both sides draw their own
  random weights of the same shapes (timing does not depend on the values; a shared 28 GB random checkpoint
  would cost each side minutes of reading per row).
"% of linear" is t1 / (n · tn) against the same implementation's 1-GPU step. The two sp4 rows of ours also
write their step's output to `--workdir` (`sp4_1process.npy`, `sp4_4processes.npy`, float32) and the table is
followed by whether the 4-process result equals the 1-process one bit for bit (else their max abs difference).

The prediction (`predict`): per step, our sp layout moves (a) every layer's FSDP weights, all-gathered
((n-1)/n of the layer per device), and (b) self-attention K and V, all-gathered over sp ((n-1)/n of the
whole sequence's K and V per device, batch 2); Ulysses would instead move 4 all-to-alls of 1/n of the
activations per layer. The 4-GPU measurement gives the link bandwidth actually achieved
(volume / (t4 - t1/4)); a larger n then costs t1/n of compute plus its volume at that bandwidth. For TPU
slices the compute is the step's FLOPs at the MFU measured on the GPU, and the bandwidth the chip's ICI
figure scaled by the same efficiency (the spec numbers are arguments).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

MODELS = {"14b": ("wan2.1-t2v-14b", (21, 90, 160)), "tiny": ("tiny", (3, 16, 16))}
TEXT_LEN = 512
BATCH = 2  # the CFG pair
ROWS = (  # label, kind, devices, mesh (dp, sp, tp) or context-parallel mode
    ("ours, 1 GPU", "jax", 1, None),
    ("ours dp2×sp2, 1 process", "jax", 4, (2, 2, 1)),
    ("ours sp4, 1 process", "jax", 4, (1, 4, 1)),
    ("ours sp4, 4 processes × 1 GPU", "jax-processes", 4, (1, 4, 1)),
    ("diffusers, 1 GPU", "diffusers", 1, None),
    ("diffusers Ulysses 4, torchrun", "diffusers", 4, "ulysses"),
    ("diffusers ring 4, torchrun", "diffusers", 4, "ring"),
)
# Published per-chip figures: bf16 dense peak (FLOP/s) and ICI bandwidth (bytes/s, one direction, all links).
TPUS = {"v6e-16": (918e12, 448e9, 16), "v7x-16": (2307e12, 600e9, 16)}
H100_PEAK = 989e12
LATENTS = {"ours sp4, 1 process": "sp4_1process.npy", "ours sp4, 4 processes × 1 GPU": "sp4_4processes.npy"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# ---- the parts, each in a fresh process -----------------------------------------------------------------


def jax_part(args) -> None:
    """One CFG step of our DiT on the first `--devices` devices (all of a multi-process job's)."""
    from wan_tpu.runtime import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before any device use
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from wan_tpu.runtime.xla_defaults import apply_xla_defaults

    apply_xla_defaults()
    import jax
    import jax.numpy as jnp
    from bench_scaling import random_dit
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import wan_tpu
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.wan.transformer import forward

    variant, latent = MODELS[args.model]
    cfg = VARIANTS[variant].transformer
    devices = jax.devices()[:args.devices]
    mesh = None if args.mesh is None else wan_tpu.make_mesh(*args.mesh, devices=devices)
    graphdef, state = random_dit(cfg, mesh, None if args.attention == "None" else args.attention)

    def make(key):
        k1, k2 = jax.random.split(key)
        return (jax.random.normal(k1, (BATCH, cfg.in_channels, *latent), jnp.bfloat16),
                jnp.full((BATCH,), 900.0, jnp.float32),
                jax.random.normal(k2, (BATCH, TEXT_LEN, cfg.text_dim), jnp.bfloat16))

    # Made by a program with output shardings: valid whether the mesh spans one process or several.
    out_shardings = None if mesh is None else (NamedSharding(mesh, P("dp")),) * 3
    x, t, c = jax.jit(make, out_shardings=out_shardings)(jax.random.key(1))
    step = jax.jit(forward, static_argnums=0)
    timing = harness.measure(lambda: step(graphdef, state, x, t, c), jax.block_until_ready, iters=args.iters)
    if args.save_latents:
        import numpy as np

        latents = distributed.to_host(timing.out)  # a collective when the output spans several processes
        if distributed.is_writer():
            np.save(args.save_latents, latents.astype(np.float32))
    if distributed.is_writer():
        _write(args, {"ms": timing.ms, "warmup_s": timing.first})
    distributed.finish()


def diffusers_part(args) -> None:
    """One CFG step of diffusers' DiT, under torchrun: plain on one process, else `ContextParallelConfig`."""
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig, WanTransformer3DModel

    from wan_tpu.configs.models import VARIANTS, config_to_json

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    variant, latent = MODELS[args.model]
    cfg = VARIANTS[variant].transformer
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # the weights drawn in bf16 directly: no float32 copy of 14B
    with device:
        model = WanTransformer3DModel(**config_to_json(cfg)).eval()
    torch.set_default_dtype(torch.float32)
    model.set_attention_backend("_native_cudnn" if cuda else "native")
    if args.cp is not None:
        degree = {"ulysses_degree": world} if args.cp == "ulysses" else {"ring_degree": world}
        model.enable_parallelism(config=ContextParallelConfig(**degree))
    generator = torch.Generator(device).manual_seed(1)
    x = torch.randn((BATCH, cfg.in_channels, *latent), generator=generator, device=device, dtype=torch.bfloat16)
    c = torch.randn((BATCH, TEXT_LEN, cfg.text_dim), generator=generator, device=device, dtype=torch.bfloat16)
    t = torch.full((BATCH,), 900.0, device=device)

    @torch.no_grad()
    def call():
        return model(hidden_states=x, timestep=t, encoder_hidden_states=c, return_dict=False)[0]

    timing = harness.measure(call, harness.torch_sync, iters=args.iters)
    if rank == 0:
        _write(args, {"ms": timing.ms, "warmup_s": timing.first})
    if world > 1:
        dist.destroy_process_group()


def _write(args, result) -> None:
    import json

    with open(args.result_json, "w") as f:
        json.dump(result, f)


# ---- the parent ---------------------------------------------------------------------------------------------


def _child_env(devices: int, visible: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if harness.device_kind() == "cpu":  # --tiny on a CPU host: that many host devices
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    elif visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def run_row(kind: str, devices: int, mesh, args, deadline: float, save: str | None = None):
    """(ms per step, None) of one row in fresh processes, or (None, why not). `save`: a .npy file the step's
    output is written to (ours only)."""
    import json

    script = os.path.abspath(__file__)
    common = ["--model", args.model, "--iters", str(args.iters), "--attention", args.attention]
    timeout = deadline - time.perf_counter()
    if timeout <= 0:
        return None, f"not run (--time-limit {args.time_limit:g} s reached)"
    if kind == "diffusers" and mesh is not None and harness.device_kind() == "cpu":
        return None, "needs CUDA GPUs (diffusers' context parallelism picks an accelerator per rank)"
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        part = [script, *common, "--result-json", result, *(["--save-latents", save] if save else [])]
        if kind == "jax":
            mesh_flag = [] if mesh is None else ["--mesh", ",".join(map(str, mesh))]
            cmds = [([sys.executable, *part, "--part", "jax", "--devices", str(devices), *mesh_flag], _child_env(devices))]
        elif kind == "jax-processes":
            port = _free_port()
            cmds = [([sys.executable, *part, "--part", "jax", "--devices", str(devices), "--mesh", ",".join(map(str, mesh)),
                      "--coordinator", f"localhost:{port}", "--num-processes", str(devices), "--process-id", str(i)],
                     _child_env(1, str(i))) for i in range(devices)]
        else:
            cp = [] if mesh is None else ["--cp", mesh]
            cmds = [([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}",
                      *part, "--part", "diffusers", *cp], _child_env(1))]
        procs = [subprocess.Popen(cmd, env=env) for cmd, env in cmds]
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.perf_counter())) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return None, f"stopped at --time-limit {args.time_limit:g} s"
        if not os.path.isfile(result):
            return None, f"failed (exit status {max(codes, key=abs)}; see its output above)"
        with open(result) as f:
            return json.load(f)["ms"], None


def volumes(cfg, tokens: int, n: int, weight_bytes: int = 2, act_bytes: int = 2) -> dict[str, float]:
    """Bytes one device receives per CFG step (batch 2) on an sp=n mesh: FSDP weight all-gathers, the
    self-attention K/V all-gather (ours), and Ulysses' four all-to-alls (q, k, v in, out back) for comparison."""
    d, f, layers = cfg.inner_dim, cfg.ffn_dim, cfg.num_layers
    # Per layer: self q,k,v,o (4 d²), cross q,k,v,o (4 d²), FFN in and out (2 d f).
    layer_params = 8 * d * d + 2 * d * f
    share = (n - 1) / n
    return {
        "fsdp_weights": share * layers * layer_params * weight_bytes,
        "kv_allgather": share * layers * 2 * BATCH * tokens * d * act_bytes,
        "ulysses_alltoall": share * layers * 4 * BATCH * tokens * d * act_bytes / n,
    }


def predict(t1_ms: float, t4_ms: float, model: str = "14b", *, peak: float = H100_PEAK, tpus=TPUS,
            gpus: tuple[int, ...] = (8,)) -> list[tuple[str, float, str]]:
    """Predicted ms per CFG step past 4 GPUs from the measured 1-GPU and 4-GPU (sp4) steps:
    [(where, ms, how)], printed as a table by `main`."""
    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.runtime.profiling import dit_forward_flops

    variant, latent = MODELS[model]
    cfg = VARIANTS[variant].transformer
    pt, ph, pw = cfg.patch_size
    tokens = (latent[0] // pt) * (latent[1] // ph) * (latent[2] // pw)
    moved4 = sum(v for k, v in volumes(cfg, tokens, 4).items() if k != "ulysses_alltoall")
    exposed4 = max(t4_ms - t1_ms / 4, 1e-3) / 1e3  # communication the step waited for on 4 GPUs
    bandwidth = moved4 / exposed4  # what the links delivered, overlap included
    flops = BATCH * dit_forward_flops(cfg, tokens)
    mfu = flops / (t1_ms / 1e3) / peak
    out = [("4 GPUs (measured)", t4_ms, f"{moved4 / 2**30:.1f} GiB/GPU moved; achieved {bandwidth / 1e9:.0f} GB/s; "
                                         f"1-GPU MFU {mfu:.1%}")]
    for n in gpus:
        moved = sum(v for k, v in volumes(cfg, tokens, n).items() if k != "ulysses_alltoall")
        ms = t1_ms / n + moved / bandwidth * 1e3
        out.append((f"{n} GPUs", ms, f"{t1_ms / n:.0f} ms compute + {moved / 2**30:.1f} GiB at {bandwidth / 1e9:.0f} GB/s"))
    link_efficiency = bandwidth / 450e9  # H100 NVLink 4: 450 GB/s per direction
    for name, (chip_peak, ici, n) in tpus.items():
        moved = sum(v for k, v in volumes(cfg, tokens, n).items() if k != "ulysses_alltoall")
        compute = flops / (n * chip_peak * mfu)
        comm = moved / (ici * link_efficiency)
        out.append((name, (compute + comm) * 1e3, f"{compute * 1e3:.0f} ms compute at {mfu:.0%} MFU + "
                                                   f"{moved / 2**30:.1f} GiB at {ici * link_efficiency / 1e9:.0f} GB/s ICI"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny model on CPU host devices (a quick check)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--attention", default="cudnn", help="our attention kernel on GPU (None: the backend's default)")
    p.add_argument("--time-limit", type=float, default=560.0, help="seconds for all rows; later rows are skipped")
    p.add_argument("--only", choices=("ours", "diffusers"), default=None,
                   help="only our rows or only diffusers' (two calls within a per-command time limit)")
    p.add_argument("--predict-only", action="store_true", help="only the prediction, from --t1-ms and --t4-ms")
    p.add_argument("--t1-ms", type=float, default=None)
    p.add_argument("--t4-ms", type=float, default=None)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "wan_tpu_bench_multigpu"),
                   help="where the sp4 rows write their step's output latents (.npy)")
    # the parts (internal)
    p.add_argument("--part", choices=("jax", "diffusers"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--mesh", default=None, type=lambda s: tuple(int(v) for v in s.split(",")), help=argparse.SUPPRESS)
    p.add_argument("--cp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save-latents", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.tiny else "14b")
    if args.tiny and args.attention == "cudnn":
        args.attention = "None"
    if args.part == "jax":
        jax_part(args)
        return 0
    if args.part == "diffusers":
        diffusers_part(args)
        return 0
    if args.predict_only:
        if args.t1_ms is None or args.t4_ms is None:
            p.error("--predict-only needs --t1-ms and --t4-ms")
        _print_prediction(args.t1_ms, args.t4_ms, args.model)
        return 0

    harness.print_env()
    deadline = time.perf_counter() + args.time_limit
    results = []
    for label, kind, devices, mesh in ROWS:
        if args.only is not None and (kind == "diffusers") != (args.only == "diffusers"):
            continue
        save = None
        if label in LATENTS:
            os.makedirs(args.workdir, exist_ok=True)
            save = os.path.join(os.path.abspath(args.workdir), LATENTS[label])
            if os.path.exists(save):
                os.remove(save)  # a previous run's: never compared
        ms, why = run_row(kind, devices, mesh, args, deadline, save)
        results.append((label, kind, devices, ms, why))
        print(f"{label}: {why or f'{ms:.1f} ms/step'}", flush=True)
    base = {kind.startswith("jax"): ms for label, kind, devices, ms, why in results if devices == 1 and ms}
    print()
    print(harness.header("run", "GPUs", "ms/step (CFG batch 2)", "speedup", "% of linear", "note"))
    for label, kind, devices, ms, why in results:
        t1 = base.get(kind.startswith("jax"))
        if ms is None:
            print(harness.row(label, devices, "", "", "", why))
        elif t1 is None:
            print(harness.row(label, devices, f"{ms:.1f}", "", "", "no 1-GPU step to compare with"))
        else:
            print(harness.row(label, devices, f"{ms:.1f}", f"{t1 / ms:.2f}", f"{t1 / (devices * ms):.0%}", ""))
    same = _compare_latents(args.workdir)
    if same:
        print()
        print(same)
    sp4 = next((ms for label, kind, devices, ms, why in results if label == "ours sp4, 1 process" and ms), None)
    if base.get(True) and sp4:
        print()
        _print_prediction(base[True], sp4, args.model)
    return 0


def _compare_latents(workdir: str) -> str | None:
    """Whether the sp4 step's output on 4 processes equals the one-process output bit for bit (None when
    neither row wrote one)."""
    one, many = (os.path.join(os.path.abspath(workdir), LATENTS[label]) for label in LATENTS)
    missing = [label for label, path in zip(LATENTS, (one, many)) if not os.path.isfile(path)]
    if len(missing) == len(LATENTS):
        return None
    if missing:
        return f"sp4 step output not compared: {missing[0]!r} wrote none"
    import numpy as np

    a, b = np.load(one), np.load(many)
    head = f"sp4 step output, 4 processes vs 1 process ({a.shape}, {one}, {many}):"
    if a.shape != b.shape:
        return f"{head} shapes differ"
    if np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        return f"{head} equal bit for bit"
    return f"{head} NOT equal; max abs difference {float(np.nanmax(np.abs(a.astype(np.float64) - b))):.3g}"


def _print_prediction(t1_ms: float, t4_ms: float, model: str) -> None:
    print(f"past 4 GPUs (from t1 = {t1_ms:.1f} ms, t4 = {t4_ms:.1f} ms, {model}):")
    print(harness.header("where", "predicted ms/step", "how"))
    for where, ms, how in predict(t1_ms, t4_ms, model):
        print(harness.row(where, f"{ms:.1f}", how))


if __name__ == "__main__":
    sys.exit(main())
