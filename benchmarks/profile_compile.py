"""Where first-call time goes: the programs the VAE decode and the UMT5 encoder compile, and start-up imports.

    python benchmarks/profile_compile.py vae                       # Wan 2.1 VAE decode, 480p latents (1,16,21,60,104)
    python benchmarks/profile_compile.py vae --cache /tmp/cc       # ... with a persistent cache (run twice: cold, warm)
    python benchmarks/profile_compile.py vae --cache /tmp/cc --ahead   # compile_decode in a thread first
    python benchmarks/profile_compile.py t5 --cache /tmp/cc        # UMT5-XXL encoder (zero weights), 2 prompts
    python benchmarks/profile_compile.py startup                   # import and device set-up seconds
    XLA_FLAGS=--xla_gpu_autotune_level=0 python benchmarks/profile_compile.py vae   # compile time without autotuning
    python benchmarks/profile_compile.py vae --small               # tiny sizes: a CPU check of this script

Each run is one fresh process (run it twice with one `--cache` folder for cold vs warm). It prints the
first and second call's seconds and, per program and thread, how many times JAX traced, lowered and
compiled it (or loaded it from the cache) and the seconds each took, from `jax.monitoring` events.
The models have random weights (the VAE's drawn by `wan_tpu.loading.random_init.random_module`, UMT5's zero), so
no checkpoint is needed; what is measured is compilation, not the numbers.

Cold start of a whole command, one per family (`unifolm`, `matrix-game`, `wan`):

    python benchmarks/profile_compile.py unifolm                    # CPU: unifolm-tiny --mode decision
    python benchmarks/profile_compile.py unifolm -- --mode interact --iterations 3
    python benchmarks/profile_compile.py matrix-game                # CPU: matrix-game-tiny, 33 frames
    python benchmarks/profile_compile.py wan                        # CPU: the tiny preset
    python benchmarks/random_folders.py unifolm /tmp/unifolm-bench                        # real-size folders of
    python benchmarks/random_folders.py matrix-game /tmp/mg_bench/converted               # random weights, then:
    python benchmarks/profile_compile.py unifolm --device --model /tmp/unifolm-bench      # real size (see --device)
    python benchmarks/profile_compile.py matrix-game --device --model /tmp/mg_bench/converted
    python benchmarks/profile_compile.py wan --device --workdir /tmp/be2e                 # Wan 2.1 1.3B, 480p
    python benchmarks/profile_compile.py wan --device --workdir /tmp/be2e --config 14b --few-step --lora-rank 64

Each runs the family's command line `--runs` times cold (every run with an empty compile-cache folder:
`WAN_TPU_CACHE_DIR`) and `--runs` times warm (the folder the first cold run filled), each a fresh
process timed from spawn to exit, and prints the whole-command seconds (each run, median), the
seconds to the command's first output line and to its first result (UnifoLM: the end of the first
sampling; Matrix-Game: the first chunk's frames; Wan: the end of denoising), then the timeline of the
median cold and the median warm run: what ran when and in which thread, from JAX's own spans (tracing,
lowering to StableHLO, XLA's compile — autotuning included — and persistent-cache reads) and the
package's (`wan_tpu.runtime.executable_cache.TIMELINE`: whole programs loaded or compiled and stored,
abstract modules, random weights, `prepare`'s background loads and compiles, and the main thread's
waits for them), with the command's stages; spans shorter than `--min-seconds` are summed per kind. Under each
timeline, its critical path: the main thread's last wait before the first result, the program whose compile
ended last within it, when that program was traced, lowered and compiled (in a worker process or here), and
how long other programs were traced and lowered meanwhile (`critical_path`).
`--autotune-split` (GPUs) adds a cold run whose cache folder holds only the autotuning results the first cold run
wrote (XLA's per-fusion autotuning folder, `autotune_packs.FOLDER`, which every process of a run reads and writes, compile
workers included; a results file, `--xla_gpu_dump_autotune_results_to`, would hold one process's): per program,
the difference of XLA's compile seconds is its autotuning (level 0 instead picks untuned algorithms, which left 3-D
convolutions too slow for a run to end), and the first result's is what tuning shipped for this GPU would save.
`--pass-times` (GPUs) turns on XLA's own timers in the cold runs (`TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1`)
and prints, per compiled module, the seconds of its HLO passes (autotuning among them) and of its backend (LLVM, PTX),
with its longest passes, and names the module each of XLA's rematerialisation warnings came from; `--child-log FILE`
keeps every run's own output; `--keep DIR` the inputs and cache folders (`DIR/cache-0` is the warm runs').
`--decode-beside-denoise` (Wan, GPUs): the VAE decode's compiles overlap the denoise instead of the first step's
waiting for them (`compile_ahead.WAIT_FOR_DEVICE_AUTOTUNING` off).
`--timeout S` stops a run past S seconds and shows the spans that had ended and the command's last lines (a
run that would not finish still says where it was). `--program-options NAME:OPTION=VALUE` compiles one program
with XLA options of its own (`_sample_loop:xla_gpu_autotune_level=0`: that program without autotuning, the
others as they are), to weigh each program's compile seconds against its run's in one whole command.
Python's bytecode: an installed package has it, so a fair start-up reads it. Where the environment sets
`PYTHONDONTWRITEBYTECODE` over packages that ship none (the GPU machines' image), run with it unset and
`PYTHONPYCACHEPREFIX=/tmp/pyc` after one priming run (each child inherits both); otherwise every import is compiled
again in every run (2.5–2.8 s of a warm world-model command on an H200).
`--device`: real sizes; `--model` is a converted folder with random
weights (`random_folders.py unifolm DIR` / `random_folders.py matrix-game DIR` write one with our code
alone; so do `bench_unifolm.py --size real --random --workdir DIR` and `bench_matrix_game.py --random
--parts prepare --workdir DIR`, the latter into `DIR/converted`); Wan writes its random checkpoint (`--config`)
and LoRA (`--lora-rank`) under `--workdir` (`bench_e2e.py`'s). Arguments after `--` go to the command itself.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import importlib
import os
import re
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

START = time.perf_counter()


def record_events():
    """(event, function, thread, seconds) of every compile-related event from now on."""
    import jax

    events = []

    def on(event, seconds, **kw):
        if event.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
            events.append((event.rsplit("/", 1)[1], kw.get("fun_name") or "", threading.current_thread().name, seconds))

    jax.monitoring.register_event_duration_secs_listener(on)
    return events


def print_events(events) -> None:
    rows = collections.defaultdict(lambda: [0, 0.0])
    for kind, fun, thread, seconds in events:
        row = rows[(fun, "main" if thread == "MainThread" else thread, kind.replace("_duration", ""))]
        row[0] += 1
        row[1] += seconds
    print(harness.table(("program", "thread", "event", "count", "seconds"),
                        ((fun, thread, kind, n, f"{seconds:.2f}")
                         for (fun, thread, kind), (n, seconds) in sorted(rows.items(), key=lambda kv: -kv[1][1])
                         if seconds >= 0.005)))


def print_timed(name: str, fn) -> None:
    print(f"{name:28} {harness.timed(fn)[1]:8.2f} s")


def use_cache(folder: str | None) -> None:
    if folder:
        from wan_tpu.runtime import compile_cache

        print(f"compile cache: {compile_cache.enable(folder)}")


def vae(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from wan_tpu.configs.vae import VAE_PRESETS
    from wan_tpu.loading.random_init import random_module
    from wan_tpu.vae.model import WanVAE

    use_cache(args.cache)
    events = record_events()
    model = random_module(lambda: WanVAE(VAE_PRESETS["tiny" if args.small else "wan2.1"], dtype=jnp.float32,
                                         rngs=nnx.Rngs(0)), 1)
    shape = (1, model.config.z_dim, 3, 8, 16) if args.small else (1, 16, 21, 60, 104)
    z = jax.block_until_ready(jax.random.normal(jax.random.key(0), shape, jnp.float32))
    events.clear()
    if args.ahead:
        thread = threading.Thread(target=model.compile_decode, args=(shape,), name="ahead")
        print_timed("compile_decode (thread)", lambda: (thread.start(), thread.join()))
    print_timed("first decode", lambda: np.asarray(model.decode(z)))
    print_timed("second decode", lambda: np.asarray(model.decode(z)))
    print_events(events)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    print(f"peak device memory: {'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}")


def t5(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from wan_tpu.encoders.tokenizers import tiny_tokenizer
    from wan_tpu.encoders.umt5 import UMT5Config, UMT5Embedding, UMT5Encoder
    from wan_tpu.encoders.umt5_text import UMT5TextEncoder

    use_cache(args.cache)
    events = record_events()
    size = dict(d_model=64, d_ff=128, num_layers=2, num_heads=2) if args.small else \
        dict(d_model=4096, d_ff=10240, num_layers=24, num_heads=64)  # UMT5-XXL, as in the Wan-AI repos
    config = UMT5Config(vocab_size=256384, d_kv=64, relative_attention_num_buckets=32,
                        relative_attention_max_distance=128, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
                        **size)
    def build():
        graphdef, state = nnx.split(nnx.eval_shape(lambda: UMT5Encoder(config, jnp.bfloat16)))
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state)  # zeros: only the program is measured
        table = np.zeros((config.vocab_size, config.d_model), jnp.bfloat16)
        return UMT5TextEncoder(nnx.merge(graphdef, state), UMT5Embedding(table, jnp.bfloat16), tiny_tokenizer())

    encoder, seconds = harness.timed(build)
    print(f"{'build (device)':28} {seconds:8.2f} s")
    events.clear()
    prompts = ["a cat walks on the grass", "low quality"]
    print_timed("first encode", lambda: np.asarray(encoder.encode(prompts)))
    print_timed("second encode", lambda: np.asarray(encoder.encode(prompts)))
    print_events(events)


def startup(args) -> None:
    print_timed("import jax", lambda: __import__("jax"))
    print_timed("jax.devices() (backend)", lambda: __import__("jax").devices())
    print_timed("import flax.nnx", lambda: __import__("flax.nnx"))
    print_timed("import wan_tpu.wan.pipeline", lambda: __import__("wan_tpu.wan.pipeline"))
    print_timed("import torch", lambda: __import__("torch"))
    print_timed("import transformers UMT5", lambda: __import__("transformers").UMT5EncoderModel)
    print_timed("import torchax (shimmed)",
                lambda: importlib.import_module("wan_tpu.runtime.torchax_compat").import_torchax())


# ---- a whole command's cold start -------------------------------------------------------------------

# Per family: its command line module (and the one with its `main`), the stage whose end is its first result, and its run on CPU (tiny
# presets) and on a device (real sizes; {model}, {workdir}: the options').
FAMILIES = {
    "unifolm": dict(module="wan_tpu.unifolm", cli="wan_tpu.unifolm.cli", first="sample",
                    cpu=["--model", "unifolm-tiny", "--mode", "decision", "--observation", "{inputs}/obs.npz"],
                    device=["--model", "{model}", "--mode", "decision", "--observation", "{inputs}/obs.npz",
                            "--steps", "16"]),
    "matrix-game": dict(module="wan_tpu.matrix_game", cli="wan_tpu.matrix_game.cli", first="first chunk",
                        cpu=["--model", "matrix-game-tiny", "--image", "{inputs}/image.png", "--random-actions",
                             "--frames", "33"],
                        device=["--model", "{model}", "--image", "{inputs}/image.png", "--random-actions",
                                "--frames", "57"]),
    "wan": dict(module="wan_tpu.generate", cli="wan_tpu.wan.cli", first="denoise",
                cpu=["--model", "tiny", "--prompt", "a cat walks on the grass"],
                device=["--model", "{model}", "--prompt", "a cat walks on the grass", "--size", "832*480",
                        "--frames", "81", "--steps", "50"]),
}
STAGE = "stage"  # the timeline kind of a command's stages (`StageTimer.stage`)


def write_inputs(folder: str, family: str, device: bool) -> None:
    """The command's input files: UnifoLM's observation (2 frames at the model's size, 16-d states), an image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    if family == "unifolm":
        h, w = (320, 512) if device else (128, 128)
        np.savez(os.path.join(folder, "obs.npz"), images=rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8),
                 states=rng.uniform(-1, 1, (2, 16)).astype(np.float32))
    if family == "matrix-game":
        Image.fromarray(rng.integers(0, 256, (360, 640, 3), dtype=np.uint8)).save(os.path.join(folder, "image.png"))


