"""OpenAI's Files and Batch API over the batch store (deployments/batch_store.py): what the
Router's `/v1/files` and `/v1/batches` routes answer, in OpenAI's shapes. The worker that runs
the batches is deployments/batch_runner.py."""
from __future__ import annotations

import re

from .batch_runner import ENDPOINTS, MAX_LINES
from .batch_store import BatchStore
from .protocol import BadRequest, NotFound, PayloadTooLarge

PURPOSE = "batch"  # the one purpose files are uploaded for here (batch_output: the answers)
WINDOW = re.compile(r"^(\d+)([hm])$")  # "24h" as OpenAI's; hours or minutes here
MAX_WINDOW_S = 7 * 24 * 3600
MAX_METADATA = 16  # OpenAI's: keys of a batch's metadata


def upload(store: BatchStore, purpose: str | None, filename: str, data: bytes, max_bytes: int) -> dict:
    """A batch input file, kept: JSONL within `max_bytes` and MAX_LINES lines (413 above)."""
    if purpose != PURPOSE:
        raise BadRequest(f"purpose must be {PURPOSE!r} (files here are batch inputs), got {purpose!r}", "purpose")
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"the file is {len(data)} bytes, over the limit of {max_bytes} (batch_file_mb)",
                              "file")
    lines = sum(1 for line in data.splitlines() if line.strip())
    if lines > MAX_LINES:
        raise PayloadTooLarge(f"the file has {lines} lines, over the {MAX_LINES} a batch may hold", "file")
    return store.create_file(purpose, filename or "upload.jsonl", data)


def list_files(store: BatchStore, purpose: str | None, after: str | None, limit: int) -> dict:
    """Oldest first, `limit` of them after the file `after` (OpenAI's cursor), and whether more follow."""
    if not 1 <= limit <= 10_000:
        raise BadRequest(f"limit must be in [1, 10000], got {limit}", "limit")
    files = store.list_files(purpose)
    if after is not None:
        ids = [f["id"] for f in files]
        files = files[ids.index(after) + 1:] if after in ids else []
    return listing(files[:limit], len(files) > limit)


def file_of(store: BatchStore, file_id: str) -> dict:
    found = store.get_file(file_id)
    if found is None:
        raise NotFound(f"no file {file_id!r}", "file_id")
    return found


def content(store: BatchStore, file_id: str) -> bytes:
    data = store.file_content(file_id)
    if data is None:
        raise NotFound(f"no file {file_id!r}", "file_id")
    return data


def delete(store: BatchStore, file_id: str) -> dict:
    if not store.delete_file(file_id):
        raise NotFound(f"no file {file_id!r}", "file_id")
    return {"id": file_id, "object": "file", "deleted": True}


def window_seconds(window) -> int:
    """`completion_window` ("24h" as OpenAI's; any hours or minutes up to a week here) in seconds."""
    match = WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * (3600 if match[2] == "h" else 60) if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise BadRequest(f"completion_window must be hours or minutes up to a week, as '24h', got {window!r}",
                         "completion_window")
    return seconds


def create_batch(store: BatchStore, body) -> dict:
    """A batch of an uploaded file's lines to one endpoint, `validating` until a worker takes it."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
    if unknown:
        raise BadRequest(f"unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0])
    if body.get("endpoint") not in ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.get('endpoint')!r}", "endpoint")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise BadRequest(f"metadata must be an object of at most {MAX_METADATA} string values", "metadata")
    window = window_seconds(body.get("completion_window", "24h"))
    file_id = body.get("input_file_id")
    found = store.get_file(file_id) if isinstance(file_id, str) else None
    if found is None or found["purpose"] != PURPOSE:
        raise BadRequest(f"input_file_id {file_id!r} is no uploaded batch file", "input_file_id")
    return store.create_batch(file_id, body["endpoint"], window, body.get("completion_window", "24h"), metadata)


def batch_of(store: BatchStore, batch_id: str) -> dict:
    found = store.get_batch(batch_id)
    if found is None:
        raise NotFound(f"no batch {batch_id!r}", "batch_id")
    return found


def list_batches(store: BatchStore, after: str | None, limit: int) -> dict:
    if not 1 <= limit <= 100:
        raise BadRequest(f"limit must be in [1, 100], got {limit}", "limit")
    return listing(*store.list_batches(after, limit))


def listing(page: list[dict], more: bool) -> dict:
    """A page of a list in OpenAI's shape, with its cursors."""
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": more}


def cancel(store: BatchStore, batch_id: str) -> dict:
    batch_of(store, batch_id)
    return store.cancel(batch_id)
