"""`StageTimer`'s per-stage peak device memory (`wan_tpu.runtime.profiling`), on a device whose
`memory_stats()` the test drives: exact where the process's peak rose during the stage, else the in-use
bytes seen (marked ≥); nothing where the backend reports no memory (CPU); the timing rows stay as they
were (what `benchmarks/bench_e2e.py` and `bench_offload.py` parse)."""

import re

import jax
import pytest

from wan_tpu.runtime.profiling import PEAK_HEADER, StageTimer

GiB = 2**30


class FakeDevice:
    def __init__(self):
        self.stats = {"bytes_in_use": 0, "peak_bytes_in_use": 0, "bytes_limit": 16 * GiB}

    def use(self, n):
        self.stats["bytes_in_use"] = n
        self.stats["peak_bytes_in_use"] = max(self.stats["peak_bytes_in_use"], n)

    def memory_stats(self):
        return dict(self.stats)


def test_each_stage_has_its_own_peak(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(jax, "local_devices", lambda: [device])
    timer = StageTimer()
    with timer.stage("load text encoder"):
        device.use(6 * GiB)
    with timer.stage("text encode"):
        device.use(7 * GiB)
        device.use(2 * GiB)  # the text encoder released
    with timer.stage("denoise"):
        device.use(1 * GiB)
        device.use(5 * GiB)  # below the earlier peak: what is seen
    with timer.stage("denoise"):  # a stage run again: its largest
        device.use(4 * GiB)
    assert timer.peaks == {"load text encoder": (6 * GiB, True), "text encode": (7 * GiB, True),
                           "denoise": (5 * GiB, False)}
    text = timer.table([("compile cache", "3 hits")])
    head, _, peaks = text.partition(PEAK_HEADER + "\n")
    assert set(re.findall(r"^(\S.*?)\s{2,}[\d.]+ s$", head, flags=re.M)) == {"load text encoder", "text encode", "denoise",
                                                                              "total"}
    assert re.findall(r"^  (\S.*?)\s{2,}(≥?[\d.]+)$", peaks, flags=re.M) == [
        ("load text encoder", "6.00"), ("text encode", "7.00"), ("denoise", "≥5.00")]


def test_no_peaks_without_memory_stats():
    timer = StageTimer()
    with timer.stage("decode"):
        pass
    if jax.local_devices()[0].memory_stats() is not None:
        pytest.skip("this backend reports memory")
    assert timer.peaks == {} and PEAK_HEADER not in timer.table()
