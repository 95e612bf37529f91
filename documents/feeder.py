"""Feed a PDF's pages through async work with bounded memory: render lazily, a window at a time.

DeepSeek's script renders every page into memory first (a 2,800-page PDF crashes it); here at
most `window` pages are between "render started" and "result handed to the consumer", whatever
the page count.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from PIL import Image

from .pdf import PdfDocument

__all__ = ["map_pages"]

# One thread renders for every document: PDFium runs one call at a time anyway (the lock in
# pdf.py), and one thread keeps PDFium's allocations in one malloc arena. Spread over
# asyncio.to_thread's pool, every thread's arena held on to freed memory, and peak memory grew
# with the page count (3,000 pages over 100: +31 MB from the pool, +8 MB from one thread).
_RENDER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdf-render")


async def map_pages(document: PdfDocument, indices: list[int], dpi: int,
                    work: Callable[[int, Image.Image], Awaitable[object]],
                    window: int) -> AsyncIterator[tuple[int, object]]:
    """Render each page of `indices` in a worker thread, run `await work(index, image)` on it,
    and yield `(index, result)` in the order of `indices` as soon as each next page is done.
    An entry of `indices` may be a tuple of pages: `work(pages, images)` gets them together
    (one multi-page request), and `window` counts such groups.

    A page whose render or work raised yields `(index, exception)`; the other pages carry on.
    Stopping early cancels the pages in flight: use `contextlib.aclosing` (a `break` out of
    `async for` alone leaves the cleanup to the garbage collector).
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")

    loop = asyncio.get_running_loop()

    async def process(index: int | tuple[int, ...]) -> object:
        if isinstance(index, tuple):  # a window of pages, worked on together
            images = [await loop.run_in_executor(_RENDER_THREAD, document.render, i, dpi) for i in index]
            return await work(index, images)
        image = await loop.run_in_executor(_RENDER_THREAD, document.render, index, dpi)
        return await work(index, image)  # the image is dropped once work returns

    upcoming = iter(indices)
    in_flight: deque[tuple[int, asyncio.Task]] = deque()  # in page order

    def fill() -> None:
        for index in itertools.islice(upcoming, window - len(in_flight)):
            in_flight.append((index, asyncio.create_task(process(index))))

    try:
        fill()
        while in_flight:
            index, task = in_flight[0]
            await asyncio.wait([task])  # unlike `await task`, a page's exception stays in it
            in_flight.popleft()
            fill()  # this page's slot is free: it is handed over right below
            yield index, _outcome(index, task)
    finally:
        # A render in progress cannot be interrupted (it finishes and is dropped; one queued
        # is not started), but no task outlives the iterator.
        for _, task in in_flight:
            task.cancel()
        await asyncio.gather(*(task for _, task in in_flight), return_exceptions=True)


def _outcome(index: int, task: asyncio.Task) -> object:
    if task.cancelled():  # the work itself raised CancelledError, or cancelled its own task
        return asyncio.CancelledError(f"page {index} was cancelled")
    exception = task.exception()
    return exception if exception is not None else task.result()
