"""The one worker thread: runs the stored jobs one at a time, oldest first, on the server's devices.

Runs are serial per device set (the pipelines are not re-entrant, and one job at a time uses the whole
mesh); same-shape jobs reuse the programs the first one compiled (the pipeline's caches). A delete stops
its job at the next safe point (after a denoise step, before the write) and removes its files; a drain
(SIGTERM) lets the running job finish within the grace period, else stops it at the next safe point and
puts it back in the queue, and starts no other.

A server over several processes (`wan_tpu.runtime.distributed`): process 0's worker tells the others each
job it starts (`JobChannel`: its request and uploaded image) and, after every denoise step, whether the job
goes on, so that every process stops a job at the same safe point; the others `follow`, running each job on
the whole mesh, and write nothing. The job's key-value store carries both, not a device collective: a
follower waits for the next job as long as the server is idle.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time

from wan_tpu.errors import NonFiniteError, WanInputError

# Uploaded images go to the other processes in pieces of this size (the body limit allows 64 MiB and more).
CHUNK = 4 * 2**20
POLL_S = 0.25


class JobStopped(Exception):
    """Raised at a safe point of a job that was deleted or whose drain grace ran out."""


class Worker:
    def __init__(self, store, videos, metrics=None, log=None, device_lock: threading.Lock | None = None,
                 channel: JobChannel | None = None):
        self.store, self.videos, self.metrics = store, videos, metrics
        self.channel = channel  # a server over several processes: the others run each job too
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
            image = self.store.input_path(job.id) if job.request.get("image") else None
            with self.device_lock, self._told(job, image, on_step) as step:
                self.videos.run(job.request, image, self.store.video_path(job.id), self.store.thumbnail_path(job.id),
                                step)
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

    def _told(self, job, image: str | None, on_step):
        """The job's step callback; with a channel, the job told to the other processes first."""
        if self.channel is None:
            return contextlib.nullcontext(on_step)
        return self.channel.announce(job.id, job.request, image, on_step)


class JobChannel:
    """Process 0's side of a server over several processes (module docstring); `follow` is the others'.

    Keys: `serve/{n}/job` (the n-th job run: id, request, image pieces), `serve/{n}/image/{i}`,
    `serve/{n}/step/{done}` ("go", or why the job stopped there), `serve/ended/{n}` (the run is over, however it
    ended), `serve/end` (the server stopped: the signal's number, 0 for none)."""

    def __init__(self):
        self.runs = 0

    @contextlib.contextmanager
    def announce(self, job_id: str, request: dict, image: str | None, on_step):
        """Around one job's run: the job published; yields its step callback, which publishes each step's outcome."""
        from wan_tpu.runtime import distributed

        self.runs += 1
        n = self.runs
        if n > 1:  # the others have read all of it: the last run's collectives needed every process
            distributed.forget(f"serve/{n - 1}/")
        data = b""
        if image is not None:
            with open(image, "rb") as f:
                data = f.read()
        pieces = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
        for i, piece in enumerate(pieces):
            distributed.publish(f"serve/{n}/image/{i}", piece)
        distributed.publish(f"serve/{n}/job", json.dumps({"id": job_id, "request": request, "pieces": len(pieces)}))

        def step(done: int, total: int) -> None:
            try:
                on_step(done, total)
            except JobStopped as e:
                distributed.publish(f"serve/{n}/step/{done}", str(e))
                raise
            distributed.publish(f"serve/{n}/step/{done}", "go")

        try:
            yield step
        finally:
            distributed.publish(f"serve/ended/{n}", "1")

    def close(self, signum: int | None) -> None:
        """The server has stopped (by `signum`, or by itself): the others end as it does, and all leave together."""
        from wan_tpu.runtime import distributed

        distributed.publish("serve/end", str(signum or 0))
        distributed.stop_together()


def follow(videos) -> None:
    """A process other than 0 of a server over several processes: run every job process 0 runs, in order, on
    the whole mesh, stopping where it stops; returns when its server stops by itself, raises
    `wan_tpu.runtime.interrupt.Interrupted` when a signal stopped it (or this process)."""
    from wan_tpu.runtime import distributed, interrupt

    def wait(key: str, ended: str) -> bytes | None:
        """The value of `key`; None if `ended` is published without it."""
        while True:
            interrupt.check()
            value = distributed.wait_for(key, POLL_S)
            if value is not None:
                return value
            if distributed.lookup(ended) is not None:
                return distributed.lookup(key)  # published just before `ended`, or never

    with tempfile.TemporaryDirectory(prefix="wan_tpu-serve-") as scratch:
        n = 0
        while True:
            n += 1
            told = wait(f"serve/{n}/job", "serve/end")
            if told is None:
                signum = int(distributed.lookup("serve/end"))
                distributed.stop_together()
                if signum:
                    raise interrupt.Interrupted(signum)
                return
            job = json.loads(told)
            image = None
            if job["pieces"]:
                image = os.path.join(scratch, "input.png")
                with open(image, "wb") as f:
                    for i in range(job["pieces"]):
                        f.write(wait(f"serve/{n}/image/{i}", f"serve/ended/{n}") or b"")

            def step(done: int, total: int, n=n) -> None:
                outcome = wait(f"serve/{n}/step/{done}", f"serve/ended/{n}")
                if outcome != b"go":
                    raise JobStopped((outcome or b"ended").decode())

            try:
                # Process 0 writes the video; here the frames go nowhere, the thumbnail to the scratch folder.
                videos.run(job["request"], image, os.path.join(scratch, "video.mp4"), os.path.join(scratch, "video.jpg"),
                           step)
            except (JobStopped, WanInputError, NonFiniteError):
                pass  # stopped where process 0 stopped it, or failed as it fails there (it records the failure)
            except Exception as e:  # noqa: BLE001 - as on process 0: the job failed, the server goes on
                what = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                sys.stderr.write(f"job {job['id']} failed on process {distributed.process_index()}: {what}\n")
                sys.stderr.flush()
