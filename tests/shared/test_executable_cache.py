"""`wan_tpu.runtime.executable_cache`: compiled programs stored whole and found without tracing, and Matrix-Game's
`prepare` loading its programs from it.

References: the jitted function itself (a stored program gives its results bit for bit); JAX's tracing
events (`jax.monitoring`, `/jax/core/compile/jaxpr_trace_duration` with the traced function's name: a
warm start traces none of the stream's programs); a stream in a process with an empty cache (frames
bit-identical to the warm one's).
"""

import dataclasses
import functools
import json
import os
import pickle
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wan_tpu.runtime import compile_cache, executable_cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _affine(scale, x, y):
    return {"out": x * scale + y, "sum": (x + y).sum()}


def _lowered(scale=3, n=5):
    return _affine.lower(scale, jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32))


@pytest.fixture
def cache(tmp_path):
    """The compile cache (and with it the executable cache) in a fresh folder; the session's restored after."""
    before = compile_cache.cache_dir()
    folder = compile_cache.enable(str(tmp_path / "cache"))
    yield folder
    compile_cache.enable(before) if before else compile_cache.disable()


def _entries(folder):
    path = os.path.join(folder, executable_cache.FOLDER)
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def test_a_stored_program_is_found_and_gives_the_jitted_results(cache):
    key = ("affine", 5)
    assert executable_cache.load("affine", key) is None
    stored = executable_cache.store("affine", key, _lowered())
    assert len(_entries(cache)) == 1
    loaded = executable_cache.load("affine", key)
    x, y = np.arange(5, dtype=np.float32), np.ones(5, np.float32)
    want = _affine(3, jnp.asarray(x), jnp.asarray(y))
    for compiled in (stored, loaded):  # called without the static argument
        got = compiled(jnp.asarray(x), jnp.asarray(y))
        jax.tree.map(np.testing.assert_array_equal, got, want)
    assert compile_cache.stats().programs_loaded >= 1


def test_another_key_or_name_misses(cache):
    executable_cache.store("affine", ("affine", 5), _lowered())
    assert executable_cache.load("affine", ("affine", 6)) is None
    assert executable_cache.load("other", ("affine", 5)) is None
    assert executable_cache.load("affine", ("affine", 5)) is not None


def test_a_program_lowered_with_tracebacks_is_another_entry(cache):
    """A program's locations (`jax_traceback_in_locations_limit`) change no result, but an executable carrying
    tracebacks loads slower: the setting keys the entries, so neither setting is served the other's."""
    name = "jax_traceback_in_locations_limit"
    before = getattr(jax.config, name)
    try:
        jax.config.update(name, 1)
        executable_cache.store("affine", ("affine", 5), _lowered())
        jax.config.update(name, 100)
        assert executable_cache.load("affine", ("affine", 5)) is None
        jax.config.update(name, 1)
        assert executable_cache.load("affine", ("affine", 5)) is not None
    finally:
        jax.config.update(name, before)


def test_an_unstable_or_missing_key_is_never_stored(cache):
    executable_cache.store("affine", None, _lowered())
    executable_cache.store("affine", ("affine", object()), _lowered())  # repr holds an address
    assert _entries(cache) == []


def test_a_corrupted_entry_is_dropped_with_a_warning_and_rewritten(cache):
    key = ("affine", 5)
    executable_cache.store("affine", key, _lowered())
    (entry,) = _entries(cache)
    path = os.path.join(cache, executable_cache.FOLDER, entry)
    with open(path, "wb") as f:
        f.write(b"not a program")
    with pytest.warns(UserWarning, match="dropped an unreadable entry for affine"):
        assert executable_cache.load("affine", key) is None
    assert not os.path.exists(path)
    executable_cache.store("affine", key, _lowered())
    assert executable_cache.load("affine", key) is not None


def test_cache_off_stores_nothing(cache):
    compile_cache.disable()
    compiled = executable_cache.store("affine", ("affine", 5), _lowered())
    assert compiled(jnp.ones(5), jnp.ones(5))["sum"] == 10
    assert executable_cache.load("affine", ("affine", 5)) is None
    assert _entries(cache) == []


