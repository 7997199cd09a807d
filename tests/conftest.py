"""Test session setup.

Eight host devices are simulated for the sharding tests; XLA reads the flag once, before the first
`import jax`, so it is set here. Tests that need a GPU carry `@pytest.mark.gpu` and are skipped
elsewhere with that reason.
"""

import os
import shutil

# On the CPU, LLVM's optimisation of the compiled programs is most of this suite's time (about half of
# a compile-heavy test's CPU seconds); the tests check results, not speed, so they compile at LLVM's
# lowest level. A subprocess that wants one device sets `XLA_FLAGS=ONE_DEVICE_XLA_FLAGS` (this
# environment variable), keeping these flags. Left alone on a GPU machine, whose tests may time kernels.
FAST_COMPILE = "" if shutil.which("nvidia-smi") else "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["ONE_DEVICE_XLA_FLAGS"] = FAST_COMPILE
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if FAST_COMPILE and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE

# The persistent compilation cache is on by default (wan_tpu.runtime.compile_cache): tests keep theirs in a
# folder of their own per test run (the xdist workers share it), not in the user's ~/.cache.
if "WAN_TPU_CACHE_DIR" not in os.environ:
    import atexit
    import tempfile

    os.environ["WAN_TPU_CACHE_DIR"] = tempfile.mkdtemp(prefix="wan_tpu_test_cache_")
    atexit.register(shutil.rmtree, os.environ["WAN_TPU_CACHE_DIR"], True)

# As a command line lowers its programs (`xla_defaults.JAX_DEFAULTS`): one source line per operation, not its traceback.
# (Its spaced-out garbage collections, `wan_tpu.runtime.cli.GC_THRESHOLDS`, are not taken here: this suite ran 1,083 s
# with them, 971-1,052 s without, 2-core CPU.)
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# Seconds each module took (setup, calls and teardown) in a full run on the 2-core CPU machine, for the modules of
# more than a few seconds; `_two_queues` orders the modules by them. Stale numbers cost time, never a result.
MODULE_SECONDS = {
    "unifolm/test_unifolm_sampling.py": 188, "unifolm/test_unifolm.py": 172, "shared/test_readme.py": 172,
    "shared/test_cli_contract.py": 124, "shared/test_vae.py": 110, "benchmarks/test_bench_e2e.py": 105,
    "unifolm/test_unifolm_model.py": 96, "shared/test_multihost.py": 88, "unifolm/test_unifolm_sharding.py": 79,
    "wan/test_generate.py": 76, "matrix_game/test_matrix_game.py": 74, "matrix_game/test_matrix_game_sampling.py": 68,
    "shared/test_compile_cache.py": 48, "benchmarks/test_bench_unifolm_compile.py": 47,
    "matrix_game/test_matrix_game_warmup.py": 41, "benchmarks/test_bench_compile_side_by_side.py": 37,
    "shared/test_flash_gpu.py": 37, "serve/test_serve.py": 37, "wan/test_warmup.py": 36, "wan/test_transformer.py": 34,
    "wan/test_offload.py": 34, "shared/test_interrupt.py": 30, "wan/test_step_cache.py": 28,
    "serve/test_play_browser.py": 27, "benchmarks/test_random_folders.py": 27, "matrix_game/test_matrix_game_model.py": 25,
    "wan/test_quantize.py": 25, "shared/test_executable_cache.py": 25, "serve/test_play_protocol.py": 24,
    "wan/test_sharding.py": 21, "matrix_game/test_matrix_game_vae.py": 20, "wan/test_pipeline.py": 20, "wan/test_lora.py": 20,
    "shared/test_splash_exp2.py": 19, "shared/test_text_encoder.py": 17, "serve/test_serve_process.py": 17,
    "unifolm/test_unifolm_checkpoint.py": 16, "wan/test_denoise.py": 15, "shared/test_torchax_compat.py": 13,
    "shared/test_clip.py": 13, "wan/test_official.py": 12, "unifolm/test_autoencoder_kl.py": 12,
    "wan/test_checkpoint_formats.py": 11, "wan/test_memory.py": 11, "shared/test_hub.py": 11,
    "shared/test_compile_workers.py": 10, "serve/test_serve_families.py": 9, "wan/test_schedulers.py": 8,
}


def _two_queues(items):
    """The items in two runs of whole modules of about equal seconds, one after the other, each run's slowest modules
    first. pytest-xdist's worksteal hands the first half of the items to one worker and the rest to the other; a worker
    that runs out takes the tail of the other's queue. Here both start on the slowest modules and what one takes from
    the other's tail is short, so that they end together. A module stays whole (its fixtures set up once) but where
    the halves meet or a worker takes from the other."""
    modules = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    seconds = {m: MODULE_SECONDS.get(m.removeprefix("tests/"), 0.2 * len(group)) for m, group in modules.items()}
    runs, loads = ([], []), [0.0, 0.0]
    for module in sorted(modules, key=lambda m: -seconds[m]):  # longest first, each to the lighter run
        i = loads.index(min(loads))
        runs[i].append(module)
        loads[i] += seconds[module]
    first, second = runs
    count = lambda run: sum(len(modules[m]) for m in run)  # noqa: E731
    half = len(items) // 2
    # The split is by count: the lightest modules move from the tail of one run to the tail of the other until the
    # first worker's half ends in the first run's last module, a light one.
    while len(first) > 1 and count(first) - len(modules[first[-1]]) >= half:
        second.append(first.pop())
    while len(second) > 1 and count(first) < half:
        first.append(second.pop())
    return [item for module in first + second for item in modules[module]]


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker orders its items alike
        items[:] = _two_queues(items)
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def backend_compiles():
    """(function, thread name) of every backend compile in this process from the test's start on."""
    import threading

    seen = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append((kw.get("fun_name"), threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(listen)
    return seen
