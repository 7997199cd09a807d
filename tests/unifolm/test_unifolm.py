"""The UnifoLM pipeline, CLI and server protocol (`wan_tpu/unifolm/pipeline.py`, `cli.py`, `server.py`) on the
`unifolm-tiny` preset (random weights, 128×128 frames), one DDIM step where what a test checks does not depend on
the count (a step of the tiny UNet runs for about a second on a 2-core CPU; the samplers' steps are checked against
the authors' in test_unifolm_sampling.py).

No numerical reference here (the models have their own golden tests): these check the modes' data
flow (the authors' queues and masks), the files the CLI writes, min-max (un)normalisation, and that
bad inputs are one-line user errors (exit status 2) that leave no file behind.
"""

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from wan_tpu.errors import WanInputError
from wan_tpu.runtime.video import read_video
from wan_tpu.unifolm.cli import main
from wan_tpu.unifolm.pipeline import MinMaxTable, UnifolmPipeline

DOF = 7
STEPS = ["--steps", "1"]


@pytest.fixture(scope="module")
def pipe():
    return UnifolmPipeline.from_pretrained("unifolm-tiny")


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "stats.safetensors"
    save_file({"action/min": np.full(DOF, -2.0, np.float32), "action/max": np.full(DOF, 3.0, np.float32),
               "observation.state/min": np.zeros(DOF, np.float32), "observation.state/max": np.full(DOF, 10.0, np.float32)},
              str(path))
    return path


def observation(n=2, size=128, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), rng.uniform(0, 10, (n, DOF)).astype(np.float32)


def test_min_max_table_is_the_authors_normalize(stats_file):
    table = MinMaxTable.from_file(str(stats_file))
    x = np.array([0.0, 5.0, 10.0] + [1.0] * (DOF - 3), np.float32)
    np.testing.assert_allclose(table.normalize(x, "state")[:3], [-1, 0, 1], atol=1e-6)
    np.testing.assert_allclose(table.unnormalize(np.full(DOF, 1.0), "action"), np.full(DOF, 3.0), atol=1e-6)
    np.testing.assert_allclose(table.unnormalize(table.normalize(x, "action"), "action"), x, atol=1e-5)


def test_stage_programs_return_no_weights(pipe):
    """The prepare and decode programs return only their results: a program handed whole modules
    (`nnx.jit`) also returns every weight, a second copy of the model at the memory peak."""
    import jax
    from flax import nnx

    from wan_tpu.unifolm.pipeline import _decode_program, _prepare_program

    images, states = observation()
    imgs = pipe.check_images(images)
    st, _ = pipe.check_vectors(states / 10, "state", imgs.shape[2], pad_rows=True)
    h, w = pipe.config.latent_size
    args = (pipe.encode_text("x"), pipe.image_encoder.encode(imgs[:, :, -1]), imgs[:, :, -1],
            jax.numpy.zeros((1, pipe.vae.config.latent_channels, h, w)), imgs, st, None, jax.numpy.int32(7))
    (mg, ms), (vg, vs) = nnx.split(pipe.model), nnx.split(pipe.vae)
    weights = sum(x.nbytes for x in jax.tree.leaves((ms, vs)))
    prep = _prepare_program.lower(mg, vg, ms, vs, *args, keep_action_tokens=True).compile().memory_analysis()
    cond = pipe.encode_conditions("x", imgs, st, key=jax.random.key(0))
    results = sum(x.nbytes for x in jax.tree.leaves(cond))
    assert results <= prep.output_size_in_bytes <= results + 1024 < weights / 10  # + the tuple's pointer table
    z = jax.numpy.zeros((1, pipe.vae.config.latent_channels, 2, h, w))
    dec = _decode_program.lower(vg, vs, z).compile().memory_analysis()
    assert dec.output_size_in_bytes <= 3 * 2 * imgs.shape[-2] * imgs.shape[-1] * 4 + 1024


