"""`wan_tpu.loading.params` and `TensorSource.read_into`: device-side layout + cast equal to the host's, bit for bit.

Reference: the same tensors converted in numpy (transpose, reshape, `astype` with ml_dtypes' round to
nearest even) — what the loaders did on the host before.
"""

import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from wan_tpu.errors import WanInputError
from wan_tpu.loading import params as param_loading
from wan_tpu.loading.checkpoint import TensorSource
from wan_tpu.loading.params import TRANSPOSE, Layout, StoredParam, load_params


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"blocks.{i}.w": rng.standard_normal((6, 4)).astype(np.float32) for i in range(3)}
    tensors["conv"] = rng.standard_normal((5, 2, 1, 3, 3)).astype(np.float32)
    tensors["gamma"] = rng.standard_normal((7, 1, 1, 1)).astype(np.float32)
    tensors["bias"] = rng.standard_normal((9,)).astype(np.float32)
    save_file(tensors, str(tmp_path / "a.safetensors"))
    return TensorSource([str(tmp_path / "a.safetensors")]), tensors


def cases(src):
    bf16 = np.dtype(ml_dtypes.bfloat16)
    return [
        StoredParam(src, [f"blocks.{i}.w" for i in range(3)], TRANSPOSE, bf16, stacked=True),
        StoredParam(src, ["conv"], Layout(perm=(2, 3, 4, 1, 0)), np.dtype(np.float32)),
        StoredParam(src, ["conv"], Layout(reshape=(5, 18), perm=(1, 0)), bf16),
        StoredParam(src, ["gamma"], Layout(reshape=(7,)), np.dtype(np.float32)),
        StoredParam(src, ["bias"], Layout(), np.dtype(np.float32)),
        StoredParam(src, [f"blocks.{i}.w" for i in range(3)], Layout(), np.dtype(np.float32), stacked=True),
    ]


def host_reference(p: StoredParam, tensors) -> np.ndarray:
    layers = [tensors[n] for n in p.names]
    a = np.stack(layers) if p.stacked else layers[0]
    if p.layout.reshape is not None:
        a = a.reshape(*a.shape[: int(p.stacked)], *p.layout.reshape)
    if p.layout.perm is not None:
        lead = int(p.stacked)
        a = a.transpose(*range(lead), *(q + lead for q in p.layout.perm))
    return np.ascontiguousarray(a.astype(p.dtype))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("device_layout_bytes", [0, 1 << 30])  # every layout change on the device; all on the host
def test_device_layout_matches_host_bitwise(source, monkeypatch, threads, device_layout_bytes):
    src, tensors = source
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", device_layout_bytes)
    params = cases(src)
    for p, out in zip(params, load_params(params, threads=threads)):
        ref = host_reference(p, tensors)
        assert isinstance(out, jax.Array) and out.dtype == ref.dtype and out.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), ref.view(np.uint8))
        np.testing.assert_array_equal(p.read_host().view(np.uint8), ref.view(np.uint8))


def test_a_warm_start_loads_the_layout_programs_instead_of_lowering_them(source, monkeypatch, tmp_path):
    """With the compile cache on, each layout program is stored whole and a fresh process (here: an empty
    in-process table) loads it from the executable cache, with results identical to the host's."""
    from wan_tpu.runtime import compile_cache, executable_cache

    src, tensors = source
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", 0)
    before = compile_cache.cache_dir()
    compile_cache.enable(str(tmp_path / "cache"))
    try:
        params = cases(src)[:4]  # the ones with a layout change or a cast: a program each
        monkeypatch.setattr(executable_cache, "_CALLED", {})
        stored = compile_cache.stats().programs_stored
        load_params(params)
        assert compile_cache.stats().programs_stored - stored == len(params)
        monkeypatch.setattr(executable_cache, "_CALLED", {})
        monkeypatch.setattr(param_loading, "_to_ours", None)  # nothing may trace or lower it now
        loaded = compile_cache.stats().programs_loaded
        outs = load_params(params)
        assert compile_cache.stats().programs_loaded - loaded == len(params)
    finally:
        compile_cache.enable(before) if before else compile_cache.disable()
    for p, out in zip(params, outs):
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), host_reference(p, tensors).view(np.uint8))


