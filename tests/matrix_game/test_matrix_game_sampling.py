"""Matrix-Game-2 sampling: the schedule against the authors' `FlowMatchScheduler` (bit-exact), a 4-chunk
stream of `denoise_chunk` against their `CausalInferencePipeline.inference` (goldens from
scripts/make_golden_matrix_game.py, float32, noise injected, latents ≤ 1e-4 relative), and the
chunk step's contract: one trace for every chunk, equal bit for bit to programs specialised to a
chunk's window size, caches donated, chunk k independent of later actions, batch > 1, an 8-device
mesh with batch over dp, and a TPU export.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matrix_game_golden import LATENT, golden, randn, rel_err, weights

import wan_tpu
from wan_tpu.configs.matrix_game import MATRIX_GAME_VARIANTS, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.matrix_game.action_module import chunk_action_window
from wan_tpu.matrix_game.cache import num_window_branches
from wan_tpu.matrix_game.loading import cache_sharding, load_matrix_game_transformer, shard_matrix_game
from wan_tpu.matrix_game.model import MatrixGameTransformer, init_cache
from wan_tpu.matrix_game.sampling import (
    check_chunk_index,
    chunk_schedule,
    denoise_chunk,
    flow_match_table,
    max_chunks,
    sigma_for,
    warp_denoising_step,
)

STREAM_TOL = 1e-4


def test_schedule_is_the_authors_bit_for_bit():
    data, meta = golden("schedule")
    sigmas, timesteps = flow_match_table(meta["shift"])
    np.testing.assert_array_equal(sigmas, data["sigmas"])
    np.testing.assert_array_equal(timesteps, data["timesteps"])
    for name in ("universal", "gta_drive", "templerun"):
        warped = warp_denoising_step(MATRIX_GAME_VARIANTS[name].denoising_step_list)
        np.testing.assert_array_equal(warped, data[f"warped_{name}"])
    np.testing.assert_allclose(data["warped_universal"], [1000, 908.8427, 713.9794], atol=1e-4)
    np.testing.assert_allclose(data["warped_templerun"], [1000, 937.5, 833.3333, 625], atol=1e-4)
    # x0 = x − σ·v uses σ = t / 1000 at the warped steps.
    np.testing.assert_allclose(sigma_for(data["warped_universal"]), data["warped_universal"] / 1000, rtol=1e-6)


def test_schedule_errors():
    with pytest.raises(WanInputError, match="ships no denoising step list"):
        chunk_schedule(MATRIX_GAME_VARIANTS["foundation"].denoising_step_list)
    with pytest.raises(WanInputError, match="integers in 0…1000"):
        warp_denoising_step([1000, 1200])


def test_chunk_inputs_are_checked():
    variant = MATRIX_GAME_VARIANTS["matrix-game-tiny"]
    model = nnx.eval_shape(lambda: MatrixGameTransformer(variant.transformer, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    h, w = variant.latent_size
    cache = jax.eval_shape(lambda s: init_cache(graphdef, s, jnp.zeros((1, 4, 32)), (h, w)), state)
    schedule = chunk_schedule(variant.denoising_step_list)
    args = (jnp.zeros((1, 16, 3, h, w)), jnp.zeros((1, 20, 3, h, w)), jnp.zeros((1, 20, 4)), jnp.zeros((1, 20, 2)), 0)
    trace = functools.partial(jax.eval_shape, functools.partial(denoise_chunk, graphdef, schedule=schedule), state, cache)
    with pytest.raises(WanInputError, match="raw uint32 key; pass a typed key"):
        trace(*args, jax.random.PRNGKey(0))
    with pytest.raises(WanInputError, match=r"step_noise has shape \(3, 1, 16, 3, 8, 14\); expected \(2, 1, 16"):
        trace(*args, jnp.zeros((3, 1, 16, 3, h, w)))
    x0, _ = trace(*args, jax.random.key(0))
    assert x0.shape == (1, 16, 3, h, w) and x0.dtype == jnp.float32
    assert max_chunks(3) == 341
    check_chunk_index(340, 3)
    with pytest.raises(WanInputError, match="chunk 341 is past the model's 1024 latent frames"):
        check_chunk_index(341, 3)


def _counted_step(graphdef, schedule):
    traces = []

    def step(*args):
        traces.append(1)
        return denoise_chunk(graphdef, *args, schedule=schedule)

    return jax.jit(step, donate_argnums=1), traces


@pytest.fixture(scope="module")
def golden_stream():
    data, meta = golden("mouse_keyboard")
    model = load_matrix_game_transformer(weights("mouse_keyboard"), config_from_json(meta["config"]))
    graphdef, state = nnx.split(model)
    step, traces = _counted_step(graphdef, chunk_schedule(meta["steps"]))
    arrays, c = meta["arrays"], meta["frames_per_chunk"]

    def run(chunks, keyboard=None, cache=None, first=0):
        """x0 of chunks first … first+chunks−1 (and the cache), with the golden noise and actions."""
        whole = keyboard is None and cache is None and (first, chunks) == (0, meta["chunks"])
        keyboard = data["keyboard"] if keyboard is None else keyboard
        if cache is None:
            cache = run.first_cache = model.init_cache(jnp.asarray(arrays["visual_context"]), LATENT)
        out = []
        for k in range(first, first + chunks):
            frames = slice(k * c, (k + 1) * c)
            eps = np.stack([randn(meta["renoise_seed"] + 10 * k + i, (1, 16, c, *LATENT)) for i in range(2)])
            x0, cache = step(state, cache, jnp.asarray(arrays["noise"][:, :, frames]),
                             jnp.asarray(arrays["cond_concat"][:, :, frames]), chunk_action_window(keyboard, k, c),
                             chunk_action_window(data["mouse"], k, c), jnp.int32(k), jnp.asarray(eps))
            out.append(np.asarray(x0))
        if whole:
            run.whole_stream = out  # the golden stream's x0, which a later test compares with again
        return out, cache

    return run, traces, data, meta


@pytest.mark.slow
def test_stream_matches_authors_and_compiles_once(golden_stream):
    run, traces, data, meta = golden_stream
    chunks, cache = run(meta["chunks"])
    c = meta["frames_per_chunk"]
    for k, x0 in enumerate(chunks):
        assert rel_err(x0[:, meta["channel"]], data["stream"][:, k * c:(k + 1) * c]) <= STREAM_TOL
    assert len(traces) == 1  # chunk index, caches and noise are arguments: one program for every chunk
    assert len(jax.tree.leaves(cache)) == len(jax.tree.leaves(run.first_cache))
    assert all(x.is_deleted() for x in jax.tree.leaves(run.first_cache))  # donated to the first chunk


@pytest.mark.slow
def test_chunks_do_not_depend_on_later_actions(golden_stream):
    run, traces, data, meta = golden_stream
    changed = data["keyboard"].copy()
    changed[:, 8:] = 1 - changed[:, 8:]  # raw frames 8… are first read by chunk 1
    (a0,), cache_a = run(1)
    (b0,), cache_b = run(1, keyboard=changed)
    np.testing.assert_array_equal(a0, b0)
    for x, y in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    (a1,), _ = run(1, cache=cache_a, first=1)
    (b1,), _ = run(1, keyboard=changed, cache=cache_b, first=1)
    assert rel_err(b1, a1) > 1e-3  # the changed actions do steer chunk 1
    assert len(traces) == 1


def _tiny(batch):
    """Tiny universal-like model, its schedule, and `batch` streams' inputs for 2 chunks."""
    variant = MATRIX_GAME_VARIANTS["matrix-game-tiny"]
    cfg, (h, w) = variant.transformer, variant.latent_size
    rng = np.random.RandomState(0)
    inputs = dict(context=rng.standard_normal((batch, 9, cfg.image_dim)),
                  noise=rng.standard_normal((batch, 16, 6, h, w)), cond=rng.standard_normal((batch, 20, 6, h, w)),
                  keyboard=(rng.rand(batch, 21, 4) < 0.3), mouse=0.1 * rng.standard_normal((batch, 21, 2)))
    return variant, {k: v.astype(np.float32) for k, v in inputs.items()}


