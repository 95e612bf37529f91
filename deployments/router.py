"""The Router: HTTP ingress and Python handle methods; no model math, no GPU (but with
encoder_in_router, on one-GPU nodes, it runs the Encoder's class of deployments/encoders.py in
its own process, on its GPU share, instead of calling an Encoder deployment).

(No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at runtime.)

One request, top to bottom (`_ocr`):
  1. validate: `OcrOptions` (deployments/protocol.py) and the image count;
  2. preprocess, on a worker thread: read each image's header (decode_on_encoder, PNG and
     JPEG), or decode it, or (views_on_encoder false) decode it and build its global view (the
     crops keep resizing on a helper thread); the prompt's length is known now and checked
     against the decoder's context before any GPU work;
  3. fan out: each global view goes to GlobalEncoder at once, the crops to LocalEncoder when
     they are ready (views_on_encoder, the default: the image to both, each making its path's
     views, as its PNG or JPEG bytes with their header (decode_on_encoder; the router only read
     the header) or else decoded; one_encoder: to the one Encoder, which decodes, makes,
     encodes and assembles both; encoder_in_router: that Encoder in this process, no Serve
     call); each encoder batches across requests;
  4. assemble each image's sequence (local grid + newlines, global, separator);
  5. decode: the Decoder generates from the prompt ids and the image embeddings;
  6. respond: text, finish reason, usage, per-stage timings.
"""
import asyncio
import base64
import hmac
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from common.checkpoint import read_config, read_tensors
from decoder import DecoderArgs, build_prompt, load_tokenizer
from decoder.grounding import parse_blocks, to_markdown
from decoder.tokenizer import count_image_tags
from documents import DocumentError, PdfDocument, map_pages, parse_page_range
from encoder import ImageError, assemble
from encoder.preprocess import (DecodedImage, ImageHeader, PendingImage, decode, read_header,
                                start_preprocess)

from . import openai_api
from . import pages
from . import protocol  # protocol.REQUEST_ARRIVED: a module pickles by name, a ContextVar not at all
from .config import SHUTDOWN, AppConfig
from .encoded_cache import EncodedCache, content_key
from .encoders import EncoderReplica
from .media import crop_image_blocks, decode_data_url, read_image_url
from .metrics import medians, router_metrics
from .model_source import TINY_WARNING, prepare_replica_process, replica_id, resolve_checkpoint
from .protocol import (BadRequest, Document, Images, NotFound, OcrOptions,
                       PayloadTooLarge, UnsupportedMediaType, from_wire, replica_error,
                       send_tensors_out_of_band, to_wire)

log = logging.getLogger("ray.serve")
api = FastAPI(title="DeepSeek-OCR on Ray Serve")

# A replica that dies mid-call (node loss, a CUDA fault that fails its health check) is
# replaced by Serve; encoding and a generation that has streamed nothing are idempotent, so the
# call is retried instead of failing the user.
RETRYABLE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


async def call_with_retry(method, *args, attempts: int = 3, backoff_s: float = 0.5):
    """`await method.remote(*args)`, retried on replica loss with a growing pause. When the
    caller is cancelled (its time limit passed, its client went away, a sibling call failed),
    so is the call: cancelling the task that awaits a DeploymentResponse leaves the replica
    working on it, holding a decoder slot or an encoder batch place for nobody."""
    for attempt in range(attempts):
        response = method.remote(*args)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        except RETRYABLE:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(backoff_s * (attempt + 1))


