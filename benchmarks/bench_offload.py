"""Big models on small cards: the DiT step with its blocks streamed from host memory (`--offload`) against
the all-resident step, on a device whose usable memory is capped, and each stage's own peak.

    python benchmarks/bench_offload.py                          # one H100/H200: 14B at 24 and 16 GiB, 1.3B at 8 GiB
    python benchmarks/bench_offload.py --quantize int8,fp8      # also FP8 (H100/H200)
    python benchmarks/bench_offload.py --rows 14b:none,14b:16 --quantize int8 --no-stages --time-limit 540
    python benchmarks/bench_offload.py --tiny                   # smoke run (CPU, seconds)

Each row runs in a fresh process (`XLA_PYTHON_CLIENT_MEM_FRACTION` caps a GPU's usable memory per process;
XLA reads it once): random weights at the real sizes (drawn on the device one parameter at a time, a streamed
stack moved to host memory as it is drawn, so the device never holds more than the cap), the blocks
`wan_tpu.wan.memory.plan_offload` keeps resident for the cap (`--resident N` forces a count), then one CFG
denoise step's DiT forward (batch 2, 512 text tokens; 480p 81 frames by default) timed as the median of
`--iters` after a warm-up. Resident rows run uncapped: a 14B bf16 DiT fits no 24 GiB card. Columns:

- step s: the median forward; × resident: against the same weights' all-resident row (target ≤ 1.25);
- stream bound s: the bytes a step streams (the non-resident blocks, plus the last one fetched twice) over
  the host → device bandwidth measured in the same process (a 1 GiB pinned copy): no streamed step can be
  faster, and a step near it is bandwidth-bound rather than compute-bound;
- peak GiB: `memory_stats()["peak_bytes_in_use"]` of the process (n/a where the backend reports none);
- compiled GiB: the step's device memory as XLA's buffer assignment counts it (`memory_analysis()`: temporaries
  and outputs, plus the device-resident arguments); the plan drops resident blocks until it fits the budget
  (`plan_offload(measure=)`), and each row prints the program's largest arrays.

Stage rows (text encode with UMT5-XXL, denoise, VAE decode), each in its own capped process: the peak of each
stage alone, as a run with offload sees it (the encoders leave the device before the DiT comes, the DiT
before the decode; the decode picks strips or tiles from the free memory), and what the plan chose for it
(UMT5 blocks streamed where the encoder alone does not fit: `OffloadPlan.text_resident`).
TPU: run it on the chip itself (v5e-1: 16 GiB HBM); the caps only apply to GPUs.

Whole commands (`--commands`): `python -m wan_tpu.generate` from spawn to exit, on a random checkpoint in the
diffusers layout written once under `--workdir` (`bench_e2e.ensure_checkpoint`: UMT5-XXL, the Wan 2.1 VAE),
capped (`XLA_PYTHON_CLIENT_MEM_FRACTION`, `--offload auto`: the plan streams what does not fit, loading the
streamed blocks straight into host memory) beside the same command uncapped and resident (`--offload none`),
in one call, each with an empty compile cache. Per command: wall time, the command's own timing table (seconds
per stage) and each stage's peak device memory (the table's peak rows, `wan_tpu.runtime.profiling.StageTimer`),
and the plan it printed. The 14B row runs `--command-steps` steps (default 8, printed with the table: meant to
keep its two commands and the 41 GB checkpoint's write within a 10-minute call), the 1.3B row the model's 50.
Each config's checkpoint is written once under `--workdir` (1.3B: about 15 GB with UMT5-XXL; 14B: 41 GB):

    python benchmarks/bench_offload.py --commands --command-rows 1.3b:8 --workdir outputs/bench_offload
    python benchmarks/bench_offload.py --commands --command-rows 14b:24 --workdir outputs/bench_offload
    python benchmarks/bench_offload.py --tiny --commands --workdir outputs/bench_offload     # CPU smoke run

(CPU has no cap: the tiny "capped" command streams with `--offload blocks:1` instead.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

from wan_tpu.runtime.memory import gpu_total_bytes  # noqa: E402  (the driver's figure: JAX not started)

GiB = 2**30
CONFIGS = {"14b": "wan2.1-t2v-14b", "1.3b": "wan2.1-t2v-1.3b", "tiny": "tiny"}
# (config, budget GiB or None for uncapped): the rows of the device run.
DEFAULT_ROWS = [("14b", None), ("14b", 24), ("14b", 16), ("1.3b", None), ("1.3b", 8)]
TINY_ROWS = [("tiny", None), ("tiny", 0)]  # 0: a budget the plan is given, not a cap (CPU has none)
# Whole commands (`--commands`): (config, cap GiB), each run beside its uncapped resident command.
COMMAND_ROWS = [("1.3b", 8), ("14b", 24)]
TINY_COMMAND_ROWS = [("tiny", 0)]  # 0: no cap (CPU), the blocks streamed by `--offload blocks:1`
COMMAND_STEPS = {"1.3b": 50, "14b": 8, "tiny": 2}
PROMPT = "a cat walks on the grass, realistic"


def cap_env(budget_gib: float | None) -> dict[str, str]:
    """The environment that caps a new process's usable GPU memory at `budget_gib` (none: uncapped, or no GPU)."""
    total = gpu_total_bytes()
    if budget_gib and total:
        return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{budget_gib * GiB / total:.4f}"}
    return {}