def command(args, inputs: str, output: str) -> list[str]:
    spec = FAMILIES[args.what]
    model = args.model
    wan = []  # --config 14b: its size; --few-step, --lora-rank: bench_e2e.py's recipe and LoRA
    if args.device and args.what == "wan":
        import bench_e2e

        if model is None:
            model = bench_e2e.ensure_checkpoint(args.workdir, args.config)
        if args.config != "1.3b":
            wan += ["--size", "1280*720"]
        if args.few_step:
            wan += ["--steps", str(len(bench_e2e.FEW_STEP_SIGMAS)), "--scheduler", "euler", "--sigmas",
                    ",".join(map(str, bench_e2e.FEW_STEP_SIGMAS)), "--shift", str(bench_e2e.FEW_STEP_SHIFT), "--guidance", "1"]
        if args.lora_rank:
            variant = bench_e2e.CONFIGS[args.config].variant
            wan += ["--lora", bench_e2e.write_lora(os.path.join(os.path.abspath(args.workdir),
                                                                f"{variant}-lora-r{args.lora_rank}.safetensors"),
                                                   args.config, args.lora_rank)]
    if args.device and model is None:
        raise SystemExit(f"--device {args.what} needs --model FOLDER (a converted folder; see the docstring)")
    argv = [a.format(inputs=inputs, model=model) for a in spec["device" if args.device else "cpu"]]
    return [sys.executable, os.path.abspath(__file__), "--child", args.what, "--", *argv, *wan, "--output", output,
            "--overwrite", *args.rest]