@pytest.mark.slow
def test_modes_and_queues(pipe):
    images, states = observation()
    out = pipe.decide("pick up the cup", images, states / 10, num_steps=1)
    assert out.video.shape == (16, 128, 128, 3) and out.video.dtype == np.uint8
    assert out.actions.shape == (16, DOF) and out.actions_raw.shape == (16, 16) and np.isfinite(out.actions).all()
    world = pipe.predict(images, states / 10, out.actions, num_steps=1)
    assert world.states.shape == (16, DOF) and world.states_raw.shape == (16, 16)
    # One observed frame is repeated to fill the queue, exactly as two copies of it.
    one = pipe.decide("x", images[:1], states[:1] / 10, num_steps=1, seed=5)
    two = pipe.decide("x", np.repeat(images[:1], 2, 0), np.repeat(states[:1], 2, 0) / 10, num_steps=1, seed=5)
    np.testing.assert_array_equal(one.actions_raw, two.actions_raw)
    episode = pipe.interact("pick up the cup", images[:1], states[:1] / 10, iterations=2, num_steps=1)
    assert episode.video.shape == (32, 128, 128, 3) and len(episode.decisions) == len(episode.predictions) == 2
    np.testing.assert_array_equal(episode.video[16:], episode.predictions[1].video)
    with pytest.raises(WanInputError, match="needs a base checkpoint"):
        UnifolmPipeline.generate(pipe, "x", images[:1])


@pytest.mark.slow  # compiles the stage programs twice (about 90 s on 2 cores)
def test_prepare_compiles_the_stage_programs_ahead_and_changes_no_bit(monkeypatch):
    """`prepare("decision")` loads the components and loads or compiles the prepare, sampling and decode
    programs and the encoders' in its threads (one per program, side by side), and the caller's thread compiles no
    program at all; `decide` then gives bit-identical outputs to a run without it. Each run with the cache off, JAX's
    caches cleared and the in-process program memo emptied first, so that it compiles its own programs. Reference:
    the run without `prepare`; tolerance: none."""
    import jax

    from wan_tpu.runtime import executable_cache

    images, states = observation(seed=4)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **kw: compiles.append(
        (threading.current_thread().name, str(kw.get("fun_name"))))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    outputs, seen = {}, {}
    for label in ("plain", "prepare"):
        monkeypatch.setattr(executable_cache, "_CALLED", {})
        jax.clear_caches()
        start = len(compiles)
        run = UnifolmPipeline.from_pretrained("unifolm-tiny", compile_cache=False)
        if label == "prepare":
            with run.prepare("decision", num_steps=2) as warmup:
                assert set(warmup.loads) == set(UnifolmPipeline.COMPONENTS) and set(warmup.compiles) == {"stages"}
                outputs[label] = run.decide("pick up the cup", images, states / 10, num_steps=2, seed=3)
            assert not [t for t in threading.enumerate() if t.name.startswith("wan_tpu-")]
        else:
            outputs[label] = run.decide("pick up the cup", images, states / 10, num_steps=2, seed=3)
        seen[label] = compiles[start:]
    stages = {"jit(_prepare_program)", "jit(_sample_loop)", "jit(_decode_program)", "jit(_text_tokens)",
              "jit(_image_tokens)"}
    assert stages <= {f for thread, f in seen["plain"] if thread == "MainThread"}
    ahead = {(thread, f) for thread, f in seen["prepare"] if thread.startswith("wan_tpu-compile-") and f in stages}
    assert stages <= {f for _, f in ahead}
    assert len({thread for thread, _ in ahead}) == len(stages)  # side by side, a thread each
    main = {f for thread, f in seen["prepare"] if thread == "MainThread"}
    # Nor any other program: the calls' few operations outside the stage programs (the seed's keys, the last
    # observed frame) were compiled in `prepare`'s thread, and the rest is put or read on the host.
    assert not main, main
    for field in ("video_raw", "actions_raw", "actions"):
        np.testing.assert_array_equal(getattr(outputs["prepare"], field), getattr(outputs["plain"], field))



