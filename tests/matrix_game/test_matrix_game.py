"""`MatrixGamePipeline` (`wan_tpu/matrix_game/pipeline.py`) and its CLI (`wan_tpu/matrix_game/cli.py`) on the
`matrix-game-tiny` preset, float32 on CPU.

References: a stream equals the one-shot call bit for bit (the same compiled chunk programs); a
chunk's frames do not change when later chunks' actions do (bit for bit); the condition latents
equal the VAE encode of the image followed by 4·(N-1) gray frames as the authors' `inference.py`
builds them (≤ 1e-6 relative: the same layers, compiled in another grouping); one pair of chunk
programs (denoise, decode) compiled for every chunk, the first included, shared by every stream.
"""

import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.matrix_game import pipeline as mg
from wan_tpu.matrix_game.actions import random_actions
from wan_tpu.matrix_game.cli import main
from wan_tpu.runtime.video import read_video

IMAGE = (np.random.default_rng(0).random((70, 130, 3)) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def pipe():
    return mg.MatrixGamePipeline.from_pretrained(mg.PRESET, dtype=jnp.float32)


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("mg") / "img.png"
    Image.fromarray(IMAGE).save(path)
    return str(path)


def chunks_of(pipe, keyboard, mouse):
    start = 0
    for k in range((len(keyboard) + 3) // 12):
        n = pipe.chunk_frames(k)
        yield keyboard[start : start + n], mouse[start : start + n]
        start += n


@pytest.mark.slow  # compiles the chunk programs (about 30 s on 2 cores); later tests reuse them
def test_stream_equals_one_shot_and_later_actions_change_only_later_chunks(pipe):
    keyboard, mouse = random_actions(pipe.action_space, 33, seed=1)
    video = pipe(IMAGE, keyboard, mouse, seed=0)
    assert video.shape == (33, *pipe.size, 3) and video.dtype == np.uint8

    session = pipe.stream(IMAGE, seed=0)
    streamed = [session.step(k, m) for k, m in chunks_of(pipe, keyboard, mouse)]
    assert [len(c) for c in streamed] == [9, 12, 12]
    np.testing.assert_array_equal(np.concatenate(streamed), video)

    other_keyboard, other_mouse = keyboard.copy(), mouse.copy()
    other_keyboard[21:] = [0, 1, 1, 0]  # only the last chunk's frames
    other_mouse[21:] = [0.1, -0.1]
    other = pipe(IMAGE, other_keyboard, other_mouse, seed=0)
    np.testing.assert_array_equal(other[:21], video[:21])
    assert not np.array_equal(other[21:], video[21:])
    assert not np.array_equal(pipe(IMAGE, keyboard, mouse, seed=1), video)
    # one pair of programs for every chunk, the first included, whatever the stream
    assert mg.chunk_denoise_program._cache_size() == mg.chunk_decode_program._cache_size() == 1


def test_condition_latents_equal_the_authors_full_encode(pipe):
    pixels = pipe.preprocess_image(IMAGE)
    condition = pipe.encode_image(pixels)
    assert condition.repeat_start < condition.latents.shape[2]  # the gray latents settled
    n = condition.repeat_start + 2 * condition.repeat_len + 1
    video = np.zeros((1, 3, 1 + 4 * (n - 1), *pixels.shape[2:]), np.float32)
    video[:, :, 0] = pixels[0]
    full = np.asarray(pipe.vae.normalize_latents(pipe.vae.encode(jnp.asarray(video))))
    ours = np.asarray(jnp.take(condition.latents, condition.index(jnp.arange(n)), axis=2))
    assert np.abs(ours - full).max() <= 1e-6 * np.abs(full).max()


def test_gray_runs_are_encoded_as_the_stream_reaches_them(pipe):
    pixels = pipe.preprocess_image(IMAGE)
    whole = pipe.encode_image(pixels)
    f = pipe.frames_per_chunk
    lazy = pipe.encode_image(pixels, frames=f)
    assert (lazy.repeat_start, lazy.repeat_len) == (1 + f, 1)  # the image and one run of gray frames
    first = np.asarray(lazy.latents)
    np.testing.assert_array_equal(first[:, :, : 1 + f], np.asarray(whole.latents)[:, :, : 1 + f])
    assert not np.array_equal(first, np.asarray(whole.latents))  # the later runs are not encoded yet
    chunk = 1
    while lazy._runs is not None:  # one more run per chunk until the repeat is found
        chunk += 1
        lazy.cover(f * chunk)
        assert lazy.repeat_start >= f * chunk or lazy._runs is None
    assert (lazy.repeat_start, lazy.repeat_len) == (whole.repeat_start, whole.repeat_len)
    np.testing.assert_array_equal(np.asarray(lazy.latents), np.asarray(whole.latents))
    assert chunk * f < whole.repeat_start + 2 * f  # it stopped at the repeat, not at the stream's end


def test_step_checks_its_actions(pipe):
    session = pipe.stream(IMAGE, seed=0, max_frames=9)
    with pytest.raises(WanInputError, match="9 frames"):
        session.step(np.zeros((12, 4)), np.zeros((12, 2)))
    frames = session.step([1, 0, 0, 0], [0, 0])  # one row, held for the chunk
    assert frames.shape == (9, *pipe.size, 3)
    with pytest.raises(WanInputError, match="at its end"):
        session.step([1, 0, 0, 0], [0, 0])


def test_interactive_from_a_pipe_with_profile(pipe, image_path, tmp_path, monkeypatch, capsys):
    read, write = os.pipe()
    os.write(write, b"w\n\nfly\nw+a mouse left\nquit\n")  # an empty line repeats; a bad one is reported
    os.close(write)
    monkeypatch.setattr(sys, "stdin", os.fdopen(read))
    out, trace = tmp_path / "play.mp4", tmp_path / "trace"
    assert main(["--image", image_path, "--interactive", "--dtype", "float32", "--output", str(out),
                 "--profile", str(trace)]) == 0
    captured = capsys.readouterr()
    assert "unknown action 'fly'" in captured.err
    assert "chunk  frames  seconds      fps" in captured.out
    frames, fps = read_video(str(out))
    assert frames.shape == (33, *pipe.size, 3) and fps == 12
    names = _trace_names(str(trace))
    for scope in ("1_Data_Preparation", "1.2_VAE_Encode_FirstFrame", "1.4_CLIP_Visual_Context", "2_Pipeline_Inference",
                  "2.1_KV_Cache_Initialization", "2.3_Block_0", "2.3_Block_2", "4_Video_Export"):
        assert scope in names, scope


def _trace_names(log_dir):
    names = set()
    for path in glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True):
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            for line in plane.lines:
                names.update(event.name for event in line.events)
    return names


@pytest.mark.parametrize("content, message", [
    ({"keyboard": [[1, 0, 0]] * 9, "mouse": [[0, 0]] * 9}, "expected (frames, 4)"),
    ({"keyboard": [[1, 0, 0, 0]] * 10, "mouse": [[0, 0]] * 10}, "12n-3"),
    ({"keyboard": [[1, 0, 0, 0]] * 9, "mouse": [[0, 0]] * 9, "gamepad": []}, "unknown name 'gamepad'"),
    ({"chunks": ["w", "fly"]}, "unknown action 'fly'"),
])
def test_bad_action_files_exit_2(image_path, tmp_path, capsys, content, message):
    actions, out = tmp_path / "actions.json", tmp_path / "o.mp4"
    actions.write_text(json.dumps(content))
    assert main(["--image", image_path, "--actions", str(actions), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".*partial*"))


def test_bad_arguments_exit_2(image_path, tmp_path, capsys):
    existing = tmp_path / "exists.mp4"
    existing.write_bytes(b"mine")
    cases = [
        (["--image", image_path, "--random-actions", "--output", str(existing)], "--overwrite"),
        (["--image", image_path, "--random-actions", "--frames", "32", "--output", str(tmp_path / "a.mp4")], "12n-3"),
        (["--image", str(tmp_path / "none.png"), "--random-actions", "--output", str(tmp_path / "b.mp4")], "does not exist"),
        (["--image", image_path, "--output", str(tmp_path / "c.mp4")], "one of the arguments"),
        (["--model", str(tmp_path), "--image", image_path, "--random-actions", "--output", str(tmp_path / "d.mp4")],
         "matrix_game.json"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert existing.read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.mp4"]


# `python -m wan_tpu.matrix_game ARGS`, then the heavy frameworks the run imported on one line.
_RUN_CLI = """import runpy, sys
import wan_tpu.runtime.cli
wan_tpu.runtime.cli.exit_now = sys.exit  # raise SystemExit, so that the line below still prints
sys.argv = ["wan_tpu.matrix_game", *sys.argv[1:]]
try:
    runpy.run_module("wan_tpu.matrix_game", run_name="__main__", alter_sys=True)
except SystemExit as e:
    status = e.code
print("imported:", sorted(m for m in ("torch", "transformers", "torchax") if m in sys.modules))
sys.exit(status)
"""


@pytest.mark.slow
def test_cli_random_actions_writes_the_frames_without_torch(image_path, tmp_path):
    command = [sys.executable, "-c", _RUN_CLI, "--model", "matrix-game-tiny", "--random-actions",
               "--frames", "33", "--image", image_path, "--output", "o.mp4"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    frames, fps = read_video(str(tmp_path / "o.mp4"))
    assert frames.shape[0] == 33 and fps == 12
    assert "video fps" in result.stdout
    # DiT, VAE and CLIP are all native: the whole run never imports torch, transformers or torchax.
    assert "imported: []" in result.stdout, result.stdout[-500:]


@pytest.mark.slow  # compiles the chunk programs of a setting no other test uses
def test_one_chunk_program_compiles_once_for_every_chunk():
    """Without `prepare` (which compiles every program ahead: tests/test_matrix_game_warmup.py): the first
    chunk's call compiles the chunk's two programs, the later chunks compile nothing."""
    import threading

    seen = []  # what this thread compiles

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and threading.current_thread() is threading.main_thread():
            seen.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.clear_caches()  # the DiT's program alone may match an earlier test's setting
    pipe = mg._tiny(jnp.float32, jnp.bfloat16, None)  # float32 DiT, bf16 VAE: programs of this test's own
    session = pipe.stream(IMAGE, seed=0, max_frames=33)
    keyboard, mouse = random_actions(pipe.action_space, 33, seed=1)
    frames = session.step(keyboard[:9], mouse[:9])
    assert seen.count("jit(chunk_denoise_program)") == seen.count("jit(chunk_decode_program)") == 1
    assert frames.shape == (9, *pipe.size, 3)
    first = len(seen)
    for start, stop in ((9, 21), (21, 33)):
        assert session.step(keyboard[start:stop], mouse[start:stop]).shape == (12, *pipe.size, 3)
    assert seen[first:] == []  # nothing compiled for the later chunks


@pytest.mark.slow  # the first chunk's program, partitioned over 8 simulated devices (about 40 s on 2 cores)
def test_a_mesh_shards_the_dit_and_gives_one_devices_frames(pipe):
    """`from_pretrained(..., mesh=...)`: the DiT sharded over a (dp, sp, tp) = (2, 2, 2) mesh of the 8
    simulated devices (`shard_matrix_game`), VAE and CLIP replicated on them; the first chunk's frames
    equal one device's to within summation order (reference: the single-device pipeline; tolerance: one
    uint8 level, on at most 0.1% of the values). `prepare` only reads ahead there."""
    import wan_tpu

    mesh = wan_tpu.make_mesh(2, 2, 2)
    sharded = mg.MatrixGamePipeline.from_pretrained(mg.PRESET, mesh=mesh, dtype=jnp.float32, compile_cache=False)
    assert sharded.mesh is mesh and sharded.program_key() is None
    with sharded.prepare() as warmup:
        assert not warmup.compiles
        frames = sharded.stream(IMAGE, seed=0, max_frames=9).step([1, 0, 0, 0], [0, 0.1])
    weights = jax.tree.leaves(nnx.state(sharded.transformer))
    assert all(len(w.sharding.device_set) == 8 for w in weights)
    assert any(not w.sharding.is_fully_replicated for w in weights)  # sharded, not only replicated
    want = pipe.stream(IMAGE, seed=0, max_frames=9).step([1, 0, 0, 0], [0, 0.1])
    diff = np.abs(frames.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() <= 1e-3
