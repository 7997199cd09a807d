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
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/profile_compile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("vae", "t5", "startup"))
    p.add_argument("--cache", default=None, help="persistent compilation cache folder (default: none)")
    p.add_argument("--ahead", action="store_true", help="vae: compile_decode in a thread before the first call")
    p.add_argument("--small", action="store_true", help="tiny sizes (a CPU check of the script itself)")
    args = p.parse_args(argv)
    harness.print_env()  # JAX's backend not started here: `startup` times that
    {"vae": vae, "t5": t5, "startup": startup}[args.what](args)
    print(f"{'process wall so far':28} {time.perf_counter() - START:8.2f} s")


if __name__ == "__main__":
    main()