def test_a_program_refusing_its_arguments_falls_back_to_jit_with_a_warning():
    programs = executable_cache.Programs()
    programs.put("affine", _lowered(n=5).compile())
    x = jnp.arange(4, dtype=jnp.float32)
    with pytest.warns(UserWarning, match="stored program affine does not take these arguments"):
        got = programs.call("affine", (x, jnp.ones(4)), lambda: _affine(3, x, jnp.ones(4)))
    np.testing.assert_array_equal(got["out"], np.arange(4) * 3 + 1)
    assert "affine" not in programs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dropped: no second warning
        programs.call("affine", (x, jnp.ones(4)), lambda: _affine(3, x, jnp.ones(4)))


@pytest.fixture
def fresh_process(monkeypatch):
    """Resets what a process remembers (programs met, manifests kept, reads under way): call it to act as
    the next process on the same cache folder."""

    def reset():
        for name in ("_CALLED", "_PREFETCHED", "_MANIFESTS", "_TOUCHED"):
            monkeypatch.setattr(executable_cache, name, {})

    reset()
    return reset


def _manifests(folder):
    return [n for n in _entries(folder) if n.startswith("manifest-")]


def test_prefetch_loads_what_the_last_run_used_and_its_callers_take_it(cache, fresh_process):
    """A run's manifest lists every program it loaded or stored; the next run with the same group and key
    loads them all in the background at once, largest first, and `load`, `cached_call` and `ahead` take those
    programs instead of reading their files again."""
    x = jnp.arange(5.0)
    assert executable_cache.prefetch("run", ("command", 1)) is None  # nothing listed yet
    executable_cache.store("affine", ("affine", 5), _lowered())
    np.testing.assert_array_equal(executable_cache.cached_call("scaled", "key", _scaled, (x,), dict(scale=2.0),
                                                               static_argnames=("scale",)), x * 2 + 1)
    (manifest,) = _manifests(cache)
    programs = sorted(n for n in _entries(cache) if not n.startswith("manifest-"))
    with open(os.path.join(cache, executable_cache.FOLDER, manifest), "rb") as f:
        assert sorted(pickle.load(f)) == programs and len(programs) == 2

    fresh_process()
    loaded = compile_cache.stats().programs_loaded
    done = executable_cache.prefetch("run", ("command", 1))
    assert done.result(timeout=60) == 2 and compile_cache.stats().programs_loaded == loaded + 2
    got = executable_cache.load("affine", ("affine", 5))(x, jnp.ones(5))  # its second argument is donated
    jax.tree.map(np.testing.assert_array_equal, got, _affine(3, x, jnp.ones(5)))
    with executable_cache.ahead():  # the program compiled ahead: the prefetched one, its shapes from its entry
        zeros = executable_cache.cached_call("scaled", "key", _scaled, (x,), dict(scale=2.0), static_argnames=("scale",))
    np.testing.assert_array_equal(zeros, np.zeros(5))
    np.testing.assert_array_equal(executable_cache.cached_call("scaled", "key", _scaled, (x + 1,), dict(scale=2.0),
                                                               static_argnames=("scale",)), (x + 1) * 2 + 1)
    assert compile_cache.stats().programs_loaded == loaded + 2 and executable_cache._PREFETCHED == {}
    # Another key: nothing listed to read (and what this process met is listed for it from now on).
    assert executable_cache.prefetch("run", ("command", 2)) is None and len(_manifests(cache)) == 2


def test_a_prefetched_entry_that_cannot_be_read_is_compiled_again(cache, fresh_process):
    key = ("affine", 5)
    executable_cache.prefetch("run", "k")
    executable_cache.store("affine", key, _lowered())
    (entry,) = [n for n in _entries(cache) if not n.startswith("manifest-")]
    with open(os.path.join(cache, executable_cache.FOLDER, entry), "wb") as f:
        f.write(b"not a program")
    fresh_process()
    with pytest.warns(UserWarning, match="dropped an unreadable entry for affine"):
        executable_cache.prefetch("run", "k").result(timeout=60)  # nothing loaded; the entry is gone
    assert executable_cache.load("affine", key) is None and entry not in _entries(cache)
    executable_cache.store("affine", key, _lowered())
    assert executable_cache.load("affine", key) is not None