def cap_memory(budget_gib: float | None) -> None:
    """Cap this process's usable GPU memory at `budget_gib` (before JAX starts)."""
    os.environ.update(cap_env(budget_gib))


# ---- one row, in its own process ---------------------------------------------------------------------


def random_weights(abstract, streamed_prefix: str | None, seed: int = 0):
    """Seeded random weights for the abstract module `abstract`, drawn on the device one parameter at a
    time in its dtype; parameters under `streamed_prefix` go to host memory as soon as they are drawn."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.parallel import offload

    @functools.cache
    def program(shape, dtype):  # one per distinct parameter shape (q, k, v and out share theirs)
        return jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32 if jnp.dtype(dtype).itemsize > 2 else dtype)
                                  * (1 / max(shape[-1], 1)) ** 0.5).astype(dtype))

    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(flat):
        spec = var.get_value()
        value = program(tuple(spec.shape), jnp.dtype(spec.dtype))(jax.random.fold_in(key, i))
        if streamed_prefix and str(path[0]) == streamed_prefix:
            value = offload.to_host(value)
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def host_to_device_gbps(nbytes: int = GiB) -> float:
    """Host → device bandwidth of one pinned copy of `nbytes` (the best of three), GB/s."""
    import jax
    import jax.numpy as jnp

    from wan_tpu.parallel import offload

    device = jax.devices()[0]
    host = offload.to_host(jnp.zeros(nbytes // 2, jnp.bfloat16))
    target = jax.sharding.SingleDeviceSharding(device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(host, target))
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def peak_bytes() -> int | None:
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def umt5_xxl_config(tiny: bool):
    from wan_tpu.encoders.umt5 import UMT5Config
    from wan_tpu.wan.presets import tiny_umt5_config

    if tiny:  # more blocks than the preset's, so that some stream
        return dataclasses.replace(tiny_umt5_config(32), num_layers=4)
    return UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)


def abstract_dit(cfg, quantize: str | None, resident: int | None, attention):
    """(graphdef, abstract state) of the DiT a row runs: shapes, dtypes and memory kinds only (the streamed
    stack in host memory, `resident` blocks on the device), for a compile before any weight exists."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from wan_tpu.parallel import offload
    from wan_tpu.wan.quantize import quantize_transformer
    from wan_tpu.wan.transformer import WanTransformer, set_attention

    def build():
        model = WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        return quantize_transformer(model, quantize) if quantize else model

    model = nnx.eval_shape(build)
    set_attention(model, attention, None)
    if resident is not None and resident < cfg.num_layers:
        device = jax.devices()[0]
        # NamedShardings: an abstract argument's memory kind reaches the traced program only through one (jax
        # drops a SingleDeviceSharding's from the aval, and the host stack would trace as resident weights read
        # in place: the program XLA's GPU compile refuses with E1200, host memory reaching device compute).
        chip = jax.sharding.Mesh(np.array([device]), ("chip",))
        host = jax.sharding.NamedSharding(chip, jax.sharding.PartitionSpec(), memory_kind=offload.host_memory_kind(device))
        on_device = jax.sharding.NamedSharding(chip, jax.sharding.PartitionSpec(), memory_kind="device")
        placed = lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)  # noqa: E731
        graphdef, state = nnx.split(model)
        nnx.update(model, jax.tree.map(lambda a: placed(a, on_device), state))
        block_graph, block_state = nnx.split(model.blocks)
        prefix = jax.tree.map(lambda a: placed(jax.ShapeDtypeStruct((resident, *a.shape[1:]), a.dtype), on_device),
                              block_state)
        nnx.update(model.blocks, jax.tree.map(lambda a: placed(a, host), block_state))
        model.resident_blocks = nnx.data(nnx.merge(block_graph, prefix) if resident else None)
    return nnx.split(model)


