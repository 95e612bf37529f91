"""A document's files under the output folder, from its per-page results.

  name.md        the pages' markdown, in DeepSeek's layout (`run_dpsk_ocr_pdf.py`: each page
                 followed by "\\n" + "\\n<--- Page Split --->" + "\\n"); a failed page is an HTML
                 comment saying why, so pages stay countable and the failure visible;
  name.raw.mmd   the model's raw text (grounding tags kept), the same layout (DeepSeek's _det.mmd);
  name.json      {"source", "sha256", "model", "pages": [{"index", "width", "height",
                 "finish_reason", "blocks", "error"}]}, each image block's crops named in
                 `crop_files` (paths relative to the JSON) instead of carried as base64;
  images/        figure crops beside name.md: `{name}_{page}_{k}.jpg` for the first box of the
                 page's k-th image block, `{name}_{page}_{k}_{j}.jpg` for its box j >= 1. The
                 server's links `images/{page}_{k}.jpg` are rewritten to them, so documents in
                 one folder do not overwrite each other's figures.
"""
from __future__ import annotations

import base64
import json
import os
import re
from urllib.parse import quote

from .manifest import write_atomic

PAGE_SPLIT = "\n<--- Page Split --->"
FORMATS = ("md", "json", "raw")
SUFFIXES = {"md": ".md", "json": ".json", "raw": ".raw.mmd"}
IMAGES_DIR = "images"


def crop_name(name: str, page: int, k: int, j: int) -> str:
    return f"{name}_{page}_{k}.jpg" if j == 0 else f"{name}_{page}_{k}_{j}.jpg"


def take_crops(page: dict, name: str) -> tuple[dict, list[tuple[str, bytes]]]:
    """The page with each image block's base64 `crops` replaced by `crop_files`, and the crops
    to write as (path relative to the document's folder, JPEG bytes)."""
    crops, blocks = [], []
    k = 0  # counts image blocks as the server's markdown does, boxes or not
    for block in page.get("blocks") or []:
        block = dict(block)
        encoded = block.pop("crops", None) or []
        if (block.get("label") or "").strip() == "image":
            files = [f"{IMAGES_DIR}/{crop_name(name, page['index'], k, j)}" for j in range(len(encoded))]
            crops += [(path, base64.b64decode(data)) for path, data in zip(files, encoded)]
            block["crop_files"] = files
            k += 1
        blocks.append(block)
    return {**page, "blocks": blocks}, crops


def rewrite_links(markdown: str, page: int, name: str) -> str:
    """`![](images/{page}_{k}.jpg)` -> `![](images/{name}_{page}_{k}.jpg)`; that exact link
    only (the name URL-quoted: spaces and brackets would end a markdown link)."""
    pattern = re.compile(rf"!\[\]\({IMAGES_DIR}/{page}_(\d+)\.jpg\)")
    return pattern.sub(lambda m: f"![]({IMAGES_DIR}/{quote(crop_name(name, page, int(m.group(1)), 0))})",
                       markdown)


def document_markdown(pages: list[dict], name: str) -> str:
    return _join(rewrite_links(p["markdown"] or "", p["index"], name) if not p.get("error")
                 else f"<!-- page {p['index']}: OCR failed: {_comment_safe(error_text(p['error']))} -->"
                 for p in pages)


def document_raw(pages: list[dict]) -> str:
    return _join("" if p.get("error") else (p["text"] or "") for p in pages)


def document_json(source: str, sha256: str, model: str | None, pages: list[dict]) -> dict:
    keep = ("index", "width", "height", "finish_reason", "blocks", "error")
    # A loop's place, and a text-layer answer's mark, where the server gave them.
    extra = ("repetition", "source")
    return {"source": source, "sha256": sha256, "model": model,
            "pages": [{**{name: page.get(name) for name in keep}, **{name: page[name] for name in extra if name in page}}
                      for page in pages]}


def write_document(out_dir: str, output: str, state: dict, crops: list[tuple[str, bytes]],
                   formats: set[str]) -> None:
    """Write the crops, then the chosen formats, each file atomically."""
    base = os.path.join(out_dir, *output.split("/"))
    folder = os.path.dirname(base)
    for relative, data in crops:
        write_atomic(os.path.join(folder, *relative.split("/")), data)
    name, pages = output.rsplit("/", 1)[-1], state["pages"]
    texts = {"md": lambda: document_markdown(pages, name),
             "raw": lambda: document_raw(pages),
             "json": lambda: json.dumps(document_json(state["source"], state["sha256"],
                                                      state.get("model"), pages),
                                        ensure_ascii=False)}
    for fmt in FORMATS:
        if fmt in formats:
            write_atomic(base + SUFFIXES[fmt], texts[fmt]().encode("utf-8"))


def missing_outputs(out_dir: str, output: str, formats: set[str]) -> list[str]:
    base = os.path.join(out_dir, *output.split("/"))
    return [fmt for fmt in FORMATS if fmt in formats and not os.path.exists(base + SUFFIXES[fmt])]


def _comment_safe(text: str) -> str:
    return text.replace("--", "- -")  # "--" cannot appear inside an HTML comment


def _join(page_texts) -> str:
    return "".join(f"{text}\n{PAGE_SPLIT}\n" for text in page_texts)


def error_text(error) -> str:
    """A page error `{"type", "message"}` as one line."""
    if isinstance(error, dict):
        kind, message = error.get("type"), error.get("message")
        return f"{kind}: {message}" if kind else str(message)
    return str(error)
