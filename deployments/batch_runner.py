"""Drives batch jobs (OpenAI's Batch API) to their end: the worker each Router replica runs
beside its requests. Plain Python over a `BatchStore` (deployments/batch_store.py) and an
`answer(endpoint, body) -> (status, body)` callable: the same path an HTTP request of that
endpoint takes, so a line is validated and answered as that request would be.

A batch's life: `validating` (the input file read and checked: a file that is not JSONL fails
the batch; a bad line fails alone, into the error file) -> `in_progress` (the lines without an
answer, `concurrency` at a time; the lease renewed as they go) -> `finalizing` (the output and
error files written from the recorded answers) -> `completed`. `cancelling` ends as `cancelled`
with the answers so far; a batch past its `completion_window` ends as `expired` so. A worker
that loses its lease (it ran out while this one stalled: another took the batch) stops at once;
the other goes on from the recorded lines.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from .batch_store import (CANCELLED, CANCELLING, COMPLETED, EXPIRED, FAILED, FINALIZING, IN_PROGRESS, VALIDATING,
                          BatchStore)

log = logging.getLogger("ray.serve")

ENDPOINTS = ("/v1/chat/completions", "/v1/ocr")
MAX_LINES = 50_000  # OpenAI's limit of lines a batch file holds
RETRYABLE_STATUS = (429, 503)  # the app full (or a replica lost): the line is sent again
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0


class LeaseLost(Exception):
    """Another worker holds the batch now."""


def parse_lines(data: bytes, endpoint: str) -> tuple[list[tuple[int, str | None, dict | None, str | None]], str | None]:
    """The input file's lines: (line number, custom_id, body or None, why the line is refused
    or None), or a reason the whole file is refused. Blank lines are skipped; a later line with
    a `custom_id` seen before is refused."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return [], "the input file is not UTF-8 text"
    lines = [(number, line) for number, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        return [], "the input file has no lines"
    if len(lines) > MAX_LINES:
        return [], f"the input file has {len(lines)} lines, over the {MAX_LINES} a batch may hold"
    parsed, seen = [], set()
    for number, line in lines:
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            parsed.append((number, None, None, f"line {number + 1} is not JSON: {e.msg}"))
            continue
        if not isinstance(request, dict):
            parsed.append((number, None, None, f"line {number + 1} is not a JSON object"))
            continue
        custom_id = request.get("custom_id")
        why = None
        if not isinstance(custom_id, str) or not custom_id:
            why, custom_id = "custom_id must be a non-empty string", None
        elif custom_id in seen:
            why = f"custom_id {custom_id!r} is used by an earlier line"
        elif request.get("method", "POST") != "POST":
            why = "method must be POST"
        elif request.get("url") != endpoint:
            why = f"url must be the batch's endpoint, {endpoint}"
        elif not isinstance(request.get("body"), dict):
            why = "body must be a JSON object"
        elif request["body"].get("stream"):
            why = "a batch line cannot stream"
        if custom_id is not None:
            seen.add(custom_id)
        parsed.append((number, custom_id, request.get("body") if why is None else None, why))
    return parsed, None


def output_line(custom_id: str | None, status: int | None, body: dict | None, error: dict | None) -> dict:
    """An output (or error) file's line, in OpenAI's shape."""
    response = None if status is None else {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}",
                                            "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


class BatchRunner:
    """Claims batches that need work from the store, one at a time, and drives each to its
    end (module docstring)."""

    def __init__(self, store: BatchStore, answer: Callable[[str, dict], Awaitable[tuple[int, dict]]],
                 owner: str | None = None, lease_s: float = 30.0, concurrency: int = 8, poll_s: float = 1.0,
                 metrics: dict | None = None, turn: Callable[[], Awaitable[None]] | None = None):
        self.store, self.answer = store, answer
        self.turn = turn  # awaited before each line goes into the app: while interactive work runs
        self.owner = owner or f"worker-{uuid.uuid4().hex[:12]}"
        self.lease_s, self.concurrency, self.poll_s = lease_s, concurrency, poll_s
        self.metrics = metrics  # router_metrics()'s batch counters; None: not counted (tests)

    async def run_forever(self) -> None:
        while True:
            if not await self.run_once():
                await asyncio.sleep(self.poll_s)

    async def run_once(self) -> bool:
        """Claim a batch that needs work and drive it; False when there was none."""
        batch = await asyncio.to_thread(self.store.claim, self.owner, self.lease_s)
        if batch is None:
            return False
        try:
            await self.drive(batch)
        except LeaseLost:
            log.warning("batch %s: lease lost to another worker; it goes on from the recorded lines", batch["id"])
        except Exception:  # noqa: BLE001 - the batch stays claimable: the next claim retries it
            log.exception("batch %s failed in this worker; released for another try", batch["id"])
            await asyncio.to_thread(self.store.release, batch["id"], self.owner)
        except asyncio.CancelledError:  # the worker is stopped (its replica shuts down): the
            self.store.release(batch["id"], self.owner)  # batch goes back now, not when the lease runs out
            raise
        return True

    async def drive(self, batch: dict) -> None:
        batch_id, store = batch["id"], self.store
        data = await asyncio.to_thread(store.file_content, batch["input_file_id"])
        lines, refused = parse_lines(data, batch["endpoint"]) if data is not None else ([], "the input file is gone")
        if refused is not None:
            await self._set(batch_id, FAILED, errors=json.dumps(
                {"object": "list", "data": [{"code": "invalid_input_file", "message": refused, "line": None}]}))
            return
        if batch["status"] == CANCELLING or time.time() > batch["expires_at"]:
            await self._finish(batch_id, CANCELLED if batch["status"] == CANCELLING else EXPIRED)
            return
        if batch["status"] == VALIDATING:
            await self._set(batch_id, IN_PROGRESS, total=len(lines))
        done = await asyncio.to_thread(store.done_lines, batch_id)
        todo = [line for line in lines if line[0] not in done]
        status = await self._work(batch_id, batch["endpoint"], todo, batch["expires_at"])
        await self._finish(batch_id, status)

    async def _work(self, batch_id: str, endpoint: str, todo: list, expires_at: int) -> str:
        """Answer the lines, `concurrency` at a time; the status the batch ends with."""
        lines = iter(todo)  # shared by the workers: each takes the next line
        stop: list[str] = []

        async def worker():
            for number, custom_id, body, why in lines:
                if stop:
                    return
                if why is not None:
                    result = output_line(custom_id, None, None, {"code": "invalid_request", "message": why})
                    ok = False
                else:
                    status, answer = await self._answer_when_taken(endpoint, body, stop)
                    if status is None:  # stopped while the app was full
                        return
                    ok = 200 <= status < 300
                    problem = answer.get("error") or {}
                    error = None if ok else {"code": problem.get("type", "error"), "message": problem.get("message", "")}
                    result = output_line(custom_id, status, answer, error)
                await asyncio.to_thread(self.store.record_line, batch_id, number, custom_id, ok, result)
                self._count("batch_lines", outcome="ok" if ok else "failed")

        async def watch():
            """Renew the lease, and notice a cancel or the window's end, while the lines run."""
            while True:
                await asyncio.sleep(self.lease_s / 3)
                if not await asyncio.to_thread(self.store.renew, batch_id, self.owner, self.lease_s):
                    stop.append("lost")
                    return
                current = await asyncio.to_thread(self.store.get_batch, batch_id)
                if current["status"] == CANCELLING:
                    stop.append(CANCELLED)
                    return
                if time.time() > expires_at:
                    stop.append(EXPIRED)
                    return
        workers = [asyncio.create_task(worker()) for _ in range(min(self.concurrency, max(1, len(todo))))]
        watcher = asyncio.create_task(watch())

        def stop_lines(_):
            for w in workers if stop else ():
                w.cancel()
        watcher.add_done_callback(stop_lines)
        try:  # a stop cancels the lines in flight (their requests end in the app): not recorded
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            watcher.cancel()
        for w in workers:
            if not w.cancelled() and w.exception() is not None:
                raise w.exception()
        if stop and stop[0] == "lost":
            raise LeaseLost(batch_id)
        current = await asyncio.to_thread(self.store.get_batch, batch_id)
        if current["status"] == CANCELLING:
            return CANCELLED
        return stop[0] if stop else COMPLETED

    async def _answer_when_taken(self, endpoint: str, body: dict, stop: list) -> tuple[int | None, dict | None]:
        """The line's answer; one refused because the app is full or lost a replica (503, 429:
        a batch line is held below interactive work, and may find the app full) is sent again
        after a pause, until it is taken or the batch stops (None)."""
        pause = RETRY_FIRST_S
        while not stop:
            if self.turn is not None:
                await self.turn()
            status, answer = await self.answer(endpoint, body)
            if status not in RETRYABLE_STATUS:
                return status, answer
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)
        return None, None

    def _count(self, metric: str, **tags: str) -> None:
        if self.metrics is not None:
            self.metrics[metric].inc(tags=tags)

    async def _finish(self, batch_id: str, status: str) -> None:
        """The output and error files from the recorded answers, then the batch's last status."""
        if status == COMPLETED:
            await self._set(batch_id, FINALIZING)
        outputs, errors = [], []
        for ok, result in await asyncio.to_thread(lambda: list(self.store.line_results(batch_id))):
            (outputs if ok else errors).append(json.dumps(result))
        files = {}
        for name, rows in (("output_file_id", outputs), ("error_file_id", errors)):
            if rows:
                made = await asyncio.to_thread(self.store.create_file, "batch_output", f"{batch_id}_{name[:-8]}.jsonl",
                                               ("\n".join(rows) + "\n").encode())
                files[name] = made["id"]
        await self._set(batch_id, status, **files)
        await asyncio.to_thread(self.store.release, batch_id, self.owner)
        self._count("batch_batches", status=status)

    async def _set(self, batch_id: str, status: str, **fields) -> None:
        if not await asyncio.to_thread(self.store.set_status, batch_id, self.owner, status, **fields):
            raise LeaseLost(batch_id)