def _run_tiny(model, step, inputs, latent_size, batch_slice=slice(None), shard=None):
    state = nnx.state(model)
    cache = model.init_cache(jnp.asarray(inputs["context"][batch_slice]), latent_size)
    if shard is not None:
        cache = jax.device_put(cache, shard(cache))
    out = []
    for k in range(2):
        frames = slice(3 * k, 3 * k + 3)
        x0, cache = step(state, cache, inputs["noise"][batch_slice, :, frames], inputs["cond"][batch_slice, :, frames],
                         chunk_action_window(inputs["keyboard"][batch_slice], k, 3),
                         chunk_action_window(inputs["mouse"][batch_slice], k, 3), jnp.int32(k),
                         jax.random.split(jax.random.key(k), 2)[batch_slice])  # one key per stream
        out.append(np.asarray(x0))
    return np.concatenate(out, axis=2)


@pytest.mark.slow
def test_batch_and_mesh():
    """Two streams in one batch equal each run alone; on a (dp, sp, tp) = (2, 2, 2) mesh of the 8
    simulated devices, with batch over dp, they equal the single-device run (≤ 1e-5)."""
    variant, inputs = _tiny(2)
    model = MatrixGameTransformer(variant.transformer, rngs=nnx.Rngs(0))
    graphdef = nnx.graphdef(model)
    step, traces = _counted_step(graphdef, chunk_schedule(variant.denoising_step_list))
    both = _run_tiny(model, step, inputs, variant.latent_size)
    for b in range(2):
        alone = _run_tiny(model, step, inputs, variant.latent_size, slice(b, b + 1))
        assert rel_err(alone, both[b:b + 1]) <= 1e-6
    assert len(traces) == 2  # batch 2, then batch 1

    mesh = wan_tpu.make_mesh(2, 2, 2)
    shard_matrix_game(model, mesh)
    sharded_step, _ = _counted_step(nnx.graphdef(model), chunk_schedule(variant.denoising_step_list))
    on_mesh = _run_tiny(model, sharded_step, inputs, variant.latent_size,
                        shard=lambda cache: cache_sharding(mesh, cache, variant.transformer.num_heads))
    assert rel_err(on_mesh, both) <= 1e-5


