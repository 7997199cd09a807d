"""The command-line harness every family's CLI runs on (`wan-generate`, `wan-matrix-game`, `wan-unifolm`,
the stage commands).

- `CliParser`: argparse whose errors are one line (`WanInputError`, exit status 2).
- `add_common_args`: the flags every family shares, declared here once (`--model`, `--dtype`, `--mesh`,
  `--attention`, `--seed`, `--output`, `--overwrite`, `--no-compile-cache`, `--profile`, `--quiet`; with
  `--mesh`, one run over several processes: `--coordinator`, `--num-processes`, `--process-id`), with each
  family's defaults and help.
- `parse_mesh`, `check_attention`, `dtype_of`: the shared flags' values, checked before any load.
- `run_cli`: the contract of a command: bad input → one line on stderr and status 2; a non-finite
  result → one line and status 1; Ctrl-C / SIGTERM → one line naming what was kept, 130 / 143
  (`wan_tpu.runtime.interrupt`); otherwise 0. A command line also claims its device memory, XLA and JAX
  defaults and spaces out Python's garbage collections (`GC_THRESHOLDS`) before the first device use; every
  command joins its multi-process job there (`wan_tpu.runtime.distributed`: one writer, the others print one
  line; a stop on any process stops all).
- `exit_now`: leave without the interpreter's teardown once the work is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from wan_tpu.errors import NonFiniteError, WanInputError

DTYPES = ("bfloat16", "float32")

# Python's cyclic garbage collector in a command line's own process: collections far apart. Building a model's
# structure (`nnx.eval_shape`) and tracing its programs allocate millions of objects that live on, and every full
# collection walks all of them again. UnifoLM-WMA-0 on a 2-core CPU, the same script in turns: its abstract UNet
# built in 2.7-3.7 s instead of 4.3-5.2 s, its prepare program traced in 0.7-1.0 s instead of 1.2-1.9 s. Its cold
# `unifolm` command on an H200 (`benchmarks/profile_compile.py unifolm --device`, in turns, 2026-11-29): the abstract
# UNet 3.2 / 3.7 s instead of 4.1, the stage programs traced in 4.5 / 6.2 s instead of 7.4, the first sampling
# done at 22.6 / 26.3 s instead of 28.2 / 26.5; Matrix-Game-2's programs traced and lowered in 7.6 / 6.5 s of
# spans instead of 9.3 / 7.6, first chunk at 9.0 / 8.6 s instead of 10.9 / 9.0. Warm starts unchanged. Cycles are
# still collected, young ones 140 times less often and full collections far less: right for a command that
# ends, not for a server, whose jobs' cycles could hold device buffers between rare full collections (`wan-serve`
# keeps Python's defaults: `spaced_gc=False`).
GC_THRESHOLDS = (100_000, 50, 100)

COMMON_FLAGS = ("--model", "--dtype", "--mesh", "--attention", "--seed", "--output", "--overwrite",
                "--no-compile-cache", "--profile", "--quiet")


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors, exit status 2 (what every bad input of a command gives).

    `unknown_hint(extra_args)` (optional) names the fix for unrecognised flags (Wan: the official
    `generate.py` flags wan_tpu does not take)."""

    def __init__(self, *args, unknown_hint: Callable[[list[str]], str | None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.unknown_hint = unknown_hint

    def error(self, message):
        raise WanInputError(f"{message}; see {self.prog} --help")

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            hint = self.unknown_hint(extra) if self.unknown_hint is not None else None
            self.error(hint or f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def add_common_args(p: argparse.ArgumentParser, *, model_default, model_help: str, dtype_default,
                    dtype_help: str, seed_default, seed_help: str, output_default: str, output_help: str,
                    aliases: dict[str, str] | None = None, mesh: bool = True, attention: bool = True,
                    seed: bool = True, profile: bool = True) -> None:
    """Declare the shared flags on `p` with a family's defaults and help. `aliases`: flag → another name
    it also answers to (Wan: the official `generate.py` names). `mesh`, `attention`, `seed`, `profile`:
    False for a command that has no use for them (a stage that neither samples nor traces)."""
    aliases = aliases or {}

    def names(flag):
        return [flag] + ([aliases[flag]] if flag in aliases else [])

    p.add_argument(*names("--model"), dest="model", default=model_default, help=model_help)
    p.add_argument("--dtype", choices=DTYPES, default=dtype_default, help=dtype_help)
    if mesh:
        p.add_argument("--mesh", default=None,
                       help="device mesh dp,sp,tp (product = number of devices; default: one device)")
        p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="several processes, one run: process 0's address, the same on every process "
                            "(default: $WAN_TPU_COORDINATOR, or what JAX detects: a TPU pod slice, Slurm, Open MPI)")
        p.add_argument("--num-processes", default=None, type=int, metavar="N",
                       help="processes in the run (with --coordinator; default: $WAN_TPU_NUM_PROCESSES)")
        p.add_argument("--process-id", default=None, type=int, metavar="I",
                       help="this process's number, 0..N-1; process 0 writes the outputs (default: $WAN_TPU_PROCESS_ID)")
    if attention:
        p.add_argument("--attention", default=None,
                       help="attention kernel (reference, splash_exp2, pallas_gpu, cudnn; default: the backend's fastest; "
                            "pallas_gpu_fp8: opt-in, Hopper, self-attention in 8 bits)")
    if seed:
        p.add_argument(*names("--seed"), dest="seed", type=int, default=seed_default, help=seed_help)
    p.add_argument(*names("--output"), dest="output", default=output_default, help=output_help)
    add_overwrite(p)
    p.add_argument("--no-compile-cache", action="store_true",
                   help="neither read nor write compiled programs on disk (see wan_tpu.runtime.compile_cache)")
    if profile:
        p.add_argument("--profile", default=None, metavar="DIR", help="write a JAX profiler trace into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_overwrite(p: argparse.ArgumentParser, help: str = "replace existing outputs") -> None:
    """`--overwrite`, also for commands without the other shared flags (the converters)."""
    p.add_argument("--overwrite", action="store_true", help=help)


def parse_mesh(spec: str | None):
    """`dp,sp,tp` → a mesh over all devices (None → no mesh: one device; in a job of several processes,
    sequence-parallel over every process's devices)."""
    if spec is None:
        from wan_tpu.runtime import distributed

        if distributed.process_count() == 1:
            return None
        spec = "1,-1,1"
    parts = spec.split(",")
    if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise WanInputError(f"mesh {spec!r} is not dp,sp,tp; pass e.g. --mesh 2,1,4 (product = number of devices)")
    from wan_tpu.parallel.mesh import make_mesh

    dp, sp, tp = (int(p) for p in parts)
    return make_mesh(dp=dp, sp=sp, tp=tp)


def check_attention(name: str | None) -> None:
    """Refuse an `--attention` kernel the backend cannot run, before anything loads."""
    if name is None:
        return
    import jax

    from wan_tpu.layers.attention import runnable_impls

    choices = runnable_impls(jax.default_backend())
    if name not in choices:
        raise WanInputError(f"attention kernel {name!r} cannot run on {jax.default_backend()}; "
                            f"choose one of {', '.join(choices)} or leave --attention out")


def dtype_of(name: str):
    """A `--dtype` value as a jnp dtype."""
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[name]


def run_cli(run: Callable, parser: argparse.ArgumentParser, argv=None, *,
            device_memory: Callable[[argparse.Namespace], int | None] | None = None,
            compile_workers: Callable[[argparse.Namespace], bool] | None = None, spaced_gc: bool = True) -> int:
    """Run `run(args)` under the command contract (module docstring); `argv=None` means a command line
    (the process is ours: device memory and XLA defaults are claimed), a list means a call from Python.
    `device_memory(args)`: the bytes the run needs on a device at most, which a command line reserves
    instead of most of the GPU (`wan_tpu.runtime.memory.claim_device_memory`). `compile_workers(args)`: whether the
    command compiles its large programs in worker processes (`wan_tpu.runtime.compile_workers`, where its default
    count is not 0); `WAN_TPU_COMPILE_WORKERS` set decides for every command line. `spaced_gc`: whether a command
    line's process takes `GC_THRESHOLDS`."""
    called = time.perf_counter()
    import warnings

    if argv is None and spaced_gc:
        import gc

        gc.set_threshold(*GC_THRESHOLDS)

    from wan_tpu.runtime import interrupt

    # torchax and jax warn that int64 token ids become int32 (x64 is off); harmless for ids < 2^31.
    warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
    with interrupt.handled():
        try:
            interrupt.check()  # a signal that came during the imports
            args = parser.parse_args(argv)
            if argv is None:
                from wan_tpu.runtime.memory import claim_device_memory
                from wan_tpu.runtime.xla_defaults import apply_jax_defaults, apply_xla_defaults

                claim_device_memory(device_memory(args) if device_memory is not None else None)
                apply_xla_defaults()
                apply_jax_defaults()
            from wan_tpu.runtime import distributed
            from wan_tpu.runtime.profiling import process_start

            in_job = distributed.initialize_from_args(args)  # before any device use
            if argv is None:
                from wan_tpu.runtime import compile_workers as workers

                # Now, before this process's backend: ready by the first large compile. Not in a job of several
                # processes, whose programs span them.
                asked = os.environ.get(workers.ENV, "").strip() or (compile_workers is not None and compile_workers(args))
                if asked and not in_job:
                    workers.start()
                from wan_tpu.runtime.compile_ahead import start_transfers

                # The accelerator's client starts now, in a thread, while this thread imports the family's
                # modules and checks its inputs, instead of at the first device use.
                start_transfers()
            # `startup` counts from the process start for a command line, from this call for a call from Python.
            args.started = process_start() if argv is None else called
            with distributed.stop_all_on_error(), distributed.writer_output(args):
                run(args)
            # A signal during the last write or after it is not dropped: the files are complete, and the
            # closing line says which were kept.
            interrupt.check()
        except WanInputError as e:
            interrupt.say(f"error: {e}")
            return 2
        except (interrupt.Interrupted, KeyboardInterrupt) as e:
            kept = interrupt.written()
            interrupt.say(f"interrupted; {'kept ' + ', '.join(kept) if kept else 'nothing written'}")
            return e.exit_status if isinstance(e, interrupt.Interrupted) else 130
        except NonFiniteError as e:
            interrupt.say(f"error: {e}")
            return 1
        finally:
            from wan_tpu.runtime import distributed

            distributed.finish()
    return 0


def exit_now(status: int) -> None:
    """End a command whose work is done and written: flush the streams and leave without the interpreter's
    teardown, which frees every device buffer one at a time and destroys the accelerator client (on an
    H100 after 1.3B runs: 1.18–1.60 s from the timing table to the end with this, 1.74–1.75 s without; a
    wait a user sees and gains nothing from). Only for a command line's `__main__`: the background
    threads have been joined and every file is closed."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
