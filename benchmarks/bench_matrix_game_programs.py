"""Matrix-Game-2's chunk as one program for every chunk against the two it replaces (the first chunk's, the
later chunks'): XLA compile seconds, a later chunk's time, and whether the outputs agree bit for bit.

    python benchmarks/bench_matrix_game_programs.py                          # CPU: matrix-game-tiny, a minute
    python benchmarks/bench_matrix_game_programs.py --model DIR/converted    # a device: the universal model

(`bench_matrix_game.py --workdir DIR` writes DIR/converted: the real sizes, random weights.) The two parts
of the chunk program, each lowered and compiled here one after the other (no compile cache), in the form
the pipeline runs ("one program": the chunk index traced) and in the two it replaces:
  * DiT: `denoise_chunk` (every denoising step and the cache pass), `first_chunk=None` against True and False
    (the window's size at each attention call chosen inside, against fixed);
  * VAE: `WanVAE.decode_chunk` of a chunk's latent frames, `start=` against caches None and carried (the
    first latent frame's path chosen inside, against traced apart).
"later chunk ms": chunk 1 (a later chunk: the window full for the distilled variants) run again and again,
caches carried and donated, the forms timed in turns, median of `--iters` each: what the choices inside
the one program cost every chunk (on a GPU each conditional waits for the host: XLA's conditional reads
its branch index back). "bitwise": chunks 0 and 1 of one stream, both forms.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_matrix_game_programs.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="matrix-game-tiny", help="a converted folder, or matrix-game-tiny (default)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the DiT's (default bfloat16)")
    p.add_argument("--iters", type=int, default=10, help="timed later chunks per form (median)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from wan_tpu.matrix_game.action_module import chunk_action_window
    from wan_tpu.matrix_game.actions import random_actions
    from wan_tpu.matrix_game.pipeline import MatrixGamePipeline
    from wan_tpu.matrix_game.programs import cache_program
    from wan_tpu.matrix_game.sampling import denoise_chunk
    from wan_tpu.runtime import compile_cache

    harness.print_env(jax.devices())
    pipe = MatrixGamePipeline.from_pretrained(args.model, dtype=getattr(jnp, args.dtype), compile_cache=False)
    dit, vae = pipe.split("transformer"), pipe.split("vae")
    model, decoder = pipe.transformer, pipe.vae
    f, (h, w) = pipe.frames_per_chunk, pipe.variant.latent_size
    clip = pipe.configs["image_encoder"]
    rng = np.random.default_rng(0)
    visual = jnp.asarray(rng.standard_normal((1, (clip.image_size // clip.patch_size) ** 2 + 1, model.config.image_dim)),
                         model.dtype)
    keyboard, mouse = random_actions(pipe.action_space, pipe.chunk_frames(0) + pipe.chunk_frames(1), seed=0)

    def chunk_inputs(k):
        windows = [None if a is None else jnp.asarray(chunk_action_window(a, k, f)[None]) for a in (keyboard, mouse)]
        return (jnp.asarray(rng.standard_normal((1, 16, f, h, w)), jnp.float32),
                jnp.asarray(rng.standard_normal((1, model.config.in_dim - 16, f, h, w)), jnp.float32),
                *windows, jnp.int32(k), jax.random.key(k))

    inputs = [chunk_inputs(0), chunk_inputs(1)]
    latents = [jnp.asarray(rng.standard_normal((1, decoder.config.z_dim, f, h, w)), decoder.dtype) for _ in range(2)]

    def fresh():
        """A stream's empty caches (DiT, VAE), as the pipeline makes them."""
        return cache_program(*dit, *vae, visual, (h, w), f)

    def compiled(fn, *example):
        lowered = fn.lower(*example)
        out, seconds = harness.timed(lowered.compile)
        return out, seconds

    def alternated(calls):
        """Median ms of each call, timed in turns (one sample of each, `--iters` times), after 2 warm-ups:
        a machine's load then weighs on every form alike."""
        for call in calls:
            harness.measure(call, jax.block_until_ready, iters=0, warmup=2)
        samples = [[] for _ in calls]
        for _ in range(args.iters):
            for call, times in zip(calls, samples):
                times.append(harness.measure(call, jax.block_until_ready, iters=1, warmup=0).times[0])
        return [1e3 * statistics.median(times) for times in samples]

    rows, equal = [], {}
    with compile_cache.selected(False):
        # DiT: (x0, cache) = program(state, cache, noise, cond, keyboard, mouse, chunk_index, key)
        def dit_program(first):
            return jax.jit(functools.partial(denoise_chunk, dit[0], schedule=pipe.schedule, first_chunk=first),
                           donate_argnums=1)

        cache = fresh()[0]
        first, s_first = compiled(dit_program(True), dit[1], cache, *inputs[0])
        later, s_later = compiled(dit_program(False), dit[1], cache, *inputs[1])
        one, s_one = compiled(dit_program(None), dit[1], cache, *inputs[0])
        x_two, cache = first(dit[1], cache, *inputs[0])
        x_two = [x_two, *later(dit[1], cache, *inputs[1])[:1]]
        cache = fresh()[0]
        x_one, cache = one(dit[1], cache, *inputs[0])
        x_one = [x_one, *one(dit[1], cache, *inputs[1])[:1]]
        equal["DiT x0"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(x_two, x_one))
        calls = []
        for program in (later, one):
            state = {"cache": fresh()[0]}

            def call(program=program, state=state):
                x0, state["cache"] = program(dit[1], state["cache"], *inputs[1])
                return x0

            calls.append(call)
        ms = alternated(calls)
        rows += [("DiT chunk", "first + later programs", f"{s_first + s_later:.2f}", f"{ms[0]:.1f}"),
                 ("DiT chunk", "one program", f"{s_one:.2f}", f"{ms[1]:.1f}")]

        # VAE: (video, caches) = decode_chunk(z, caches[, start])
        def decode(state, z, caches=None, start=None):
            return nnx.merge(vae[0], state).decode_chunk(z, caches, start)

        caches = fresh()[1]
        opening, s_first = compiled(jax.jit(decode), vae[1], latents[0])
        later, s_later = compiled(jax.jit(decode, donate_argnums=2), vae[1], latents[1], caches)
        one, s_one = compiled(jax.jit(decode, donate_argnums=2), vae[1], latents[0], caches, jnp.asarray(True))
        v0, caches = opening(vae[1], latents[0])
        v_two = [v0, later(vae[1], latents[1], caches)[0]]
        caches = fresh()[1]
        v0, caches = one(vae[1], latents[0], caches, jnp.asarray(True))
        v_one = [v0[:, :, 3:], one(vae[1], latents[1], caches, jnp.asarray(False))[0]]
        equal["VAE frames"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(v_two, v_one))
        calls = []
        for program, extra in ((later, ()), (one, (jnp.asarray(False),))):
            state = {"caches": fresh()[1]}

            def call(program=program, state=state, extra=extra):
                video, state["caches"] = program(vae[1], latents[1], state["caches"], *extra)
                return video

            calls.append(call)
        ms = alternated(calls)
        rows += [("VAE decode", "first + later programs", f"{s_first + s_later:.2f}", f"{ms[0]:.1f}"),
                 ("VAE decode", "one program", f"{s_one:.2f}", f"{ms[1]:.1f}")]

    print(f"model {args.model} ({pipe.variant.name}), DiT {args.dtype}, VAE {jnp.dtype(pipe.vae_dtype).name}; "
          f"chunks of {f} latent frames at {h}×{w}, window {model.config.window_frames}")
    print(harness.table(("part", "form", "XLA compile s", "later chunk ms"), rows))
    print("bitwise, chunks 0 and 1 of one stream: " + "; ".join(f"{k} {'equal' if v else 'DIFFERENT'}"
                                                                for k, v in equal.items()))


if __name__ == "__main__":
    main()