def test_matrix_game_keys_change_with_dtype_config_and_size():
    from wan_tpu.matrix_game import pipeline as mg

    tiny = mg._tiny(jnp.float32, jnp.float32, None)
    configs = tiny.configs

    def pipe(variant=tiny.variant, config=configs, dtype=jnp.float32):
        return mg.MatrixGamePipeline(variant, tiny._loaders, name="x", dtype=dtype, vae_dtype=jnp.float32,
                                     abstracts=tiny._abstracts, configs=lambda: config)

    keys = [pipe(), pipe(dtype=jnp.bfloat16), pipe(config={**configs, "vae": dataclasses.replace(configs["vae"], base_dim=16)}),
            pipe(variant=dataclasses.replace(tiny.variant, latent_size=(16, 28)))]
    assert repr(keys[0].program_key()) == repr(tiny.program_key())
    assert len({repr(p.program_key()) for p in keys}) == 4
    no_configs = mg.MatrixGamePipeline(tiny.variant, tiny._loaders, name="x", dtype=jnp.float32, vae_dtype=jnp.float32)
    assert no_configs.program_key() is None  # never stored


# One stream after `prepare` in a fresh process: the stream's programs it traced, what the executable cache
# did, and the frames.
_STREAM = """import json, sys
import jax, jax.numpy as jnp, numpy as np
from wan_tpu.runtime import compile_cache
from wan_tpu.matrix_game import pipeline as mg
from wan_tpu.matrix_game.actions import random_actions

traced = []
jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **kw: traced.append(
    str(kw.get("fun_name"))) if event == "/jax/core/compile/jaxpr_trace_duration" else None)
image = (np.random.default_rng(0).random((70, 130, 3)) * 255).astype(np.uint8)
pipe = mg.MatrixGamePipeline.from_pretrained("matrix-game-tiny", dtype=jnp.float32)
keyboard, mouse = random_actions(pipe.action_space, 21, seed=1)
with pipe.prepare():
    session = pipe.stream(image, seed=0, max_frames=21)
    frames = [session.step(keyboard[:9], mouse[:9]), session.step(keyboard[9:21], mouse[9:21])]
np.save(sys.argv[1], np.concatenate(frames))
stats = compile_cache.stats()
print(json.dumps({"traced": traced, "hits": stats.programs_loaded, "writes": stats.programs_stored}))
"""
PROGRAMS = {"chunk_denoise_program", "chunk_decode_program", "cache_program", "key", "_run", "_encode_chunk",
            "start_latents", "gray_latents", "normalized_latents"}


