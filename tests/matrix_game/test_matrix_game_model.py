"""`MatrixGameTransformer` against the authors' `CausalWanModel` (goldens from
scripts/make_golden_matrix_game.py, float32, ≤ 1e-5 relative), and its cache and action pieces.

The golden forward sequence runs chunk by chunk through the caches with given inputs: chunk 0 on
empty caches, chunk 1 with per-frame timesteps, chunk 3 after the window rolled. `mouse_keyboard`
is universal-like (window 6 = 2 chunks); `keyboard` is keyboard-only with window 4, so chunks wrap
around the ring's end.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matrix_game_golden import LATENT, golden, randn, rel_err, weights

from wan_tpu.configs.matrix_game import MATRIX_GAME_VARIANTS, config_from_json
from wan_tpu.errors import WanInputError
from wan_tpu.matrix_game.action_module import chunk_action_window
from wan_tpu.matrix_game.cache import ring_write
from wan_tpu.matrix_game.loading import load_matrix_game_transformer
from wan_tpu.matrix_game.model import MatrixGameTransformer, block_runs

TOL = 1e-5


@pytest.mark.parametrize("case", ["mouse_keyboard", "keyboard"])
def test_forward_through_caches_matches_authors(case):
    data, meta = golden(case)
    cfg = config_from_json(meta["config"])
    model = load_matrix_game_transformer(weights(case), cfg)
    arrays, c = meta["arrays"], meta["frames_per_chunk"]
    cache = model.init_cache(jnp.asarray(arrays["visual_context"]), LATENT)
    graphdef, state = nnx.split(model)

    # Time embeddings from host timesteps (float64 sinusoids, as the authors'), outside the jit so that
    # one compile per window size serves every call.
    @functools.partial(jax.jit, static_argnums=9)
    def step(state, x, cond, temb, tproj, keyboard, mouse, cache, frame_offset, valid_frames):
        return nnx.merge(graphdef, state).apply_embedded(x, cond, temb, tproj, keyboard, mouse, cache, frame_offset,
                                                         valid_frames)

    recorded = []
    for chunk, timesteps, seed, record in meta["sequence"]:
        frames = slice(chunk * c, (chunk + 1) * c)
        temb, tproj = model.embed_time(np.asarray([timesteps], np.float32))
        mouse = chunk_action_window(data["mouse"], chunk, c) if "mouse" in data else None
        flow, cache = step(state, jnp.asarray(randn(seed, (1, 16, c, *LATENT))),
                           jnp.asarray(arrays["cond_concat"][:, :, frames]), temb, tproj,
                           chunk_action_window(data["keyboard"], chunk, c), mouse, cache, jnp.int32(chunk * c),
                           min(cfg.window_frames, (chunk + 1) * c))
        if record:
            recorded.append(np.asarray(flow[:, meta["channel"]]))
    for ours, ref in zip(recorded, data["sequence"]):
        assert rel_err(ours, ref) <= TOL


def test_ring_write_wraps_around_the_window():
    cache = jnp.zeros((1, 4 * 2, 1))  # window 4 frames of 2 entries
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(1, 6, 1)  # frames 3, 4, 5 → slots 3, 0, 1
    out = ring_write(cache, new, jnp.int32(3), axis=1, frame_len=2)
    np.testing.assert_array_equal(np.asarray(out[0, :, 0]), [3, 4, 5, 6, 0, 0, 1, 2])


def test_chunk_action_window_front_pads_with_frame_zero():
    actions = np.arange(1, 33, dtype=np.float32)[:, None]  # raw frames 0…31 hold 1…32
    first = chunk_action_window(actions, 0, 3)  # raw −12 … 7: twelve copies of frame 0, then 0…7
    np.testing.assert_array_equal(first[:, 0], [1] * 12 + list(range(1, 9)))
    second = chunk_action_window(actions, 1, 3)  # raw 0 … 19
    np.testing.assert_array_equal(second[:, 0], range(1, 21))
    with pytest.raises(WanInputError, match="reads action frames 0…31 but only 20"):
        chunk_action_window(actions[:20], 2, 3)


def test_blocks_form_runs_of_equal_structure():
    assert block_runs(MATRIX_GAME_VARIANTS["universal"].transformer) == ((0, 15, True), (15, 30, False))
    assert block_runs(MATRIX_GAME_VARIANTS["foundation"].transformer) == ((0, 30, True),)
    tiny = MATRIX_GAME_VARIANTS["matrix-game-tiny"].transformer
    assert block_runs(tiny) == ((0, 1, True), (1, 2, False))


def test_caches_are_fixed_shape_and_inputs_are_checked():
    cfg = MATRIX_GAME_VARIANTS["matrix-game-tiny"].transformer
    model = MatrixGameTransformer(cfg, rngs=nnx.Rngs(0))
    cache = model.init_cache(jnp.zeros((2, 5, cfg.image_dim)), (8, 14))  # 4·7 = 28 tokens per frame
    action, plain = cache.blocks
    assert action.self_attn.k.shape == (1, 2, 6 * 28, 2, 32)  # (layers, B, window·S, H, D)
    assert action.cross_attn.k.shape == (1, 2, 5, 2, 32)
    assert action.keyboard.k.shape == (1, 2, 6, 1, 64)
    assert action.mouse.k.shape == (1, 2, 28, 6, 1, 64)
    assert plain.keyboard is None and plain.mouse is None

    x, cond = jnp.zeros((2, 16, 3, 8, 14)), jnp.zeros((2, 20, 3, 8, 14))
    kb, mouse = jnp.zeros((2, 20, 4)), jnp.zeros((2, 20, 2))
    with pytest.raises(WanInputError, match=r"timestep has shape \(2,\); expected \(2, 3\)"):
        model(x, cond, jnp.zeros((2,)), kb, mouse, cache, 0)
    with pytest.raises(WanInputError, match=r"mouse has shape None; expected \(2, 20, 2\)"):
        model(x, cond, jnp.zeros((2, 3)), kb, None, cache, 0)
    with pytest.raises(WanInputError, match="the cache was made for"):
        model(x[:1], cond[:1], jnp.zeros((1, 3)), kb[:1], mouse[:1], cache, 0)
