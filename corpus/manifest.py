"""What a run has finished, so that a rerun does only the rest.

`DIR/manifest.jsonl` holds one JSON line per finished document attempt. A document's key is the
sha256 of its bytes plus a hash of the options that change its outputs, so an edited file or a
new page range / dpi / preset / max_tokens is done again, while concurrency, server and retries
are not part of it. The last line for a (key, output) wins: an identical file at a second path
still gets its own outputs. Lines are appended whole and fsynced; a process killed mid-write
leaves a torn last line, which is skipped on read (and ended before the next append, so the next
record is not glued to it).

`DIR/.state/<output>.json` keeps a document's per-page results (text, markdown, blocks, errors),
so a rerun of a document with failed pages asks for those pages only and merges them in, and
outputs can be written again in any `--format` without asking the server.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading

MANIFEST = "manifest.jsonl"
STATE_DIR = ".state"
# Options that change what the server returns, per input kind (an image has no pages or dpi).
KEYED_OPTIONS = {"document": ("page_range", "dpi", "preset", "max_tokens"),
                 "image": ("preset", "max_tokens")}


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def options_hash(kind: str, options: dict) -> str:
    keyed = {name: options.get(name) for name in KEYED_OPTIONS[kind]}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def document_key(sha256: str, kind: str, options: dict) -> str:
    return f"{sha256}:{options_hash(kind, options)}"


def write_atomic(path: str, data: bytes) -> None:
    """Write `path` whole or not at all: a temp file beside it, fsynced, then renamed over it."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


class Manifest:
    """The records of `DIR/manifest.jsonl`, and appends to it (thread-safe)."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, MANIFEST)
        self.records: dict[tuple[str, str], dict] = {}
        self.skipped_lines = 0
        self._lock = threading.Lock()
        os.makedirs(out_dir, exist_ok=True)
        self._read()
        self._file = open(self.path, "a", encoding="utf-8")
        if self._ends_torn():
            self._write_line("")  # end the torn line; the next record starts on a line of its own

    def latest(self, key: str, output: str) -> dict | None:
        return self.records.get((key, output))

    def append(self, record: dict) -> None:
        with self._lock:
            self._write_line(json.dumps(record, ensure_ascii=False))
            self.records[(record["key"], record["output"])] = record

    def close(self) -> None:
        self._file.close()

    def _read(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    self.records[(record["key"], record["output"])] = record
                except (ValueError, KeyError, TypeError):
                    self.skipped_lines += int(bool(line.strip()))  # a torn or foreign line

    def _ends_torn(self) -> bool:
        size = os.path.getsize(self.path)
        if size == 0:
            return False
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            return f.read(1) != b"\n"

    def _write_line(self, text: str) -> None:
        self._file.write(text + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


class StateStore:
    """Per-page results of each document, by output name."""

    def __init__(self, out_dir: str):
        self.root = os.path.join(out_dir, STATE_DIR)

    def path(self, output: str) -> str:
        return os.path.join(self.root, *output.split("/")) + ".json"

    def load(self, output: str, key: str) -> dict | None:
        """The stored results for this output, if they were made from the same bytes and options."""
        try:
            with open(self.path(output), encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) and state.get("key") == key else None

    def save(self, output: str, state: dict) -> None:
        write_atomic(self.path(output), json.dumps(state, ensure_ascii=False).encode())
