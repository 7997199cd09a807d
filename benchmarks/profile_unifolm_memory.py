"""Where UnifoLM's device memory goes: each compiled program's buffers, without loading any weights.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/profile_unifolm_memory.py --dtype bfloat16 --steps 16
    python benchmarks/profile_unifolm_memory.py --config unifolm-tiny          # CPU smoke run

Lowers and compiles, on abstract weights (`abstract_unifolm`, no memory), the programs one sampling
runs: `prepare` (VAE encode of the last frame + the model's step-invariant work), the DDIM loop, and
the frame-by-frame VAE decode; prints XLA's memory analysis of each (arguments, outputs, temporaries)
and the largest values in each program's temporary allocation (from XLA's buffer-assignment dump), so
the peak = resident weights + the largest program's temporaries can be read without running anything.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="unifolm-mem-")
_DUMP_FLAGS = f" --xla_dump_to={DUMP}"
if "--xla_dump_hlo_module_re" not in os.environ.get("XLA_FLAGS", ""):  # a caller's own choice (e.g. every module) wins
    _DUMP_FLAGS += " --xla_dump_hlo_module_re=.*(sample_loop|prepare_program|decode_program).*"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _DUMP_FLAGS).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this script
import harness  # noqa: E402

GB = 1024**3
_SIZES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "s64": 8}


def _bytes(shape: str) -> int:
    m = re.match(r"(\w+)\[([\d,]*)\]", shape)
    if not m:
        return 0
    dims = [int(d) for d in m.group(2).split(",") if d]
    return _SIZES.get(m.group(1), 4) * int(np.prod(dims, dtype=np.int64))


def largest_temp_values(name_part: str, top: int) -> list[tuple[int, str]]:
    """The biggest values that live in the program's largest allocation (its temporaries), by shape."""
    reports = sorted(glob.glob(os.path.join(DUMP, f"*{name_part}*memory-usage-report.txt")))
    if not reports:
        return []
    text = open(reports[-1]).read()
    shapes = re.findall(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8|f8e4m3fn|s64)\[[\d,]*\]", text)
    seen: dict[str, int] = {}
    for s in shapes:
        seen[s] = seen.get(s, 0) + 1
    return sorted(((_bytes(s), f"{s} ×{n}") for s, n in seen.items()), reverse=True)[:top]


def outside_loops(name_part: str, top: int) -> tuple[int, list[tuple[int, str]]]:
    """Values the program's entry computation makes outside its loops (XLA hoists loop-invariant work
    there, e.g. a weight's layout change: it then lives through the whole loop) → (their total bytes,
    the largest: size and 'shape opcode (op name)')."""
    hlo = sorted(glob.glob(os.path.join(DUMP, f"*{name_part}*_after_optimizations.txt")))
    if not hlo:
        return 0, []
    text = open(hlo[-1]).read()
    entry = text[text.index("\nENTRY "):]
    found = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s+(?:ROOT )?%\S+ = (\w+\[[\d,]*\])\S* (\S+?)\(", line)
        if not m or m.group(2) in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant"):
            continue
        op = re.search(r'op_name="([^"]+)"', line)
        found.append((_bytes(m.group(1)), f"{m.group(1)} {m.group(2)}" + (f" ({op.group(1)[-90:]})" if op else "")))
    found.sort(reverse=True)
    return sum(size for size, _ in found), found[:top]


def report(name: str, compiled, dump_name: str, top: int):
    m = compiled.memory_analysis()
    print(f"\n== {name}: arguments {m.argument_size_in_bytes / GB:.3f} GB, outputs {m.output_size_in_bytes / GB:.3f} GB, "
          f"aliased {m.alias_size_in_bytes / GB:.3f} GB, temporaries {m.temp_size_in_bytes / GB:.3f} GB")
    for size, what in largest_temp_values(dump_name, top):
        print(f"   {size / 2**20:9.1f} MiB  {what}")
    total, hoisted = outside_loops(dump_name, top)
    print(f"   made outside its loops (live through them): {total / GB:.3f} GB; the largest:")
    for size, what in hoisted:
        print(f"   {size / 2**20:9.1f} MiB  {what}")
    return m


def main(argv=None) -> int:
    from wan_tpu.configs.autoencoder_kl import AUTOENCODER_KL_CONFIGS
    from wan_tpu.configs.unifolm import CONFIGS
    from wan_tpu.unifolm.autoencoder_kl import AutoencoderKL
    from wan_tpu.unifolm.model import KeyCounter, _prepare_jit, abstract_unifolm
    from wan_tpu.unifolm.pipeline import _decode_program, _prepare_program
    from wan_tpu.unifolm.sampling import _sample_loop, schedule_tables

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="unifolm-wma-0", choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    cfg = CONFIGS[args.config]
    dtype = jnp.dtype(args.dtype)
    vae_cfg = AUTOENCODER_KL_CONFIGS["unifolm" if args.config == "unifolm-wma-0" else "tiny"]
    harness.print_env(jax.devices())
    print(f"{args.config}, {args.dtype}, {args.steps} steps; dump {DUMP}")

    model = abstract_unifolm(cfg, dtype)
    vae = nnx.eval_shape(lambda: AutoencoderKL(vae_cfg, rngs=KeyCounter(0)))
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(tree)))
    print(f"weights: UNet + heads + projectors {size(model) / GB:.3f} GB, VAE {size(vae) / GB:.3f} GB")

    h, w = cfg.latent_size
    t, n_obs = cfg.unet.temporal_length, cfg.unet.n_obs_steps
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    H, W = h * vae_cfg.downscale, w * vae_cfg.downscale
    text = f32(1, cfg.unet.text_context_len, cfg.unet.context_dim)
    clip = f32(1, 257, cfg.resampler.embedding_dim)
    images, states = f32(1, 3, n_obs, H, W), f32(1, n_obs, cfg.agent_state_dim)
    fs = jax.ShapeDtypeStruct((1,), jnp.int32)

    graphdef, state = nnx.split(model)
    vgraph, vstate = nnx.split(vae)

    prep = _prepare_program.lower(graphdef, vgraph, state, vstate, text, clip, f32(1, 3, H, W),
                                  f32(1, vae_cfg.latent_channels, h, w), images, states, None, fs, keep_action_tokens=True)
    report("prepare (VAE encode + step-invariant work)", prep.compile(), "prepare_program", args.top)

    cond = jax.eval_shape(lambda s: _prepare_jit(graphdef, s, text, clip, f32(1, 4, h, w), images, states, None, fs,
                                                 keep_action_tokens=True), state)
    ugraph, ustate = nnx.split(model.diffusion_model)
    tables = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in schedule_tables(cfg, args.steps, 1.0).items()}
    shape = (1, cfg.unet.out_channels, t, h, w)
    horizon = cfg.head.horizon if cfg.head else t
    shapes = (shape, (1, horizon, cfg.agent_action_dim), (1, horizon, cfg.agent_state_dim))
    loop = _sample_loop.lower(ugraph, ustate, cond, None, tables, jax.random.key(0), {}, f32(), f32(),
                              cfg.head_clip_sample, shapes, True)
    report(f"DDIM loop ({args.steps} steps)", loop.compile(), "sample_loop", args.top)

    dec = _decode_program.lower(vgraph, vstate, f32(*shape))
    report(f"VAE decode ({t} frames)", dec.compile(), "decode_program", args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
