"""The Router: HTTP ingress and Python handle methods; no model math, no GPU.

(No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at runtime.)

One request, top to bottom (`_ocr`):
  1. validate: `OcrOptions` (deployments/protocol.py) and the image count;
  2. preprocess: decode each image and build its global view on a worker thread (the crops keep
     resizing on a helper thread); the prompt's length is known now and checked against the
     decoder's context before any GPU work;
  3. fan out: each global view goes to GlobalEncoder at once, the crops to LocalEncoder when
     they are ready; each encoder batches across requests;
  4. assemble each image's sequence (local grid + newlines, global, separator);
  5. decode: the Decoder generates from the prompt ids and the image embeddings;
  6. respond: text, finish reason, usage, per-stage timings.
"""
import asyncio
import base64
import binascii
import hmac
import json
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from common.checkpoint import read_config, read_tensors
from decoder import DecoderArgs, build_prompt, load_tokenizer
from decoder.grounding import parse_blocks, to_markdown
from encoder import ImageError, assemble
from encoder.preprocess import PendingImage, start_preprocess

from .config import AppConfig
from .metrics import router_metrics
from .model_source import replica_id, resolve_checkpoint
from .protocol import (BadRequest, OcrOptions, PayloadTooLarge, UnsupportedMediaType, from_wire,
                       to_wire)

log = logging.getLogger("ray.serve")
api = FastAPI(title="DeepSeek-OCR on Ray Serve")

# A replica that dies mid-call (node loss, a CUDA fault that fails its health check) is
# replaced by Serve; encoding and a generation that has streamed nothing are idempotent, so the
# call is retried instead of failing the user.
RETRYABLE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


async def call_with_retry(method, *args, attempts: int = 3, backoff_s: float = 0.5):
    """`await method.remote(*args)`, retried on replica loss with a growing pause."""
    for attempt in range(attempts):
        try:
            return await method.remote(*args)
        except RETRYABLE:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(backoff_s * (attempt + 1))