def test_chunk_step_exports_for_tpu():
    """The sharded chunk step with the splash exp2 kernel (Mosaic TPU, not interpret mode) on a
    (2, 2, 2) mesh of the 8 simulated devices exports for platform "tpu"."""
    variant = MATRIX_GAME_VARIANTS["matrix-game-tiny"]
    cfg = variant.transformer
    mesh = wan_tpu.make_mesh(2, 2, 2)
    model = nnx.eval_shape(lambda: MatrixGameTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                                         attention_impl="splash_exp2"))
    shard_matrix_game(model, mesh)
    graphdef, state = nnx.split(model)
    h, w = variant.latent_size

    def arg(shape, dtype=jnp.float32, spec=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    cache = jax.eval_shape(lambda s, ctx: init_cache(graphdef, s, ctx, (h, w)), state, arg((2, 257, cfg.image_dim)))
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache,
                         cache_sharding(mesh, cache, cfg.num_heads))
    step = jax.jit(functools.partial(denoise_chunk, graphdef, schedule=chunk_schedule(variant.denoising_step_list)),
                   donate_argnums=1)
    exported = jax.export.export(step, platforms=("tpu",))(
        state, cache, arg((2, 16, 3, h, w), spec=P("dp")), arg((2, 20, 3, h, w), spec=P("dp")),
        arg((2, 20, 4), spec=P("dp")), arg((2, 20, 2), spec=P("dp")), arg((), jnp.int32),
        jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
    assert exported.platforms == ("tpu",)
    assert exported.nr_devices == 8
    assert exported.out_avals[0].shape == (2, 16, 3, h, w)
    module = exported.mlir_module()
    # Self-attention of both runs of blocks over both window sizes (one branch each, chosen by the traced
    # chunk index) and their cross-attention run sharded (6 sites: the rest of the DiT is traced once) on
    # the TPU kernel, one kernel per shape: the window of 3 frames (84 keys), of 6 (168), the 257 CLIP
    # tokens; per device a (1, 42, 1, 32) query block: batch over dp, tokens over sp, heads over tp.
    assert module.count("sdy.manual_computation(") == 6
    assert module.count("@tpu_custom_call") == 3
    for keys in (84, 168, 257):
        assert re.search(rf"@_call\w*\(%arg0: tensor<1x42x1x32xbf16>.*tensor<1x{keys}x1x32xbf16>", module)


@pytest.mark.slow
def test_one_program_equals_the_per_chunk_programs_bit_for_bit(golden_stream):
    """Every chunk in one program (the traced chunk index picks the window's size at each attention call)
    computes bitwise what a program for its chunk's size alone computes (`first_chunk` True, then False:
    the first chunk's and the later chunks' programs, which the pipeline compiled apart before)."""
    run, _, data, meta = golden_stream
    model = load_matrix_game_transformer(weights("mouse_keyboard"), config_from_json(meta["config"]))
    graphdef, state = nnx.split(model)
    schedule, c, arrays = chunk_schedule(meta["steps"]), meta["frames_per_chunk"], meta["arrays"]
    assert num_window_branches(model.config.window_frames, c) == 2  # each program keeps one of the two
    programs = {first: jax.jit(functools.partial(denoise_chunk, graphdef, schedule=schedule, first_chunk=first))
                for first in (True, False)}
    # The one program's x0: the stream test's (the same program on the same inputs) when it ran in this process,
    # which saves running the four chunks again (8 s on 2 cores).
    expected = getattr(run, "whole_stream", None) or run(meta["chunks"])[0]
    cache = model.init_cache(jnp.asarray(arrays["visual_context"]), LATENT)
    for k in range(meta["chunks"]):
        frames = slice(k * c, (k + 1) * c)
        eps = np.stack([randn(meta["renoise_seed"] + 10 * k + i, (1, 16, c, *LATENT)) for i in range(2)])
        x0, cache = programs[k == 0](state, cache, jnp.asarray(arrays["noise"][:, :, frames]),
                                     jnp.asarray(arrays["cond_concat"][:, :, frames]),
                                     chunk_action_window(data["keyboard"], k, c), chunk_action_window(data["mouse"], k, c),
                                     jnp.int32(k), jnp.asarray(eps))
        np.testing.assert_array_equal(np.asarray(x0), expected[k])
