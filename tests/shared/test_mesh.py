"""`wan_tpu.make_mesh`: axis sizes and order, `-1` for "the rest", one-line errors naming the counts,
and the multi-host switch (`jax.distributed.initialize` only when the environment asks for it).

Runs on the 8 simulated CPU devices of tests/conftest.py.
"""

import jax
import pytest

import wan_tpu
from wan_tpu.errors import WanInputError
from wan_tpu.parallel import mesh as mesh_lib

MULTI_HOST_VARS = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "NUM_PROCESSES",
                   "JAX_PROCESS_ID", "PROCESS_ID", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
                   "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def test_eight_devices_are_simulated():
    assert jax.device_count() == 8


@pytest.mark.parametrize("sizes", [(1, 1, 8), (2, 1, 4), (2, 2, 2), (1, 8, 1), (8, 1, 1)])
def test_sizes_and_default_order(sizes):
    mesh = wan_tpu.make_mesh(*sizes)
    assert mesh.axis_names == ("dp", "sp", "tp")
    assert tuple(mesh.shape.values()) == sizes
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_minus_one_takes_the_rest():
    assert dict(wan_tpu.make_mesh(dp=2, sp=-1).shape) == {"dp": 2, "sp": 4, "tp": 1}
    assert dict(wan_tpu.make_mesh(tp=-1).shape) == {"dp": 1, "sp": 1, "tp": 8}
    assert dict(wan_tpu.make_mesh(dp=-1, tp=2).shape) == {"dp": 4, "sp": 1, "tp": 2}


def test_default_fits_any_device_count():
    """make_mesh() with no sizes spreads the sequence over every device (README's snippet on any machine)."""
    assert dict(wan_tpu.make_mesh().shape) == {"dp": 1, "sp": 8, "tp": 1}
    assert dict(wan_tpu.make_mesh(devices=jax.devices()[:1]).shape) == {"dp": 1, "sp": 1, "tp": 1}
    assert dict(wan_tpu.make_mesh(dp=2).shape) == {"dp": 2, "sp": 4, "tp": 1}


def test_order_is_honoured():
    mesh = wan_tpu.make_mesh(dp=2, sp=2, tp=2, order=("tp", "dp", "sp"))
    assert mesh.axis_names == ("tp", "dp", "sp")
    assert dict(mesh.shape) == {"tp": 2, "dp": 2, "sp": 2}


def test_device_subset():
    devices = jax.devices()[:4]
    mesh = wan_tpu.make_mesh(dp=2, sp=-1, devices=devices)
    assert dict(mesh.shape) == {"dp": 2, "sp": 2, "tp": 1}
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dp=2, sp=1, tp=3), "mesh dp=2 sp=1 tp=3 needs 6 devices but 8 are available; choose sizes whose product is 8"),
        (dict(dp=3, sp=-1), "mesh dp=3 sp=-1 tp=1 cannot fill 8 devices (8 is not a multiple of 3)"),
        (dict(dp=-1, sp=-1), "only one axis may be -1"),
        (dict(dp=0), "mesh size dp=0 is not valid"),
        (dict(tp=2.0), "mesh size tp=2.0 is not valid"),
        (dict(order=("dp", "sp")), "must name each of ('dp', 'sp', 'tp') exactly once"),
        (dict(order=("dp", "dp", "tp")), "must name each of ('dp', 'sp', 'tp') exactly once"),
    ],
)
def test_errors_name_the_counts(kwargs, message):
    with pytest.raises(WanInputError) as e:
        wan_tpu.make_mesh(**kwargs)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.fixture
def clean_env(monkeypatch):
    for name in MULTI_HOST_VARS:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    return monkeypatch, calls


def test_single_host_does_not_initialize_distributed(clean_env):
    _, calls = clean_env
    assert mesh_lib.maybe_initialize_distributed() is False
    assert calls == []


def test_coordinator_env_initializes_distributed(clean_env):
    monkeypatch, calls = clean_env
    monkeypatch.setenv("COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("NUM_PROCESSES", "4")
    monkeypatch.setenv("PROCESS_ID", "3")
    assert mesh_lib.maybe_initialize_distributed() is True
    assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)]


@pytest.mark.parametrize("name, value, starts", [("TPU_WORKER_HOSTNAMES", "h0,h1", True),
                                                 ("TPU_WORKER_HOSTNAMES", "h0", False),
                                                 ("SLURM_NTASKS", "2", True),
                                                 ("OMPI_COMM_WORLD_SIZE", "1", False)])
def test_cluster_env_initializes_with_auto_detection(clean_env, name, value, starts):
    monkeypatch, calls = clean_env
    monkeypatch.setenv(name, value)
    assert mesh_lib.maybe_initialize_distributed() is starts
    assert calls == ([{}] if starts else [])


def test_already_initialized_is_left_alone(clean_env):
    monkeypatch, calls = clean_env
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert mesh_lib.maybe_initialize_distributed() is False
    assert calls == []
