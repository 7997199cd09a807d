"""Compiles beside each other in one process: the Wan VAE's streaming decode program (Matrix-Game-2's
`chunk_decode_program`, 3 latent frames) compiled alone, then N copies for latents of other widths (so that
nothing is shared) each in a thread of its own, as `prepare` compiles a start's programs. Each case runs in a
fresh process with an empty cache: wall seconds, each program's, and the share of the CPUs busy meanwhile
(`/proc/stat`).

    python benchmarks/bench_compile_side_by_side.py                      # GPU: 44×80 latents (640×352), N = 1, 3, 6
    python benchmarks/bench_compile_side_by_side.py --workers 0,6                # ... and in 6 worker processes
    python benchmarks/bench_compile_side_by_side.py --vae tiny --height 8 --width 12 --copies 1,2   # CPU check

`--workers N`: each case also with N compile worker processes (`wan_tpu.runtime.compile_workers`), ready before the
compiles start, to which the threads send their programs. On an NVIDIA GPU the compiles in threads queue on each
other: a start pays about the sum of its programs' compiles, whatever their order; in workers they run at once.
Abstract weights: nothing is read or run.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402


def _cpu_times() -> tuple[int, int] | None:
    """(all jiffies, idle + iowait jiffies) since boot; None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + fields[4]


def child(vae: str, height: int, widths: list[int], workers: int) -> None:
    from wan_tpu.runtime import compile_workers
    from wan_tpu.runtime.xla_defaults import apply_xla_defaults

    apply_xla_defaults()  # as a command line compiles
    started = time.perf_counter()
    import jax
    import jax.numpy as jnp

    if workers:
        compile_workers.start(workers, platform=jax.devices()[0].platform.replace("gpu", "cuda"))
        compile_workers.MIN_BYTES = 0  # the tiny VAE's program counts too
    from flax import nnx

    from wan_tpu.configs.vae import VAE_PRESETS
    from wan_tpu.matrix_game.programs import chunk_decode_program
    from wan_tpu.vae.loading import abstract_vae

    model = abstract_vae(VAE_PRESETS[vae], jnp.float32)
    graphdef, state = nnx.split(model)
    lowered = []
    for w in widths:
        z = (1, model.config.z_dim, 3, height, w)
        caches = jax.eval_shape(lambda: model.start_decode_caches(z))  # noqa: B023 - called at once
        lowered.append(chunk_decode_program.lower(graphdef, state, caches, jax.ShapeDtypeStruct(z, jnp.float32),
                                                  jax.ShapeDtypeStruct((), jnp.int32)))
    ready = compile_workers.wait_started(120) if workers else 0
    ready_s = time.perf_counter() - started
    seconds = [0.0] * len(lowered)

    def compile_one(i):
        start = time.perf_counter()
        lowered[i].compile()
        seconds[i] = time.perf_counter() - start

    threads = [threading.Thread(target=compile_one, args=(i,)) for i in range(len(lowered))]
    before, start = _cpu_times(), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, after = time.perf_counter() - start, _cpu_times()
    busy = None if before is None or after is None or after[0] == before[0] else \
        1 - (after[1] - before[1]) / (after[0] - before[0])
    harness.emit_result(dict(wall=wall, each=seconds, busy=busy, cpus=os.cpu_count(), ready=ready, ready_s=ready_s,
                             in_workers=compile_workers.stats()["compiled"]))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        child(argv[1], int(argv[2]), [int(w) for w in argv[3].split(",")], int(argv[4]))
        return 0
    p = argparse.ArgumentParser(prog="python benchmarks/bench_compile_side_by_side.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--vae", default="wan2.1", help="a VAE preset (wan2.1, tiny)")
    p.add_argument("--height", type=int, default=44, help="latent rows")
    p.add_argument("--width", type=int, default=80, help="latent columns of the first copy; each next one 4 fewer")
    p.add_argument("--copies", default="1,3,6", help="comma-separated counts of programs compiled side by side")
    p.add_argument("--workers", default="0", help="comma-separated counts of compile worker processes "
                   "(`wan_tpu.runtime.compile_workers`; 0: the threads compile in their own process)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a case's process may take")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.copies.split(",")]
    pools = [int(w) for w in args.workers.split(",")]
    if any(w < 0 for w in pools):
        raise SystemExit("--workers must be ≥ 0")
    if any(c < 1 for c in counts) or args.width - 4 * (max(counts) - 1) < 4:
        raise SystemExit(f"--copies must be ≥ 1 and leave each copy ≥ 4 latent columns from --width {args.width}")
    harness.print_env()
    rows = []
    for workers in pools:
        for n in counts:
            widths = [args.width - 4 * i for i in range(n)]
            proc = harness.run_fresh([sys.executable, os.path.abspath(__file__), "--child", args.vae, str(args.height),
                                      ",".join(map(str, widths)), str(workers)],
                                     env={"WAN_TPU_CACHE_DIR": "", "JAX_COMPILATION_CACHE_DIR": ""}, timeout=args.timeout)
            results = proc.results()
            if proc.rc or not results:
                raise SystemExit(f"{n} side by side failed (exit status {proc.rc}):\n{proc.output[-3000:]}")
            r = results[-1]
            busy = "—" if r["busy"] is None else f"{r['busy']:.0%} of {r['cpus']}"
            pool = f"{r['ready']} ready at {r['ready_s']:.1f} s, {r['in_workers']} compiled there" if workers else "—"
            rows.append((str(n), str(workers), f"{r['wall']:.2f}", " / ".join(f"{s:.2f}" for s in r["each"]), busy,
                         pool))
            print(f"{n} side by side, {workers} workers: {r['wall']:.2f} s", flush=True)
    print(f"\n{args.vae} VAE streaming decode, latents {args.height}×{args.width} (each next copy 4 columns fewer), "
          "compiled in threads of one process, or sent by them to compile worker processes")
    print(harness.table(("programs", "workers", "wall s", "each program s", "CPUs busy", "workers' start"), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
