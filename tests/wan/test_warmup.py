"""`WanPipeline.prepare` (`wan_tpu.runtime.compile_ahead`): components load and the text encoder (from its config
alone), the denoise step and the VAE decode compile in background threads, so the calls compile none
of the big programs themselves; latents and frames are bit-identical to a run without `prepare` in a fresh process
(reference: that run; tolerance:
none). The step and the decode compile from abstract modules, before the weights are in; the decode's
programs side by side; a later start reads the step from the executable cache, tracing nothing. Load errors
surface where the component is used; a failed ahead-of-time compile is a warning; no thread outlives the
`with` block."""

import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import wan_tpu
from wan_tpu.errors import WanInputError
from wan_tpu.runtime import compile_ahead as warmup
from wan_tpu.runtime import compile_cache, executable_cache
from wan_tpu.wan import memory as wan_memory

# A size no other test uses, so this process has compiled none of its programs before.
RUN = dict(height=48, width=80, num_frames=9, num_inference_steps=3, guidance_scale=4.0, seed=5)
BIG = ("jit(_embed)", "jit(_step)", "jit(_decode_stem)", "jit(_decode_strip)", "jit(to_uint8)", "jit(_normal)")

REFERENCE = """
import json, sys, numpy as np, wan_tpu
pipe = wan_tpu.WanPipeline.from_pretrained("tiny", compile_cache=False)
run = json.loads(sys.argv[1])
latents = pipe("a red kite", **run, output_type="latent", progress=False)
np.save(sys.argv[2], np.asarray(latents))
np.save(sys.argv[3], pipe.decode(latents))
"""