SPAN = "SPAN "  # a child's span as it ends: this prefix, then one line of JSON on its stderr


def run_timed(argv: list[str], env: dict, timeout: float | None = None) -> dict:
    """`argv` in a fresh process: seconds from spawn to exit and to its first output byte (stdout or stderr),
    and the child's RESULT (its timeline); its output is kept for an error message. Past `timeout` seconds
    the child's process group is killed and the run comes back `timed_out`, with the spans that had ended
    (the child prints each as it ends) and the last lines the command printed."""
    import signal
    import subprocess

    start_wall, start = time.time(), time.perf_counter()
    proc = subprocess.Popen(argv, env={**os.environ, **env, "PROFILE_SPAWN": repr(start_wall)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    expired = threading.Event()

    def expire():
        expired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, expire) if timeout else None
    if timer:
        timer.start()
    first, out = None, bytearray()
    try:
        while chunk := proc.stdout.read1(65536):
            first = first if first is not None else time.perf_counter() - start
            out += chunk
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
    wall = time.perf_counter() - start
    text = out.decode(errors="replace")
    if os.environ.get("PROFILE_CHILD_LOG"):  # --child-log: every run's own output, appended
        with open(os.environ["PROFILE_CHILD_LOG"], "a") as f:
            f.write(f"\n===== {' '.join(argv[5:])} ({env.get('WAN_TPU_CACHE_DIR')})\n{text}")
    remat = [line for line in text.splitlines() if REMAT in line]
    if expired.is_set():
        import json

        spans, said = [], []
        for line in text.split("\n"):  # not splitlines: a progress line's carriage returns are one line's updates
            if line.startswith(SPAN):
                with contextlib.suppress(ValueError):  # a line cut by the kill
                    spans.append(tuple(json.loads(line[len(SPAN):])))
            elif line.strip() and REMAT not in line and not XLA_LOG.search(line):
                said.append(line.rsplit("\r", 1)[-1])
        return dict(wall=wall, first_output=first, remat=remat, spans=spans, spawn=start_wall, counts={},
                    timed_out=True, tail=said[-12:], anatomy=compile_anatomy(text),
                    remat_sources=remat_sources(text))
    results = harness.read_results(text)
    if rc or not results:
        said = "\n".join(line for line in text.split("\n") if not line.startswith(SPAN))
        raise SystemExit(f"{' '.join(argv)} failed (exit status {rc}):\n{said[-4000:]}")
    return dict(wall=wall, first_output=first, remat=remat, timed_out=False, anatomy=compile_anatomy(text),
                remat_sources=remat_sources(text),
                **results[-1])


REMAT = "by rematerialization; only reduced to"  # XLA's "Can't reduce memory use below X by rematerialization; ..."
# An XLA log line (glog format); a progress line's text, which ends in no newline, may come before it.
XLA_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+(\d+) \S+\] (.*)$")
PASS_TIMERS = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "gpu_compiler=1,hlo_pass_pipeline=1"}