@pytest.mark.slow  # compiles every program of a stream once (about 40 s on 2 cores)
def test_a_warm_start_traces_nothing_and_gives_the_same_frames(tmp_path):
    env = dict(os.environ, WAN_TPU_CACHE_DIR=str(tmp_path / "cache"))
    runs = {}
    for label in ("cold", "warm"):
        result = subprocess.run([sys.executable, "-c", _STREAM, str(tmp_path / f"{label}.npy")], env=env,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[label] = json.loads(result.stdout.strip().splitlines()[-1])
    cold, warm = runs["cold"], runs["warm"]
    assert PROGRAMS <= set(cold["traced"]) and cold["writes"] == 9 and cold["hits"] == 0, cold
    assert not PROGRAMS & set(warm["traced"]) and warm["hits"] == 9 and warm["writes"] == 0, warm
    np.testing.assert_array_equal(np.load(tmp_path / "warm.npy"), np.load(tmp_path / "cold.npy"))


@functools.partial(jax.jit, static_argnames="scale")
def _scaled(x, scale):
    return x * scale + 1


def test_cached_call_serves_a_stored_program_and_its_options_are_part_of_the_key(cache, monkeypatch):
    monkeypatch.setattr(executable_cache, "_CALLED", {})
    x = jnp.arange(4.0)

    def call(options=None):
        return executable_cache.cached_call("scaled", "key", _scaled, (x,), dict(scale=2.0), static_argnames=("scale",),
                                            compiler_options=options)

    np.testing.assert_array_equal(call(), x * 2 + 1)
    assert len(_entries(cache)) == 1
    executable_cache._CALLED.clear()  # as a new process: found on disk, not compiled
    loaded = compile_cache.stats().programs_loaded
    np.testing.assert_array_equal(call(), x * 2 + 1)
    assert compile_cache.stats().programs_loaded == loaded + 1
    np.testing.assert_array_equal(call(executable_cache.GRAPHLESS), x * 2 + 1)  # other options: another program
    assert len(_entries(cache)) == 2



def test_cached_program_finds_its_program_once_and_runs_it_for_new_values(cache, monkeypatch):
    """`cached_program` builds the key and finds (here: compiles and stores) the program once; the function it
    gives runs that program for other values of the same shapes, as `cached_call` would; within `ahead()` it
    gives zeros of the outputs; a program refusing its arguments falls back to jit once, with one warning."""
    monkeypatch.setattr(executable_cache, "_CALLED", {})
    x = jnp.arange(4.0)
    built = []
    monkeypatch.setattr(executable_cache, "_lower", lambda *a: built.append(1) or _scaled.lower(x, scale=2.0))
    run = executable_cache.cached_program("scaled", "key", _scaled, (x,), dict(scale=2.0), static_argnames=("scale",))
    for y in (x, x + 10, x * 3):
        np.testing.assert_array_equal(run(y, scale=2.0), y * 2 + 1)
    assert built == [1] and len(_entries(cache)) == 1
    np.testing.assert_array_equal(
        executable_cache.cached_call("scaled", "key", _scaled, (x + 1,), dict(scale=2.0), static_argnames=("scale",)),
        (x + 1) * 2 + 1)
    assert built == [1]  # the same program, from this process's memo
    with executable_cache.ahead():
        zeros = executable_cache.cached_program("scaled", "key", _scaled, (x,), dict(scale=2.0),
                                                static_argnames=("scale",))(x, scale=2.0)
    np.testing.assert_array_equal(zeros, np.zeros(4))
    # A view of one zero: a stage's outputs (activations of gigabytes) take no host memory ahead.
    assert zeros.strides == (0,) and zeros.base is not None and zeros.base.size == 1
    with pytest.warns(UserWarning, match="stored program scaled does not take these arguments"):
        np.testing.assert_array_equal(run(jnp.arange(3.0), scale=2.0), np.arange(3.0) * 2 + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the jitted path from then on: no second warning
        np.testing.assert_array_equal(run(jnp.arange(3.0), scale=2.0), np.arange(3.0) * 2 + 1)

def test_an_abstract_module_is_read_back_with_its_structure_and_shapes(cache, monkeypatch):
    """`cached_abstract`: the second call builds nothing (read from disk) and gives the same graphdef and
    parameter shapes and dtypes; an unreadable entry is dropped with a warning and built again."""
    from flax import nnx

    built = []

    def build():
        built.append(1)
        return nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))

    def shapes(module):
        return jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(module))

    first = executable_cache.cached_abstract("seq", ("seq", 3, 4), build)
    again = executable_cache.cached_abstract("seq", ("seq", 3, 4), build)
    assert len(built) == 1
    assert nnx.graphdef(again) == nnx.graphdef(first) and shapes(again) == shapes(first)
    (entry,) = _entries(cache)
    with open(os.path.join(cache, executable_cache.FOLDER, entry), "wb") as f:
        f.write(b"not a module")
    monkeypatch.setattr(executable_cache, "_ABSTRACTS", {})  # as a new process: read from disk, not memory
    with pytest.warns(UserWarning, match="dropped an unreadable entry for seq"):
        rebuilt = executable_cache.cached_abstract("seq", ("seq", 3, 4), build)
    assert len(built) == 2 and shapes(rebuilt) == shapes(first)
    executable_cache.cached_abstract("seq", None, build)  # no key: built, nothing stored
    assert len(built) == 3 and len(_entries(cache)) == 1
    # `split`: the entry's (graphdef, state) as `nnx.split` gives them, each caller's state its own to fill.
    monkeypatch.setattr(executable_cache, "_ABSTRACTS", {})
    for _ in range(2):  # from disk, then from this process's copy
        graphdef, state = executable_cache.cached_abstract("seq", ("seq", 3, 4), build, split=True)
        assert graphdef == nnx.graphdef(first) and shapes(nnx.merge(graphdef, state)) == shapes(first)
        flat = nnx.to_flat_state(state)
        flat[0][1].set_value(np.zeros((3, 4), np.float32))
    assert len(built) == 3 and isinstance(nnx.to_flat_state(state)[0][1].get_value(), np.ndarray)
    assert shapes(executable_cache.cached_abstract("seq", ("seq", 3, 4), build)) == shapes(first)
    again = nnx.to_flat_state(executable_cache.cached_abstract("seq", ("seq", 3, 4), build, split=True)[1])
    assert isinstance(again[0][1].get_value(), jax.ShapeDtypeStruct)  # untouched by the callers before