def test_prepare_compiles_ahead_and_changes_no_bit(tmp_path, monkeypatch, backend_compiles):
    env = {**os.environ, "XLA_FLAGS": os.environ["ONE_DEVICE_XLA_FLAGS"]}  # one CPU device
    ref = subprocess.run([sys.executable, "-c", REFERENCE, json.dumps(RUN), str(tmp_path / "l.npy"),
                          str(tmp_path / "f.npy")], env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]

    jax.clear_caches()  # the text program depends on no size: an earlier test may have compiled it here
    seen = backend_compiles
    pipe = wan_tpu.WanPipeline.from_pretrained("tiny")
    # The DiT's and the VAE's loads end only once their programs compiled: from the abstract modules, not
    # the weights (a compile that waited for its load would time the wait out).
    waits = []
    for name, program in (("transformer", "jit(_step)"), ("vae", "jit(_decode_strip)")):
        pipe._loaders[name] = _after_compile(program, pipe._loaders[name], waits)
    s = pipe.settings(**{k: RUN[k] for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")})
    with pipe.prepare(s) as prepared:
        assert set(prepared.loads) == {"text_encoder", "transformer", "vae"}
        assert set(prepared.compiles) == {"text", "denoise", "decode"}
        latents = pipe("a red kite", **RUN, output_type="latent", progress=False)
        frames = pipe.decode(latents)

    assert waits == [True, True]
    main = [f for f, thread in seen if thread == threading.main_thread().name and f in BIG]
    assert not main, f"compiled on the caller's thread: {main}"
    ahead = {f for f, thread in seen if thread.startswith("wan_tpu-compile-")}
    assert {"jit(_embed)", "jit(_step)", "jit(_decode_stem)", "jit(_decode_strip)", "jit(to_uint8)"} <= ahead
    decode_threads = {thread for f, thread in seen if f in BIG and thread.startswith("wan_tpu-compile-decode-")}
    assert len(decode_threads) >= 3, decode_threads  # stem, strips, uint8: each in a thread of its own
    assert np.array_equal(np.asarray(latents), np.load(tmp_path / "l.npy"))
    assert np.array_equal(frames, np.load(tmp_path / "f.npy"))

    # As a new process would: the step is read whole from the executable cache, not traced again.
    jax.clear_caches()
    monkeypatch.setattr(executable_cache, "_CALLED", {})
    traced, loaded = _traced(), compile_cache.stats().programs_loaded
    embeds = pipe.encode_prompt("a red kite", guidance_scale=RUN["guidance_scale"])
    with pipe.prepare(s) as prepared:
        again = pipe.denoise(embeds, **{k: v for k, v in RUN.items() if k != "guidance_scale"},
                             guidance_scale=RUN["guidance_scale"], progress=False)
        prepared.cancel()  # the decode's programs: not needed here
    assert "_step" not in traced and compile_cache.stats().programs_loaded > loaded
    assert np.array_equal(np.asarray(again), np.load(tmp_path / "l.npy"))


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "as-on-a-gpu"])
def test_prepare_compiles_ahead_on_a_mesh(backend_compiles, monkeypatch, gpu):
    """On a 4-device mesh the text encoder's, the step's and the decode's programs compile in `prepare`'s
    threads from the loaded modules (the step's first call runs the program the later ones run); the
    latents and frames equal, bit for bit, a run on the same mesh without `prepare`. Where compiles time
    kernels on the devices (GPUs), the first call waits until every compile ended: a program of
    collectives must not start beside them."""
    if gpu:
        monkeypatch.setattr(warmup, "autotunes_on_device", lambda: True)
        monkeypatch.setattr(warmup, "WAIT_FOR_DEVICE_AUTOTUNING", False)  # the decode compiles beside the steps
        ended = []
        for name, method in (("text", "_compile_loaded_text"), ("denoise", "_compile_denoise"),
                             ("decode", "_compile_decode")):
            noted = _noting(getattr(wan_tpu.WanPipeline, method), name, ended)
            monkeypatch.setattr(wan_tpu.WanPipeline, method, staticmethod(noted) if name == "text" else noted)
        from wan_tpu.encoders.umt5_text import UMT5TextEncoder

        encode = UMT5TextEncoder.encode  # the run's first program of collectives
        monkeypatch.setattr(UMT5TextEncoder, "encode", lambda self, p: (ended.append("encode"), encode(self, p))[1])
    jax.clear_caches()  # the other parameter's run compiled these programs in this process
    run = dict(height=32, width=96, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=3)
    mesh = wan_tpu.make_mesh(1, 4, 1, devices=jax.devices()[:4])
    pipe = wan_tpu.WanPipeline.from_pretrained("tiny", mesh=mesh)
    s = pipe.settings(**{k: run[k] for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")})
    seen = backend_compiles
    with pipe.prepare(s) as prepared:
        assert set(prepared.compiles) == {"text", "denoise", "decode"}
        latents = pipe("a red kite", **run, output_type="latent", progress=False)
        frames = pipe.decode(latents)
    main = [f for f, thread in seen if thread == threading.main_thread().name and f in BIG]
    assert not main, f"compiled on the caller's thread: {main}"
    ahead = {f for f, thread in seen if thread.startswith("wan_tpu-compile-")}
    assert {"jit(_embed)", "jit(_step)", "jit(_decode_stem)", "jit(_decode_strip)", "jit(to_uint8)"} <= ahead
    assert [f for f, _ in seen].count("jit(_step)") == 1  # one program for every step

    if gpu:
        assert ended.index("encode") == 3 and set(ended[:3]) == {"text", "denoise", "decode"}, ended

    plain = wan_tpu.WanPipeline.from_pretrained("tiny", mesh=mesh)
    again = plain("a red kite", **run, output_type="latent", progress=False)
    assert np.array_equal(np.asarray(again), np.asarray(latents))
    assert np.array_equal(plain.decode(again), frames)


def _noting(fn, name, ended):
    """`fn`, noting `name` in `ended` when it returns."""
    def noted(*args, **kwargs):
        out = fn(*args, **kwargs)
        ended.append(name)
        return out

    return noted


def _after_compile(program, loader, waits, timeout=300):
    """`loader`, returning once `program` was compiled, or after `timeout` seconds (whether it was: `waits`)."""
    compiled = threading.Event()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiled.set()
        if event == "/jax/core/compile/backend_compile_duration" and kw.get("fun_name") == program else None)

    def load(**options):
        waits.append(compiled.wait(timeout))
        return loader(**options)

    return load


def _traced():
    """The functions traced from now on."""
    seen = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: seen.append(kw.get("fun_name"))
        if event == "/jax/core/compile/jaxpr_trace_duration" else None)
    return seen