def xla_lines(text: str):
    """(thread id, message) of each XLA log line (glog format) in a run's output."""
    for line in text.split("\n"):
        if (m := XLA_LOG.search(line)):
            yield m.groups()


def compile_anatomy(text: str) -> dict:
    """XLA's own timers in a run's output (`PASS_TIMERS`) → {module: {"count", "passes", "backend" (seconds,
    summed over its compiles), "longest" ({pass: its longest single run, s})}}. A pass is the module's that
    its thread was last running the pipelines of (a module compiles in one thread; the nested pipelines a
    pass runs on pieces of it, e.g. the Triton normalization rewriter's, count within that pass)."""
    current, out = {}, {}
    entry = lambda module: out.setdefault(module, {"count": 0, "passes": 0.0, "backend": 0.0, "longest": {}})  # noqa: E731
    for thread, message in xla_lines(text):
        if (g := re.match(r"Running HLO pass pipeline on module (jit_\S+): ", message)):
            current[thread] = g[1]
        elif (g := re.match(r"HLO pass: (\S+) time: .*?\((\d+) us\)", message)) and thread in current:
            longest = entry(current[thread])["longest"]
            longest[g[1]] = max(longest.get(g[1], 0.0), int(g[2]) / 1e6)
        elif (g := re.match(r"GpuCompiler::(RunHloPasses|RunBackend) for (\S+) time: .*?\((\d+) us\)", message)):
            e = entry(g[2])
            if g[1] == "RunHloPasses":
                e["count"] += 1
            e["passes" if g[1] == "RunHloPasses" else "backend"] += int(g[3]) / 1e6
    return out


def remat_sources(text: str) -> list[tuple[str, str]]:
    """XLA's rematerialisation warnings in a run's output (`PASS_TIMERS` on) → [(where, the warning)]: the module
    its thread last ran a pass pipeline on (a program's `jit_...`, or a piece compiled apart, e.g. a convolution
    autotuner's candidate `cudnn-conv-bias-activation.N`) and, for a piece, the programs whose autotuning
    (`config-assigner`) was under way then."""
    last, tuning, out = {}, {}, []
    for thread, message in xla_lines(text):
        if (g := re.match(r"Running HLO pass pipeline on module (\S+): (\S+)", message)):
            last[thread] = g[1]
            if g[1].startswith("jit_") and g[2] == "config-assigner":
                tuning[thread] = g[1]
        elif message.startswith("HLO pass: config-assigner time:"):
            tuning.pop(thread, None)
        elif REMAT in message:
            where = last.get(thread, f"thread {thread}: no pass pipeline logged")
            if not where.startswith("jit_") and tuning:
                where += f" (autotuning {', '.join(sorted(set(tuning.values())))})"
            out.append((where, re.sub(r" \(\d+ bytes\)", "", message)))
    return out