def test_layout_programs_compile_without_autotuning_on_gpus(source, monkeypatch):
    """A layout program runs once per load: on a GPU it compiles with autotuning off (and no CUDA graph). Here
    the GPU's options are given on the CPU (XLA takes them, ignoring what concerns GPUs): the calls carry them
    and the results stay the host's, bit for bit."""
    from wan_tpu.runtime import executable_cache

    src, tensors = source
    assert executable_cache.run_once() is None  # on the CPU: no options, the programs as before
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", 0)
    monkeypatch.setattr(executable_cache, "run_once", lambda: executable_cache.RUN_ONCE)
    monkeypatch.setattr(executable_cache, "_CALLED", {})
    seen, original = [], executable_cache.cached_call

    def cached_call(*args, compiler_options=None, **kwargs):
        seen.append(compiler_options)
        return original(*args, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(executable_cache, "cached_call", cached_call)
    params = cases(src)[:4]
    for p, out in zip(params, load_params(params)):
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), host_reference(p, tensors).view(np.uint8))
    assert seen == [{"xla_gpu_enable_command_buffer": "", "xla_gpu_autotune_level": 0}] * len(params)


def test_early_puts_are_taken_once_and_give_the_hosts_bits(source, monkeypatch):
    """`EarlyPuts` puts the large tensors as stored before any parameter list exists; `load_params(early=)` takes
    each instead of putting it again (a tensor that a second parameter reads is put again for it, as without), and
    every layout program compiles once, in the layout thread, before its parameter's call: results bit for bit
    the host's."""
    from wan_tpu.runtime import executable_cache

    src, tensors = source
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", 0)
    monkeypatch.setattr(executable_cache, "_CALLED", {})
    puts, put_stored = [], param_loading._put_stored
    monkeypatch.setattr(param_loading, "_put_stored", lambda t, n: puts.append(n) or put_stored(t, n))
    compiled, store = [], executable_cache.store
    monkeypatch.setattr(executable_cache, "store", lambda name, *a, **k: compiled.append(name) or store(name, *a, **k))
    early = param_loading.EarlyPuts(src)
    params = cases(src)
    for p, out in zip(params, load_params(params, early=early)):
        ref = host_reference(p, tensors)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), ref.view(np.uint8))
    assert sorted(puts) == sorted(tensors)  # each stored tensor put once, early
    assert all(early.take(src, name) is None for name in tensors)  # all taken
    # Five device layouts (the as-stored bias needs none): five programs, none compiled twice.
    assert compiled == ["param-layout"] * 5


def test_closed_early_puts_hold_nothing(source, monkeypatch):
    """A load that fails its checks closes its `EarlyPuts`: what was put is dropped and nothing more is put; another
    source's tensors are never taken from it."""
    src, tensors = source
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", 0)
    early = param_loading.EarlyPuts(src, threads=1)
    other = TensorSource(src.files)
    assert early.take(other, "bias") is None
    early.close()
    assert all(early.take(src, name) is None for name in tensors)
    assert not [t for t in threading.enumerate() if t.name.startswith("wan_tpu-early-put")]
    every = param_loading.EarlyPuts(src)
    assert len(every._futures) == len(tensors)
    every.close()
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", 1 << 30)
    none = param_loading.EarlyPuts(src)
    assert not none._futures  # small tensors stay for the host's conversion
    none.close()


def test_place_gets_final_host_arrays_in_order(source):
    src, tensors = source
    params = cases(src)
    seen = []
    out = load_params(params, place=lambda i, host: seen.append(i) or jax.device_put(host))
    assert seen == list(range(len(params)))
    for p, o in zip(params, out):
        np.testing.assert_array_equal(np.asarray(o).view(np.uint8), host_reference(p, tensors).view(np.uint8))


