"""Test session setup.

Eight host devices are simulated for the sharding tests; XLA reads the flag once, before the first
`import jax`, so it is set here. Tests that need a GPU carry `@pytest.mark.gpu` and are skipped
elsewhere with that reason.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

# The persistent compilation cache is on by default (wan_tpu.runtime.compile_cache): tests keep theirs in a
# folder of their own per test run (the xdist workers share it), not in the user's ~/.cache.
if "WAN_TPU_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["WAN_TPU_CACHE_DIR"] = tempfile.mkdtemp(prefix="wan_tpu_test_cache_")
    atexit.register(shutil.rmtree, os.environ["WAN_TPU_CACHE_DIR"], True)

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