def test_load_errors_surface_where_the_component_is_used():
    pipe = wan_tpu.WanPipeline.from_pretrained("tiny")

    def broken():
        raise WanInputError("vae/ is damaged; re-download it")

    pipe._loaders["vae"] = broken
    with pytest.warns(UserWarning, match="compiling decode ahead of time failed"):
        with pipe.prepare(pipe.settings(height=32, width=32, num_frames=5, num_inference_steps=2)) as prepared:
            with pytest.raises(WanInputError, match="damaged"):
                pipe.vae
            prepared.wait_compiled("decode")
    assert not [t for t in threading.enumerate() if t.name.startswith("wan_tpu-")]  # none outlives the block


def test_weights_fit_against_free_device_memory(monkeypatch):
    class Device:
        def memory_stats(self):
            return {"bytes_limit": 100, "bytes_in_use": 20}

    monkeypatch.setattr(warmup.jax, "devices", lambda: [Device()])
    monkeypatch.setattr(warmup.jax, "local_devices", lambda: [Device()])
    sizes = {"text_encoder": 40, "transformer": 31, "vae": 2}
    assert wan_memory.weights_fit(sizes, ["text_encoder", "vae"], None)  # 42 <= 0.9 * 80 free
    assert not wan_memory.weights_fit(sizes, ["text_encoder", "transformer", "vae"], None)  # 73 > 72
    mesh = type("Mesh", (), {"devices": np.zeros(2)})()
    assert wan_memory.weights_fit(sizes, ["text_encoder", "transformer", "vae"], mesh)  # 36.5 per device
    assert wan_memory.weights_fit({}, ["transformer"], None)  # sizes unknown (a preset)


def test_decode_compiles_before_the_denoise_where_both_do_not_fit(monkeypatch):
    """Where the memory holds the denoise's and the decode's working sets together the decode compiles
    while the DiT denoises; else `denoise()` waits for that compile first (the autotuner's buffers). Where
    compiles time kernels on the device (a GPU's autotuner), the denoise waits for it too."""
    from wan_tpu.wan.memory import stage_bytes

    pipe = wan_tpu.WanPipeline.from_pretrained("tiny")
    s = pipe.settings(height=32, width=32, num_frames=5, num_inference_steps=2)
    need = sum(b for b, _ in stage_bytes(pipe, s, ("denoise", "decode")).values())
    devices, local_devices = jax.devices, jax.local_devices

    class GPU:
        platform = "gpu"

        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return {"bytes_limit": self.limit, "bytes_in_use": 0}

    monkeypatch.setattr(warmup.jax, "devices", lambda *a: [GPU(2 * need)])
    monkeypatch.setattr(warmup.jax, "local_devices", lambda *a: [GPU(2 * need)])
    assert wan_memory.decode_compiles_beside_denoise(pipe, s)
    monkeypatch.setattr(warmup.jax, "devices", lambda *a: [GPU(need)])
    monkeypatch.setattr(warmup.jax, "local_devices", lambda *a: [GPU(need)])
    assert not wan_memory.decode_compiles_beside_denoise(pipe, s)
    monkeypatch.setattr(warmup.jax, "devices", devices)
    monkeypatch.setattr(warmup.jax, "local_devices", local_devices)
    assert wan_memory.decode_compiles_beside_denoise(pipe, s)  # this CPU: no autotuner, nothing to wait for

    for beside in (True, False):
        monkeypatch.setattr(warmup, "WAIT_FOR_DEVICE_AUTOTUNING", True)
        monkeypatch.setattr(warmup, "autotunes_on_device", lambda: not beside)
        with pipe.prepare(s) as prepared:
            assert pipe._decode_beside_denoise == beside
            latents = pipe("a cat", height=32, width=32, num_frames=5, num_inference_steps=2, output_type="latent",
                           progress=False)
            # `wait_compiled` takes the future it waited for: gone once the denoise waited for the decode.
            assert ("decode" in prepared.compiles) == beside
            pipe.decode(latents)
