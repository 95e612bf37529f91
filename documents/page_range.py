"""Page ranges in marker's `--page_range` syntax: "0,5-10,20" (0-based, inclusive ranges)."""
from __future__ import annotations

import re

from .errors import PageRangeError

_NUMBER = re.compile(r"\d+", re.ASCII)  # ASCII: int() would also take "+5" or "٥"
_SHOWN_CHARS = 40  # a part quoted in an error is cut here: the spec comes from a client


def parse_page_range(spec: str | None, page_count: int) -> list[int]:
    """Sorted, de-duplicated 0-based page indices of `spec`; None or "" means every page.

    `spec` is a comma-separated list of page numbers and inclusive ranges ("0,5-10,20"),
    spaces allowed. Raises PageRangeError naming the bad part.
    """
    if spec is None or not spec.strip():
        return list(range(page_count))
    spans = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise PageRangeError(f"page range {_shown(spec)} has an empty part "
                                 "(two commas in a row, or a comma at an end)")
        if "-" in part:
            first, _, last = (piece.strip() for piece in part.partition("-"))
            start, end = _page(first, part, page_count), _page(last, part, page_count)
            if start > end:
                raise PageRangeError(f"page range {_shown(part)} is reversed: "
                                     f"write it as '{end}-{start}'")
            spans.append((start, end))
        else:
            page = _page(part, part, page_count)
            spans.append((page, page))
    # Merge the spans before expanding them: "0-999" repeated a thousand times stays cheap.
    pages, next_page = [], 0
    for start, end in sorted(spans):
        pages.extend(range(max(start, next_page), end + 1))
        next_page = max(next_page, end + 1)
    return pages


def page_out_of_range(page: int | str, page_count: int) -> PageRangeError:
    return PageRangeError(
        f"page {page} is out of range: the document has {page_count} "
        f"page{'s' if page_count != 1 else ''}"
        + (f" (0-{page_count - 1}; pages are counted from 0)" if page_count else ""))


def _page(text: str, part: str, page_count: int) -> int:
    if not text:
        raise PageRangeError(f"page range part {_shown(part)} lacks a page number on one side "
                             "of '-' (ranges look like '5-10'; pages are counted from 0)")
    if not _NUMBER.fullmatch(text):
        raise PageRangeError(
            f"page range part {_shown(part)}: {_shown(text)} is not a page number "
            "(expected numbers and ranges such as '0,5-10,20'; pages are counted from 0)")
    # Compare digit counts first: a 5,000-digit number is out of range, and int() refuses it.
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(page_count)) or int(digits) >= page_count:
        shown = digits if len(digits) <= _SHOWN_CHARS else digits[:_SHOWN_CHARS] + "..."
        raise page_out_of_range(shown, page_count)
    return int(digits)


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")
