"""The Router: the app's ingress. HTTP in (API key, admission, body parsing, the error envelope,
server-sent events, liveness and readiness) and Python handle calls -> one call into the
`OcrPipeline` (deployments/pipeline.py) of the model the request names -> HTTP or a dict out.
No model math, no placement: each served model's pipeline, with its encoder strategy, is built
once from the handles the app was built with (`placement.model_pipeline`).

(No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at runtime.)
"""
import asyncio
import base64
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException

from . import batch_api, openai_api
from . import protocol  # protocol.REQUEST_ARRIVED: a module pickles by name, a ContextVar not at all
from .config import SHUTDOWN, AppConfig, ServedModel
from .batch_runner import BatchRunner
from .batch_store import BatchStore, FileStorage
from .http_io import (bad_request, check_length, error_body, event_stream, ocr_json, overloaded, read_json,
                      read_ocr_body)
from .metrics import router_metrics
from .model_source import prepare_replica_process, replica_id
from .pipeline import OcrPipeline
from .placement import RETRYABLE, ModelTiers, model_pipeline
from .protocol import CLIENT_ERRORS, BadRequest, Document, Images, NotFound, OcrOptions

log = logging.getLogger("ray.serve")
api = FastAPI(title="DeepSeek-OCR on Ray Serve")
BATCH_QUIET_S = 0.5  # a Router without HTTP requests this long sends batch lines again


# Module helpers come before the class: `serve.ingress` pickles the FastAPI app (and so the
# endpoints' globals) when the class is decorated, before anything below it exists.
@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException):
    """Unknown routes (404) and wrong methods (405) answer in the same JSON shape as the rest."""
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(status_code=exc.status_code, headers=exc.headers,
                        content=error_body("invalid_request", message))


@api.exception_handler(RequestValidationError)
async def _invalid_parameter(request: Request, exc: RequestValidationError):
    """A route's path or query parameter of the wrong type (`?limit=abc`): 400 naming it, in the
    same JSON shape as the rest (FastAPI's own answer is a 422 of another shape)."""
    error = exc.errors()[0]
    param = str(error["loc"][-1]) if error.get("loc") else None
    return JSONResponse(status_code=400, content=error_body("invalid_request", f"{param}: {error['msg']}", param))


def _memory_mb() -> dict:
    """This process's resident memory now and at its peak (Linux), in MB."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    return {name: int(fields[key].split()[0]) / 1024 for name, key in
            (("rss_mb", "VmRSS"), ("peak_rss_mb", "VmHWM")) if key in fields}


def expand(location: str) -> str:
    """A store's location with `~` expanded (a URL as it is)."""
    return location if "://" in location else os.path.expanduser(location)


def _handle_source(image, document) -> Images | Document:
    """A handle call's images (one or a list) or its PDF (bytes or a path on this node)."""
    if document is None:
        return Images(image if isinstance(image, list) else [image])
    if image is not None:
        raise BadRequest("send images or a document, not both", "document")
    if not isinstance(document, (bytes, bytearray, str, os.PathLike)):
        raise BadRequest(f"document must be PDF bytes or a path, got {type(document).__name__}",
                         "document")
    return Document(bytes(document) if isinstance(document, bytearray) else document)


