"""Batch jobs' durable state: uploaded files, batches and each line's answer (OpenAI's Files and
Batch API, served by the Router: deployments/batches.py). Plain Python, no Ray.

The state is SQL: in SQLite by default (one file in WAL mode: the Router replicas of a node
share it), in PostgreSQL when the config names a URL (a cluster's shared store: every Router
replica and node sees the same batches); the same statements run on both. The files' bytes live beside it in `FileStorage`
(a directory, or any filesystem pyarrow opens by URI), the store holds their metadata.

Exactly one worker drives a batch at a time: `claim` takes a lease on a batch that needs work
(its lease free or run out) and `renew` extends it; a worker that lost its lease stops. Each
line's answer is recorded once (`record_line`: the first write wins, the counts move with it),
so a batch resumed after a restart (or a Router replica lost) redoes only the lines with no
answer, and its output holds each line once.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

# Statuses of OpenAI's Batch object, and those a worker drives on.
VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
ACTIVE = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL, location TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL, errors TEXT,
    created_at BIGINT NOT NULL, created DOUBLE PRECISION NOT NULL, expires_at BIGINT NOT NULL, in_progress_at BIGINT,
    finalizing_at BIGINT, completed_at BIGINT, failed_at BIGINT, expired_at BIGINT,
    cancelling_at BIGINT, cancelled_at BIGINT, output_file_id TEXT, error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, lease_owner TEXT, lease_until DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, ok INTEGER NOT NULL,
    result TEXT NOT NULL, PRIMARY KEY (batch_id, line));
"""
BATCH_COLUMNS = ("id", "input_file_id", "endpoint", "completion_window", "metadata", "status", "errors",
                 "created_at", "expires_at", *TIMESTAMPS, "output_file_id", "error_file_id", "total",
                 "completed", "failed")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class FileStorage:
    """The files' bytes, one object per file id: under a local directory, or under a URI any
    pyarrow filesystem opens (`s3://bucket/prefix`), so every node reads the same files."""

    def __init__(self, location: str):
        from pyarrow import fs
        if "://" in location:
            self.fs, self.root = fs.FileSystem.from_uri(location)
        else:
            os.makedirs(location, exist_ok=True)
            self.fs, self.root = fs.LocalFileSystem(), os.path.abspath(location)
        self.root = self.root.rstrip("/")

    def path(self, file_id: str) -> str:
        return f"{self.root}/{file_id}"

    def write(self, file_id: str, data: bytes) -> str:
        path = self.path(file_id)
        with self.fs.open_output_stream(path) as f:
            f.write(data)
        return path

    def read(self, location: str) -> bytes:
        with self.fs.open_input_stream(location) as f:
            return f.read()

    def delete(self, location: str) -> None:
        from pyarrow import fs
        if self.fs.get_file_info(location).type != fs.FileType.NotFound:
            self.fs.delete_file(location)


class SQLite:
    """SQLite through one connection (and one lock: its statements are short); other processes
    on the node share the file (WAL; a write waits for another's)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA busy_timeout=30000")  # another process's write: wait, not fail
        self.lock = threading.Lock()
        with self.lock:
            self.db.executescript(SCHEMA)  # its own transaction

    def read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql, args).fetchall()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def close(self) -> None:
        self.db.close()


class PostgreSQL:
    """PostgreSQL by URL (psycopg), one connection under a lock: a cluster's shared store."""

    def __init__(self, url: str):
        import psycopg
        self.db = psycopg.connect(url, autocommit=True)
        self.lock = threading.Lock()
        with self.lock, self.db.transaction():
            self.db.execute(SCHEMA)

    def read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql.replace("?", "%s"), args).fetchall()

    @contextmanager
    def transaction(self):
        with self.lock, self.db.transaction():
            yield self

    def execute(self, sql: str, args: tuple = ()):
        return self.db.execute(sql.replace("?", "%s"), args)

    def close(self) -> None:
        self.db.close()


