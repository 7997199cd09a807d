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


def pytest_collection_modifyitems(config, items):
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
