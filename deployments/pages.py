"""A document's answer, page by page: each page's entry, and the whole document's response.

A page that fails is an entry with its `error` (never the document's failure); a page that ran
to `max_tokens` keeps its text and says `finish_reason: "length"` (DeepSeek's PDF script drops
such pages silently).
"""
from __future__ import annotations

from contextlib import aclosing

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError

from documents import DocumentError
from encoder import ImageError

from .protocol import BadRequest, replica_error

# What DeepSeek's PDF script writes between pages.
PAGE_SPLIT = "\n\n<--- Page Split --->\n"
# What Unlimited-OCR writes between the pages of a multi-page answer.
PAGE_MARK = "<PAGE>"
USAGE_KEYS = ("prompt_tokens", "image_tokens", "completion_tokens")


def page_entry(index: int, result: dict, size: tuple[int, int]) -> dict:
    entry = {"index": index, "text": result["text"], "finish_reason": result["finish_reason"],
             "usage": result["usage"], "width": size[0], "height": size[1], "error": None}
    for extra in ("markdown", "blocks", "repetition"):
        if extra in result:
            entry[extra] = result[extra]
    return entry


def split_pages(window: tuple[int, ...], result: dict, sizes: list[tuple[int, int]]) -> list[dict]:
    """The entries of a window of pages answered as one request: its text split at the model's
    page marks (`PAGE_MARK`) when there is one part per page (a mark before the first page is
    allowed); otherwise the whole text stays on the window's first page and `split` is false.
    The request's usage is on the first page (the totals stay right); every entry names its
    `window`."""
    parts = result["text"].split(PAGE_MARK)
    if len(parts) == len(window) + 1 and not parts[0].strip():
        parts = parts[1:]
    split = len(parts) == len(window)
    texts = [part.strip() for part in parts] if split else [result["text"]] + [""] * (len(window) - 1)
    none = dict.fromkeys(USAGE_KEYS, 0)
    return [{**page_entry(index, {**result, "text": text, "usage": result["usage"] if i == 0 else none}, size),
             "window": list(window), "split": split}
            for i, (index, text, size) in enumerate(zip(window, texts, sizes))]


def failed_page(index: int, error: BaseException, log) -> dict:
    """The entry of a page that failed; our own bugs are logged and described without detail."""
    if isinstance(error, (BadRequest, ImageError, DocumentError)):
        kind, message = "invalid_request", str(replica_error(error))
    elif isinstance(error, (RayError, BackPressureError, TimeoutError)):
        kind, message = "unavailable", f"the page could not be processed now ({type(error).__name__}); retry it"
    else:
        log.error("page %d failed", index, exc_info=error)
        kind, message = "internal_error", "internal error (see the server log)"
    return {"index": index, "text": None, "finish_reason": None, "usage": None, "width": None,
            "height": None, "error": {"type": kind, "message": message}}


def total_usage(entries: list[dict]) -> dict:
    """Token counts summed over the pages that did not fail."""
    return {k: sum(e["usage"][k] for e in entries if e["error"] is None) for k in USAGE_KEYS}


def document_response(entries: list[dict], model: dict) -> dict:
    """`model`: the model's fields of every answer (its id, any warning)."""
    return {**model, "pages": entries,
            "text": PAGE_SPLIT.join(e["text"] or "" for e in entries),
            "usage": total_usage(entries),
            "failed_pages": [e["index"] for e in entries if e["error"] is not None]}


def finish_reason(entries: list[dict]) -> str:
    """A document's finish reason in one word: `length` when any page ran to max_tokens, else
    `repetition` when any page looped, else `stop`."""
    reasons = {e["finish_reason"] for e in entries}
    return "length" if "length" in reasons else "repetition" if "repetition" in reasons else "stop"


async def as_deltas(entries):
    """A document's page entries as one text delta a page (pages split as in `text`), then a
    finishing delta with the totals: what a chat stream of an image request is made of."""
    seen = []
    async with aclosing(entries):
        async for entry in entries:
            text = (PAGE_SPLIT if seen else "") + (entry["text"] or "")
            seen.append(entry)
            yield {"text": text, "finished": False, "finish_reason": None}
    yield {"text": "", "finished": True, "finish_reason": finish_reason(seen), **total_usage(seen)}