@pytest.mark.slow
def test_prepare_compiles_a_split_step_side_by_side(monkeypatch):
    """With `sampling_programs=3` `prepare` compiles the step's programs (and the noise's) each in a thread of its
    own, beside the stage programs, meeting them at the first step only (the other steps would trace the same
    calls again); `decide` then runs them, every step, without compiling any on its thread."""
    import jax

    from wan_tpu.runtime import executable_cache
    from wan_tpu.unifolm import sampling

    steps_built = []
    constants = sampling._step_constants
    monkeypatch.setattr(sampling, "_step_constants", lambda *a: steps_built.append(a[2]) or constants(*a))

    images, states = observation(seed=4)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **kw: compiles.append(
        (threading.current_thread().name, str(kw.get("fun_name"))))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    monkeypatch.setattr(executable_cache, "_CALLED", {})
    jax.clear_caches()
    run = UnifolmPipeline.from_pretrained("unifolm-tiny", compile_cache=False, sampling_programs=3)
    with run.prepare("decision", num_steps=2) as warmup:
        warmup.wait_compiled("stages")
        assert steps_built == [0]
        out = run.decide("pick up the cup", images, states / 10, num_steps=2, seed=3)
    assert steps_built == [0, 0, 1]
    assert out.actions.shape == (16, DOF) and np.isfinite(out.actions_raw).all()
    step = {"jit(_noise_program)", "jit(_first_program)", "jit(_middle_program)", "jit(_last_video_program)",
            "jit(_head_program)"}
    ahead = {(thread, f) for thread, f in compiles if thread.startswith("wan_tpu-compile-") and f in step}
    assert {f for _, f in ahead} == step and len({thread for thread, _ in ahead}) == len(step)
    assert not {f for thread, f in compiles if thread == "MainThread"} & step
    with pytest.raises(WanInputError, match="sampling programs must be a whole number from 1 to"):
        UnifolmPipeline.from_pretrained("unifolm-tiny", sampling_programs=0)

def test_the_step_is_cut_in_pieces_by_default_where_compile_workers_run(monkeypatch):
    """`sampling_programs=None` (the default): `WORKER_SAMPLING_PROGRAMS` pieces where compile worker processes run
    (they compile the pieces at once), else the whole sampling as one program; a number given is kept."""
    from wan_tpu.runtime import compile_workers
    from wan_tpu.unifolm.pipeline import WORKER_SAMPLING_PROGRAMS

    monkeypatch.setattr(compile_workers, "running", lambda: False)
    assert UnifolmPipeline.from_pretrained("unifolm-tiny").sampling_programs == 1
    monkeypatch.setattr(compile_workers, "running", lambda: True)
    assert UnifolmPipeline.from_pretrained("unifolm-tiny").sampling_programs == WORKER_SAMPLING_PROGRAMS == 4
    assert UnifolmPipeline.from_pretrained("unifolm-tiny", sampling_programs=2).sampling_programs == 2
    assert UnifolmPipeline.from_pretrained("unifolm-tiny").set_sampling_programs(1).sampling_programs == 1


def test_prepare_checks_its_mode():
    pipe = UnifolmPipeline.from_pretrained("unifolm-tiny")
    with pytest.raises(WanInputError, match="mode must be one of"):
        pipe.prepare("dance")
    with pytest.raises(WanInputError, match="generate needs a base checkpoint"):
        pipe.prepare("generate")
    with pytest.raises(WanInputError, match="num_steps 0 must be in"):
        pipe.prepare("decision", num_steps=0)
    with pytest.raises(WanInputError, match="a UnifoLM-WMA-0 checkpoint"):
        UnifolmPipeline.from_pretrained("unifolm-tiny-base").prepare("interact")


def test_bad_inputs_are_user_errors(pipe, stats_file):
    images, states = observation()
    with pytest.raises(WanInputError, match="takes 128x128"):
        pipe.decide("x", observation(size=96)[0], states / 10, num_steps=2)
    with pytest.raises(WanInputError, match="observes 1 to 2 images"):
        pipe.decide("x", observation(n=3)[0], states / 10, num_steps=2)
    with pytest.raises(WanInputError, match=r"states must be \(n ≤ 2, dof ≤ 16\)"):
        pipe.decide("x", images, np.zeros((2, 17)), num_steps=2)
    with pytest.raises(WanInputError, match=r"actions must be \(16, dof ≤ 16\)"):
        pipe.predict(images, states / 10, np.zeros((8, DOF)), num_steps=2)
    pipe.stats = MinMaxTable.from_file(str(stats_file))
    try:
        with pytest.raises(WanInputError, match="states have 6 dims but the min-max table has 7"):
            pipe.decide("x", images, states[:, :6], num_steps=2)
    finally:
        pipe.stats = None


def _obs_file(tmp_path, n=1, size=128, name="obs.npz"):
    images, states = observation(n, size)
    np.savez(tmp_path / name, images=images, states=states)
    return str(tmp_path / name)


