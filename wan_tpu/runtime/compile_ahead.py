"""Loading and compiling ahead of use: what `prepare()` of each pipeline starts in background threads
(`Warmup`): `WanPipeline.prepare` (below), `MatrixGamePipeline.prepare` (`wan_tpu.matrix_game.compile_ahead`),
`UnifolmPipeline.prepare` (its components, then its stage programs through `executable_cache.ahead`).
Each thread runs in its pipeline's compile-cache choice (`compile_cache.selected(pipe.compile_cache)`).

    pipe = wan_tpu.WanPipeline.from_pretrained("Wan2.1-T2V-1.3B-Diffusers")
    s = pipe.settings(height=480, width=832, num_frames=81)
    with pipe.prepare(s):                             # returns at once
        frames = pipe("a cat walks on the grass", height=480, width=832, num_frames=81)   # waits only where needed

What runs for `WanPipeline`, each in its own thread:
  * every component the run needs is read at the same time (text encoder, transformer(s), VAE, image
    encoder): the weights of one come off the disk while another's are placed on the devices;
  * at once, the text encoder's program is compiled from its config alone (`text_encoder.compile_encode`)
    while its weights are read;
  * at once, the denoise step (`denoise.compile_steps`) for the run's latent and prompt shapes, from
    the DiTs' abstract modules (shapes only: what the loaders fill), read from the executable cache where
    a process stored it before (nothing traced), else compiled and stored, while the weights are read
    and the text encoder encodes. Where the loads make other modules (quantised, streamed from host
    memory, given an attention kernel) or a loaded DiT is not what its config describes (`serves`), the
    step compiles once the DiT is in, through jit, as the call then runs it;
  * at once, from the VAE's abstract module (`abstract_vae`), its decode programs (`WanVAE.compile_decode`)
    and the uint8 conversion, lowered one after the other and compiled side by side (`SideBySide`);
    while the DiT denoises; on a GPU the first step waits for them instead (`WAIT_FOR_DEVICE_AUTOTUNING`: their
    compiles time kernels on the device, `autotunes_on_device`, and beside a running denoise both slow down).
On a device mesh the programs compile once their module is loaded (the weights' placements are the
loader's and go into the programs): the text encoder's; the step, for latents, scheduler state and
conditioning that `denoise` lays out whole on every device before the first step (so every step runs one
program); the decode one program after the other (each program's output placements, which XLA's
partitioner picks, are the next one's inputs). On GPUs the calls then wait for every compile: a program of
collectives first run beside on-device autotuning fails to set up its communicators. Otherwise
`component()`, `denoise()` and `decode()` of the pipeline (and `encode_prompt`) wait for the piece they need and
for nothing else. A compile that fails is reported as a warning and the call compiles as it always did. Leaving the
`with` block (or `close()`) cancels what has not started and waits for what runs, so that no thread
outlives it (an error or Ctrl-C then costs at most the loads and compiles under way). Compiling
ahead of time runs the very programs the calls would compile (same functions, same arguments' shapes
and placements), so results are bit-identical with and without `prepare`.

Memory: reading everything at once holds the text encoder's and the transformer's weights together
while the prompt is encoded (the text encoder is still released before the first denoising step, so
the denoising peak, the run's largest, is unchanged: DiT weights + activations, plus the VAE's
weights, 0.5 GB for Wan 2.1). Where the devices report their memory and all weights do not fit in
90% of what is free, only the text encoder and the VAE are read ahead and the transformer loads after
the text encoder is released, as without `prepare`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import threading
import warnings
import weakref

import jax


@functools.cache
def start_transfers() -> threading.Thread:
    """Make this process's first host→device transfer now, in a background thread, once (→ that thread).
    The first transfer sets up the runtime's transfer path: 1.1 s on an H100 host (a 4-byte `device_put`;
    the next 64 MB took 0.04 s), which the first weights to load would otherwise wait for while the other
    loads, already read from disk, queue behind it. Started beside the loads' abstract builds and header
    reads, it is off their path (the Matrix-Game DiT's warm load: 2.1 s → 0.9 s with it done beforehand). A
    command line starts it as soon as its arguments are parsed (`wan_tpu.runtime.cli.run_cli`), so that the
    accelerator's client also starts (seconds on a GPU host) while the family's modules are imported."""
    import numpy as np

    def first_transfer():
        try:
            jax.device_put(np.zeros(1, np.float32)).block_until_ready()
        except Exception:  # noqa: BLE001 - a warm-up only: the loads report a real device failure themselves
            pass

    thread = threading.Thread(target=first_transfer, name="wan_tpu-first-transfer", daemon=True)
    thread.start()
    return thread


@functools.cache
def start_imports(*modules: str) -> threading.Thread:
    """Import `modules` now, in a background thread, once (→ that thread): for modules that only a cold start's
    tracing imports, which otherwise pay their file reads beside the weights' loads (a cold Wan 1.3B command on
    an H200: 3.8 s of its denoise step's trace importing Mosaic GPU, py-spy). Started before the loads, while
    the accelerator's client starts; an import that fails is left for the tracing to report."""
    import importlib

    def run():
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a head start only
                pass

    thread = threading.Thread(target=run, name="wan_tpu-imports", daemon=True)
    thread.start()
    return thread


@functools.cache
def start_libraries() -> concurrent.futures.Future:
    """On NVIDIA GPUs, start cuDNN and cuBLAS now, in a background thread, once per process (→ its future): a
    tiny convolution and matrix products compiled and run. A warm start runs stored programs, which compiled
    nothing in the process: their first convolution or product would otherwise load and set up these
    libraries after the weights' loads, on the first result's path (UnifoLM's first condition encode on an
    H200, warm: 1.29–1.53 s, 0.88 s with them started before; then 0.35–0.65 s). Not a daemon thread: one
    killed inside XLA's compiler at exit aborts the process."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            if jax.devices()[0].platform == "gpu":
                import jax.numpy as jnp

                def tiny(x, k, a, b):
                    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME"), a @ a, b @ b

                jax.block_until_ready(jax.jit(tiny)(jnp.ones((1, 8, 16, 16)), jnp.ones((8, 8, 3, 3)), jnp.ones((64, 64)),
                                                    jnp.ones((64, 64), jnp.bfloat16)))
        except Exception:  # noqa: BLE001 - a warm-up only: the programs report a real device failure themselves
            pass
        future.set_result(None)

    threading.Thread(target=run, name="wan_tpu-libraries").start()
    return future


class Warmup:
    """Background loads (`loads[name]`) and compiles (`compiles[name]`: "text", "denoise", "decode" for
    `WanPipeline`; "stages" for `UnifolmPipeline`; see `wan_tpu.matrix_game.compile_ahead` for
    `MatrixGamePipeline`) for one run.

    `compile_cache`: the pipeline's choice, which every thread runs in (`compile_cache.selected`; None:
    the process's state as it is). `cancel()` (called by itself when the interpreter exits, e.g. after an
    error or Ctrl-C) lets the threads stop at the next program boundary: the process then waits for the
    compiles under way (one per thread, a few side by side: `SideBySide`), not for all of them.
    """

    def __init__(self, compile_cache: bool | None = None):
        self.compile_cache = compile_cache
        self.loads: dict[str, concurrent.futures.Future] = {}
        self.compiles: dict[str, concurrent.futures.Future] = {}
        # Set where no call may run beside a compile: `wait_compiled` then waits for every one (on GPUs a
        # program of collectives first run beside on-device autotuning fails to set up its communicators).
        self.exclusive = False
        self.cancelled = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        _live.add(self)
        self.first_transfer = start_transfers()  # join it before a CUDA-graph capture (Matrix-Game's first chunk)
        # CUDA work in threads of their own, which `wait_compiled` waits for: the libraries' start, `prefetch`.
        self.background: list[concurrent.futures.Future] = [start_libraries()]
        from wan_tpu.runtime.executable_cache import source_hash

        source_hash()  # before the threads that all need it start (its docstring says why)

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        """Cancel what has not started and wait for what runs (the loads and compiles under way)."""
        self.cancel()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> Warmup:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from wan_tpu.runtime import interrupt

        if exc_type is not None and issubclass(exc_type, interrupt.Interrupted) and interrupt.process_ends_at_once():
            # A command line stopped by Ctrl-C / SIGTERM ends through `os._exit`, which ends these threads
            # too (no interpreter teardown, so no thread is killed inside XLA): waiting for a compile in
            # flight would only delay the exit by its length.
            self.cancel()
            return
        self.close()

    def start(self, name: str, fn, *args, kind: str = "load", select: bool = True) -> concurrent.futures.Future:
        """Run `fn(*args)` in a new thread, in the pipeline's compile-cache choice (`select=False`: `fn`
        selects it itself, e.g. to wait outside it); its future goes under `kind` ("load" or "compile").

        Not a daemon thread: the interpreter waits for it at exit, since a thread killed inside XLA's
        compiler aborts the process ("exception not rethrown")."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def target():
            if not future.set_running_or_notify_cancel():
                return
            if self.cancelled.is_set():
                future.set_exception(Cancelled())
                return
            from wan_tpu.runtime.executable_cache import span

            try:
                with self.selected() if select else contextlib.nullcontext(), span(kind, name):
                    result = fn(*args)
                future.set_result(result)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)

        (self.loads if kind == "load" else self.compiles)[name] = future
        thread = threading.Thread(target=target, name=f"wan_tpu-{kind}-{name}")
        self._threads.append(thread)
        thread.start()
        return future

    def selected(self):
        """A context in the pipeline's compile-cache choice (`compile_cache.selected`), or none without one."""
        from wan_tpu.runtime import compile_cache

        return compile_cache.selected(self.compile_cache)

    def take_load(self, name: str):
        """The loaded component `name` (waiting for it; its error, if loading failed), or None if it is not
        being loaded. Taken once: the pipeline holds it from then on."""
        from wan_tpu.runtime.executable_cache import span

        with self._lock:
            future = self.loads.pop(name, None)
        if future is not None:
            with span("wait", name):
                future.exception()
        if future is None or isinstance(future.exception(), Cancelled):
            return None  # the caller loads it itself
        return future.result()

    def as_loaded(self, names, loaded=()):
        """`names`, yielded as their components become ready: those already `loaded` or not being loaded
        first, then the others as their loads finish (whatever their outcome: `take_load` raises it)."""
        with self._lock:
            futures = {self.loads[n]: n for n in names if n in self.loads and n not in loaded}
        yield from (n for n in names if n not in futures.values())
        for future in concurrent.futures.as_completed(futures):
            yield futures[future]

    def prefetch(self, group: str, key) -> bool:
        """Start loading the programs the last run of (`group`, `key`) used (`executable_cache.prefetch`), now,
        beside the loads: a warm start's largest program deserialises from the start instead of once the
        compile thread has traced its way to it. `wait_compiled` waits for these loads too: a program's first
        run must not overlap other CUDA work (`MatrixGamePipeline._wait_compiled` says why). → whether there
        were programs to load (a warm start)."""
        from wan_tpu.runtime import executable_cache

        with self.selected():
            future = executable_cache.prefetch(group, key)
        if future is not None:
            self.background.append(future)
        return future is not None

    def wait_compiled(self, name: str) -> None:
        """Wait for the compile `name` if one was started (for all of them where `exclusive`), for the
        programs `prefetch` loads and for `start_libraries`; a failure becomes a warning (the call compiles)."""
        from wan_tpu.runtime.executable_cache import span

        while self.background:
            with span("wait", "background"):
                self.background.pop().result()
        for one in list(self.compiles) if self.exclusive else [name]:
            future = self.compiles.pop(one, None)
            if future is None:
                continue
            try:
                with span("wait", one):
                    future.result()
            except Cancelled:
                pass
            except Exception as e:  # noqa: BLE001 - compiling ahead is an optimisation only
                warnings.warn(f"compiling {one} ahead of time failed ({type(e).__name__}: {e}); it compiles on use",
                              stacklevel=3)


