"""DeepSeek-OCR's grounding output as data, and its markdown clean-up. Plain Python.

With a `<|grounding|>` prompt the model writes, before each block of text,
`<|ref|>label<|/ref|><|det|>[[x1, y1, x2, y2], ...]<|/det|>`, coordinates normalised to 0..999
of the ORIGINAL image. DeepSeek's own scripts read the box lists with `eval()`; here they are read
as JSON and checked, and nothing in the model's output can make the parser raise: a malformed or
truncated box list leaves its block with its text, `boxes_norm` / `boxes` None and a
`parse_error` saying what was wrong.
"""
from __future__ import annotations

import json
import re

REF, REF_END, DET, DET_END = "<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>"
COORD_MAX = 999  # the model's coordinate range is 0..999 of each side
# A label and a box list hold no tag; a box list cut off by the token limit has no closing tag.
_TAG = re.compile(r"<\|ref\|>((?:(?!<\|).)*?)<\|/ref\|><\|det\|>((?:(?!<\|).)*)(<\|/det\|>)?", re.S)
# DeepSeek's two LaTeX fixes in its markdown clean-up.
_LATEX_FIXES = ((r"\coloneqq", ":="), (r"\eqqcolon", "=:"))


def parse_boxes(det: str) -> tuple[list[list[int]] | None, str | None]:
    """`[[x1, y1, x2, y2], ...]` -> (boxes, None), or (None, what is wrong)."""
    try:
        value = json.loads(det)
    except ValueError:
        return None, f"box list is not a list of [x1, y1, x2, y2]: {det[:80]!r}"
    if not isinstance(value, list) or not value:
        return None, f"box list is not a non-empty list: {det[:80]!r}"
    boxes = []
    for box in value:
        if not (isinstance(box, list) and len(box) == 4
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
            return None, f"box {json.dumps(box)[:60]} is not four numbers"
        if not all(0 <= v <= COORD_MAX for v in box):
            return None, f"box {box} is outside 0..{COORD_MAX}"
        boxes.append([int(v) for v in box])
    return boxes, None


def to_pixels(box: list[int], width: int, height: int) -> list[int]:
    """A 0..999 box -> pixels of a width x height image, as DeepSeek's scripts compute them."""
    x1, y1, x2, y2 = box
    return [int(x1 / COORD_MAX * width), int(y1 / COORD_MAX * height),
            int(x2 / COORD_MAX * width), int(y2 / COORD_MAX * height)]


def parse_blocks(text: str, width: int | None = None, height: int | None = None) -> list[dict]:
    """The model's output -> `[{"label", "text", "boxes_norm", "boxes", "parse_error"}]` in
    order. `boxes` are pixel boxes of the original image when its size is given. Text before the
    first tag is a block with label None; a tag cut off by the token limit still makes a block
    (its boxes None, `parse_error` saying it was truncated)."""
    blocks = []
    matches = list(_TAG.finditer(text))
    lead = text[:matches[0].start()] if matches else text
    if lead.strip():
        blocks.append(_block(None, lead, None, None))
    for i, match in enumerate(matches):
        label, det = match.group(1), match.group(2)
        body = text[match.end():matches[i + 1].start() if i + 1 < len(matches) else len(text)]
        if match.group(3) is None:
            boxes, error = None, f"box list cut off: {det[:80]!r}"
        else:
            boxes, error = parse_boxes(det)
        blocks.append(_block(label, body, boxes, error, width, height))
    return blocks


def _block(label, body, boxes, error, width=None, height=None) -> dict:
    pixels = None
    if boxes is not None and width and height:
        pixels = [to_pixels(box, width, height) for box in boxes]
    return {"label": label, "text": body.strip(), "boxes_norm": boxes, "boxes": pixels,
            "parse_error": error}


def to_markdown(text: str, page: int = 0) -> str:
    """DeepSeek's clean-up: each `image` block's tag becomes `![](images/{page}_{k}.jpg)` (k
    counts image blocks), every other grounding tag is removed, and its two LaTeX fixes."""
    count = 0

    def replace(match: re.Match) -> str:
        nonlocal count
        if match.group(1).strip() != "image":
            return ""
        count += 1
        return f"![](images/{page}_{count - 1}.jpg)"
    out = _TAG.sub(replace, text)
    for old, new in _LATEX_FIXES:
        out = out.replace(old, new)
    return out.strip()