def print_anatomy(title: str, anatomy: dict, min_seconds: float = 1.0, longest: int = 3) -> None:
    rows = [(module, e["count"], f"{e['passes']:.2f}", f"{e['backend']:.2f}",
             ", ".join(f"{name} {sec:.2f}" for name, sec in sorted(e["longest"].items(), key=lambda kv: -kv[1])[:longest]))
            for module, e in sorted(anatomy.items(), key=lambda kv: -(kv[1]["passes"] + kv[1]["backend"]))
            if e["passes"] + e["backend"] >= min_seconds]
    print(f"\n{title}: XLA's timers per module compiled (≥ {min_seconds} s; passes include autotuning)")
    print(harness.table(("module", "compiles", "HLO passes s", "backend s", "longest passes, s"), rows) if rows
          else "no XLA timers in the output (GPUs only: --pass-times)")


def program_options(specs: list[str]) -> dict:
    """`--program-options` → {program name: {XLA option: value}}: `NAME:OPTION=VALUE[,OPTION=VALUE]`, NAME
    as the timeline shows it (`jit(_sample_loop)` or `_sample_loop`; `*` for every program)."""
    out = {}
    for spec in specs:
        name, _, options = spec.partition(":")
        pairs = [o.partition("=") for o in options.split(",") if o]
        if not name or not pairs or any(not k or not sep for k, sep, _ in pairs):
            raise SystemExit(f"--program-options {spec!r}: expected NAME:OPTION=VALUE[,OPTION=VALUE], e.g. "
                             "_decode_strip:xla_gpu_autotune_level=0")
        name = name if name == "*" or name.startswith("jit(") else f"jit({name})"
        out.setdefault(name, {}).update({k: _option_value(v) for k, _, v in pairs})
    return out


def _option_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def use_program_options(options: dict) -> None:
    """Compile every program named in `options` with its XLA options added, on every path: a jitted call's own
    compile, `jax.stages.Lowered.compile` (programs compiled ahead), the executable cache's. The options go into
    the lowering itself (JAX's `MeshComputation`), as `jax.jit(..., compiler_options=...)` puts them: passed to
    `Lowered.compile` alone they reached only a program compiled ahead, and a plain jitted call of the same
    function compiled its own program without them."""
    from jax._src.interpreters import pxla

    original = pxla.MeshComputation.compile

    def compile_(self, *args, **kw):
        extra = {**options.get("*", {}), **options.get(getattr(self, "_name", ""), {})}
        if extra and not getattr(self, "_profile_options_added", False):
            self._compiler_options_kvs = tuple(self._compiler_options_kvs) + tuple(extra.items())
            self._profile_options_added = True
        return original(self, *args, **kw)

    pxla.MeshComputation.compile = compile_


def child(what: str, argv: list[str]) -> None:
    """Run the family's command line in this process, with every span recorded → a RESULT line, then exit
    as the command line does."""
    import jax

    from wan_tpu.runtime import compile_ahead, profiling
    from wan_tpu.runtime.cli import exit_now
    from wan_tpu.runtime.executable_cache import TIMELINE

    if os.environ.get("PROFILE_DECODE_BESIDE_DENOISE"):
        compile_ahead.WAIT_FOR_DEVICE_AUTOTUNING = False  # Wan: a GPU's decode compiles overlap the denoise
    if os.environ.get("PROFILE_PROGRAM_OPTIONS"):
        import json

        use_program_options(json.loads(os.environ["PROFILE_PROGRAM_OPTIONS"]))
    spans, counts = [], collections.Counter()
    live = os.environ.get("PROFILE_LIVE") == "1"

    def add(span):
        spans.append(span)
        if live:  # the parent reads these back when it kills a run past --timeout
            import json

            # One write (print's two can interleave between threads), on a line of its own (progress lines
            # end in a carriage return).
            sys.__stderr__.write(f"\n{SPAN}{json.dumps(list(span))}\n")
            sys.__stderr__.flush()
    names = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
             "backend_compile_duration": "XLA compile"}

    def on_span(event, start, end, **kw):
        kind = names.get(event.rsplit("/", 1)[1]) if event.startswith("/jax/core/compile/") else (
            event[len(TIMELINE):] if event.startswith(TIMELINE) else None)
        if kind:
            add((start, end, threading.current_thread().name, kind, kw.get("fun_name", "")))

    def on_duration(event, seconds, **kw):
        if event == "/jax/compilation_cache/cache_retrieval_time_sec":
            now = time.time()
            add((now - seconds, now, threading.current_thread().name, "compile-cache read", ""))

    jax.monitoring.register_event_time_span_listener(on_span)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(lambda event, **kw: counts.update([event]))
    stage = profiling.StageTimer.stage

    @contextlib.contextmanager
    def recorded(timer, name):
        start = time.time()
        try:
            with stage(timer, name):
                yield
        finally:
            add((start, time.time(), "MainThread", STAGE, name))

    profiling.StageTimer.stage = recorded
    sys.argv = [FAMILIES[what]["module"], *argv]
    rc = importlib.import_module(FAMILIES[what]["cli"]).main()
    harness.emit_result(dict(rc=rc, spawn=float(os.environ.get("PROFILE_SPAWN", START)), spans=spans,
                             counts={k.rsplit("/", 1)[1]: v for k, v in counts.items() if "cache" in k}))
    exit_now(rc)


def first_result(run: dict, stage_name: str) -> float | None:
    ends = [end for _, end, _, kind, name in run["spans"] if kind == STAGE and name == stage_name]
    return min(ends) - run["spawn"] if ends else None