def largest_buffers(compiled, count: int = 5) -> list[str]:
    """The `count` largest arrays an optimized program makes outside fusions (name, shape, GiB): where a
    compiled step's temporaries go."""
    import math
    import re

    sizes = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
             "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "pred": 1}
    found, computation = [], None
    for line in compiled.as_text().splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            computation = head.group(1)
            continue
        m = re.match(r"\s+(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* (\S+?)\(", line)
        if m and computation and "fused" not in computation and m.group(4) not in ("parameter", "get-tuple-element"):
            n = math.prod(int(d) for d in m.group(3).split(",") if d) * sizes.get(m.group(2), 4)
            found.append((n, f"{m.group(1)} {m.group(2)}[{m.group(3)}] {m.group(4)}"))
    return [f"{n / GiB:.2f} GiB {what}" for n, what in sorted(found, reverse=True)[:count]]


def run_denoise(args) -> dict:
    """One row: the DiT forward of a CFG step, resident or streamed as the plan for the budget says. The
    plan is checked against the compiled program (`plan_offload(measure=)`): XLA's own count of the step's
    temporaries, before any weight is drawn; the program it settles on is the one timed."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.configs.models import VARIANTS
    from wan_tpu.configs.vae import TINY_VAE, VAE_PRESETS
    from wan_tpu.wan import memory
    from wan_tpu.wan.pipeline import WanPipeline
    from wan_tpu.wan.quantize import quantize_transformer
    from wan_tpu.wan.transformer import WanTransformer, forward, set_attention

    variant = VARIANTS[CONFIGS[args.config]]
    tiny = args.config == "tiny"
    if tiny:  # more blocks than the preset's 2, so that some stream
        variant = dataclasses.replace(variant, transformer=dataclasses.replace(variant.transformer, num_layers=6))
    cfg = variant.transformer
    pipe = WanPipeline(variant, TINY_VAE if tiny else VAE_PRESETS["wan2.1"], {}, name=args.config,
                       dtype=jnp.bfloat16, text_encoder_config=umt5_xxl_config(tiny))
    pipe.quantization = None if args.quantize == "bf16" else args.quantize
    s = pipe.settings(height=args.height, width=args.width, num_frames=args.frames)
    latent = pipe.latent_shape(s.height, s.width, s.num_frames)
    inputs = (jax.ShapeDtypeStruct((2, *latent[1:]), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.float32),
              jax.ShapeDtypeStruct((2, 512, cfg.text_dim), jnp.bfloat16))
    programs = {}

    def compiled(resident):
        if resident not in programs:
            graphdef, state = abstract_dit(cfg, pipe.quantization, resident, args.attention)
            program = jax.jit(forward, static_argnums=0).trace(graphdef, state, *inputs).lower().compile()
            programs[resident] = (program, memory.compiled_device_bytes(program, (state, *inputs)))
            print(f"{args.config} {args.quantize}, {'all' if resident is None else resident} blocks resident: the "
                  f"compiled step needs {programs[resident][1] / GiB:.2f} GiB of device memory; its largest arrays: "
                  f"{'; '.join(largest_buffers(program))}", flush=True)
        return programs[resident]

    resident, said, text_resident = None, "", None
    if args.budget is not None:
        free = None
        if args.budget == 0:  # --tiny: a "device" halfway between the fully streamed and the resident need,
            # by the estimate and by the compiled programs (the CPU's own temporaries differ from a GPU's)
            need = [memory.stage_bytes(pipe, s, ("denoise",), args.attention, resident=r)["denoise"][0] for r in (0, None)]
            free = max(sum(need) // 2, compiled(0)[1] + (compiled(None)[1] - compiled(0)[1]) // 3)
        measure = None if args.resident is not None else (lambda r: compiled(r)[1])
        plan = memory.plan_offload(pipe, s, "auto", args.attention, device_free=free, measure=measure)
        resident = plan.resident if args.resident is None else args.resident
        text_resident = plan.text_resident
        said = plan.describe()
    streamed = resident is not None and resident < cfg.num_layers
    try:
        program, device_bytes = compiled(resident if streamed else None)
    except jax.errors.JaxRuntimeError as why:  # an abstract compile XLA refuses: jit on the drawn weights instead
        print(f"(compiling from shapes failed: {str(why).splitlines()[0][:160]}; jit compiles on the weights)", flush=True)
        program, device_bytes = None, None
    abstract = nnx.eval_shape(lambda: WanTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    dit = random_weights(abstract, "blocks" if streamed else None)
    if pipe.quantization:
        quantize_transformer(dit, pipe.quantization)
    if streamed:
        dit.offload_blocks(resident)
    set_attention(dit, args.attention, None)
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], inputs[0].shape, jnp.bfloat16)
    t = jnp.array([900.0, 900.0])
    context = jax.random.normal(keys[1], inputs[2].shape, jnp.bfloat16)
    call = dit_call(program, dit, (x, t, context))
    timing = harness.measure(call, jax.block_until_ready, iters=args.iters)
    _, block = memory.dit_bytes(cfg, "bfloat16", pipe.quantization)
    streamed_bytes = (cfg.num_layers - resident + 1) * block if streamed else 0
    gbps = host_to_device_gbps(min(GiB, max(block, 2**20))) if streamed else None
    return {"config": args.config, "quantize": args.quantize, "budget": args.budget,
            "resident": cfg.num_layers if resident is None else resident, "layers": cfg.num_layers,
            "step": timing.median, "first": timing.first, "streamed_bytes": streamed_bytes, "gbps": gbps,
            "peak": peak_bytes(), "compiled": device_bytes, "devices": harness.device_kind(jax.devices()),
            "plan": said, "text_resident": text_resident}


def dit_call(program, dit, inputs):
    """The compiled program on the drawn weights; jit's own compile where the weights' placements differ
    from the abstract ones it was compiled for."""
    import jax
    from flax import nnx

    from wan_tpu.wan.transformer import forward

    _, state = nnx.split(dit)
    try:
        if program is None:
            raise ValueError("no program compiled ahead")
        program(state, *inputs)
    except (TypeError, ValueError) as why:
        print(f"(the planned program refused the drawn weights: {str(why).splitlines()[0][:160]}; jit compiles "
              "its own)", flush=True)
        graphdef, _ = nnx.split(dit)
        return lambda: jax.jit(forward, static_argnums=0)(graphdef, state, *inputs)
    return lambda: program(state, *inputs)


def run_stage(args) -> dict:
    """One stage alone in a capped process: its peak device memory."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.configs.vae import TINY_VAE, VAE_PRESETS
    from wan_tpu.wan.pipeline import WanPipeline

    tiny = args.config == "tiny"
    plan = ""
    if args.stage == "text":
        from wan_tpu.encoders.umt5 import UMT5Encoder
        from wan_tpu.runtime.memory import available_bytes
        from wan_tpu.wan import memory

        cfg = umt5_xxl_config(tiny)
        free = None
        if args.budget == 0:  # --tiny: halfway between the fully streamed and the resident need
            free = sum(memory.text_device_bytes(cfg, "bfloat16", r) for r in (0, None)) // 2
        elif args.budget is not None:  # what the capped device reports free, as the pipeline's plan reads it
            free = available_bytes()[0] if jax.devices()[0].platform != "cpu" else args.budget * GiB
        # The plan `plan_offload` makes for the text stage (`OffloadPlan.text_resident`).
        resident = memory.plan_text_resident(cfg, "bfloat16", free)
        streamed = resident is not None and resident < cfg.num_layers
        plan = "every UMT5 block on the device"
        encoder = random_weights(nnx.eval_shape(lambda: UMT5Encoder(cfg, jnp.bfloat16)), "blocks" if streamed else None)
        if streamed:
            encoder.offload_blocks(resident)
            plan = f"blocks:{resident} ({resident} of {cfg.num_layers} UMT5 blocks on the device, the rest streamed)"
        embeds = jax.random.normal(jax.random.key(0), (2, 512, cfg.d_model), jnp.bfloat16)
        timing = harness.measure(lambda: encoder(embeds, jnp.ones((2, 512), jnp.int32)), jax.block_until_ready,
                                 iters=1)
    else:
        from wan_tpu.configs.models import VARIANTS
        from wan_tpu.vae.model import WanVAE

        config = TINY_VAE if tiny else VAE_PRESETS["wan2.1"]
        vae = random_weights(nnx.eval_shape(lambda: WanVAE(config, dtype=jnp.float32, rngs=nnx.Rngs(0))), None)
        pipe = WanPipeline(VARIANTS[CONFIGS[args.config]], config, {}, name="vae", dtype=jnp.bfloat16)
        z = jax.random.normal(jax.random.key(0), pipe.latent_shape(args.height, args.width, args.frames))
        timing = harness.measure(lambda: vae.decode(z), jax.block_until_ready, iters=1)
    return {"stage": args.stage, "budget": args.budget, "seconds": timing.median, "peak": peak_bytes(), "plan": plan}