# Module helpers come before the class: `serve.ingress` pickles the FastAPI app (and so the
# endpoints' globals) when the class is decorated, before anything below it exists.
def _error_body(kind: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The one error shape of every route (OpenAI's and vLLM's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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


async def _read(request: Request, max_bytes: int) -> tuple[list[bytes], dict, bool]:
    """(images, options as sent, whether the options are typed JSON values)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise PayloadTooLarge(f"request body of {int(length)} bytes is over the limit of "
                              f"{max_bytes} (max_request_mb)")
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form()
        images = [await f.read() for key in ("image", "file") for f in form.getlist(key)
                  if hasattr(f, "read")]
        options = {k: v for k, v in form.items() if k not in ("image", "file")}
        if "ngram" in options:  # an object inside a form: JSON text
            options["ngram"] = _json_field(options["ngram"], "ngram")
        return images, options, False
    if not content_type.startswith("application/json"):
        raise UnsupportedMediaType(f"content-type must be application/json or multipart/form-data, "
                                   f"got {content_type or 'none'!r}")
    raw = await request.body()
    if len(raw) > max_bytes:  # a body sent without a content-length
        raise PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes (max_request_mb)")
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("JSON body must be an object")
    if "image" in body and "images" in body:
        raise BadRequest("send 'image' or 'images', not both")
    images = body.pop("image", None)
    images = body.pop("images", None) if images is None else images
    images = [] if images is None else images
    return [_decode_base64(b) for b in (images if isinstance(images, list) else [images])], body, True


def _json_field(value: str, name: str):
    try:
        return json.loads(value)
    except ValueError:
        raise BadRequest(f"{name} must be a JSON object") from None


def _decode_base64(value) -> bytes:
    if not isinstance(value, str):
        raise BadRequest(f"images in JSON must be base64 strings, got {type(value).__name__}")
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if not header.startswith(("data:image/", "data:application/octet-stream")) \
                or not header.endswith(";base64"):
            raise BadRequest(f"a data: URL image must be 'data:image/...;base64,...', got "
                             f"{header[:60]!r}")
    try:  # line-wrapped base64 (what `base64` and `base64.encodebytes` write) is fine
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("image is not valid base64") from None


@serve.deployment(max_ongoing_requests=200, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api)
class Router:
    def __init__(self, global_encoder: DeploymentHandle, local_encoder: DeploymentHandle,
                 decoder: DeploymentHandle | None, config: AppConfig):
        self.global_encoder, self.local_encoder, self.decoder = global_encoder, local_encoder, decoder
        self.config = config
        directory, self.model_label = resolve_checkpoint(config.checkpoint)
        specials = read_tensors(directory, lambda k: k in ("model.image_newline", "model.view_seperator"))
        self.newline, self.separator = specials["model.image_newline"], specials["model.view_seperator"]
        # Encode-only apps need no tokenizer (and their checkpoints may carry none).
        self.tokenizer = load_tokenizer(directory if config.checkpoint else None) if decoder else None
        self.max_len = config.max_len or DecoderArgs.from_config(read_config(directory)).max_positions
        self.recent: deque[dict] = deque(maxlen=1000)  # per-request stage timings
        self.inflight = 0  # HTTP requests being worked on (admission control)
        self.api_key = config.api_key or os.environ.get("DEEPSEEK_OCR_API_KEY") or None

    # -- Python handle API ------------------------------------------------------------------
    async def encode(self, image, mode: str = "gundam", max_crops: int = 6) -> list[torch.Tensor]:
        """One [num_tokens, D] sequence per image (a single image or a list)."""
        images = image if isinstance(image, list) else [image]
        options = OcrOptions.parse({"mode": mode, "max_crops": max_crops})
        options.prompt_for(len(images), self.config.max_images_per_request)
        seqs, _ = await self._encode(await self._preprocess(images, options))
        return seqs

    async def ocr(self, image, prompt: str | None = None, **options) -> dict:
        """OCR one image (or a list): {text, finish_reason, usage, model, timings}."""
        return await self._ocr(image, OcrOptions.parse({**options, "prompt": prompt}))

    async def ocr_stream(self, image, prompt: str | None = None, **options) -> AsyncIterator[dict]:
        """Like ocr, but yields text deltas as they are generated (handle.options(stream=True))."""
        async for delta in await self._ocr_stream(image, OcrOptions.parse({**options, "prompt": prompt})):
            yield delta

    def stats(self) -> dict:
        return {"model": self.model_label, "replica": replica_id(), "pid": os.getpid(),
                "requests": len(self.recent)}

    def timings(self) -> dict:
        """Median ms per stage over the last 1,000 requests: preprocess (until the crops are
        ready; the global view is already encoding by then), encode (until both paths
        answered), assemble, and the whole encoding of the request."""
        keys = ("preprocess_ms", "encode_ms", "assemble_ms", "total_ms")
        return {"requests": len(self.recent),
                **{k: statistics.median(t[k] for t in self.recent) if self.recent else None
                   for k in keys}}

    # -- one request ----------------------------------------------------------------------------
    async def _ocr(self, image, options: OcrOptions) -> dict:
        ids, seqs, timings, sizes = await self._encode_prompt(image, options)
        start = time.perf_counter()
        result = await call_with_retry(self.decoder.generate, ids, [to_wire(s) for s in seqs],
                                       options.sampling())
        timings["decode_ms"] = (time.perf_counter() - start) * 1e3
        self._record_generation(result, seqs, timings["decode_ms"])
        response = {"text": result["text"], "finish_reason": result["finish_reason"],
                    "model": self.model_label,
                    "usage": {"prompt_tokens": result["prompt_tokens"],
                              "image_tokens": sum(s.shape[0] for s in seqs),
                              "completion_tokens": result["completion_tokens"]},
                    "timings": timings}
        if options.output_format == "markdown":  # DeepSeek's clean-up of the grounding tags
            response["text"] = to_markdown(result["text"])
        elif options.output_format == "blocks":  # boxes in pixels of the (one) original image
            response["blocks"] = parse_blocks(result["text"], *sizes[0])
        return response

    async def _ocr_stream(self, image, options: OcrOptions) -> AsyncIterator[dict]:
        """Validate and encode now (errors surface before anything is streamed), then return
        the decoder's delta stream."""
        ids, seqs, _, _ = await self._encode_prompt(image, options)
        stream = self.decoder.options(stream=True).generate_stream.remote(
            ids, [to_wire(s) for s in seqs], options.sampling())

        async def deltas():
            start = time.perf_counter()
            async for delta in stream:
                if delta["finished"]:
                    self._record_generation(delta, seqs, (time.perf_counter() - start) * 1e3)
                yield {**delta, "model": self.model_label}
        return deltas()

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
        if self.decoder is None:
            raise BadRequest("this deployment is encode-only (encode_only=true): use /v1/encode")
        images = image if isinstance(image, list) else [image]
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

    async def _preprocess(self, images: list, options: OcrOptions) -> list[PendingImage]:
        """Decode each image and build its global view on a worker thread (the event loop stays
        free); the crops go on resizing on a helper thread."""
        return await asyncio.gather(*(
            asyncio.to_thread(start_preprocess, image, options.mode, options.max_crops)
            for image in images))

    async def _encode(self, pending: list[PendingImage]):
        start = time.perf_counter()
        results = await asyncio.gather(*(self._encode_one(p, start) for p in pending))
        seqs = [seq for seq, _ in results]
        stages = [t for _, t in results]
        timings = {"preprocess_ms": max(t["preprocess_ms"] for t in stages),
                   "encode_ms": max(t["encode_ms"] for t in stages),
                   "assemble_ms": sum(t["assemble_ms"] for t in stages),
                   "total_ms": (time.perf_counter() - start) * 1e3}
        self.recent.append(timings)
        for stage in ("preprocess", "encode", "assemble"):
            router_metrics()["stage"].observe(timings[f"{stage}_ms"], tags={"stage": stage})
        return seqs, timings

    async def _encode_one(self, pending: PendingImage, start: float):
        """One image: its global view goes to GlobalEncoder at once, while its crops are still
        being resized; then the crops go to LocalEncoder; then its sequence is assembled."""
        global_call = asyncio.ensure_future(
            call_with_retry(self.global_encoder.encode, to_wire(pending.global_view)))
        try:
            item = await asyncio.to_thread(pending.result)
            ready = time.perf_counter()
            crop_tokens = None
            if item.tiled:
                crop_tokens = from_wire(await call_with_retry(self.local_encoder.encode,
                                                              to_wire(item.crops)))
            global_tokens = from_wire(await global_call)
        finally:
            global_call.cancel()  # no-op when done; frees the call if this image failed
        encoded = time.perf_counter()
        seq = assemble(global_tokens, crop_tokens, item.grid, self.newline, self.separator)
        assert seq.shape[0] == item.num_tokens, (seq.shape, item.num_tokens)
        return seq, {"preprocess_ms": (ready - start) * 1e3, "encode_ms": (encoded - ready) * 1e3,
                     "assemble_ms": (time.perf_counter() - encoded) * 1e3}

    # -- HTTP -----------------------------------------------------------------------------------
    @api.post("/v1/ocr")
    async def http_ocr(self, request: Request):
        async def work(images, options: OcrOptions):
            if not options.stream:
                return await self._ocr(images, options)
            deltas = await self._ocr_stream(images, options)
            limit = options.timeout_s or self.config.request_timeout_s

            async def events():  # server-sent events: one JSON delta each, then [DONE]
                try:
                    async with asyncio.timeout(limit):
                        async for delta in deltas:
                            yield f"data: {json.dumps(delta)}\n\n"
                except TimeoutError:  # the stream has begun: report it in-band
                    error = _error_body("timeout", f"the request took longer than {limit:g} s")
                    yield f"data: {json.dumps(error)}\n\n"
                except Exception:  # noqa: BLE001
                    log.exception("stream failed")
                    yield f"data: {json.dumps(_error_body('internal_error', 'generation failed'))}\n\n"
                finally:
                    await deltas.aclose()  # a client that went away frees its decoder slot
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return await self._guard(request, work)

    @api.post("/v1/encode")
    async def http_encode(self, request: Request):
        async def work(images, options: OcrOptions):
            options.prompt_for(len(images), self.config.max_images_per_request)
            seqs, timings = await self._encode(await self._preprocess(images, options))
            return {"model": self.model_label, "timings": timings, "images": [
                {"num_tokens": s.shape[0], "dim": s.shape[1], "dtype": "float32",
                 "embedding_base64": base64.b64encode(s.float().numpy().tobytes()).decode()}
                for s in seqs]}
        return await self._guard(request, work)

    @api.get("/health")
    async def health(self):
        """Liveness: this Router replica answers (no model call, no key needed)."""
        return {"status": "ok", "model": self.model_label}

    @api.get("/ready")
    async def ready(self, request: Request):
        """Readiness: 200 once every tier has loaded its weights and captured its graphs (each
        answers its `ready` call within a second), else 503 naming the tiers that are not."""
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        tiers = {"GlobalEncoder": self.global_encoder, "LocalEncoder": self.local_encoder}
        if self.decoder is not None:
            tiers["Decoder"] = self.decoder

        async def state(handle):
            try:
                return await asyncio.wait_for(handle.ready.remote(), timeout=1.0)
            except Exception as e:  # noqa: BLE001 - not up yet, or failing: both mean not ready
                return {"ready": False, "reason": type(e).__name__}
        states = dict(zip(tiers, await asyncio.gather(*(state(h) for h in tiers.values()))))
        waiting = [name for name, st in states.items() if not st.get("ready")]
        body = {"status": "ready" if not waiting else "not ready", "not_ready": waiting,
                "tiers": states, "model": self.model_label}
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

    async def _guard(self, request: Request, work):
        """`_answer`, counted in the metrics by endpoint and status."""
        start = time.perf_counter()
        response = await self._answer(request, work)
        status = getattr(response, "status_code", 200)
        metrics = router_metrics()
        metrics["requests"].inc(tags={"endpoint": request.url.path, "status": str(status)})
        metrics["latency"].observe((time.perf_counter() - start) * 1e3, tags={"endpoint": request.url.path})
        if status >= 400:
            reason = getattr(response, "reason", None) or {401: "unauthorized", 408: "timeout",
                                                          413: "too_large", 500: "internal"}.get(status, "invalid")
            metrics["rejections"].inc(tags={"reason": reason})
        return response

    async def _answer(self, request: Request, work):
        """Check the key, admit (or refuse with 503 when this replica is full), read the body,
        validate its options, run `work` within the request's time limit; every error answers
        in one JSON shape."""
        refused = self._refuse_without_key(request)
        if refused is not None:
            return refused
        if self.inflight >= self.config.max_inflight_requests:
            return _overloaded("overloaded", f"the server is at its limit of "
                               f"{self.config.max_inflight_requests} requests in flight; retry shortly")
        self.inflight += 1
        try:
            images, options, strict = await _read(request, self.config.max_request_mb << 20)
            options = OcrOptions.parse(options, strict=strict)
            limit = options.timeout_s or self.config.request_timeout_s
            return await asyncio.wait_for(work(images, options), timeout=limit)
        except (BadRequest, ImageError) as e:
            return JSONResponse(status_code=getattr(e, "status", 400),
                                content=_error_body("invalid_request", str(e), getattr(e, "param", None)))
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