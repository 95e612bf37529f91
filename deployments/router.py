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
import json
import logging
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from common.checkpoint import read_config, read_tensors
from decoder import DecoderArgs, build_prompt, load_tokenizer
from encoder import ImageError, assemble
from encoder.preprocess import PendingImage, start_preprocess

from .config import AppConfig
from .model_source import resolve_checkpoint
from .protocol import BadRequest, OcrOptions, from_wire, to_wire

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
def _error_body(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "message": message}}


async def _read(request: Request) -> tuple[list[bytes], dict, bool]:
    """(images, options as sent, whether the options are typed JSON values)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form()
        images = [await f.read() for key in ("image", "file") for f in form.getlist(key)
                  if hasattr(f, "read")]
        options = {k: v for k, v in form.items() if k not in ("image", "file")}
        if "ngram" in options:  # an object inside a form: JSON text
            options["ngram"] = _json_field(options["ngram"], "ngram")
        return images, options, False
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("body must be JSON or multipart/form-data") from None
    if not isinstance(body, dict):
        raise BadRequest("JSON body must be an object")
    raw = body.pop("image", None) or body.pop("images", None) or []
    return [_decode_base64(b) for b in (raw if isinstance(raw, list) else [raw])], body, True


def _json_field(value: str, name: str):
    try:
        return json.loads(value)
    except ValueError:
        raise BadRequest(f"{name} must be a JSON object") from None


def _decode_base64(value) -> bytes:
    if not isinstance(value, str):
        raise BadRequest("images in JSON must be base64 strings")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        return base64.b64decode(value, validate=True)
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
        ids, seqs, timings = await self._encode_prompt(image, options)
        start = time.perf_counter()
        result = await call_with_retry(self.decoder.generate, ids, [to_wire(s) for s in seqs],
                                       options.sampling())
        timings["decode_ms"] = (time.perf_counter() - start) * 1e3
        return {"text": result["text"], "finish_reason": result["finish_reason"],
                "model": self.model_label,
                "usage": {"prompt_tokens": result["prompt_tokens"],
                          "image_tokens": sum(s.shape[0] for s in seqs),
                          "completion_tokens": result["completion_tokens"]},
                "timings": timings}

    async def _ocr_stream(self, image, options: OcrOptions) -> AsyncIterator[dict]:
        """Validate and encode now (errors surface before anything is streamed), then return
        the decoder's delta stream."""
        ids, seqs, _ = await self._encode_prompt(image, options)
        stream = self.decoder.options(stream=True).generate_stream.remote(
            ids, [to_wire(s) for s in seqs], options.sampling())

        async def deltas():
            async for delta in stream:
                yield {**delta, "model": self.model_label}
        return deltas()

    async def _encode_prompt(self, image, options: OcrOptions):
        """Steps 1-4: validate, preprocess, check the context, encode -> (prompt ids, sequences,
        timings)."""
        if self.decoder is None:
            raise BadRequest("this deployment is encode-only (encode_only=true): use /v1/encode")
        images = image if isinstance(image, list) else [image]
        prompt = options.prompt_for(len(images), self.config.max_images_per_request)
        pending = await self._preprocess(images, options)
        ids = build_prompt(self.tokenizer, prompt, [p.num_tokens for p in pending])
        if len(ids) >= self.max_len:
            image_tokens = sum(p.num_tokens for p in pending)
            raise BadRequest(f"the prompt is {len(ids)} tokens ({image_tokens} of them image "
                             f"tokens) but the decoder's context holds {self.max_len}: send fewer "
                             f"images, or a smaller mode or max_crops")
        seqs, timings = await self._encode(pending)
        return ids, seqs, timings

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

            async def events():  # server-sent events: one JSON delta each, then [DONE]
                try:
                    async for delta in deltas:
                        yield f"data: {json.dumps(delta)}\n\n"
                except Exception:  # noqa: BLE001 - the stream has begun: report it in-band
                    log.exception("stream failed")
                    yield f"data: {json.dumps(_error_body('internal_error', 'generation failed'))}\n\n"
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
        return {"status": "ok", "model": self.model_label}

    async def _guard(self, request: Request, work):
        """Read the body, validate its options, run `work`; errors answer in one JSON shape."""
        try:
            images, options, strict = await _read(request)
            return await work(images, OcrOptions.parse(options, strict=strict))
        except (BadRequest, ImageError) as e:
            return JSONResponse(status_code=400, content=_error_body("invalid_request", str(e)))
        except Exception:  # noqa: BLE001 - the replica must answer, not die
            log.exception("request failed")
            return JSONResponse(status_code=500,
                                content=_error_body("internal_error", "internal error (see the server log)"))
