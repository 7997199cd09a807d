"""The one worker thread: runs the stored jobs one at a time, oldest first, on the server's devices.

Runs are serial per device set (the pipelines are not re-entrant, and one job at a time uses the whole
mesh); same-shape jobs reuse the programs the first one compiled (the pipeline's caches). A delete stops
its job at the next safe point (after a denoise step, before the write) and removes its files; a drain
(SIGTERM) lets the running job finish within the grace period, else stops it at the next safe point and
puts it back in the queue, and starts no other.
"""

from __future__ import annotations

import threading
import time

from wan_tpu.errors import NonFiniteError, WanInputError


class JobStopped(Exception):
    """Raised at a safe point of a job that was deleted or whose drain grace ran out."""


class Worker:
    def __init__(self, store, videos, metrics=None, log=None, device_lock: threading.Lock | None = None):
        self.store, self.videos, self.metrics = store, videos, metrics
        self.log = log or (lambda **fields: None)
        # Shared with the synchronous routes (UnifoLM's /predict_action): one user of the devices at a time.
        self.device_lock = device_lock or threading.Lock()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._current: str | None = None
        self._cancelled: set[str] = set()
        self._draining = False
        self._deadline = float("inf")
        self.thread = threading.Thread(target=self._loop, name="wan_tpu-serve-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def notify(self) -> None:
        """A job was queued."""
        self._wake.set()

    def delete(self, job_id: str) -> None:
        """Hide the job now; purge it now, or, if it is running, once it stops at its next safe point."""
        with self._lock:
            self.store.mark_deleted(job_id)
            if self._current == job_id:
                self._cancelled.add(job_id)
            else:
                self.store.purge(job_id)

    def drain(self, grace: float) -> None:
        """Start no other job; stop the running one at its next safe point after `grace` seconds."""
        with self._lock:
            self._draining = True
            self._deadline = time.monotonic() + max(0.0, grace)
        self._wake.set()

    @property
    def running(self) -> str | None:
        return self._current

    def join(self, timeout: float | None = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # ---- the thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._draining:
                    return
                job = self.store.next_queued()
                self._current = None if job is None else job.id
            if job is None:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            self._run(job)

    def _checkpoint(self, job_id: str) -> None:
        with self._lock:
            if job_id in self._cancelled:
                raise JobStopped("deleted")
            if self._draining and time.monotonic() >= self._deadline:
                raise JobStopped("drain")

    def _run(self, job) -> None:
        started = last = time.perf_counter()

        def on_step(done: int, total: int) -> None:
            nonlocal last
            now = time.perf_counter()
            if self.metrics is not None:
                self.metrics.step_seconds.observe(now - last)
            last = now
            self.store.set_progress(job.id, min(99, 100 * done // total))
            self._checkpoint(job.id)

        outcome, error = "completed", None
        self.log(event="job_started", id=job.id, run=job.runs)
        try:
            self._checkpoint(job.id)
            with self.device_lock:
                self.videos.run(job.request, self.store.input_path(job.id) if job.request.get("image") else None,
                                self.store.video_path(job.id), self.store.thumbnail_path(job.id), on_step)
        except JobStopped as e:
            outcome = str(e)
        except WanInputError as e:
            outcome, error = "failed", ("invalid_request", str(e))
        except NonFiniteError as e:
            outcome, error = "failed", ("non_finite", str(e))
        except Exception as e:  # noqa: BLE001 - a failed job is reported in its record; the server keeps serving
            outcome, error = "failed", ("internal_error", " ".join(f"{type(e).__name__}: {e}".split())[:300])
        except BaseException:
            # Not the job's failure but the process's end (an interrupt): the job runs again at the next start.
            with self._lock:
                self.store.requeue(job.id)
                self._current = None
            raise
        with self._lock:
            self._current = None
            if job.id in self._cancelled:
                self._cancelled.discard(job.id)
                self.store.purge(job.id)
                outcome = "deleted"
            elif outcome == "drain":
                self.store.requeue(job.id)
            elif outcome == "failed":
                self.store.finish(job.id, error_code=error[0], error_message=error[1])
            else:
                self.store.finish(job.id)
        if self.metrics is not None:
            self.metrics.jobs_finished.labels(outcome).inc()
        self.log(event="job_" + outcome, id=job.id, seconds=round(time.perf_counter() - started, 3),
                 **({"error": error[1]} if error else {}))
