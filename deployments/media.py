"""Images named by URL in chat requests, and crops of the figure blocks the model located.

`data:` URLs are always read. http(s) URLs are fetched only when the operator turns it on
(`fetch_image_urls`), within the request size limit and a time limit; `file://` URLs only under
the directory the operator names (`allowed_local_media_path`, vLLM's option of that name), so a
client can never make the router read arbitrary files or reach arbitrary hosts by default.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request

from encoder.preprocess import load_image

from .protocol import BadRequest, PayloadTooLarge


_DATA_URL_TYPES = {"image": ("data:image/", "data:application/octet-stream"),
                   "document": ("data:application/pdf", "data:application/octet-stream")}


def decode_data_url(value, what: str = "image") -> bytes:
    """base64 (optionally as a `data:image/...;base64,` URL, `data:application/pdf;base64,` for
    a document) -> bytes."""
    if not isinstance(value, str):
        raise BadRequest(f"{what}s in JSON must be base64 strings, got {type(value).__name__}", what)
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if not header.startswith(_DATA_URL_TYPES[what]) or not header.endswith(";base64"):
            expected = "data:image/...;base64,..." if what == "image" else "data:application/pdf;base64,..."
            raise BadRequest(f"a data: URL {what} must be '{expected}', got {header[:60]!r}", what)
    try:  # line-wrapped base64 (what `base64` and `base64.encodebytes` write) is fine
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{what} is not valid base64", what) from None


async def read_image_url(url: str, max_bytes: int, fetch: bool, timeout_s: float,
                         local_root: str | None) -> bytes:
    """The bytes of a chat image part's URL, within the operator's rules (module docstring)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return decode_data_url(url)
    if scheme in ("http", "https"):
        if not fetch:
            raise BadRequest("image URLs are not fetched by this server (fetch_image_urls is off): "
                             "send the image inline as a data:image/...;base64 URL", "image_url")
        return await asyncio.to_thread(_fetch, url, max_bytes, timeout_s)
    if scheme == "file":
        if local_root is None:
            raise BadRequest("file:// image URLs are not allowed by this server "
                             "(allowed_local_media_path is not set)", "image_url")
        return await asyncio.to_thread(_read_local, url, local_root, max_bytes)
    raise BadRequest(f"image_url must be a data:, http(s): or file: URL, got {url[:40]!r}", "image_url")


def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            data = response.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise BadRequest(f"fetching the image URL answered HTTP {e.code}", "image_url") from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, DNS, timeout
        raise BadRequest(f"could not fetch the image URL: {getattr(e, 'reason', e)}", "image_url") from None
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"the image at the URL is over the limit of {max_bytes} bytes", "image_url")
    return data


def _read_local(url: str, local_root: str, max_bytes: int) -> bytes:
    path = os.path.realpath(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(local_root)
    if os.path.commonpath([path, root]) != root:
        raise BadRequest("file:// image URLs must name a file under allowed_local_media_path", "image_url")
    if not os.path.isfile(path):
        raise BadRequest("no such image file under allowed_local_media_path", "image_url")
    if os.path.getsize(path) > max_bytes:
        raise PayloadTooLarge(f"the image file is over the limit of {max_bytes} bytes", "image_url")
    with open(path, "rb") as f:
        return f.read()


def crop_image_blocks(image, blocks: list[dict], quality: int = 90) -> None:
    """Add `crops` (base64 JPEG, one per pixel box) to each `image` block of `blocks`, cut from the
    original image as DeepSeek's scripts cut them."""
    figures = [b for b in blocks if b["label"] == "image" and b["boxes"]]
    if not figures:
        return
    picture = load_image(image)
    for block in figures:
        block["crops"] = []
        for x1, y1, x2, y2 in block["boxes"]:
            buffer = io.BytesIO()
            picture.crop((x1, y1, max(x2, x1 + 1), max(y2, y1 + 1))).save(buffer, "JPEG", quality=quality)
            block["crops"].append(base64.b64encode(buffer.getvalue()).decode())