# Module helpers come before the class: `serve.ingress` pickles the FastAPI app (and so the
# endpoints' globals) when the class is decorated, before anything below it exists.
def _error_body(kind: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The one error shape of every route (OpenAI's and vLLM's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _bad_request(e: Exception, source=None) -> JSONResponse:
    """A BadRequest (or ImageError, DocumentError) in the envelope, with its status and field:
    an error about one image (`image_index`) names the field that image came in (`source`'s
    `fields`). Raised in a replica, it is the replica's own exception, never Ray's wrapper."""
    e = replica_error(e)
    param = getattr(e, "param", None)
    index, fields = getattr(e, "image_index", None), getattr(source, "fields", None)
    if index is not None and fields:
        param = fields[index]
    return JSONResponse(status_code=getattr(e, "status", 400), content=_error_body(
        "invalid_request", str(e), param, getattr(e, "code", None)))


def _of_image(error: Exception, index: int) -> Exception:
    """`error` (an ImageError, maybe raised in a replica) as this process's own exception,
    marked with the index of the request's image it is about."""
    error = replica_error(error)
    error.image_index = index
    return error


def _overloaded(reason: str, message: str) -> JSONResponse:
    response = JSONResponse(status_code=503, headers={"Retry-After": "1"},
                            content=_error_body("overloaded", message))
    response.reason = reason  # the metrics' rejection reason
    return response


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException):
    """Unknown routes (404) and wrong methods (405) answer in the same JSON shape as the rest."""
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(status_code=exc.status_code, headers=exc.headers,
                        content=_error_body("invalid_request", message))


def _check_length(request: Request, max_bytes: int) -> None:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise PayloadTooLarge(f"request body of {int(length)} bytes is over the limit of "
                              f"{max_bytes} (max_request_mb)")


SOURCE_FIELDS = ("image", "images", "document")  # the same names in JSON and in forms


async def _read(request: Request, max_bytes: int) -> tuple[Images | Document, dict, bool]:
    """(images or the PDF, options as sent, whether the options are typed JSON values). JSON
    and multipart take the same fields: `image` (one), `images` (several) or `document` (a PDF),
    as files or base64 text in a form, base64 or data: URLs in JSON."""
    _check_length(request, max_bytes)
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form()
        sent = {key: [await v.read() if hasattr(v, "read") else v for v in form.getlist(key)]
                for key in SOURCE_FIELDS if key in form}
        for key, value in form.multi_items():
            if hasattr(value, "read") and key not in SOURCE_FIELDS:
                raise BadRequest(f"unknown file field {key!r}: send images as 'image' or "
                                 f"'images', a PDF as 'document'", key)
        options = {k: v for k, v in form.items() if k not in SOURCE_FIELDS}
        if "ngram" in options:  # an object inside a form: JSON text
            options["ngram"] = _json_field(options["ngram"], "ngram")
        return _source(sent), options, False
    body = await _read_json(request, max_bytes, "application/json or multipart/form-data")
    if not isinstance(body, dict):
        raise BadRequest("JSON body must be an object")
    sent = {}
    for key in SOURCE_FIELDS:
        value = body.pop(key, None)
        if value is not None:  # `image` may be a list too, `images` one string
            sent[key] = value if isinstance(value, list) and key != "document" else [value]
    return _source(sent), body, True


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


async def _read_json(request: Request, max_bytes: int, accepted: str = "application/json"):
    """The JSON body (size-checked first)."""
    _check_length(request, max_bytes)
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
    try:
        return json.loads(value)
    except ValueError:
        raise BadRequest(f"{name} must be a JSON object") from None


@dataclass
class _Image:
    """One image of a request: its cache key and either its sequence from the cache
    (`cached`: (sequence, original size)) or its pixels: decoded, for the encoders to make the
    views from (`pending` a DecodedImage, views_on_encoder), or their views under way here (a
    PendingImage)."""
    key: str | None
    pending: PendingImage | DecodedImage | None = None
    cached: tuple[torch.Tensor, tuple[int, int]] | None = None
    decode_ms: float = 0.0  # decoding a DecodedImage took

    @property
    def num_tokens(self) -> int:
        return self.cached[0].shape[0] if self.cached is not None else self.pending.num_tokens

    @property
    def original_size(self) -> tuple[int, int]:
        return self.cached[1] if self.cached is not None else self.pending.original_size


def _memory_mb() -> dict:
    """This process's resident memory now and at its peak (Linux), in MB."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    return {name: int(fields[key].split()[0]) / 1024 for name, key in
            (("rss_mb", "VmRSS"), ("peak_rss_mb", "VmHWM")) if key in fields}


def _handle_source(image, document) -> Document:
    if image is not None:
        raise BadRequest("send images or a document, not both", "document")
    if not isinstance(document, (bytes, bytearray, str, os.PathLike)):
        raise BadRequest(f"document must be PDF bytes or a path, got {type(document).__name__}",
                         "document")
    return Document(bytes(document) if isinstance(document, bytearray) else document)


@serve.deployment(max_ongoing_requests=200, ray_actor_options={"num_cpus": 0.25}, **SHUTDOWN)
@serve.ingress(api)
class Router:
    def __init__(self, global_encoder: DeploymentHandle | None, local_encoder: DeploymentHandle | None,
                 decoder: DeploymentHandle | None, config: AppConfig):
        """`local_encoder` None: `global_encoder` is the one Encoder of both paths (one_encoder);
        both None (encoder_in_router): this replica runs that Encoder's class itself, on its
        GPU share, and calls it in-process."""
        prepare_replica_process()
        send_tensors_out_of_band()  # the sequences Router.encode returns
        self.global_encoder, self.local_encoder, self.decoder = global_encoder, local_encoder, decoder
        self.encoder = EncoderReplica("both", config) if config.encoder_in_router else None
        self.config = config
        directory, self.model_label = resolve_checkpoint(config.checkpoint)
        specials = read_tensors(directory, lambda k: k in ("model.image_newline", "model.view_seperator"))
        self.newline, self.separator = specials["model.image_newline"], specials["model.view_seperator"]
        # Encode-only apps need no tokenizer (and their checkpoints may carry none).
        self.tokenizer = load_tokenizer(directory if config.checkpoint else None) if decoder else None
        # The decoder's context bounds prompts; encode-only apps have none (and an encoder-only
        # checkpoint has no language config).
        self.max_len = (config.max_len or DecoderArgs.from_config(read_config(directory)).max_positions
                        if decoder else None)
        self.recent: deque[dict] = deque(maxlen=1000)  # per-request stage timings
        self.cache = EncodedCache(config.encoder_cache_mb << 20) if config.encoder_cache_mb else None
        self.inflight = 0  # HTTP requests being worked on (admission control)
        self.api_key = config.api_key or os.environ.get("DEEPSEEK_OCR_API_KEY") or None
        self.model_id = config.served_model_name or self.model_label  # what clients call it
        # In every answer: the model's id, and the tiny random model's warning in its own field.
        self.model_fields = {"model": self.model_id, **({} if config.checkpoint else {"warning": TINY_WARNING})}
        self.started = int(time.time())

    # -- Python handle API ------------------------------------------------------------------
    async def encode(self, image, mode: str = "gundam", max_crops: int = 6) -> list[torch.Tensor]:
        """One [num_tokens, D] sequence per image (a single image or a list)."""
        entered = time.perf_counter()
        images = image if isinstance(image, list) else [image]
        options = OcrOptions.parse({"mode": mode, "max_crops": max_crops})
        options.prompt_for(len(images), self.config.max_images_per_request)
        seqs, timings = await self._encode(await self._preprocess(images, options))
        timings["handler_ms"] = (time.perf_counter() - entered) * 1e3  # kept in self.recent
        return seqs

    async def ocr(self, image=None, prompt: str | None = None, *, document=None, **options) -> dict:
        """OCR one image (or a list): {text, finish_reason, usage, model, timings}; or a PDF
        `document` (bytes or a path): {pages, text, usage, failed_pages, model}."""
        options = OcrOptions.parse({**options, "prompt": prompt})
        if document is not None:
            return await self._ocr_document(_handle_source(image, document), options)
        return await self._ocr(image, options)

    async def ocr_stream(self, image=None, prompt: str | None = None, *, document=None,
                         **options) -> AsyncIterator[dict]:
        """Like ocr, but yields text deltas as they are generated (handle.options(stream=True));
        for a `document`, one page dict per finished page, in page order."""
        options = OcrOptions.parse({**options, "prompt": prompt})
        if document is not None:
            stream = await self._document_pages(_handle_source(image, document), options)
        else:
            stream = await self._ocr_stream(image, options)
        async with aclosing(stream):
            async for item in stream:
                yield item

    async def chat(self, messages: list[dict], **options) -> dict:
        """A chat completion, as `POST /v1/chat/completions` answers it (images as data: URLs)."""
        source, ocr_options, _ = await self._read_chat({"messages": messages, **options})
        return await self._chat(source, ocr_options)

    async def chat_stream(self, messages: list[dict], **options) -> AsyncIterator[dict]:
        """The chat completion's chunks (handle.options(stream=True)), the usage chunk last."""
        source, ocr_options, _ = await self._read_chat({"messages": messages, **options, "stream": True})
        deltas = await self._chat_deltas(source, ocr_options)
        async with aclosing(deltas):
            async for event in self._chat_chunks(deltas, include_usage=True):
                yield event

    def stats(self) -> dict:
        """This replica's; with encoder_in_router its encoder's stats under `encoder`."""
        return {"model": self.model_label, "replica": replica_id(), "pid": os.getpid(),
                "requests": len(self.recent), **_memory_mb(),
                "encoder_cache": self.cache.stats() if self.cache else None,
                **({"encoder": self.encoder.stats()} if self.encoder is not None else {})}

    async def check_health(self):
        """With encoder_in_router, the encoder's health check (a CUDA fault, a stuck batch) is
        this replica's: Serve replaces the Router with its encoder."""
        if self.encoder is not None:
            await self.encoder.check_health()

    def timings(self) -> dict:
        """Median ms per stage over the last 1,000 requests: preprocess (decoding, when the
        encoders make the views; else until the crops are ready, the global view already
        encoding by then), encode (until both paths answered), assemble, and the whole encoding
        of the request; and over the `encode` handle calls among them, the handler's whole
        time from its entry to its return (what Serve's call adds is outside it)."""
        keys = ("preprocess_ms", "encode_ms", "assemble_ms", "encoding_ms")
        handled = [t for t in self.recent if "handler_ms" in t]
        return {"requests": len(self.recent), **medians(self.recent, keys),
                **medians(handled, ("handler_ms",))}

    # -- one request ----------------------------------------------------------------------------
    async def _ocr(self, image, options: OcrOptions, page: int = 0, arrived: float | None = None) -> dict:
        """One image request's answer; `timings` holds each stage and `total_ms`, the whole
        request from its arrival (`arrived`, else the HTTP request's, else now) to its answer."""
        arrived = arrived or protocol.REQUEST_ARRIVED.get() or time.perf_counter()
        ids, seqs, timings, sizes = await self._encode_prompt(image, options)
        start = time.perf_counter()
        result = await call_with_retry(self.decoder.generate, ids, [to_wire(s) for s in seqs],
                                       options.sampling())
        timings["decode_ms"] = (time.perf_counter() - start) * 1e3
        timings.update(result.get("timings", {}))  # the decoder's own stages
        self._record_generation(result, seqs, timings["decode_ms"])
        response = {"text": result["text"], "finish_reason": result["finish_reason"],
                    **self.model_fields,
                    "usage": {"prompt_tokens": result["prompt_tokens"],
                              "image_tokens": sum(s.shape[0] for s in seqs),
                              "completion_tokens": result["completion_tokens"]},
                    "timings": timings}
        if options.output_format == "markdown":  # DeepSeek's clean-up of the grounding tags
            response["text"] = to_markdown(result["text"], page)
        elif options.output_format == "blocks":  # boxes in pixels of the (one) original image
            response["blocks"] = parse_blocks(result["text"], *sizes[0])
            response["width"], response["height"] = sizes[0]
            response["markdown"] = to_markdown(result["text"], page)
            if options.return_crops:
                image = image[0] if isinstance(image, list) else image
                await asyncio.to_thread(crop_image_blocks, image, response["blocks"])
        timings["total_ms"] = (time.perf_counter() - arrived) * 1e3
        return response

    async def _chat(self, source: list | Document, options: OcrOptions) -> dict:
        if isinstance(source, Document):
            document = await self._ocr_document(source, options)
            ocr = {**document, "finish_reason": pages.finish_reason(document["pages"])}
        else:
            ocr = await self._ocr(source, options)
        return openai_api.completion(openai_api.completion_id(), self.model_id, ocr)

    async def _chat_deltas(self, source: list | Document, options: OcrOptions) -> AsyncIterator[dict]:
        """The decoder's deltas of an image request; a document's pages as deltas, one a page."""
        if isinstance(source, Document):
            return pages.as_deltas(await self._document_pages(source, options))
        return await self._ocr_stream(source, options)

    async def _chat_chunks(self, deltas: AsyncIterator[dict], include_usage: bool) -> AsyncIterator[dict]:
        """The decoder's deltas as `chat.completion.chunk`s: the assistant role first, content
        deltas, the finish reason, then (when asked) a usage chunk."""
        request_id, created = openai_api.completion_id(), int(time.time())

        def chunk(delta, finish_reason=None, usage=None):
            return openai_api.chunk(request_id, self.model_fields, created, delta, finish_reason,
                                    usage, include_usage)
        yield chunk({"role": "assistant", "content": ""})
        async for delta in deltas:
            if delta["text"]:
                yield chunk({"content": delta["text"]})
            if delta["finished"]:
                reason = delta["finish_reason"]
                yield chunk({}, openai_api.FINISH_REASONS.get(reason, reason))
                if include_usage:
                    yield chunk(None, usage=openai_api.usage(delta))

    async def _read_chat(self, body) -> tuple[list[bytes] | Document, OcrOptions, openai_api.ChatRequest]:
        """A chat request -> (images or its PDF, the OCR options it means, the request)."""
        chat = openai_api.ChatRequest.parse(body)
        if chat.model is not None:
            self._check_model(chat.model)
        urls, document, prompt = chat.sources_and_prompt()
        options = chat.ocr_options(prompt)
        if document is not None:
            return Document(decode_data_url(document, "document", "messages")), options, chat
        if not urls:
            raise BadRequest("the user message has no image: add an image_url part (a data: URL) "
                             "or a file part (a PDF)", "messages")
        if len(urls) > self.config.max_images_per_request:
            raise BadRequest(f"at most {self.config.max_images_per_request} images per request: the "
                             f"user message has {len(urls)} image_url parts", "messages")
        fields = chat.image_fields()
        limits = dict(max_bytes=self.config.max_request_mb << 20, fetch=self.config.fetch_image_urls,
                      timeout_s=self.config.fetch_timeout_s,
                      local_root=self.config.allowed_local_media_path,
                      allowed_domains=tuple(self.config.allowed_media_domains or ()) or None,
                      allow_private=self.config.fetch_private_addresses)

        async def read(url: str, field: str) -> bytes:
            try:
                return await read_image_url(url, **limits)
            except BadRequest as e:  # named by where it is in the chat request
                e.param = field
                raise
        tags = count_image_tags(options.prompt) if options.prompt is not None else len(urls)
        if tags != len(urls):
            raise BadRequest(f"the messages' text has {tags} <image> tags for {len(urls)} image_url "
                             f"parts: leave the tags out (one is placed per image) or place one "
                             f"per image", "messages")
        images = await asyncio.gather(*(read(url, field) for url, field in zip(urls, fields)))
        return Images(images, fields), options, chat

    async def _ocr_stream(self, image, options: OcrOptions) -> AsyncIterator[dict]:
        """Validate and encode now (errors surface before anything is streamed), then return
        the decoder's delta stream."""
        if options.output_format != "text":
            raise BadRequest("output_format applies to whole answers: a stream of an image sends "
                             "raw text (a document's stream sends whole pages)", "output_format")
        ids, seqs, _, _ = await self._encode_prompt(image, options)

        async def deltas():  # the generation starts when its consumer first asks
            stream = self.decoder.options(stream=True).generate_stream.remote(
                ids, [to_wire(s) for s in seqs], options.sampling())
            start, finished = time.perf_counter(), False
            try:
                async for delta in stream:
                    if delta["finished"]:
                        finished = True
                        self._record_generation(delta, seqs, (time.perf_counter() - start) * 1e3)
                    yield {**delta, **self.model_fields}
            finally:
                if not finished:  # closed early (time limit, client gone): free the slot now
                    stream.cancel()
        return deltas()

    async def _ocr_document(self, document: Document, options: OcrOptions) -> dict:
        """Every page through the image path; one response for the document."""
        stream = await self._document_pages(document, options)
        async with aclosing(stream):
            entries = [entry async for entry in stream]
        return pages.document_response(entries, self.model_fields)

    async def _document_pages(self, document: Document, options: OcrOptions) -> AsyncIterator[dict]:
        """Open the PDF and check the page range now (errors answer 4xx before any page is
        sent), then return its pages' entries in page order. Pages are rendered lazily, at most
        `pages_in_flight` at a time, and each goes through the encoders and the decoder as its
        own request (batched with every other request's pages); a page that fails is an entry
        with its error, never the document's failure."""
        self._require_decoder()
        options.prompt_for(1, 1)  # a prompt every page can take: one <image> tag
        pdf = await asyncio.to_thread(PdfDocument, document.data, self.config.max_pages)
        try:
            indices = parse_page_range(options.page_range, pdf.page_count)
        except DocumentError:
            pdf.close()
            raise
        page_options = options.model_copy(update={"stream": False, "page_range": None})

        async def work(index: int, image):
            return (await self._ocr([image], page_options, page=index, arrived=time.perf_counter()),
                    image.size)

        async def entries():
            try:
                async with aclosing(map_pages(pdf, indices, options.dpi, work,
                                              self.config.pages_in_flight)) as results:
                    async for index, outcome in results:
                        if isinstance(outcome, BaseException):
                            yield pages.failed_page(index, outcome, log)
                        else:
                            yield pages.page_entry(index, *outcome)
            finally:
                await asyncio.to_thread(pdf.close)
        return entries()

    def _require_decoder(self) -> None:
        if self.decoder is None:
            raise BadRequest("this deployment is encode-only (encode_only=true): use /v1/encode")

    def _record_generation(self, result: dict, seqs, decode_ms: float) -> None:
        metrics = router_metrics()
        metrics["stage"].observe(decode_ms, tags={"stage": "decode"})
        metrics["finish"].inc(tags={"reason": result["finish_reason"] or "unknown"})
        for kind, count in (("image", sum(s.shape[0] for s in seqs)),
                            ("prompt", result["prompt_tokens"]),
                            ("completion", result["completion_tokens"])):
            metrics["tokens"].inc(count, tags={"kind": kind})

    async def _encode_prompt(self, image, options: OcrOptions):
        """Steps 1-4: validate, preprocess, check the context, encode -> (prompt ids, sequences,
        timings, the images' original sizes)."""
        self._require_decoder()
        images = image if isinstance(image, list) else [image]
        if options.page_range is not None:
            raise BadRequest("page_range applies to documents (send a PDF as 'document')", "page_range")
        if options.output_format == "blocks" and len(images) != 1:
            raise BadRequest("output_format 'blocks' places boxes on one image: send one image",
                             "output_format")
        prompt = options.prompt_for(len(images), self.config.max_images_per_request)
        pending = await self._preprocess(images, options)
        ids = build_prompt(self.tokenizer, prompt, [p.num_tokens for p in pending])
        if len(ids) >= self.max_len:
            image_tokens = sum(p.num_tokens for p in pending)
            raise BadRequest(f"the prompt is {len(ids)} tokens ({image_tokens} of them image "
                             f"tokens) but the decoder's context holds {self.max_len}: send fewer "
                             f"images, or a smaller mode or max_crops")
        seqs, timings = await self._encode(pending)
        return ids, seqs, timings, [p.original_size for p in pending]

    async def _preprocess(self, images: list, options: OcrOptions) -> list["_Image"]:
        """Each image's encoded sequence from the cache, or else, on a worker thread (the event
        loop stays free): decode it (views_on_encoder), or decode it and build its global view
        while the crops go on resizing on a helper thread."""
        def start(image) -> _Image:
            key = content_key(image, options.mode, options.max_crops) if self.cache else None
            cached = self.cache.get(key) if self.cache else None
            if cached is not None:
                return _Image(key, cached=cached)
            if self.config.views_on_encoder:
                began = time.perf_counter()
                sent = (read_header(image, options.mode, options.max_crops)
                        if self.config.decode_on_encoder else None)
                sent = sent or decode(image, options.mode, options.max_crops)
                return _Image(key, pending=sent, decode_ms=(time.perf_counter() - began) * 1e3)
            return _Image(key, pending=start_preprocess(image, options.mode, options.max_crops))

        async def one(index: int, image) -> _Image:
            try:
                return await asyncio.to_thread(start, image)
            except ImageError as e:
                raise _of_image(e, index) from None
        return await asyncio.gather(*(one(i, image) for i, image in enumerate(images)))

    async def _encode(self, pending: list["_Image"]):
        start = time.perf_counter()

        async def one(index: int, image: _Image):
            try:
                return await self._encode_one(image, start)
            except ImageError as e:  # decoded in an encoder replica: its exception, this image's
                raise _of_image(e, index) from None
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(pending)))
        seqs = [seq for seq, _ in results]
        stages = [t for _, t in results]
        timings = {"preprocess_ms": max(t["preprocess_ms"] for t in stages),
                   "encode_ms": max(t["encode_ms"] for t in stages),
                   "assemble_ms": sum(t["assemble_ms"] for t in stages),
                   "encoding_ms": (time.perf_counter() - start) * 1e3}
        self.recent.append(timings)
        for stage in ("preprocess", "encode", "assemble"):
            router_metrics()["stage"].observe(timings[f"{stage}_ms"], tags={"stage": stage})
        return seqs, timings

    async def _encode_one(self, image: "_Image", start: float):
        """One image: its global view goes to GlobalEncoder and its crops to LocalEncoder (the
        image's bytes or pixels to both at once, each making its views; or the global view at
        once and the crops when resized here); then its sequence is assembled (and cached). A
        cached image skips all of it."""
        if image.cached is not None:
            return image.cached[0], {"preprocess_ms": 0.0, "encode_ms": 0.0, "assemble_ms": 0.0}
        pending = image.pending
        # Sent to the encoders: the image's bytes with their header (decode_on_encoder), or
        # its decoded pixels, for them to make the views from; or (views made here) its views.
        sent = pending if isinstance(pending, ImageHeader) else (
            to_wire(pending.pixels) if isinstance(pending, DecodedImage) else None)
        if self.local_encoder is None:  # one_encoder: one call decodes, encodes and assembles
            view = ("both", pending.mode, pending.grid)
            seq = (await self.encoder.encode(sent, view) if self.encoder is not None  # in-process
                   else await call_with_retry(self.global_encoder.encode, sent, view))
            return self._assembled(image, from_wire(seq), start, image.decode_ms)
        if sent is not None:
            # One copy into the object store for both encoders (each call would make its own).
            sent = ray.put(sent) if pending.tiled else sent
            global_call = asyncio.ensure_future(call_with_retry(
                self.global_encoder.encode, sent, ("global", pending.mode, pending.grid)))
        else:
            global_call = asyncio.ensure_future(
                call_with_retry(self.global_encoder.encode, to_wire(pending.global_view)))
        try:
            if sent is not None:  # decoded or its header read (in image.decode_ms) before `start`
                item, ready, preprocess_ms = pending, start, image.decode_ms
                crops = (sent, ("local", pending.mode, pending.grid))
            else:
                item = await asyncio.to_thread(pending.result)
                ready = time.perf_counter()
                preprocess_ms, crops = (ready - start) * 1e3, (to_wire(item.crops),)
            crop_tokens = None
            if item.tiled:
                crop_tokens = from_wire(await call_with_retry(self.local_encoder.encode, *crops))
            global_tokens = from_wire(await global_call)
        finally:
            global_call.cancel()  # no-op when done; frees the call if this image failed
        return self._assembled(image, (global_tokens, crop_tokens), ready, preprocess_ms, item)

    def _assembled(self, image: "_Image", tokens, ready: float, preprocess_ms: float, item=None):
        """An image's sequence (cached), with its stage timings: `tokens` is the sequence (the
        one Encoder assembles it) or its paths' (global tokens, crop tokens or None)."""
        item = item or image.pending
        encoded = time.perf_counter()
        seq = (tokens if torch.is_tensor(tokens)
               else assemble(*tokens, item.grid, self.newline, self.separator))
        assert seq.shape[0] == item.num_tokens, (seq.shape, item.num_tokens)
        if self.cache is not None:
            self.cache.put(image.key, (seq, item.original_size), seq.numel() * seq.element_size())
        return seq, {"preprocess_ms": preprocess_ms, "encode_ms": (encoded - ready) * 1e3,
                     "assemble_ms": (time.perf_counter() - encoded) * 1e3}

    # -- HTTP -----------------------------------------------------------------------------------
    @api.post("/v1/ocr")
    async def http_ocr(self, request: Request):
        async def work(source, options: OcrOptions):
            if isinstance(source, Document):
                if not options.stream:
                    return await self._ocr_document(source, options)
                entries = await self._document_pages(source, options)
                return self._event_stream(entries, entries, options)
            if not options.stream:
                return await self._ocr(source, options)
            deltas = await self._ocr_stream(source, options)
            return self._event_stream(deltas, deltas, options)
        return await self._guard(request, work)

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        async def read(request):
            body = await _read_json(request, self.config.max_request_mb << 20)
            return await self._read_chat(body)

        async def work(source, options: OcrOptions, chat: openai_api.ChatRequest):
            if not options.stream:
                return await self._chat(source, options)
            deltas = await self._chat_deltas(source, options)
            include_usage = chat.stream_options is not None and chat.stream_options.include_usage
            return self._event_stream(self._chat_chunks(deltas, include_usage), deltas, options)
        return await self._guard(request, work, read)

    @api.get("/v1/models")
    async def http_models(self, request: Request):
        return self._refuse_without_key(request) or {
            "object": "list", "data": [openai_api.model_card(self.model_id, self.started)]}

    @api.get("/v1/models/{model_id:path}")
    async def http_model(self, model_id: str, request: Request):
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        try:
            self._check_model(model_id)
        except NotFound as e:
            return _bad_request(e)
        return openai_api.model_card(self.model_id, self.started)

    def _check_model(self, model_id: str) -> None:
        if model_id != self.model_id:
            raise NotFound(f"the model {model_id!r} is not served here; it serves "
                           f"{self.model_id!r} (GET /v1/models)", "model", "model_not_found")

    def _event_stream(self, events: AsyncIterator[dict], deltas, options: OcrOptions) -> StreamingResponse:
        """Server-sent events, one JSON object each, then [DONE]; a failure or the time limit
        after the stream began is reported in-band (an error event), never a silent cut."""
        limit = options.timeout_s or self.config.request_timeout_s

        async def body():
            try:
                async with asyncio.timeout(limit):
                    async for event in events:
                        yield f"data: {json.dumps(event)}\n\n"
            except TimeoutError:
                error = _error_body("timeout", f"the request took longer than {limit:g} s")
                yield f"data: {json.dumps(error)}\n\n"
            except Exception:  # noqa: BLE001
                log.exception("stream failed")
                yield f"data: {json.dumps(_error_body('internal_error', 'generation failed'))}\n\n"
            finally:
                await deltas.aclose()  # a client that went away frees its decoder slot
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @api.post("/v1/encode")
    async def http_encode(self, request: Request):
        async def work(images, options: OcrOptions):
            if isinstance(images, Document):
                raise BadRequest("/v1/encode takes images; send documents to /v1/ocr", "document")
            options.prompt_for(len(images), self.config.max_images_per_request)
            seqs, timings = await self._encode(await self._preprocess(images, options))
            return {**self.model_fields, "timings": timings, "images": [
                {"num_tokens": s.shape[0], "dim": s.shape[1], "dtype": "float32",
                 "embedding_base64": base64.b64encode(s.float().numpy().tobytes()).decode()}
                for s in seqs]}
        return await self._guard(request, work)

    @api.get("/health")
    async def health(self):
        """Liveness: this Router replica answers (no model call, no key needed)."""
        return {"status": "ok", **self.model_fields}

    @api.get("/ready")
    async def ready(self, request: Request):
        """Readiness: 200 once every tier has loaded its weights and captured its graphs (each
        answers its `ready` call within a second), else 503 naming the tiers that are not."""
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        tiers = ({"Encoder": self.encoder or self.global_encoder} if self.local_encoder is None else
                 {"GlobalEncoder": self.global_encoder, "LocalEncoder": self.local_encoder})
        if self.decoder is not None:
            tiers["Decoder"] = self.decoder

        async def state(handle):
            if handle is self.encoder:  # in this process: ready, as this replica answers
                return self.encoder.ready()
            try:
                return await asyncio.wait_for(handle.ready.remote(), timeout=1.0)
            except Exception as e:  # noqa: BLE001 - not up yet, or failing: both mean not ready
                return {"ready": False, "reason": type(e).__name__}
        states = dict(zip(tiers, await asyncio.gather(*(state(h) for h in tiers.values()))))
        waiting = [name for name, st in states.items() if not st.get("ready")]
        body = {"status": "ready" if not waiting else "not ready", "not_ready": waiting,
                "tiers": states, **self.model_fields}
        return JSONResponse(status_code=503 if waiting else 200, content=body,
                            headers={"Retry-After": "5"} if waiting else None)

    def _refuse_without_key(self, request: Request) -> JSONResponse | None:
        if self.api_key is None:
            return None
        sent = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(sent, f"Bearer {self.api_key}".encode()):  # constant time
            return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                content=_error_body("authentication_error",
                                                    "missing or wrong API key (Authorization: Bearer <key>)"))
        return None

    async def _guard(self, request: Request, work, read=None):
        """`_answer`, counted in the metrics by endpoint and status."""
        start = time.perf_counter()
        response = await self._answer(request, work, read or self._read_ocr)
        status = getattr(response, "status_code", 200)
        metrics = router_metrics()
        metrics["requests"].inc(tags={"endpoint": request.url.path, "status": str(status)})
        metrics["latency"].observe((time.perf_counter() - start) * 1e3, tags={"endpoint": request.url.path})
        if status >= 400:
            reason = getattr(response, "reason", None) or {401: "unauthorized", 408: "timeout",
                                                          413: "too_large", 500: "internal"}.get(status, "invalid")
            metrics["rejections"].inc(tags={"reason": reason})
        return response

    async def _read_ocr(self, request: Request) -> tuple[list[bytes], OcrOptions]:
        images, options, strict = await _read(request, self.config.max_request_mb << 20)
        return images, OcrOptions.parse(options, strict=strict)

    async def _answer(self, request: Request, work, read):
        """Check the key, admit (or refuse with 503 when this replica is full), read the body
        and validate its options (`read`: the images and OcrOptions first), run `work` on them
        within the request's time limit; every error answers in one JSON shape."""
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        if self.inflight >= self.config.max_inflight_requests:
            return _overloaded("overloaded", f"the server is at its limit of "
                               f"{self.config.max_inflight_requests} requests in flight; retry shortly")
        self.inflight += 1
        protocol.REQUEST_ARRIVED.set(time.perf_counter())
        inputs = None
        try:
            inputs = await read(request)
            limit = inputs[1].timeout_s or self.config.request_timeout_s
            return await asyncio.wait_for(work(*inputs), timeout=limit)
        except (BadRequest, ImageError, DocumentError) as e:
            return _bad_request(e, inputs[0] if inputs else None)
        except asyncio.TimeoutError:
            return JSONResponse(status_code=408, content=_error_body(
                "timeout", f"the request took longer than its limit of {limit:g} s (timeout_s)"))
        except BackPressureError:
            return _overloaded("backpressure", "a model tier's queue is full; retry shortly")
        except RETRYABLE + (DeploymentUnavailableError,):
            return _overloaded("replica_lost", "a model replica was lost and is being replaced; "
                               "retry shortly")
        except Exception:  # noqa: BLE001 - the replica must answer, not die
            log.exception("request failed")
            return JSONResponse(status_code=500,
                                content=_error_body("internal_error", "internal error (see the server log)"))
        finally:
            self.inflight -= 1