class Cancelled(Exception):
    """Raised in a warmup thread that stops early (`Warmup.cancel`)."""


class SideBySide:
    """Lowered programs compiled side by side, each in a thread of its own (this thread's name + `-N`), for a
    walk that lowers one program after another, each lowering's `out_info` feeding the next: lowering is
    cheap, XLA's compile releases the GIL, and one compile need not wait for the previous one (the Wan
    VAE's decode at 480p: two strip programs of 4.5 s each on an idle H200 and a stem of 1.8 s). At
    most half the process's cores compile at once: the other threads' compiles and loads keep the rest (the
    denoise step's, which the first step waits for, must not queue behind a dozen decode compiles on a
    small CPU). A program lowered twice (JAX's lowering cache hands back the one computation)
    compiles once. Each compile fills JAX's in-process caches as a call's would, so a later call with
    arguments of the same shapes and placements runs that program. `stop` (a `threading.Event`): once set,
    `add` raises `Cancelled`, and the compiles not yet begun are skipped.

        with SideBySide(stop) as compiles:     # leaving waits for every compile, then raises the first failure
            out = fn.lower(*args); compiles.add(out); out = out.out_info ...
    """

    def __init__(self, stop: threading.Event | None = None):
        self.stop = stop
        self._threads: dict[int, tuple[threading.Thread, object]] = {}
        self._errors: list[BaseException] = []
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._slots = threading.Semaphore(max(1, cores // 2))

    def add(self, lowered) -> None:
        """Start compiling `lowered` (a `jax.stages.Lowered`) unless the same program is under way."""
        if self.stop is not None and self.stop.is_set():
            raise Cancelled()
        computation = getattr(lowered, "_lowering", lowered)
        if id(computation) in self._threads:
            return

        def compile_():
            with self._slots:
                if self.stop is not None and self.stop.is_set():
                    self._errors.append(Cancelled())
                    return
                try:
                    lowered.compile()
                except BaseException as e:  # noqa: BLE001 - raised by the thread that waits for them all
                    self._errors.append(e)

        thread = threading.Thread(target=compile_, name=f"{threading.current_thread().name}-{len(self._threads) + 1}")
        self._threads[id(computation)] = (thread, computation)  # the computation kept alive: its id stays its own
        thread.start()

    def __enter__(self) -> SideBySide:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for thread, _ in self._threads.values():  # also after an error: no compile outlives the block
            thread.join()
        if exc_type is None and self._errors:
            raise self._errors[0]


# Whether the first denoise step waits for the decode's compiles where those time kernels on the device. On: on an
# H200 (Wan 2.1 1.3B, 480p, 50 steps, `benchmarks/profile_compile.py wan --device`, with and without
# `--decode-beside-denoise`) cold commands took 65.2, 68.4 and 72.4 s waiting (the strips compiled in 10-18 s, the
# first step waited 2.3-5.3 s for them) and 71.3 and 74.4 s beside the denoise (the strips compiled in 58-63 s on the
# busy device, slowed the denoise by 6-9 s and ended 3-4 s after it); warm 56.3-58.4 s either way.
WAIT_FOR_DEVICE_AUTOTUNING = True


def autotunes_on_device() -> bool:
    """Whether XLA's compiles here time candidate kernels on the device (NVIDIA GPUs: its autotuner). Such a
    compile beside a running program is slowed by it and slows it: on an H200 the Wan VAE decode's first
    strip program took 48 s to compile beside a 1.3B denoise, its second 4.5 s on the idle device, and the
    denoise took 9% longer. TPU and CPU compiles leave the device alone."""
    return jax.devices()[0].platform == "gpu"


def abstract(tree):
    """Shapes, dtypes and placements of `tree`'s arrays (concrete or abstract): what a program is compiled
    for. Arrays put on the default device without naming one (uncommitted) get no placement, as jit sees
    them: a call moves them to its other arguments' devices."""
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
        return x

    return jax.tree.map(one, tree)


def serves(module, abstract) -> bool:
    """Whether programs traced for `abstract` (a module without weights, `nnx.eval_shape`) serve calls with
    `module`'s weights, so a compile from the abstract one (before the weights exist) is the program the
    calls run: equal graphdefs (the same static argument to `jax.jit`), each weight of the abstract one's
    shape and dtype, and placed on the default device without being committed to it (JAX lowers a
    committed argument's placement into the program; an abstract one has none)."""
    from flax import nnx

    graphdef, state = nnx.split(module)
    abstract_graphdef, abstract_state = nnx.split(abstract)
    if graphdef != abstract_graphdef:
        return False
    leaves, tree = jax.tree.flatten(state)
    abstract_leaves, abstract_tree = jax.tree.flatten(abstract_state)
    return tree == abstract_tree and all(
        isinstance(x, jax.Array) and not x.committed and getattr(a, "sharding", None) is None
        and (x.shape, x.dtype) == (a.shape, a.dtype) for x, a in zip(leaves, abstract_leaves))


_live: weakref.WeakSet = weakref.WeakSet()


def _cancel_all() -> None:
    for warmup in list(_live):
        warmup.cancel()


# Runs before the interpreter joins its threads at exit (public `atexit` handlers run after): what
# concurrent.futures uses for the same purpose.
getattr(threading, "_register_atexit", lambda fn: None)(_cancel_all)