# max_ongoing_requests: above the app's own limit (`AppConfig.inflight_limit`, 512 by default),
# which refuses in the app's JSON envelope; Serve's is only the ceiling.
@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.25}, **SHUTDOWN)
@serve.ingress(api)
class Router:
    def __init__(self, models: list[ModelTiers], config: AppConfig):
        """`models`: each served model's tiers as the app was built (`ModelTiers`: handles,
        None where its placement has none: one Encoder of both paths, or none with the encoder
        in this replica's process; no decoder: encode-only). The first is the default."""
        prepare_replica_process()  # also: the sequences Router.encode returns go out of band
        self.config = config
        self.served: dict[str, tuple[ServedModel, OcrPipeline]] = {}
        for tiers in models:
            pipeline = model_pipeline(tiers)
            self.served[pipeline.model_fields["model"]] = (tiers.model, pipeline)
        self.default_model = next(iter(self.served))
        self.inflight = 0  # HTTP requests being worked on (admission control)
        self.idle_since = time.monotonic()  # when the last of them ended (batch lines' turn)
        self.no_requests = asyncio.Event()  # set while none is in flight
        self.no_requests.set()
        self.inflight_limit = config.inflight_limit()
        self.started = int(time.time())
        # Batch jobs (OpenAI's Files and Batch API): their store, and this replica's worker,
        # started on the replica's event loop by its first request or health check.
        self.batches = BatchStore(expand(config.batch_store), FileStorage(expand(config.batch_files)))
        self.batch_runner = BatchRunner(self.batches, self._answer_line, owner=f"router-{replica_id()}",
                                        lease_s=config.batch_lease_s, concurrency=config.batch_lines_in_flight,
                                        metrics=router_metrics(),
                                        turn=self._batch_turn)
        self.batch_worker: asyncio.Task | None = None

    def _pipeline(self, model: str | None) -> OcrPipeline:
        """The pipeline of the model a request names (none: the default); 404 for another."""
        model = self.default_model if model is None else model
        if model not in self.served:
            raise NotFound(f"the model {model!r} is not served here; it serves "
                           f"{', '.join(map(repr, self.served))} (GET /v1/models)", "model",
                           "model_not_found")
        return self.served[model][1]

    # -- Python handle API ------------------------------------------------------------------
    async def encode(self, image, mode: str = "gundam", max_crops: int = 6,
                     model: str | None = None) -> list[torch.Tensor]:
        """One [num_tokens, D] sequence per image (a single image or a list)."""
        entered = time.perf_counter()
        options = OcrOptions.parse({"mode": mode, "max_crops": max_crops, "model": model})
        seqs, timings = await self._pipeline(model).encode(_handle_source(image, None), options)
        timings["handler_ms"] = (time.perf_counter() - entered) * 1e3  # kept in the pipeline's recent
        return seqs

    async def ocr(self, image=None, prompt: str | None = None, *, document=None, **options) -> dict:
        """OCR one image (or a list): {text, finish_reason, usage, model, timings}; or a PDF
        `document` (bytes or a path): {pages, text, usage, failed_pages, model}."""
        options = OcrOptions.parse({**options, "prompt": prompt})
        source, pipeline = _handle_source(image, document), self._pipeline(options.model)
        if isinstance(source, Document):
            return await pipeline.document(source, options)
        return await pipeline.ocr(source, options)

    async def ocr_stream(self, image=None, prompt: str | None = None, *, document=None,
                         **options) -> AsyncIterator[dict]:
        """Like ocr, but yields text deltas as they are generated (handle.options(stream=True));
        for a `document`, one page dict per finished page, in page order."""
        options = OcrOptions.parse({**options, "prompt": prompt})
        source, pipeline = _handle_source(image, document), self._pipeline(options.model)
        stream = await (pipeline.document_pages(source, options) if isinstance(source, Document)
                        else pipeline.ocr_stream(source, options))
        async with aclosing(stream):
            async for item in stream:
                yield item

    async def chat(self, messages: list[dict], **options) -> dict:
        """A chat completion, as `POST /v1/chat/completions` answers it (images as data: URLs)."""
        source, ocr_options, _ = await self._read_chat({"messages": messages, **options})
        return await openai_api.answer(self._pipeline(ocr_options.model), source, ocr_options)

    async def chat_stream(self, messages: list[dict], **options) -> AsyncIterator[dict]:
        """The chat completion's chunks (handle.options(stream=True)), the usage chunk last."""
        source, ocr_options, _ = await self._read_chat({"messages": messages, **options, "stream": True})
        pipeline = self._pipeline(ocr_options.model)
        deltas = await openai_api.deltas(pipeline, source, ocr_options)
        async with aclosing(deltas):
            async for event in openai_api.chunks(deltas, pipeline.model_fields, include_usage=True):
                yield event

    def stats(self, model: str | None = None) -> dict:
        """This replica's, for one model (none: the default); with encoder_in_router its
        encoder's stats under `encoder`."""
        pipeline = self._pipeline(model)
        cache = pipeline.cache
        return {"model": pipeline.model_fields["model"], "models": list(self.served),
                "replica": replica_id(), "pid": os.getpid(), "requests": len(pipeline.recent),
                **_memory_mb(), "encoder_cache": cache.stats() if cache else None,
                **pipeline.encoder.stats()}

    async def check_health(self):
        self._start_batch_worker()
        for _, pipeline in self.served.values():
            await pipeline.encoder.check_health()

    async def __del__(self):
        """Serve's graceful shutdown of this replica: its batch worker stops and gives back the
        batch it held (a restarted or updated app goes on from the recorded lines at once)."""
        if self.batch_worker is not None:
            self.batch_worker.cancel()
            await asyncio.gather(self.batch_worker, return_exceptions=True)

    def _start_batch_worker(self) -> None:
        """This replica's batch worker, on its event loop (from the first request or health
        check, Serve's first call into the replica): unfinished batches resume after a restart."""
        if self.batch_worker is None or self.batch_worker.done():
            self.batch_worker = asyncio.get_running_loop().create_task(self.batch_runner.run_forever())

    def timings(self, model: str | None = None) -> dict:
        return self._pipeline(model).timings()

    # -- HTTP -----------------------------------------------------------------------------------
    @api.post("/v1/ocr")
    async def http_ocr(self, request: Request):
        return await self._guard(request, self._ocr_work)

    async def _ocr_work(self, source, options: OcrOptions):
        pipeline = self._pipeline(options.model)
        if isinstance(source, Document):
            if not options.stream:
                return await pipeline.document(source, options)
            entries = await pipeline.document_pages(source, options)
            return self._event_stream(entries, entries, options)
        if not options.stream:
            return await pipeline.ocr(source, options)
        deltas = await pipeline.ocr_stream(source, options)
        return self._event_stream(deltas, deltas, options)

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        async def read(request):
            return await self._read_chat(await read_json(request, self.config.max_request_mb << 20))
        return await self._guard(request, self._chat_work, read)

    async def _chat_work(self, source, options: OcrOptions, chat: openai_api.ChatRequest):
        pipeline = self._pipeline(options.model)
        if not options.stream:
            return await openai_api.answer(pipeline, source, options)
        deltas = await openai_api.deltas(pipeline, source, options)
        include_usage = chat.stream_options is not None and chat.stream_options.include_usage
        chunks = openai_api.chunks(deltas, pipeline.model_fields, include_usage)
        return self._event_stream(chunks, deltas, options)

    # -- batch jobs: OpenAI's Files and Batch API (deployments/batch_api.py) ---------------------
    @api.post("/v1/files")
    async def http_upload(self, request: Request):
        async def upload():
            limit = self.config.batch_file_mb << 20
            check_length(request, limit + (1 << 20))  # the form's own bytes besides the file
            form = await request.form(max_files=1, max_fields=4, max_part_size=limit + 1)
            sent = form.get("file")
            if not hasattr(sent, "read"):
                raise BadRequest("send the JSONL file as the multipart field 'file'", "file")
            data = await sent.read()
            return await asyncio.to_thread(batch_api.upload, self.batches, form.get("purpose"), sent.filename, data, limit)
        return await self._batch_call(request, upload)

    @api.get("/v1/files")
    async def http_files(self, request: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = 10_000):
        return await self._store_call(request, batch_api.list_files, purpose, after, limit)

    @api.get("/v1/files/{file_id}")
    async def http_file(self, file_id: str, request: Request):
        return await self._store_call(request, batch_api.file_of, file_id)

    @api.get("/v1/files/{file_id}/content")
    async def http_file_content(self, file_id: str, request: Request):
        async def content():
            data = await asyncio.to_thread(batch_api.content, self.batches, file_id)
            return Response(content=data, media_type="application/jsonl")
        return await self._batch_call(request, content)

    @api.delete("/v1/files/{file_id}")
    async def http_delete_file(self, file_id: str, request: Request):
        return await self._store_call(request, batch_api.delete, file_id)

    @api.post("/v1/batches")
    async def http_create_batch(self, request: Request):
        async def create():
            body = await read_json(request, 1 << 20)
            return await asyncio.to_thread(batch_api.create_batch, self.batches, body)
        return await self._batch_call(request, create)

    @api.get("/v1/batches")
    async def http_batches(self, request: Request, after: str | None = None, limit: int = 20):
        return await self._store_call(request, batch_api.list_batches, after, limit)

    @api.get("/v1/batches/{batch_id}")
    async def http_batch(self, batch_id: str, request: Request):
        return await self._store_call(request, batch_api.batch_of, batch_id)

    @api.post("/v1/batches/{batch_id}/cancel")
    async def http_cancel_batch(self, batch_id: str, request: Request):
        return await self._store_call(request, batch_api.cancel, batch_id)

    async def _store_call(self, request: Request, call, *args):
        """`_batch_call` of `call(store, *args)` on a worker thread (the store's I/O off the loop)."""
        return await self._batch_call(request, lambda: asyncio.to_thread(call, self.batches, *args))

    async def _batch_call(self, request: Request, call):
        """A Files or Batch API call: the key checked, `call()` answered, its errors in the
        envelope (the worker started, if this is the replica's first call)."""
        self._start_batch_worker()
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        try:
            return await call()
        except CLIENT_ERRORS as e:
            return bad_request(e)

    async def _answer_line(self, endpoint: str, body: dict) -> tuple[int, dict]:
        """A batch line, answered as an HTTP request of its endpoint with that JSON body is:
        (status, body); generated below interactive requests (`priority` "batch"), with no
        time limit but its own `timeout_s` (its batch's window bounds it)."""
        async def read():
            if endpoint == "/v1/ocr":
                source, options = ocr_json(body)
                inputs = (source, OcrOptions.parse(options))
            else:
                inputs = await self._read_chat(body)  # (source, options, the chat's own)
            return (inputs[0], inputs[1].model_copy(update={"priority": "batch"}), *inputs[2:])
        response = await self._run(read, self._ocr_work if endpoint == "/v1/ocr" else self._chat_work,
                                   time_limit=False)
        if isinstance(response, Response):
            return response.status_code, json.loads(response.body)
        return 200, response

    @api.get("/v1/models")
    async def http_models(self, request: Request):
        return self._refuse_without_key(request) or {
            "object": "list", "data": [openai_api.model_card(name, self.started) for name in self.served]}

    @api.get("/v1/models/{model_id:path}")
    async def http_model(self, model_id: str, request: Request):
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        try:
            self._pipeline(model_id)
        except NotFound as e:
            return bad_request(e)
        return openai_api.model_card(model_id, self.started)

    @api.post("/v1/encode")
    async def http_encode(self, request: Request):
        async def work(images, options: OcrOptions):
            if isinstance(images, Document):
                raise BadRequest("/v1/encode takes images; send documents to /v1/ocr", "document")
            pipeline = self._pipeline(options.model)
            seqs, timings = await pipeline.encode(images, options)
            return {**pipeline.model_fields, "timings": timings, "images": [
                {"num_tokens": s.shape[0], "dim": s.shape[1], "dtype": "float32",
                 "embedding_base64": base64.b64encode(s.float().numpy().tobytes()).decode()}
                for s in seqs]}
        return await self._guard(request, work)

    @api.get("/health")
    async def health(self):
        """Liveness: this Router replica answers (no model call, no key needed)."""
        return {"status": "ok", **self._pipeline(None).model_fields, "models": list(self.served)}

    @api.get("/ready")
    async def ready(self, request: Request):
        """Readiness: 200 once every tier has loaded its weights and captured its graphs (each
        answers its `ready` call within half a second), else 503 naming the tiers that are not."""
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        tiers = {}  # every model's, by deployment name
        for model, pipeline in self.served.values():
            decoder = {"Decoder": pipeline.decoder.ready} if pipeline.decoder is not None else {}
            tiers.update({model.tier_name(name): ready
                          for name, ready in {**pipeline.encoder.tiers, **decoder}.items()})
        states = dict(zip(tiers, await asyncio.gather(*(ready() for ready in tiers.values()))))
        waiting = [name for name, st in states.items() if not st.get("ready")]
        body = {"status": "ready" if not waiting else "not ready", "not_ready": waiting,
                "tiers": states, **self._pipeline(None).model_fields, "models": list(self.served)}
        return JSONResponse(status_code=503 if waiting else 200, content=body,
                            headers={"Retry-After": "5"} if waiting else None)

    # -- the HTTP edge --------------------------------------------------------------------------
    async def _read_chat(self, body):
        source, options, chat = await openai_api.read_chat(body, self.config)
        self._pipeline(options.model)  # an unknown model: 404 before any work
        return source, options, chat

    def _event_stream(self, events: AsyncIterator[dict], deltas, options: OcrOptions):
        return event_stream(events, deltas, options.timeout_s or self.config.request_timeout_s)

    def _refuse_without_key(self, request: Request) -> JSONResponse | None:
        if self.config.api_key is None:
            return None
        sent = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(sent, f"Bearer {self.config.api_key}".encode()):  # constant time
            return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                content=error_body("authentication_error",
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

    async def _read_ocr(self, request: Request) -> tuple[Images | Document, OcrOptions]:
        source, options, strict = await read_ocr_body(request, self.config.max_request_mb << 20,
                                                        self.config.max_images_per_request)
        return source, OcrOptions.parse(options, strict=strict)

    async def _answer(self, request: Request, work, read):
        """Check the key, admit (or refuse with 503 when this replica is full), read the body
        and validate its options (`read`: the images and OcrOptions first), run `work` on them
        within the request's time limit (past it, its work is cancelled); every error answers in
        one JSON shape."""
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        if self.inflight >= self.inflight_limit:
            return overloaded("overloaded", f"the server is at its limit of "
                              f"{self.inflight_limit} requests in flight; retry shortly")
        self.inflight += 1
        self.no_requests.clear()
        protocol.REQUEST_ARRIVED.set(time.perf_counter())
        try:
            return await self._run(lambda: read(request), work)
        finally:
            self.inflight -= 1
            self.idle_since = time.monotonic()
            if not self.inflight:
                self.no_requests.set()

    async def _batch_turn(self) -> None:
        """A batch line goes into the app once this replica has had no HTTP request in flight
        for BATCH_QUIET_S: the lines in flight already run below interactive work in the
        encoders and the decoder; this keeps new ones out of their queues meanwhile. The
        workers wait on the event while requests run (not a poll on the replica's loop each)."""
        while True:
            await self.no_requests.wait()
            quiet_for = time.monotonic() - self.idle_since
            if quiet_for >= BATCH_QUIET_S and self.no_requests.is_set():
                return
            await asyncio.sleep(BATCH_QUIET_S - quiet_for)

    async def _run(self, read, work, time_limit: bool = True):
        """`work` on what `read()` gives, within the request's time limit (`timeout_s`, else
        the app's unless `time_limit` is off); every error as the one JSON envelope (an HTTP
        request's, or a batch line's)."""
        inputs = None
        try:
            inputs = await read()
            limit = inputs[1].timeout_s or (self.config.request_timeout_s if time_limit else None)
            return await asyncio.wait_for(work(*inputs), timeout=limit)
        except CLIENT_ERRORS as e:
            return bad_request(e, inputs[0] if inputs else None)
        except asyncio.TimeoutError:
            return JSONResponse(status_code=408, content=error_body(
                "timeout", f"the request took longer than its limit of {limit:g} s (timeout_s)"))
        except BackPressureError:
            return overloaded("backpressure", "a model tier's queue is full; retry shortly")
        except RETRYABLE + (DeploymentUnavailableError,):
            return overloaded("replica_lost", "a model replica was lost and is being replaced; "
                              "retry shortly")
        except Exception:  # noqa: BLE001 - the replica must answer, not die
            log.exception("request failed")
            return JSONResponse(status_code=500,
                                content=error_body("internal_error", "internal error (see the server log)"))
