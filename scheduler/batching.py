"""Requests in, batches out, one batch at a time (plain asyncio; the encoder replicas' queue).

When the batch before is done, the next one takes every request queued by then, oldest first,
as many as fit `max_size` (counted by `size_of`), without waiting for more: a lone request runs
at once, and under load a batch holds whatever arrived while the one before it ran.

Ray Serve's `@serve.batch` does not do this (Ray 2.60): its loop forms the next batch as soon as
the one before is handed to its semaphore, not when that batch is done, so with no wait time the
requests that arrive one by one while a batch runs became batches of one each (measured on the
H200: 1,625 of 1,633 encoder batches held one request at 64 pages in flight).

Batch jobs' items (`submit(..., batch=True)`) wait behind every interactive one: a batch takes
interactive items while any wait, batch items only when none does (never both: the interactive
ones would wait on the batch items' share of it), and at most `batch_max_size` of them (a
quarter of `max_size` by default), so that an interactive item arriving while they run waits
for a short batch, not a full one.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


class BatchQueue:
    def __init__(self, run_batch: Callable[[list], Awaitable[Sequence]], max_size: int,
                 size_of: Callable[[list], int] = len, batch_max_size: int | None = None):
        """`run_batch(items)` returns one result per item, in order; it runs once at a time.
        `size_of(items)` is a batch's size (default: the number of items); `batch_max_size`:
        a batch of batch jobs' items (default max_size // 4)."""
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        self.run_batch, self.max_size, self.size_of = run_batch, max_size, size_of
        self.batch_max_size = batch_max_size or max(1, max_size // 4)
        # Waiting items, interactive and batch jobs' (`submit`), oldest first in each.
        self._pending: deque[tuple[Any, asyncio.Future]] = deque()
        self._pending_batch: deque[tuple[Any, asyncio.Future]] = deque()
        self._arrived: asyncio.Event | None = None  # made in the loop that runs the batches
        self._worker: asyncio.Task | None = None
        self.batches = 0  # batches run so far

    async def submit(self, item, batch: bool = False):
        """`item`'s result, once a batch holding it has run (its exception if the batch
        raised); `batch`: a batch job's item, run below interactive ones. A caller cancelled
        while its item waits leaves the item out of every batch."""
        loop = asyncio.get_running_loop()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        future = loop.create_future()
        (self._pending_batch if batch else self._pending).append((item, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run_batches())
        return await future

    def queued(self) -> int:
        return sum(not future.done() for pending in (self._pending, self._pending_batch) for _, future in pending)

    def _next_batch(self) -> list[tuple[Any, asyncio.Future]]:
        """The oldest waiting items that fit max_size together (at least one: an item bigger
        than max_size runs alone): interactive ones while any wait, else batch jobs'."""
        for pending, max_size in ((self._pending, self.max_size), (self._pending_batch, self.batch_max_size)):
            batch: list[tuple[Any, asyncio.Future]] = []
            while pending:
                item, future = pending[0]
                if future.done():  # its caller was cancelled
                    pending.popleft()
                    continue
                if batch and self.size_of([i for i, _ in batch] + [item]) > max_size:
                    break
                batch.append(pending.popleft())
            if batch:
                return batch
        return []

    async def _run_batches(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while True:
                batch = self._next_batch()
                if not batch:
                    break
                self.batches += 1
                try:
                    results = await self.run_batch([item for item, _ in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"run_batch returned {len(results)} results for "
                                           f"{len(batch)} items")
                except BaseException as e:  # each caller of this batch gets it; the queue goes on
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    if not isinstance(e, Exception):  # cancelled: the next submit starts anew
                        raise
                    continue
                for (_, future), result in zip(batch, results):
                    if not future.done():
                        future.set_result(result)
