"""UnifoLM's sampling program compiled alone, on abstract weights, with nothing else compiling or loading:
XLA's compile seconds, its pass and backend timers (GPUs), and the sampling's seconds on weights of a
constant 0.01 (a rate, not a result), for variants of the UNet's graph.

    python benchmarks/bench_unifolm_compile.py                                   # GPU: real size, 16 steps
    python benchmarks/bench_unifolm_compile.py --variants base,barrier,scan,barrier+scan
    python benchmarks/bench_unifolm_compile.py --variants base,split:3,split:4    # the step as 3 or 4 programs
    python benchmarks/bench_unifolm_compile.py --config unifolm-tiny --steps 2   # CPU check of the script

Variants (`base` and `split:K` ship, the others were measured and left out: docs/TRIED.md):
  * `base`: the shipped UNet;
  * `taps`: the temporal (3, 1) convolutions and the heads' stride-1 1-D ones as one matrix product over
    (taps × input channels) of the padded input's shifted views, instead of convolutions (cuDNN on GPUs);
  * `barrier`: GroupNorm's and LayerNorm's statistics behind an optimization barrier on GPUs
    (`own_pass_on_gpu`), so XLA's Triton normalization rewriter meets no reduction diamond;
  * `scan`: a ResBlock's four temporal convolutions (GroupNorm, SiLU, conv) in a `lax.scan` over their
    stacked weights (one copy of them to compile);
  * `split:K`: one step as K programs (`sample(..., programs=K)`, `--sampling-programs K` of the command
    lines: the UNet's blocks cut into K runs whose largest is the least it can be (`cut_units`); the first also takes the step's
    inputs, the last also runs the heads and the DDIM update), compiled side by side as `prepare` compiles them
    (`executable_cache.ahead`) and run as a command runs them (the programs found once, then called at every
    step); XLA compiles one module per thread, so the table gives the largest program's XLA seconds, then the
    others'.

Each variant runs in a fresh process (`XLA's timers`: `profile_compile.PASS_TIMERS`), as a whole command's
compile would, but alone on the machine: beside a command's loads and other compiles the same passes take
longer (`profile_compile.py unifolm --device --pass-times`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, profile_compile.py, beside this script
import harness  # noqa: E402

VARIANTS = ("base", "taps", "barrier", "scan", "barrier+scan", "split:K")


def apply(variant: str) -> None:
    """Patch the UNet's building blocks for `variant` (this process only)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.layers import norms
    from wan_tpu.layers.fusion import own_pass_on_gpu
    from wan_tpu.unifolm import blocks, heads

    parts = set(variant.split("+"))
    if split_count(variant) is not None:
        return
    if not parts <= {"base", *VARIANTS}:
        raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if "barrier" in parts:
        def group_norm(self, x):
            shape = x.shape
            g = x.astype(jnp.float32).reshape(shape[0], -1, self.num_groups, shape[-1] // self.num_groups)
            mean = own_pass_on_gpu(jnp.mean(g, axis=(1, 3), keepdims=True))
            var = own_pass_on_gpu(jnp.mean(jnp.square(g - mean), axis=(1, 3), keepdims=True))
            y = ((g - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
            return (y * self.weight[...] + self.bias[...]).astype(x.dtype)

        def layer_norm(x, eps, weight=None, bias=None):
            x = x.astype(jnp.float32)
            centered = x - own_pass_on_gpu(jnp.mean(x, axis=-1, keepdims=True))
            y = centered * jax.lax.rsqrt(own_pass_on_gpu(jnp.mean(jnp.square(centered), axis=-1, keepdims=True)) + eps)
            y = y if weight is None else y * weight.astype(jnp.float32)
            return y if bias is None else y + bias.astype(jnp.float32)

        norms.GroupNorm.__call__ = group_norm
        norms.layer_norm = layer_norm
    if "taps" in parts:
        import itertools

        from wan_tpu.layers.conv import Conv

        conv_call = Conv.__call__

        def taps_matmul(self, x):
            kernel = self.kernel[...]
            taps = kernel.shape[1:-1] if self.out_first else kernel.shape[:-2]
            if any(s != 1 for s in self.strides) or (len(taps) > 1 and taps != (3, 1)):
                return conv_call(self, x)  # the heads' stride-2 downsampling, their keypoints' 1×1 convolutions
            xp = jnp.pad(x.astype(self.dtype), ((0, 0), *self.padding, (0, 0)))
            out = [n - k + 1 for n, k in zip(xp.shape[1:-1], taps)]
            views = [xp[(slice(None), *(slice(i, i + o) for i, o in zip(at, out)), slice(None))]
                     for at in itertools.product(*(range(k) for k in taps))]  # the kernel's own (row-major) tap order
            stacked = jnp.stack(views, axis=-2)  # (N, *out, taps, in)
            if self.out_first:
                y = jnp.einsum("...tc,otc->...o", stacked, kernel.reshape(kernel.shape[0], -1, kernel.shape[-1]))
            else:
                y = jnp.einsum("...tc,tco->...o", stacked, kernel.reshape(-1, *kernel.shape[-2:]))
            return y if self.bias is None else y + self.bias[...]

        for module in (blocks.TemporalConvBlock, heads.ConditionalUnet1D):
            module.__call__ = _with_conv(module.__call__, taps_matmul)
    if "scan" in parts:
        def temporal_conv(self, x):
            b, t, hh, ww, c = x.shape
            norm_def, conv_def = nnx.graphdef(self.norm1), nnx.graphdef(self.conv1)
            stacked = lambda prefix: jax.tree.map(  # noqa: E731
                lambda *a: jnp.stack(a), *[nnx.state(getattr(self, f"{prefix}{i}")) for i in range(1, 5)])

            def layer(h, weights):
                norm, conv = nnx.merge(norm_def, weights[0]), nnx.merge(conv_def, weights[1])
                return conv(jax.nn.silu(norm(h)).reshape(b, t, hh * ww, c)).reshape(b, t, hh, ww, c), None

            return x + jax.lax.scan(layer, x, (stacked("norm"), stacked("conv")))[0]

        blocks.TemporalConvBlock.__call__ = temporal_conv


def _with_conv(call, conv_call):
    """`call` with every `Conv` it runs (its own and its children's) computed by `conv_call` instead."""
    from wan_tpu.layers.conv import Conv

    def wrapped(self, *args):
        original = Conv.__call__
        Conv.__call__ = conv_call
        try:
            return call(self, *args)
        finally:
            Conv.__call__ = original

    return wrapped


def split_count(variant: str) -> int | None:
    """K of a `split:K` variant (None for the others)."""
    if not variant.startswith("split:"):
        return None
    k = variant.partition(":")[2]
    if not k.isdigit() or int(k) < 2:
        raise SystemExit(f"variant {variant!r}: K must be an integer ≥ 2 (split:3)")
    return int(k)


def split_sampling(ugraph, ustate, cond, tables, key, shapes, clip: bool, k: int, compile_only: bool = False):
    """The sampling (guidance off, eta 1) as `split:K`'s programs, through the shipped path: `_sample_programs`
    with a program key (`tables`: `schedule_tables`' numpy arrays). `compile_only`: traced by `jax.eval_shape`
    under `executable_cache.ahead`, which compiles the programs side by side, a thread each, as `prepare` does,
    running nothing → (trace and lower seconds, then the compiles' seconds); else → (x, action, state), run by
    the programs compiled ahead, each called as a command calls it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.runtime import executable_cache
    from wan_tpu.unifolm import sampling

    runs = sampling.cut_units(nnx.merge(ugraph, ustate), k)
    one, zero = jnp.float32(1), jnp.float32(0)

    def call(u, c, key_):
        return sampling._sample_programs(ugraph, u, c, None, tables, key_, {}, one, zero, clip, shapes, True, runs,
                                         ("bench_unifolm_compile", k))

    if not compile_only:
        return call(ustate, cond, key)
    start = time.perf_counter()
    with executable_cache.ahead():
        jax.eval_shape(call, ustate, cond, key)
        lowered_at = time.perf_counter()
    return lowered_at - start, time.perf_counter() - lowered_at


def child(variant: str, config: str, steps: int, runs: int) -> None:
    from wan_tpu.runtime.xla_defaults import apply_xla_defaults

    apply_xla_defaults()  # as the command line compiles (XLA's Triton GEMM search off); a flag in XLA_FLAGS wins
    import jax
    import jax.numpy as jnp
    from flax import nnx

    apply(variant)
    from wan_tpu.configs.unifolm import CONFIGS
    from wan_tpu.unifolm.model import _prepare_jit, abstract_unifolm
    from wan_tpu.unifolm.sampling import _sample_loop, schedule_tables

    cfg = CONFIGS[config]
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = abstract_unifolm(cfg, dtype)
    h, w = cfg.latent_size
    t, n_obs = cfg.unet.temporal_length, cfg.unet.n_obs_steps
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    text = f32(1, cfg.unet.text_context_len, cfg.unet.context_dim)
    clip = f32(1, 257, cfg.resampler.embedding_dim)
    images, states = f32(1, 3, n_obs, h * 8, w * 8), f32(1, n_obs, cfg.agent_state_dim)
    graphdef, state = nnx.split(model)
    cond = jax.eval_shape(lambda s: _prepare_jit(graphdef, s, text, clip, f32(1, 4, h, w), images, states, None,
                                                 jax.ShapeDtypeStruct((1,), jnp.int32), keep_action_tokens=True), state)
    ugraph, ustate = nnx.split(model.diffusion_model)
    tables = {k: jnp.asarray(v) for k, v in schedule_tables(cfg, steps, 1.0).items()}
    horizon = cfg.head.horizon if cfg.head else t
    shapes = ((1, cfg.unet.out_channels, t, h, w), (1, horizon, cfg.agent_action_dim), (1, horizon, cfg.agent_state_dim))
    statics = (cfg.head_clip_sample, shapes, True)
    k = split_count(variant)
    if k is not None:
        host_tables = schedule_tables(cfg, steps, 1.0)
        lower, compile_ = split_sampling(ugraph, ustate, cond, host_tables, jax.random.key(0), shapes,
                                         cfg.head_clip_sample, k, compile_only=True)
        sample = lambda u, c: split_sampling(ugraph, u, c, host_tables, jax.random.key(0), shapes,  # noqa: E731
                                             cfg.head_clip_sample, k)
    else:
        start = time.perf_counter()
        lowered = _sample_loop.lower(ugraph, ustate, cond, None, tables, jax.random.key(0), {}, jnp.float32(1),
                                     jnp.float32(0), *statics)
        lowered_at = time.perf_counter()
        lowered.compile()
        lower, compile_ = lowered_at - start, time.perf_counter() - lowered_at
        sample = lambda u, c: _sample_loop(ugraph, u, c, None, tables, jax.random.key(0), {},  # noqa: E731
                                           jnp.float32(1), jnp.float32(0), *statics)
    const = lambda tree: jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), tree)  # noqa: E731
    ustate, cond = const(ustate), const(cond)
    seconds = []
    for _ in range(runs):  # through the jitted functions: the programs compiled above, from their cache
        begin = time.perf_counter()
        jax.block_until_ready(sample(ustate, cond))
        seconds.append(time.perf_counter() - begin)
    harness.emit_result(dict(variant=variant, lower=lower, compile=compile_, runs=seconds))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    import profile_compile

    p = argparse.ArgumentParser(prog="python benchmarks/bench_unifolm_compile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="base", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--config", default="unifolm-wma-0")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--runs", type=int, default=3, help="samplings timed after the compile (the first warms up)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a variant's process may take")
    args = p.parse_args(argv)
    harness.print_env()
    rows = []
    for variant in args.variants.split(","):
        proc = harness.run_fresh([sys.executable, os.path.abspath(__file__), "--child", variant, args.config,
                                  str(args.steps), str(args.runs)], env=profile_compile.PASS_TIMERS, timeout=args.timeout)
        results = proc.results()
        if proc.rc or not results:
            raise SystemExit(f"variant {variant} failed (exit status {proc.rc}):\n{proc.output[-3000:]}")
        r = results[-1]
        anatomy = profile_compile.compile_anatomy(proc.output)
        # split:K: its largest program's (the compiles run side by side), with the others' after it.
        programs = ("_sample_loop", "_noise_program", "_first_program", "_middle_program", "_last_program",
                    "_last_video_program", "_head_program")
        modules = sorted((m for m in anatomy if m.startswith(tuple(f"jit_{p}" for p in programs))),
                         key=lambda m: -(anatomy[m]["passes"] + anatomy[m]["backend"]))
        xla = anatomy[modules[0]] if modules else {}
        others = "".join(f" + {anatomy[m]['passes'] + anatomy[m]['backend']:.1f}" for m in modules[1:])
        longest = sorted(xla.get("longest", {}).items(), key=lambda kv: -kv[1])[:2]
        rows.append((variant, f"{r['lower']:.2f}", f"{r['compile']:.2f}",
                     f"{xla['passes']:.2f} / {xla['backend']:.2f}{others}" if xla.get("count") else "—",
                     ", ".join(f"{name} {sec:.2f}" for name, sec in longest) or "—",
                     " ".join(f"{s:.3f}" for s in r["runs"]), str(proc.output.count(profile_compile.REMAT))))
        print(f"{variant}: compile {r['compile']:.2f} s", flush=True)
    print(f"\n{args.config}, {args.steps} steps, sampling program compiled alone (XLA's timers: GPUs)")
    print(harness.table(("variant", "lower s", "compile s", "largest: passes / backend s (+ others)", "longest passes, s",
                         f"{args.steps}-step sampling s, each run", "remat warnings"), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
