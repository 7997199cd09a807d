"""`benchmarks/bench_multigpu.py`'s arithmetic and its bit-for-bit check, without GPUs: the volumes each device
receives per step (by hand for the 14B config), the prediction recovering the bandwidth it was given, and the
comparison of the one-process and four-process step outputs."""

import bench_multigpu as bench
import numpy as np
import pytest

from wan_tpu.configs.models import VARIANTS


def test_volumes_by_hand():
    cfg = VARIANTS["wan2.1-t2v-14b"].transformer
    d, f, layers, tokens = cfg.inner_dim, cfg.ffn_dim, cfg.num_layers, 75_600
    v = bench.volumes(cfg, tokens, 4)
    assert (d, f, layers) == (5120, 13824, 40)
    assert v["fsdp_weights"] == pytest.approx(0.75 * 40 * (8 * 5120**2 + 2 * 5120 * 13824) * 2)
    assert v["kv_allgather"] == pytest.approx(0.75 * 40 * 2 * 2 * tokens * 5120 * 2)
    assert v["ulysses_alltoall"] == pytest.approx(v["kv_allgather"] * 2 / 4)  # 4 tensors of 1/n vs 2 whole ones
    assert bench.volumes(cfg, tokens, 1) == {"fsdp_weights": 0.0, "kv_allgather": 0.0, "ulysses_alltoall": 0.0}


def test_prediction_recovers_the_bandwidth_it_was_built_from():
    """A 4-GPU step made of a quarter of the 1-GPU compute plus its volume at 300 GB/s: the model reports
    300 GB/s, and 8 GPUs cost an eighth of the compute plus the 8-way volume at that rate."""
    cfg = VARIANTS["wan2.1-t2v-14b"].transformer
    t1 = 20_000.0
    moved4 = sum(v for k, v in bench.volumes(cfg, 75_600, 4).items() if k != "ulysses_alltoall")
    t4 = t1 / 4 + moved4 / 300e9 * 1e3
    rows = {where: (ms, how) for where, ms, how in bench.predict(t1, t4)}
    assert "achieved 300 GB/s" in rows["4 GPUs (measured)"][1]
    moved8 = sum(v for k, v in bench.volumes(cfg, 75_600, 8).items() if k != "ulysses_alltoall")
    assert rows["8 GPUs"][0] == pytest.approx(t1 / 8 + moved8 / 300e9 * 1e3)
    assert set(rows) == {"4 GPUs (measured)", "8 GPUs", "v6e-16", "v7x-16"}


def test_outputs_compared_bit_for_bit(tmp_path):
    one, many = (tmp_path / name for name in bench.LATENTS.values())
    assert bench._compare_latents(str(tmp_path)) is None  # neither row ran
    a = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    np.save(one, a)
    assert "wrote none" in bench._compare_latents(str(tmp_path))
    np.save(many, a.copy())
    assert bench._compare_latents(str(tmp_path)).endswith("equal bit for bit")
    b = a.copy()
    b[0, 0, 0] = np.nextafter(b[0, 0, 0], np.float32(np.inf))  # one ulp
    np.save(many, b)
    assert "NOT equal; max abs difference" in bench._compare_latents(str(tmp_path))