SLACK = 0.05  # seconds: spans that follow one another end and start within this of each other


def critical_path(run: dict, stage_name: str) -> dict | None:
    """What a run's first result waited for last: the main thread's last wait before the stage `stage_name`
    ended, the program whose compile ended last within that wait, and that program's trace and lowering
    (the latest spans of its name ending before the next step began), with the seconds spent tracing and
    lowering other programs meanwhile (the same process's GIL). None where the main thread waited for nothing.
    Times are seconds from the process's spawn."""
    spans, spawn = run["spans"], run["spawn"]
    ends = [end for _, end, _, kind, name in spans if kind == STAGE and name == stage_name]
    if not ends:
        return None
    waits = [s for s in spans if s[2] == "MainThread" and s[3] == "wait" and s[1] <= min(ends) + SLACK
             and s[1] - s[0] > SLACK]  # a wait for what was done already says nothing
    if not waits:
        return None
    wait = max(waits, key=lambda s: s[1])
    out = dict(wait=(wait[0] - spawn, wait[1] - spawn, wait[4]))

    def latest(kind, name, before, thread=None):
        found = [s for s in spans if s[3] == kind and s[4] == name and s[1] <= before + SLACK
                 and (thread is None or s[2] == thread)]
        return max(found, key=lambda s: s[1]) if found else None

    compiles = [s for s in spans if s[3] == "XLA compile" and s[2] != "MainThread"
                and wait[0] - SLACK <= s[1] <= wait[1] + SLACK]
    if not compiles:
        return out
    compile_ = max(compiles, key=lambda s: s[1])
    name = compile_[4]
    inner = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
    lower = latest("lower", name, compile_[0])
    trace = latest("trace", inner, lower[0] if lower else compile_[0])
    worker = [s for s in spans if s[3] == "compile in a worker" and s[2] == compile_[2]
              and s[0] >= compile_[0] - SLACK and s[1] <= compile_[1] + SLACK]
    rel = lambda s: None if s is None else (s[0] - spawn, s[1] - spawn)  # noqa: E731
    out.update(program=name, compile=rel(compile_), lower=rel(lower), trace=rel(trace),
               worker=worker[0][1] - worker[0][0] if worker else None)
    start = (trace or lower or compile_)[0]
    stop = lower[1] if lower else compile_[0]
    mine = {id(s) for s in (trace, lower) if s is not None}
    out["others_python"] = sum(max(0.0, min(s[1], stop) - max(s[0], start)) for s in spans
                               if s[3] in ("trace", "lower") and id(s) not in mine)
    return out


def print_critical_path(run: dict, stage_name: str) -> None:
    path = critical_path(run, stage_name)
    if path is None:
        print(f"\ncritical path: the main thread waited for nothing before the end of {stage_name!r}")
        return
    start, end, what = path["wait"]
    line = (f"\ncritical path: the main thread's last wait before the end of {stage_name!r}: {what!r}, "
            f"{start:.2f}–{end:.2f} s")
    if "program" not in path:
        print(line + "; no compile ended within it")
        return
    span = lambda s: "within another trace" if s is None else f"{s[0]:.2f}–{s[1]:.2f} s"  # noqa: E731
    c = path["compile"]
    where = f", in a worker process {path['worker']:.2f} s" if path["worker"] is not None else ", in this process"
    print(line + f"; the last compile to end in it: {path['program']}, traced {span(path['trace'])}, lowered "
          f"{span(path['lower'])}, compiled {span(c)} ({c[1] - c[0]:.2f} s{where}); meanwhile other programs were "
          f"traced and lowered for {path['others_python']:.2f} s")


def print_timeline(title: str, run: dict, min_seconds: float) -> None:
    stopped = " (stopped at --timeout: the spans that had ended)" if run.get("timed_out") else ""
    print(f"\n### {title}: {run['wall']:.2f} s whole command{stopped}; persistent-cache events {run['counts']}")
    rows, small = [], collections.defaultdict(lambda: [0, 0.0])
    for start, end, thread, kind, name in sorted(run["spans"]):
        thread = "main" if thread == "MainThread" else thread.removeprefix("wan_tpu-")
        if end - start >= min_seconds or kind == STAGE:
            rows.append((f"{start - run['spawn']:7.2f}", f"{end - run['spawn']:7.2f}", f"{end - start:6.2f}", thread,
                         kind, name))
        else:
            small[(thread, kind)][0] += 1
            small[(thread, kind)][1] += end - start
    print(harness.table(("start s", "end s", "seconds", "thread", "what", "name"), rows))
    totals = collections.defaultdict(lambda: [0, 0.0])
    for start, end, _, kind, _ in run["spans"]:
        totals[kind][0] += 1
        totals[kind][1] += end - start
    print("\nper kind (all spans; threads overlap, so these add up to more than the wall time):")
    print(harness.table(("what", "count", "seconds"), ((k, n, f"{sec:.2f}") for k, (n, sec) in
                                                          sorted(totals.items(), key=lambda kv: -kv[1][1]))))
    if small:
        print(f"\nshorter than {min_seconds} s, summed: " + "; ".join(
            f"{thread} {kind} {n}× {sec:.2f} s" for (thread, kind), (n, sec) in sorted(small.items())))