# ---- whole commands -------------------------------------------------------------------------------------


def parse_timing_table(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """The generate command's timing table (`StageTimer.table`) → (stage → seconds, stage → peak GiB as printed,
    "≥" marking a sampled one)."""
    import re

    from wan_tpu.runtime.profiling import PEAK_HEADER

    head, _, peaks = text.partition(PEAK_HEADER)
    seconds = {k: float(v) for k, v in re.findall(r"^(\S.*?)\s{2,}([\d.]+) s\s*$", head, flags=re.M)}
    peak = dict(re.findall(r"^  (\S.*?)\s{2,}(≥?[\d.]+)\s*$", peaks, flags=re.M))
    return seconds, peak


def run_command(ckpt: str, args, config: str, budget: float | None, steps: int, deadline) -> dict:
    """One `python -m wan_tpu.generate` from spawn to exit: resident (`budget` None), capped at `budget` GiB
    with `--offload auto`, or (0: CPU) streaming one block less than all with `--offload blocks:1`."""
    import tempfile

    out = os.path.join(os.path.abspath(args.workdir), f"offload_{config}_{'resident' if budget is None else budget}.mp4")
    offload = "none" if budget is None else "blocks:1" if budget == 0 else "auto"
    argv = [sys.executable, "-m", "wan_tpu.generate", "--model", ckpt, "--prompt", PROMPT, "--seed", "0",
            "--size", f"{args.width}*{args.height}", "--frames", str(args.frames), "--steps", str(steps),
            "--offload", offload, "--output", out, "--overwrite", "--quiet"]
    argv += [] if args.attention is None else ["--attention", args.attention]
    timeout = None if deadline is None else deadline - time.perf_counter()
    if timeout is not None and timeout <= 0:
        return {"budget": budget, "why": f"not run (--time-limit {args.time_limit:g} s reached)"}
    with tempfile.TemporaryDirectory(prefix="bench_offload_cache_") as cache:
        try:
            proc = harness.run_fresh(argv, env={**cap_env(budget), "WAN_TPU_CACHE_DIR": cache}, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"budget": budget, "why": f"stopped at --time-limit {args.time_limit:g} s"}
    if proc.rc:
        print(proc.output[-3000:], file=sys.stderr)
        return {"budget": budget, "why": f"failed (exit status {proc.rc}; its output is above)"}
    seconds, peaks = parse_timing_table(proc.output)
    if peaks:  # each exact stage peak raised the process's: their largest is the process's peak
        peaks["total"] = max(peaks.values(), key=lambda v: float(v.lstrip("≥")))
    plan = [line for line in proc.output.splitlines() if line.startswith("offload:")]
    print(f"{config} {command_name(budget)}: {proc.wall:.1f} s" + (f"; {plan[-1]}" if plan else ""), flush=True)
    return {"budget": budget, "wall": proc.wall, "seconds": seconds, "peaks": peaks, "plan": plan[-1] if plan else "",
            "offload": offload}


def command_name(budget) -> str:
    return "resident" if budget is None else "streamed, no cap" if budget == 0 else f"{budget:g} GiB cap"


def command_tables(args, rows, deadline) -> None:
    """Per config: the capped command beside the resident one, stage by stage."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_e2e

    for config, budget in rows:
        steps = args.command_steps or COMMAND_STEPS[config]
        ckpt = bench_e2e.ensure_checkpoint(args.workdir, config)
        runs = [run_command(ckpt, args, config, b, steps, deadline) for b in (None, budget)]
        print(f"\nWhole command, Wan 2.1 T2V {config} random weights: {args.width}×{args.height}, {args.frames} frames, "
              f"{steps} steps, CFG; `python -m wan_tpu.generate` from spawn to exit, empty compile cache")
        done = [r for r in runs if "why" not in r]
        for r in runs:
            if "why" in r:
                print(f"{command_name(r['budget'])}: {r['why']}")
        if not done:
            continue
        after = ("total", "s/step (median)")  # the table's rows past its stages
        stages = list(dict.fromkeys(name for r in done for name in r["seconds"] if name not in after))
        head, body = ["stage"], []
        for r in done:
            where = command_name(r["budget"])
            head += [f"{where} s", f"{where} peak GiB"]
        for name in [*stages, *after]:
            body.append([name] + [cell for r in done for cell in
                                  (f"{r['seconds'][name]:.2f}" if name in r["seconds"] else "",
                                   r["peaks"].get(name, "n/a" if name in stages and not r["peaks"] else ""))])
        body.append(["wall (spawn to exit)"] + [cell for r in done for cell in (f"{r['wall']:.2f}", "")])
        if len(done) == 2:
            body.append(["wall × resident", "", "", f"{done[1]['wall'] / done[0]['wall']:.2f}", ""])
        print(harness.table(head, body))
        for r in done:
            print(f"{command_name(r['budget'])}: --offload {r['offload']}" + (f"; it printed: {r['plan']}" if r["plan"] else ""))


# ---- the table -----------------------------------------------------------------------------------------


def child(argv, budget, deadline, limit) -> tuple[dict | None, str | None]:
    budget = [] if budget is None else ["--budget", str(budget)]
    return harness.run_part([sys.executable, os.path.abspath(__file__), *argv, *budget], deadline, limit)


def parse_rows(text: str) -> list[tuple[str, float | None]]:
    """`14b:none,14b:16` → [("14b", None), ("14b", 16.0)]."""
    rows = []
    for item in text.split(","):
        config, _, budget = item.partition(":")
        if config not in CONFIGS or not budget:
            raise SystemExit(f"--rows {item}: expected CONFIG:GIB or CONFIG:none, CONFIG from {', '.join(CONFIGS)}")
        rows.append((config, None if budget == "none" else float(budget)))
    return rows


def budget_name(budget) -> str:
    return "uncapped" if budget is None else "given to the plan" if budget == 0 else f"{budget:g} GiB"


def gib(n) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny DiT, VAE and UMT5 at 64×64×5 (CPU smoke run)")
    p.add_argument("--quantize", default="bf16,int8", help="comma-separated, from bf16, int8, fp8")
    p.add_argument("--size", default="832*480", help="W*H (default 480p)")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--attention", default=None, help="DiT attention kernel (default: the backend's fastest)")
    p.add_argument("--resident", type=int, default=None, help="resident blocks of the streamed rows (default: the plan's)")
    p.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True, help="the per-stage peak rows")
    p.add_argument("--rows", default=None, help="CONFIG:GIB or CONFIG:none (uncapped), comma-separated (default: "
                   + ",".join(f"{c}:{'none' if b is None else b}" for c, b in DEFAULT_ROWS) + ")")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole table; rows past it are skipped")
    p.add_argument("--commands", action="store_true", help="the whole generate command capped beside resident, "
                   "instead of the step rows")
    p.add_argument("--command-rows", default=None, help="CONFIG:GIB, comma-separated (default: "
                   + ",".join(f"{c}:{b}" for c, b in COMMAND_ROWS) + ")")
    p.add_argument("--command-steps", type=int, default=None,
                   help="denoising steps of the whole commands (default: " + ", ".join(f"{c} {n}" for c, n in
                                                                                      COMMAND_STEPS.items()) + ")")
    p.add_argument("--workdir", default="outputs/bench_offload", help="where the commands' random checkpoints and "
                   "videos go (reused when present)")
    # One row of the parent's table (run in a fresh process).
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.width, args.height = map(int, args.size.split("*"))
    if args.tiny:
        args.width, args.height, args.frames = 64, 64, 5
    if args.config is not None:  # a child: one row
        cap_memory(args.budget)
        result = run_stage(args) if args.stage else run_denoise(args)
        with open(args.result_json, "w") as f:
            json.dump(result, f)
        return
    harness.print_env()
    deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
    if args.commands:
        rows = parse_rows(args.command_rows) if args.command_rows else TINY_COMMAND_ROWS if args.tiny else COMMAND_ROWS
        command_tables(args, rows, deadline)
        return
    common = ["--size", f"{args.width}*{args.height}", "--frames", str(args.frames), "--iters", str(args.iters)]
    common += [] if args.attention is None else ["--attention", args.attention]
    common += [] if args.resident is None else ["--resident", str(args.resident)]
    plan = parse_rows(args.rows) if args.rows else TINY_ROWS if args.tiny else DEFAULT_ROWS
    rows, failed = [], []
    for config, budget in plan:
        for quant in args.quantize.split(","):
            result, why = child(["--config", config, "--quantize", quant, *common], budget, deadline, args.time_limit)
            (rows.append(result) if result else failed.append((config, quant, budget, why)))
    baseline = {(r["config"], r["quantize"]): r["step"] for r in rows if r["budget"] is None}
    print(f"\nDiT forward of one CFG step ({args.width}×{args.height}, {args.frames} frames, batch 2), random weights")
    table = []
    for r in rows:
        base = baseline.get((r["config"], r["quantize"]))
        bound = r["streamed_bytes"] / (r["gbps"] * 1e9) if r["gbps"] else None
        table.append([r["config"], r["quantize"], budget_name(r["budget"]),
                      f"{r['resident']}/{r['layers']}", f"{r['step']:.3f}",
                      "" if base is None else f"{r['step'] / base:.2f}",
                      "" if bound is None else f"{bound:.3f} ({r['gbps']:.1f} GB/s)", gib(r["peak"]),
                      gib(r["compiled"])])
    table += [[c, q, budget_name(b), why] for c, q, b, why in failed]
    print(harness.table(["config", "weights", "device memory", "resident blocks", "step s", "× resident",
                         "stream bound s", "peak GiB", "compiled GiB"], table))
    for r in rows:
        if r["plan"]:
            print(f"{r['config']} {r['quantize']} at {budget_name(r['budget'])}: {r['plan']}")
    if not args.stages:
        return
    budgets = sorted({b for _, b in plan if b is not None}, reverse=True)
    stage_rows = []
    for budget in budgets:
        for stage in ("text", "decode"):
            result, why = child(["--config", "tiny" if args.tiny else "14b", "--stage", stage, *common], budget,
                                deadline, args.time_limit)
            stage_rows.append([stage, budget_name(budget), why] if result is None else
                              [stage, budget_name(budget), f"{result['seconds']:.2f}", gib(result["peak"]),
                               result["plan"]])
    denoise = [[f"denoise ({r['config']} {r['quantize']})", budget_name(r["budget"]), f"{r['step']:.2f}", gib(r["peak"]),
                f"blocks:{r['resident']} of {r['layers']}"]
               for r in rows
               if r["budget"] is not None]
    print("\nEach stage alone (its own process and cap): UMT5-XXL text encode, the streamed DiT step, VAE decode")
    print(harness.table(["stage", "device memory", "s", "peak GiB", "plan"], stage_rows + denoise))


if __name__ == "__main__":
    main()