class BatchStore:
    """Files, batches and lines in SQLite (`location`: its file, made with its folder) or
    PostgreSQL (`location`: a postgresql:// URL), their bytes in `storage`. Thread-safe."""

    def __init__(self, location: str, storage: FileStorage):
        self.storage = storage
        self._sql = PostgreSQL(location) if location.startswith(("postgresql://", "postgres://")) else SQLite(location)

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._sql.read(sql, args)

    def _transaction(self):
        return self._sql.transaction()

    def close(self) -> None:
        self._sql.close()

    # -- files -------------------------------------------------------------------------------
    def create_file(self, purpose: str, filename: str, data: bytes) -> dict:
        file_id = new_id("file")
        location = self.storage.write(file_id, data)
        row = (file_id, purpose, filename, len(data), int(time.time()), location)
        with self._transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", row)
        return file_object(row)

    def get_file(self, file_id: str) -> dict | None:
        rows = self._read("SELECT * FROM files WHERE id = ?", (file_id,))
        return file_object(rows[0]) if rows else None

    def list_files(self, purpose: str | None = None) -> list[dict]:
        rows = (self._read("SELECT * FROM files ORDER BY created_at, id") if purpose is None else
                self._read("SELECT * FROM files WHERE purpose = ? ORDER BY created_at, id", (purpose,)))
        return [file_object(row) for row in rows]

    def file_content(self, file_id: str) -> bytes | None:
        rows = self._read("SELECT location FROM files WHERE id = ?", (file_id,))
        return self.storage.read(rows[0][0]) if rows else None

    def delete_file(self, file_id: str) -> bool:
        with self._transaction() as db:
            row = db.execute("SELECT location FROM files WHERE id = ?", (file_id,)).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.storage.delete(row[0])
        return True

    # -- batches -----------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, window_s: int, completion_window: str,
                     metadata: dict | None) -> dict:
        created = time.time()  # `created_at` in seconds, as OpenAI's; `created` orders batches of one second
        batch_id = new_id("batch")
        with self._transaction() as db:
            db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, metadata, status, "
                       "created_at, created, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (batch_id, input_file_id, endpoint, completion_window,
                        json.dumps(metadata) if metadata is not None else None, VALIDATING, int(created), created,
                        int(created) + window_s))
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict | None:
        rows = self._read(f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE id = ?", (batch_id,))
        return batch_object(rows[0]) if rows else None

    def list_batches(self, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """Newest first, `limit` of them after the batch `after` (OpenAI's cursor); and whether
        more follow."""
        cursor = ""
        if after is not None:
            rows = self._read("SELECT created FROM batches WHERE id = ?", (after,))
            if not rows:
                return [], False
            cursor, args = " WHERE (created, id) < (?, ?)", (rows[0][0], after)
        else:
            args = ()
        rows = self._read(f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches{cursor} "
                          f"ORDER BY created DESC, id DESC LIMIT ?", (*args, limit + 1))
        return [batch_object(row) for row in rows[:limit]], len(rows) > limit

    def cancel(self, batch_id: str) -> dict | None:
        """A batch not yet finished goes to `cancelling` (its worker ends it as `cancelled`)."""
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = ?, cancelling_at = ? WHERE id = ? AND status IN (?, ?)",
                       (CANCELLING, int(time.time()), batch_id, VALIDATING, IN_PROGRESS))
        return self.get_batch(batch_id)

    # -- the worker's side: leases, lines, status -----------------------------------------------
    def claim(self, owner: str, lease_s: float) -> dict | None:
        """The oldest batch that needs work and that no live worker holds, its lease now
        `owner`'s; None when there is none."""
        now = time.time()
        with self._transaction() as db:
            row = db.execute(f"SELECT id FROM batches WHERE status IN ({', '.join('?' * len(ACTIVE))}) "
                             "AND (lease_until IS NULL OR lease_until < ?) ORDER BY created, id LIMIT 1",
                             (*ACTIVE, now)).fetchone()
            if row is None:
                return None
            # Taken only if still free: two workers that read the same row take it once.
            taken = db.execute("UPDATE batches SET lease_owner = ?, lease_until = ? WHERE id = ? "
                               "AND (lease_until IS NULL OR lease_until < ?)", (owner, now + lease_s, row[0], now)).rowcount
        return self.get_batch(row[0]) if taken == 1 else None

    def renew(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Extend `owner`'s lease; False when it is no longer `owner`'s (it ran out and another
        worker took the batch): the worker stops."""
        with self._transaction() as db:
            changed = db.execute("UPDATE batches SET lease_until = ? WHERE id = ? AND lease_owner = ?",
                                 (time.time() + lease_s, batch_id, owner)).rowcount
        return changed == 1

    def release(self, batch_id: str, owner: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE batches SET lease_owner = NULL, lease_until = NULL WHERE id = ? AND lease_owner = ?",
                       (batch_id, owner))

    def set_status(self, batch_id: str, owner: str, status: str, **fields) -> bool:
        """The batch's status (and its timestamp, `<status>_at`, now) and other columns, if
        `owner` still holds its lease."""
        fields = {**fields, "status": status}
        if f"{status}_at" in TIMESTAMPS:
            fields[f"{status}_at"] = int(time.time())
        columns = ", ".join(f"{name} = ?" for name in fields)
        with self._transaction() as db:
            changed = db.execute(f"UPDATE batches SET {columns} WHERE id = ? AND lease_owner = ?",
                                 (*fields.values(), batch_id, owner)).rowcount
        return changed == 1

    def record_line(self, batch_id: str, line: int, custom_id: str | None, ok: bool, result: dict) -> bool:
        """A line's answer, kept if it is the first for that line (the counts move with it);
        False if the line had one already."""
        with self._transaction() as db:
            inserted = db.execute("INSERT INTO lines VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                                  (batch_id, line, custom_id, int(ok), json.dumps(result))).rowcount
            if inserted:
                db.execute(f"UPDATE batches SET {'completed' if ok else 'failed'} = "
                           f"{'completed' if ok else 'failed'} + 1 WHERE id = ?", (batch_id,))
        return inserted == 1

    def done_lines(self, batch_id: str) -> set[int]:
        return {row[0] for row in self._read("SELECT line FROM lines WHERE batch_id = ?", (batch_id,))}

    def line_results(self, batch_id: str) -> Iterator[tuple[bool, dict]]:
        """Each recorded line's (ok, result), in line order."""
        for ok, result in self._read("SELECT ok, result FROM lines WHERE batch_id = ? ORDER BY line", (batch_id,)):
            yield bool(ok), json.loads(result)


def file_object(row: tuple) -> dict:
    """OpenAI's FileObject of a `files` row."""
    file_id, purpose, filename, size, created_at, _ = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


def batch_object(row: tuple) -> dict:
    """OpenAI's Batch object of a `batches` row."""
    batch = dict(zip(BATCH_COLUMNS, row))
    total, completed, failed = batch.pop("total"), batch.pop("completed"), batch.pop("failed")
    batch["metadata"] = json.loads(batch["metadata"]) if batch["metadata"] else None
    batch["errors"] = json.loads(batch["errors"]) if batch["errors"] else None
    return {**batch, "object": "batch", "request_counts": {"total": total, "completed": completed, "failed": failed}}
