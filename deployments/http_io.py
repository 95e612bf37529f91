"""The HTTP edge of the Router: reading request bodies (JSON or multipart, size- and
depth-checked), the one error envelope of every route, and server-sent event streams. No model
work here; deployments/router.py wires these to its routes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from .media import decode_data_url
from .placement import RETRYABLE
from .protocol import (BadRequest, Document, Images, PayloadTooLarge, UnsupportedMediaType,
                       replica_error)

log = logging.getLogger("ray.serve")


def error_body(kind: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The one error shape of every route (OpenAI's and vLLM's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(e: Exception, source=None) -> JSONResponse:
    """A BadRequest (or ImageError, DocumentError) in the envelope, with its status and field:
    an error about one image (`image_index`) names the field that image came in (`source`'s
    `fields`). Raised in a replica, it is the replica's own exception, never Ray's wrapper."""
    e = replica_error(e)
    param = getattr(e, "param", None)
    index, fields = getattr(e, "image_index", None), getattr(source, "fields", None)
    if index is not None and fields:
        param = fields[index]
    return JSONResponse(status_code=getattr(e, "status", 400), content=error_body(
        "invalid_request", str(e), param, getattr(e, "code", None)))


def overloaded(reason: str, message: str) -> JSONResponse:
    response = JSONResponse(status_code=503, headers={"Retry-After": "1"},
                            content=error_body("overloaded", message))
    response.reason = reason  # the metrics' rejection reason
    return response


def check_length(request: Request, max_bytes: int) -> None:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise PayloadTooLarge(f"request body of {int(length)} bytes is over the limit of "
                              f"{max_bytes} (max_request_mb)")


SOURCE_FIELDS = ("image", "images", "document")  # the same names in JSON and in forms


# Options whose value is a JSON object: in a form, sent as JSON text.
JSON_FORM_FIELDS = ("ngram", "repetition_guard", "retry")
# A form's text fields besides its images: every option, with room to spare; more is an attack on
# the parser (each part is parsed and held before any check of ours runs).
MAX_OPTION_FIELDS = 64


async def read_ocr_body(request: Request, max_bytes: int,
                        max_images: int) -> tuple[Images | Document, dict, bool]:
    """(images or the PDF, options as sent, whether the options are typed JSON values). JSON
    and multipart take the same fields: `image` (one), `images` (several) or `document` (a PDF),
    as files or base64 text in a form, base64 or data: URLs in JSON. A form stops being read at
    its `max_images`-th file past the limit (400), not after the whole body is buffered."""
    check_length(request, max_bytes)
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await _read_form(request, max_bytes, max_images)
        sent = {key: [await v.read() if hasattr(v, "read") else v for v in form.getlist(key)]
                for key in SOURCE_FIELDS if key in form}
        for key, value in form.multi_items():
            if hasattr(value, "read") and key not in SOURCE_FIELDS:
                raise BadRequest(f"unknown file field {key!r}: send images as 'image' or "
                                 f"'images', a PDF as 'document'", key)
        options = {k: v for k, v in form.items() if k not in SOURCE_FIELDS}
        for name in JSON_FORM_FIELDS:
            if name in options:
                options[name] = _json_field(options[name], name)
        return _source(sent), options, False
    body = await read_json(request, max_bytes, "application/json or multipart/form-data")
    return (*ocr_json(body), True)


def ocr_json(body) -> tuple[Images | Document, dict]:
    """A JSON body's images or PDF (`image`, `images`, `document`: base64 or data: URLs) and
    its options as sent (a batch line's body too)."""
    if not isinstance(body, dict):
        raise BadRequest("JSON body must be an object")
    body, sent = dict(body), {}
    for key in SOURCE_FIELDS:
        value = body.pop(key, None)
        if value is not None:  # `image` may be a list too, `images` one string
            sent[key] = value if isinstance(value, list) and key != "document" else [value]
    return _source(sent), body


async def _read_form(request: Request, max_bytes: int, max_images: int):
    """The multipart form, its parts counted as they stream in: past `max_images` files or
    `max_images + MAX_OPTION_FIELDS` text fields (base64 images are text), Starlette's parser
    stops and this answers 400 naming the limit; a text field may be as large as the body."""
    try:
        return await request.form(max_files=max_images, max_fields=max_images + MAX_OPTION_FIELDS,
                                  max_part_size=max_bytes)
    except (HTTPException, MultiPartException) as e:  # the parser's own 400 (HTTPException in an app)
        detail = str(getattr(e, "detail", None) or getattr(e, "message", e))
        if "files" in detail:
            raise BadRequest(f"more than {max_images} images in one request "
                             f"(max_images_per_request)", "images") from None
        if "fields" in detail:
            raise BadRequest(f"more than {max_images + MAX_OPTION_FIELDS} form fields in one "
                             f"request (at most {max_images} images, max_images_per_request, "
                             f"and {MAX_OPTION_FIELDS} options)") from None
        raise BadRequest(f"malformed multipart body: {detail}") from None


def _source(sent: dict[str, list]) -> Images | Document:
    """A request's images, each named by its field (`image` when it is the one value sent in
    it, else `images[2]`, `image[1]`), or its one PDF, from the values sent in each source field
    (bytes, or base64 text / data: URLs)."""
    if "image" in sent and "images" in sent:
        raise BadRequest("send 'image' or 'images', not both", "images")
    if "document" in sent:
        if len(sent) > 1:
            raise BadRequest("send images or a document, not both", "document")
        if len(sent["document"]) > 1:
            raise BadRequest("send one document per request", "document")
        return Document(_bytes_of(sent["document"][0], "document", "document"))
    key, values = next(iter(sent.items()), ("image", []))
    fields = [key if key == "image" and len(values) == 1 else f"{key}[{i}]" for i in range(len(values))]
    return Images([_bytes_of(v, field, "image") for v, field in zip(values, fields)], fields)


def _bytes_of(value, field: str, what: str) -> bytes:
    return value if isinstance(value, bytes) else decode_data_url(value, what, field)


# Nesting a request needs: a chat message's content part's image_url (5 levels); far deeper is
# an attack on the parser (each level is a recursion in json and in validation).
MAX_JSON_DEPTH = 32
# JSON strings (escapes included), written as an unrolled loop: linear, no backtracking.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPENERS, _CLOSERS = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(raw: bytes) -> int:
    """How deeply `raw`'s arrays and objects nest, found without parsing (no recursion): the
    brackets outside strings, counted up and down."""
    codes = np.frombuffer(_JSON_STRING.sub(b'""', raw), np.uint8)
    steps = np.isin(codes, _OPENERS).astype(np.int64) - np.isin(codes, _CLOSERS)
    return int(np.cumsum(steps).max(initial=0))


async def read_json(request: Request, max_bytes: int, accepted: str = "application/json"):
    """The JSON body (size-checked first)."""
    check_length(request, max_bytes)
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("application/json"):
        raise UnsupportedMediaType(f"content-type must be {accepted}, got {content_type or 'none'!r}")
    raw = await request.body()
    if len(raw) > max_bytes:  # a body sent without a content-length
        raise PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes (max_request_mb)")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise BadRequest(f"JSON body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("body is not valid JSON") from None


def _json_field(value: str, name: str):
    """A form field's JSON text, held to a JSON body's depth limit; errors name the field."""
    if json_depth(value.encode("utf-8", "surrogatepass")) > MAX_JSON_DEPTH:
        raise BadRequest(f"{name} nests deeper than {MAX_JSON_DEPTH} levels", name)
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise BadRequest(f"{name} must be a JSON object", name) from None


def event_stream(events: AsyncIterator[dict], deltas, limit: float) -> StreamingResponse:
    """Server-sent events, one JSON object each, then [DONE]; a failure or the time limit
    (`limit` seconds) after the stream began is reported in-band (an error event), never a
    silent cut; a replica lost mid-stream (its node lost) as a retryable `overloaded` error, as
    the 503 of a request that meets a lost replica before it streams. `deltas` (the generator
    under `events`) is closed however the stream ends, so a client that went away frees its
    decoder slot."""
    async def body():
        try:
            async with asyncio.timeout(limit):
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
        except TimeoutError:
            error = error_body("timeout", f"the request took longer than {limit:g} s")
            yield f"data: {json.dumps(error)}\n\n"
        except RETRYABLE:  # the replica generating it was lost (its node, its process): retryable
            error = error_body("overloaded", "the model replica generating this stream was lost "
                               "and is being replaced; retry the request")
            yield f"data: {json.dumps(error)}\n\n"
        except Exception:  # noqa: BLE001
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body('internal_error', 'generation failed'))}\n\n"
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")