def cold_start(args) -> None:
    import json
    import statistics
    import tempfile

    harness.print_env()
    extra = {"PROFILE_LIVE": "1"}
    if args.decode_beside_denoise:
        extra["PROFILE_DECODE_BESIDE_DENOISE"] = "1"
    if args.program_options:
        extra["PROFILE_PROGRAM_OPTIONS"] = json.dumps(program_options(args.program_options))
        print(f"program options: {extra['PROFILE_PROGRAM_OPTIONS']}")
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="profile-cold-") as tmp:
        if args.keep:
            os.makedirs(tmp, exist_ok=True)
            for old in glob.glob(os.path.join(tmp, "cache-*")):
                shutil.rmtree(old)  # a cold run's folder must start empty
        write_inputs(tmp, args.what, args.device)
        argv = command(args, tmp, os.path.join(tmp, "out.mp4"))
        print("command: " + " ".join(argv[5:]), flush=True)
        cold, warm_cache = [], os.path.join(tmp, "cache-0")
        run = lambda cache, env=None: run_timed(argv, {"WAN_TPU_CACHE_DIR": cache, **extra, **(env or {})},  # noqa: E731
                                                args.timeout)
        timers = PASS_TIMERS if args.pass_times else {}
        split = None
        for i in range(args.runs):
            cold.append(run(os.path.join(tmp, f"cache-{i}"), timers))
            print(f"cold run {i + 1}: {said(cold[-1])}", flush=True)
            if i == 0 and args.autotune_split:
                tuned = os.path.join(tmp, "cache-tuned")
                if (copied := seed_autotuning(os.path.join(tmp, "cache-0"), tuned)):
                    split = run(tuned, timers)
                    print(f"cold run with its autotuning results loaded ({copied} files): {said(split)}", flush=True)
                else:
                    print("--autotune-split: the first cold run wrote no autotuning results (no GPU, or it did not end)")
        warm = []
        for i in range(args.runs):
            warm.append(run(warm_cache))
            print(f"warm run {i + 1}: {said(warm[-1])}", flush=True)
    first = FAMILIES[args.what]["first"]
    rows = []
    for label, runs in (("cold", cold), ("warm", warm)):
        for key, what in (("wall", "whole command"), ("first_output", "first output line")):
            values = [r["wall"] if r[key] is None else r[key] for r in runs]
            rows.append((label, what, " ".join(seconds(v, r) for v, r in zip(values, runs)),
                         seconds(statistics.median(values), *runs)))
        results = [first_result(r, first) for r in runs]
        if None not in results:
            rows.append((label, f"first result (end of {first!r})", " ".join(f"{v:.2f}" for v in results),
                         f"{statistics.median(results):.2f}"))
    gap = statistics.median(r["wall"] for r in cold) - statistics.median(r["wall"] for r in warm)
    rows.append(("cold − warm", "whole command", "", f"{gap:.2f}"))
    print()
    print(harness.table(("cache", "seconds to", "each run", "median"), rows))
    remat = [line for run in cold + warm for line in run["remat"]]
    print(f"\nXLA rematerialisation warnings: {len(remat)}" + (f"; the first: {remat[0].strip()[:300]}" if remat else ""))
    for module, warning in (source for run in cold + warm for source in run.get("remat_sources", ())):
        print(f"  {module}: {warning}")
    if split is not None:
        print_autotune_split(cold[0], split, first)
    median = lambda runs: sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
    print_timeline("cold (median run)", median(cold), args.min_seconds)
    print_critical_path(median(cold), first)
    print_timeline("warm (median run)", median(warm), args.min_seconds)
    print_critical_path(median(warm), first)
    if args.pass_times:
        print_anatomy("cold (median run)", median(cold)["anatomy"])
        if split is not None:
            print_anatomy("cold, autotuning results loaded", split["anatomy"])
    if split is not None and split["timed_out"]:
        print_timeline("cold, autotuning results loaded", split, args.min_seconds)


def seed_autotuning(source: str, target: str) -> int:
    """A fresh cache folder `target` holding only the autotuning results in cache folder `source` (each version
    folder's per-fusion folder, `wan_tpu.runtime.autotune_packs.FOLDER`), at the same places → how many result
    files were copied."""
    from wan_tpu.runtime.autotune_packs import FOLDER

    shutil.rmtree(target, ignore_errors=True)
    copied = 0
    for folder in glob.glob(os.path.join(source, "*", FOLDER)):
        shutil.copytree(folder, os.path.join(target, os.path.relpath(folder, source)))
        copied += sum(len(files) for _, _, files in os.walk(folder))
    return copied


def xla_seconds(run: dict) -> dict:
    """{program: seconds of XLA compile} of a run, summed over its compiles."""
    out = collections.Counter()
    for start, end, _, kind, name in run["spans"]:
        if kind == "XLA compile":
            out[name] += end - start
    return out


