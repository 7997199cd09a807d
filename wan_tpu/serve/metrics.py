"""`/metrics`: Prometheus text (`prometheus_client`) from a registry of the server's own.

Counted as they happen: requests by route, method and status, their latency, the seconds of each
denoise step, finished jobs by outcome. Read at each scrape: jobs by state and the queue depth (from
the job store), the compile cache's hits and writes (`wan_tpu.runtime.compile_cache.stats`), and the
devices' memory in use and limit where the backend reports it (GPU, TPU; not the CPU).
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ID = re.compile(r"video_[0-9a-f]{32}")


def route_label(path: str) -> str:
    """The path with job ids replaced, so that the label set stays small."""
    return _ID.sub("{id}", path) if path.startswith("/v1/") else path


class Metrics:
    def __init__(self, store=None):
        self.registry = CollectorRegistry()
        self.requests = Counter("wan_serve_requests", "HTTP requests answered", ("route", "method", "status"),
                                registry=self.registry)
        self.latency = Histogram("wan_serve_request_seconds", "time to answer a request", ("route",),
                                 registry=self.registry)
        self.step_seconds = Histogram("wan_serve_step_seconds", "wall time of one denoise step (the first of a new shape "
                                      "includes its compile)", registry=self.registry,
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.jobs_finished = Counter("wan_serve_jobs_finished", "jobs that ended, by outcome", ("outcome",),
                                     registry=self.registry)
        self.registry.register(_Live(store))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Values read at scrape time."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        if self.store is not None:
            counts = self.store.counts()
            jobs = GaugeMetricFamily("wan_serve_jobs", "jobs in the store by state", labels=("state",))
            for state, n in counts.items():
                jobs.add_metric((state,), n)
            yield jobs
            yield GaugeMetricFamily("wan_serve_queue_depth", "jobs waiting to run", value=counts["queued"])
        from wan_tpu.runtime import compile_cache

        stats = compile_cache.stats()
        yield GaugeMetricFamily("wan_serve_compile_cache_hits", "programs loaded from the compile cache", value=stats.hits)
        yield GaugeMetricFamily("wan_serve_compile_cache_writes", "programs compiled and written to the compile cache",
                                value=stats.writes)
        yield GaugeMetricFamily("wan_serve_whole_programs_loaded", "whole programs loaded from the executable cache",
                                value=stats.programs_loaded)
        memory = GaugeMetricFamily("wan_serve_device_memory_bytes", "device memory (where the backend reports it)",
                                   labels=("device", "kind"))
        for device, kind, value in device_memory():
            memory.add_metric((device, kind), value)
        yield memory


def device_memory() -> list[tuple[str, str, int]]:
    import jax

    out = []
    for device in jax.local_devices():
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        for kind, key in (("in_use", "bytes_in_use"), ("peak", "peak_bytes_in_use"), ("limit", "bytes_limit")):
            if stats and key in stats:
                out.append((str(device.id), kind, int(stats[key])))
    return out