def test_tensors_are_views_of_one_map_per_file(source, tmp_path, monkeypatch):
    src, tensors = source
    maps = []
    real = np.memmap.__new__
    monkeypatch.setattr(np.memmap, "__new__", lambda cls, *a, **k: maps.append(a) or real(cls, *a, **k))
    assert "conv" in src and "nothing" not in src and maps == []  # membership reads no tensor
    for _ in range(2):
        for name, want in tensors.items():
            got = src[name]
            assert got.dtype == want.dtype and not got.flags.writeable
            np.testing.assert_array_equal(got, want)
    assert len(maps) == 1  # the file mapped once, on the first read
    # Another file's tensors come from a map of their own.
    save_file({"x": np.arange(6, dtype=np.float32)}, str(tmp_path / "b.safetensors"))
    both = TensorSource([str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")])
    np.testing.assert_array_equal(both["x"], np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(both["bias"], tensors["bias"])
    assert len(maps) == 3


def test_read_into(source, tmp_path):
    src, tensors = source
    out = np.empty((6, 4), np.float32)
    src.read_into("blocks.1.w", out)
    np.testing.assert_array_equal(out, tensors["blocks.1.w"])
    with pytest.raises(ValueError, match="does not fit"):
        src.read_into("blocks.1.w", np.empty((5, 4), np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        src.read_into("blocks.1.w", np.empty((4, 12), np.float32)[:, :6])  # not contiguous
    # A file cut short after its header was read: the read names the tensor.
    path = tmp_path / "a.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    last = max(src, key=lambda n: src._entries[n].end)  # the tensor the cut falls in
    with pytest.raises(WanInputError, match=f"truncated.*|{last}"):
        src.read_into(last, np.empty(src.shape(last), src.dtype(last)))


@pytest.mark.parametrize("stored", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("stacked", [True, False])
def test_host_transpose_in_bands_matches_numpy_bitwise(tmp_path, monkeypatch, stored, stacked):
    """A torch Linear's (out, in) → (in, out) built on the host (the streamed stacks' and a mesh's path) in
    bands of rows, in threads: the bits numpy's transpose and `astype` give, band edges off the rows' count."""
    rng = np.random.default_rng(1)
    tensors = {f"blocks.{i}.w": rng.standard_normal((37, 11)).astype(stored) for i in range(3 if stacked else 1)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    src = TensorSource([str(tmp_path / "t.safetensors")])
    monkeypatch.setattr(param_loading, "HOST_TILED_BYTES", 0)
    monkeypatch.setattr(param_loading, "HOST_TILE_ROWS", 8)
    for dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)):
        p = StoredParam(src, list(tensors), TRANSPOSE, dtype, stacked=stacked)
        got = p.read_host()
        ref = host_reference(p, tensors)
        assert got.dtype == ref.dtype and got.shape == ref.shape == ((3,) if stacked else ()) + (11, 37)
        assert got.flags.c_contiguous and got.tobytes() == ref.tobytes()
    assert not [t for t in threading.enumerate() if t.name.startswith("wan_tpu-transpose")]  # none outlives it


def test_host_work_waits_for_its_event_while_the_early_puts_go_on(source, monkeypatch):
    """Within `host_work_after(event)` `load_params` converts nothing on the host, and lays nothing out, before
    `event` is set, while the large tensors' early puts go on (what UnifoLM's `prepare` runs its model's load in);
    then every parameter comes out as the host's, bit for bit."""
    import time

    from wan_tpu.loading.params import StoredParam

    src, tensors = source
    monkeypatch.setattr(param_loading, "DEVICE_LAYOUT_BYTES", 48)  # the blocks' and conv's tensors: early puts
    puts, put_stored = [], param_loading._put_stored
    monkeypatch.setattr(param_loading, "_put_stored", lambda t, n: puts.append(n) or put_stored(t, n))
    converted, read_host = [], StoredParam.read_host
    monkeypatch.setattr(StoredParam, "read_host", lambda self: converted.append(self.names[0]) or read_host(self))
    laid_out, layout_program = [], param_loading._layout_program
    monkeypatch.setattr(param_loading, "_layout_program", lambda *a: laid_out.append(a) or layout_program(*a))
    event, out, params = threading.Event(), [], cases(src)
    early = param_loading.EarlyPuts(src)

    def load():
        with param_loading.host_work_after(event):
            out.extend(load_params(params, early=early))

    thread = threading.Thread(target=load)
    thread.start()
    deadline = time.monotonic() + 30
    while len(puts) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert sorted(puts) == ["blocks.0.w", "blocks.1.w", "blocks.2.w", "conv"]
    assert not converted and not out and thread.is_alive()
    assert laid_out and all(isinstance(x, jax.ShapeDtypeStruct) for a in laid_out for x in a[0])  # compiles only
    event.set()
    thread.join(60)
    assert converted == ["gamma"] and len(out) == len(params)
    for p, o in zip(params, out):
        np.testing.assert_array_equal(np.asarray(o).view(np.uint8), host_reference(p, tensors).view(np.uint8))