def print_autotune_split(cold: dict, tuned: dict, first: str | None = None, min_seconds: float = 0.5) -> None:
    """Per program, XLA's compile seconds in the first cold run and in the cold run that loaded its autotuning
    results: the difference is that program's autotuning (programs compiled at once share the GPU, so
    their autotuning also slows each other). `first`: the stage whose end is the first result, given for both."""
    a, b = xla_seconds(cold), xla_seconds(tuned)
    rows = [(name, f"{a[name]:.2f}", f"{b.get(name, 0.0):.2f}", f"{a[name] - b.get(name, 0.0):.2f}")
            for name in sorted(a, key=lambda n: -a[n]) if a[name] >= min_seconds]
    rows.append(("all", f"{sum(a.values()):.2f}", f"{sum(b.values()):.2f}", f"{sum(a.values()) - sum(b.values()):.2f}"))
    print(f"\nautotuning: the cold run again with the first's autotuning results loaded: {said(tuned)} whole "
          f"command (cold {said(cold)}); rematerialisation warnings {len(tuned['remat'])} (cold {len(cold['remat'])})")
    results = [None if first is None else first_result(run, first) for run in (tuned, cold)]
    if None not in results:
        print(f"first result (end of {first!r}): {results[0]:.2f} s with the results loaded, {results[1]:.2f} s cold")
    print(harness.table(("program", "XLA compile s, cold", "results loaded", "autotuning s"), rows))


def said(run: dict) -> str:
    if not run["timed_out"]:
        return f"{run['wall']:.2f} s"
    return f"timed out after {run['wall']:.2f} s; its last lines:\n    " + "\n    ".join(run["tail"])


def seconds(value: float, *runs: dict) -> str:
    """`value` in seconds, marked `>` where a run it comes from was stopped at --timeout."""
    return f"{'>' if any(r['timed_out'] for r in runs) else ''}{value:.2f}"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        child(argv[1], argv[3:])
        return
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python benchmarks/profile_compile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("vae", "t5", "startup", *FAMILIES))
    p.add_argument("--cache", default=None, help="vae, t5: persistent compilation cache folder (default: none)")
    p.add_argument("--ahead", action="store_true", help="vae: compile_decode in a thread before the first call")
    p.add_argument("--small", action="store_true", help="vae, t5: tiny sizes (a CPU check of the script itself)")
    p.add_argument("--runs", type=int, default=3, help="families: cold runs and warm runs, each (median)")
    p.add_argument("--device", action="store_true", help="families: real sizes (see the docstring)")
    p.add_argument("--model", default=None, help="--device: the converted folder (UnifoLM, Matrix-Game) or Wan folder")
    p.add_argument("--workdir", default="outputs/bench_e2e",
                   help="--device wan: where the random checkpoint (and LoRA) are written (bench_e2e.py's)")
    p.add_argument("--config", choices=("1.3b", "14b"), default="1.3b",
                   help="--device wan: the model (14b: at 1280*720)")
    p.add_argument("--few-step", action="store_true",
                   help="--device wan: bench_e2e.py's 4-step recipe (Euler, its sigmas and shift, guidance 1)")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="--device wan: a random rank-R kohya LoRA merged (bench_e2e.py's)")
    p.add_argument("--min-seconds", type=float, default=0.1, help="timeline: shorter spans are summed per kind")
    p.add_argument("--autotune-split", action="store_true",
                   help="GPU: one more cold run with the first cold run's autotuning results (see the docstring)")
    p.add_argument("--pass-times", action="store_true",
                   help="GPU: XLA's pass and backend timers in the cold runs, per compiled module")
    p.add_argument("--decode-beside-denoise", action="store_true",
                   help="wan, GPU: the decode's compiles overlap the denoise instead of the first step's waiting "
                        "for them: the other side of that choice")
    p.add_argument("--timeout", type=float, default=None,
                   help="families: seconds a run may take; past it the run is killed and what had ended is shown")
    p.add_argument("--program-options", action="append", default=[], metavar="NAME:OPTION=VALUE[,...]",
                   help="families: XLA options for one program, named as in the timeline (`_sample_loop`, "
                        "`jit(_decode_strip)`, `*` for all), e.g. _decode_strip:xla_gpu_autotune_level=0; repeatable")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="families: the inputs and each run's cache folder in DIR (cache-0: the warm runs'), kept "
                        "after, e.g. to run the warm command again under a profiler; its old cache-* are removed")
    p.add_argument("--child-log", default=None, metavar="FILE",
                   help="families: append every run's own output (XLA's logs among it) to FILE")
    args = p.parse_args(argv)
    args.rest = rest
    if args.child_log:
        os.environ["PROFILE_CHILD_LOG"] = os.path.abspath(args.child_log)
    if args.what in FAMILIES:
        cold_start(args)
        return
    harness.print_env()  # JAX's backend not started here: `startup` times that
    {"vae": vae, "t5": t5, "startup": startup}[args.what](args)
    print(f"{'process wall so far':28} {time.perf_counter() - START:8.2f} s")


if __name__ == "__main__":
    main()
