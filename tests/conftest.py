"""Test session setup.

Eight host devices are simulated for the sharding tests; XLA reads the flag once, before the first
`import jax`, so it is set here. Tests that need a GPU carry `@pytest.mark.gpu` and are skipped
elsewhere with that reason.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