@pytest.mark.slow
def test_cli_interact_writes_video_and_unnormalised_vectors(tmp_path, stats_file, capsys):
    obs = _obs_file(tmp_path)
    out = tmp_path / "episode.mp4"
    assert main(["--model", "unifolm-tiny", "--mode", "interact", "--instruction", "stack the cups", "--observation", obs,
                 "--stats", str(stats_file), "--iterations", "2", "--output", str(out), *STEPS]) == 0
    frames, fps = read_video(str(out))
    assert frames.shape == (32, 128, 128, 3) and fps == 8
    vectors = np.load(tmp_path / "episode.npz")
    assert vectors["actions"].shape == (2, 16, DOF) and vectors["states"].shape == (2, 16, DOF)
    meta = json.loads((tmp_path / "episode.json").read_text())
    assert meta["unnormalised"] and meta["mode"] == "interact"
    np.testing.assert_allclose(np.asarray(meta["actions"]), vectors["actions"], rtol=1e-6)
    printed = capsys.readouterr().out
    assert "sample" in printed and "total" in printed  # the timing table
    # Outputs are never replaced without --overwrite.
    assert main(["--mode", "interact", "--observation", obs, "--output", str(out), *STEPS]) == 2


def test_cli_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys):
    obs = _obs_file(tmp_path)
    (tmp_path / "model.ckpt").write_bytes(b"PK\x03\x04 not really")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--model", str(tmp_path / "model.ckpt"), "--mode", "decision", "--observation", obs], "pickle checkpoint; convert it first"),
        (["--model", str(tmp_path / "empty"), "--mode", "decision", "--observation", obs], "no config.json"),
        (["--model", "nope", "--mode", "decision", "--observation", obs], "neither a converted UnifoLM folder nor a preset"),
        (["--mode", "world", "--observation", obs], "pass --actions FILE"),
        (["--mode", "decision", "--observation", str(tmp_path / "missing.npz")], "does not exist"),
        (["--mode", "decision", "--observation", obs, "--output", str(tmp_path / "out.gif")], "must end in .mp4"),
        (["--mode", "dance", "--observation", obs], "invalid choice"),
    ]
    for argv, message in cases:
        out = tmp_path / "out.mp4"
        assert main(argv if "--output" in argv else [*argv, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
        assert not list(tmp_path.glob("out.*"))


@pytest.mark.slow
def test_cli_wrong_image_size_exits_2(tmp_path, capsys):
    obs = _obs_file(tmp_path, size=64)
    assert main(["--mode", "decision", "--observation", obs, "--output", str(tmp_path / "out.mp4"), *STEPS]) == 2
    assert "takes 128x128" in capsys.readouterr().err and not list(tmp_path.glob("out.*"))


@pytest.mark.slow
def test_server_speaks_the_authors_protocol(pipe):
    """`/predict_action` of the serving app (`wan_tpu.serve`, what `--serve` starts): good requests answer 200
    with 16 actions; every bad one 400 (413 when too large) with a one-line `desc` and no traceback; the
    server answers the next good request after each."""
    from starlette.testclient import TestClient

    from wan_tpu.serve.app import ServerState, build_app
    from wan_tpu.unifolm import server as server_module

    images, states = observation(n=2, size=160)
    state = ServerState(family="unifolm", model_name="unifolm-tiny", pipe=pipe, predict_options={"num_steps": 1},
                        max_body=server_module.MAX_BODY)
    with TestClient(build_app(state)) as client:

        def post(body: bytes, headers=None):
            response = client.post("/predict_action", content=body, headers={"Content-Type": "application/json",
                                                                                **(headers or {})})
            return response.status_code, response.json()

        good = {"observation.images.top": images.transpose(0, 3, 1, 2).tolist(), "observation.state": (states / 10).tolist(),
                "action": np.zeros((16, DOF)).tolist(), "language_instruction": "pick up the cup"}
        status, ok = post(json.dumps(good).encode())
        assert status == 200 and ok["result"] == "ok" and np.asarray(ok["action"]).shape == (16, DOF)
        nan_state = {**good, "observation.state": [[float("nan")] * DOF] * 2}
        bad = [(b"{not json", "not JSON"),
               (json.dumps([1, 2]).encode(), "JSON object"),
               (json.dumps({"observation.state": []}).encode(), "observation.images.top"),
               (json.dumps({**good, "observation.images.top": [[1, 2, 3]]}).encode(), "observation.images.top"),
               (json.dumps(nan_state).replace("NaN", "NaN").encode(), "NaN"),
               (json.dumps({**good, "observation.state": [[0.0] * (DOF + 30)] * 2}).encode(), "dof")]
        for body, message in bad:
            status, reply = post(body)
            assert status == 400 and reply["result"] == "error", (message, status, reply)
            assert message.lower() in reply["desc"].lower() and "\n" not in reply["desc"], (message, reply)
            assert "Traceback" not in reply["desc"]
        status, reply = post(b"{}", {"Content-Length": str(server_module.MAX_BODY + 1)})
        assert status == 413 and reply["result"] == "error" and "\n" not in reply["desc"]
        status, ok = post(json.dumps(good).encode())
        assert status == 200 and ok["result"] == "ok"


@pytest.mark.slow
def test_cli_generate_with_a_base_model(tmp_path):
    obs = _obs_file(tmp_path)
    out = tmp_path / "gen.mp4"
    assert main(["--model", "unifolm-tiny-base", "--mode", "generate", "--instruction", "open the drawer",
                 "--observation", obs, "--output", str(out), *STEPS]) == 0
    frames, _ = read_video(str(out))
    assert frames.shape == (16, 128, 128, 3) and not list(tmp_path.glob("gen.npz"))
    assert main(["--model", "unifolm-tiny-base", "--mode", "decision", "--observation", obs,
                 "--output", str(tmp_path / "d.mp4"), *STEPS]) == 2


def test_a_second_process_loads_the_stage_programs_whole(tmp_path):
    """Two fresh processes, one cache folder: the first compiles and stores the prepare, sampling and
    decode programs (`wan_tpu.runtime.executable_cache`, keyed by `UnifolmPipeline.program_key`) and the two
    encoders' (keyed by their towers' `program_key`), the second loads all five without tracing them, and its
    actions are bit-identical (XLA:CPU once failed to run such loaded programs; `executable_cache.store` compiles
    afresh what JAX's cache served). The
    preset's random weights are kept there too (`executable_cache.cached_arrays`), and its default is
    `presets.TINY_STEPS` DDIM steps."""
    from wan_tpu.unifolm.presets import TINY_STEPS

    np.savez(tmp_path / "obs.npz", **dict(zip(("images", "states"), observation(1))))
    env = dict(os.environ, WAN_TPU_CACHE_DIR=str(tmp_path / "cache"))
    loaded = []
    for run in ("first", "second"):
        done = subprocess.run([sys.executable, "-m", "wan_tpu.unifolm", "--model", "unifolm-tiny", "--mode", "decision",
                               "--observation", str(tmp_path / "obs.npz"), "--output", str(tmp_path / f"{run}.mp4")],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        loaded.append(re.search(r"whole programs: (\d+) loaded, (\d+) stored", done.stdout).groups())
        if run == "first":
            assert list((tmp_path / "cache").glob("*/executables/arrays-random-UnifolmWMA-*.bin"))
            # What the second process reads from its start, beside the loads (`executable_cache.prefetch`).
            (manifest,) = (tmp_path / "cache").glob("*/executables/manifest-unifolm-*.bin")
            listed = pickle.loads(manifest.read_bytes())
            assert sorted(name.rsplit("-", 1)[0] for name in listed) == [
                "openclip-image", "openclip-text", "unifolm-decode", "unifolm-prepare", "unifolm-sample"], listed
    assert loaded == [("0", "5"), ("5", "0")], loaded
    assert json.loads((tmp_path / "first.json").read_text())["steps"] == TINY_STEPS == 2
    first, second = np.load(tmp_path / "first.npz"), np.load(tmp_path / "second.npz")
    np.testing.assert_array_equal(first["actions"], second["actions"])


def test_the_abstract_model_is_built_once_per_process(monkeypatch):
    """The model's loader and `prepare`'s compile thread both ask for the abstract UNet at once: one builds
    it (`executable_cache.cached_abstract`), the other waits, and each gets its own module with an equal
    graphdef (the same static argument to `jax.jit`)."""
    from flax import nnx

    from wan_tpu.configs.unifolm import CONFIGS
    from wan_tpu.runtime import executable_cache
    from wan_tpu.unifolm.model import abstract_unifolm

    builds, results = [], []
    real = executable_cache._cached_abstract
    monkeypatch.setattr(executable_cache, "_cached_abstract", lambda *a: builds.append(a[0]) or real(*a))
    cfg = dataclasses.replace(CONFIGS["unifolm-tiny-base"], name="built-once")  # no other test asks for it
    threads = [threading.Thread(target=lambda: results.append(abstract_unifolm(cfg))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first, second = results
    assert builds == ["unifolm"] and first is not second and nnx.graphdef(first) == nnx.graphdef(second)