_SERVED = """import sys
import jax, jax.numpy as jnp, numpy as np
from wan_tpu.runtime import compile_cache, executable_cache
compile_cache.enable(sys.argv[1])

def f(x, y):  # a concatenation XLA:CPU fuses with a bitcast
    z = jnp.concatenate([x.reshape(-1, 4), y.reshape(-1, 4)], axis=0)
    return (z @ z.T).astype(jnp.bfloat16).view(jnp.int16).sum(), jnp.concatenate([x, y])[::2] * 2

args = (jnp.arange(64.0), jnp.ones(64))
lowered = jax.jit(f).lower(*args)
if sys.argv[2] == "fill":  # JAX's persistent cache only
    lowered.compile()
elif sys.argv[2] == "store":  # JAX's cache serves this compile
    executable_cache.store("f", ("f", 64), lowered)
    assert compile_cache.stats().programs_stored == 1
else:
    got = executable_cache.load("f", ("f", 64))(*args)
    jax.tree.map(np.testing.assert_array_equal, got, jax.jit(f)(*args))
"""


def test_a_program_served_by_jaxs_cache_is_stored_runnable(tmp_path):
    """XLA:CPU serialises an executable that JAX's persistent cache served without all its functions (a
    later process failed: "Function bitcast_concatenate_fusion not found"): `store` compiles it afresh.
    Three processes: JAX's cache filled; the program stored (its compile served by that cache); loaded and run."""
    for step in ("fill", "store", "load"):
        done = subprocess.run([sys.executable, "-c", _SERVED, str(tmp_path / "cache"), step], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (step, done.stderr[-2000:])


def test_the_source_hash_covers_the_whole_package():
    """A change anywhere in the package (a model file of any family) must key new programs."""
    import wan_tpu
    from wan_tpu.runtime import executable_cache

    assert executable_cache.PACKAGE_ROOT == os.path.dirname(os.path.abspath(wan_tpu.__file__))


def test_a_warmup_prefetches_and_its_calls_wait_for_the_reads(cache, fresh_process):
    """`Warmup.prefetch` starts the reads; `wait_compiled` (what a stage calls before its first program) returns
    only once they and the libraries' start (`start_libraries`, a no-op off NVIDIA GPUs) are done."""
    from wan_tpu.runtime.compile_ahead import Warmup, start_libraries

    executable_cache.prefetch("run", "k")
    executable_cache.store("affine", ("affine", 5), _lowered())
    fresh_process()
    loaded = compile_cache.stats().programs_loaded
    with Warmup() as warmup:
        warmup.prefetch("run", "k")
        assert len(warmup.background) == 2 and warmup.background[0] is start_libraries()
        warmup.wait_compiled("stages")
        assert warmup.background == [] and compile_cache.stats().programs_loaded == loaded + 1
    assert executable_cache.load("affine", ("affine", 5)) is not None  # the prefetched program, taken
    assert compile_cache.stats().programs_loaded == loaded + 1
