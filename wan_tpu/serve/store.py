"""The durable job store: one SQLite file (WAL mode) holds every accepted job and its state; results live
beside it in `videos/`, written under a temporary name and renamed into place.

A job is committed before its `POST` is answered, and its state changes are committed as they happen, so a
server killed at any point (SIGKILL included) and started again on the same folder loses nothing:
`recover()` puts the job that was running back in the queue (it runs again from the start), drops the
temporaries a killed write left, and finishes deletions that were asked for. Result and input paths are
built from the server's own ids only, never from anything a client sent.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass

STATES = ("queued", "in_progress", "completed", "failed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    request TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    deleted INTEGER NOT NULL DEFAULT 0,
    runs INTEGER NOT NULL DEFAULT 0
)
"""


@dataclass(frozen=True)
class Job:
    seq: int
    id: str
    created_at: int
    completed_at: int | None
    status: str
    progress: int
    request: dict
    error_code: str | None
    error_message: str | None
    deleted: bool
    runs: int


class JobStore:
    """Jobs in `folder/jobs.sqlite3`, results in `folder/videos/`, uploaded images in `folder/inputs/`.

    Thread-safe: one connection per thread (SQLite's own locking between them and between processes)."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        self.videos = os.path.join(self.folder, "videos")
        self.inputs = os.path.join(self.folder, "inputs")
        for path in (self.folder, self.videos, self.inputs):
            os.makedirs(path, exist_ok=True)
        self.path = os.path.join(self.folder, "jobs.sqlite3")
        self._hold(os.path.join(self.folder, "server.lock"))
        self._local = threading.local()
        db = self._db()
        db.execute("PRAGMA journal_mode=WAL")  # readers (the API) never wait for the worker's writes
        db.execute(SCHEMA)

    def _hold(self, path: str) -> None:
        """One server per folder: `recover` would take another live server's running job for an interrupted one.
        The lock goes with the process, however it ends."""
        import fcntl

        from wan_tpu.errors import WanInputError

        self._lock_file = open(path, "a")  # held for the store's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise WanInputError(f"another server uses {self.folder}; stop it or pass another --output") from None

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            # synchronous=FULL: a committed job survives a power cut too, not only a killed process.
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=True)
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA busy_timeout=30000")
            db.row_factory = sqlite3.Row
            self._local.db = _Transaction(db)
            db = self._local.db
        return db

    # ---- paths -------------------------------------------------------------------------------

    def video_path(self, job_id: str) -> str:
        return os.path.join(self.videos, f"{_checked(job_id)}.mp4")

    def thumbnail_path(self, job_id: str) -> str:
        return os.path.join(self.videos, f"{_checked(job_id)}.jpg")

    def input_path(self, job_id: str) -> str:
        return os.path.join(self.inputs, f"{_checked(job_id)}.png")

    def remove_files(self, job_id: str) -> None:
        for path in (self.video_path(job_id), self.thumbnail_path(job_id), self.input_path(job_id)):
            if os.path.exists(path):
                os.remove(path)

    # ---- jobs --------------------------------------------------------------------------------

    @staticmethod
    def new_id() -> str:
        return "video_" + secrets.token_hex(16)

    def add(self, job_id: str, request: dict, max_queued: int | None = None) -> Job | None:
        """Commit a queued job; None (nothing added) when `max_queued` jobs are waiting already."""
        with self._db() as db:
            if max_queued is not None:
                (queued,) = db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued' AND deleted=0").fetchone()
                if queued >= max_queued:
                    return None
            db.execute("INSERT INTO jobs (id, created_at, status, request) VALUES (?, ?, 'queued', ?)",
                       (job_id, int(time.time()), json.dumps(request)))
        return self.get(job_id)

    def get(self, job_id: str, *, deleted: bool = False) -> Job | None:
        row = self._db().execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        job = None if row is None else _job(row)
        return None if job is None or (job.deleted and not deleted) else job

    def list(self, *, after: str | None = None, limit: int = 20, order: str = "desc") -> tuple[list[Job], bool] | None:
        """A page of jobs (newest first for `desc`) after the job `after`, and whether more follow; None if
        `after` names no job."""
        where, args = "deleted=0", []
        if after is not None:
            anchor = self.get(after)
            if anchor is None:
                return None
            where += " AND seq " + (">" if order == "asc" else "<") + " ?"
            args.append(anchor.seq)
        rows = self._db().execute(f"SELECT * FROM jobs WHERE {where} ORDER BY seq {'ASC' if order == 'asc' else 'DESC'} "
                                  "LIMIT ?", (*args, limit + 1)).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def counts(self) -> dict[str, int]:
        rows = self._db().execute("SELECT status, COUNT(*) FROM jobs WHERE deleted=0 GROUP BY status").fetchall()
        return {**dict.fromkeys(STATES, 0), **{r[0]: r[1] for r in rows}}

    def next_queued(self) -> Job | None:
        """The oldest queued job, marked in progress (one more run counted)."""
        with self._db() as db:
            row = db.execute("SELECT * FROM jobs WHERE status='queued' AND deleted=0 ORDER BY seq LIMIT 1").fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET status='in_progress', progress=0, runs=runs+1 WHERE seq=?", (row["seq"],))
        return self.get(row["id"])

    def set_progress(self, job_id: str, progress: int) -> None:
        with self._db() as db:
            db.execute("UPDATE jobs SET progress=? WHERE id=? AND status='in_progress'", (int(progress), job_id))

    def finish(self, job_id: str, *, error_code: str | None = None, error_message: str | None = None) -> None:
        """Completed (no error) or failed with a reason."""
        status = "failed" if error_code else "completed"
        with self._db() as db:
            db.execute("UPDATE jobs SET status=?, progress=?, completed_at=?, error_code=?, error_message=? WHERE id=?",
                       (status, 100 if status == "completed" else 0, int(time.time()), error_code, error_message, job_id))

    def requeue(self, job_id: str) -> None:
        """Back in the queue at its old place (a drain stopped it): it runs again from the start."""
        with self._db() as db:
            db.execute("UPDATE jobs SET status='queued', progress=0 WHERE id=?", (job_id,))

    def mark_deleted(self, job_id: str) -> Job | None:
        """Hide a job from the API at once (the worker stops it at its next safe point); its row and files
        go with `purge`."""
        with self._db() as db:
            db.execute("UPDATE jobs SET deleted=1 WHERE id=? AND deleted=0", (job_id,))
        return self.get(job_id, deleted=True)

    def purge(self, job_id: str) -> None:
        self.remove_files(job_id)
        with self._db() as db:
            db.execute("DELETE FROM jobs WHERE id=?", (job_id,))

    def recover(self) -> list[str]:
        """At start: the job a killed server was running goes back to the queue, deletions asked for are
        finished, temporaries of killed writes are removed. Returns the ids put back in the queue."""
        for row in self._db().execute("SELECT id FROM jobs WHERE deleted=1").fetchall():
            self.purge(row["id"])
        with self._db() as db:
            rerun = [r["id"] for r in db.execute("SELECT id FROM jobs WHERE status='in_progress'").fetchall()]
            db.execute("UPDATE jobs SET status='queued', progress=0 WHERE status='in_progress'")
        for folder in (self.videos, self.inputs):
            for name in os.listdir(folder):
                if name.startswith("."):
                    os.remove(os.path.join(folder, name))
        return rerun


class _Transaction:
    """A connection whose `with` block is one immediate transaction (BEGIN IMMEDIATE ... COMMIT): the
    count-then-insert of `add` cannot race another thread's insert."""

    def __init__(self, connection: sqlite3.Connection):
        self.connection = connection

    def execute(self, *args):
        return self.connection.execute(*args)

    def __enter__(self):
        self.connection.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type, exc, tb):
        self.connection.execute("ROLLBACK" if exc_type else "COMMIT")


def _job(row) -> Job:
    return Job(seq=row["seq"], id=row["id"], created_at=row["created_at"], completed_at=row["completed_at"],
               status=row["status"], progress=row["progress"], request=json.loads(row["request"]),
               error_code=row["error_code"], error_message=row["error_message"], deleted=bool(row["deleted"]),
               runs=row["runs"])


def _checked(job_id: str) -> str:
    # Paths are built from server-made ids only; this guards against a caller passing anything else.
    if not (job_id.startswith("video_") and len(job_id) == 38 and all(c in "0123456789abcdef" for c in job_id[6:])):
        raise ValueError(f"not a job id: {job_id!r}")
    return job_id
