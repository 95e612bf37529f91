"""The Router: HTTP ingress and Python handle methods; no model math, no GPU.

(No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at runtime.)

For each image: decode it and build the global view on CPU (a worker thread, so the event loop
stays free), send the global view to GlobalEncoder while the crops are still being resized, then
the crops to LocalEncoder, stitch the image's sequence (local grid + newlines, global,
separator), build the prompt, and call the Decoder.
"""
import asyncio
import base64
import binascii
import json
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

from decoder import DEFAULT_PROMPT, build_prompt, load_tokenizer
from decoder.prompt import count_image_tags
from encoder import ImageError
from encoder.checkpoint import read_tensors
from encoder.model import assemble
from encoder.preprocess import MAX_CROPS_LIMIT, MIN_CROPS, MODES, start_preprocess

from .model_source import resolve_checkpoint
from .wire import from_wire, to_wire

MAX_IMAGES_PER_REQUEST = 16
MAX_NEW_TOKENS = 8192
api = FastAPI(title="DeepSeek-OCR on Ray Serve")


class BadRequest(ValueError):
    """A request the caller must fix (HTTP 400)."""


def _int(options: dict, key: str, default: int, low: int, high: int) -> int:
    value = options.get(key, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in {low}..{high}, got {value!r}")
    return value


def check_options(options: dict, n_images: int) -> dict:
    """Validated generation and tiling options; raises BadRequest naming the bad field."""
    if n_images == 0:
        raise BadRequest("no image given (send 'image' as a file upload or base64 JSON)")
    if n_images > MAX_IMAGES_PER_REQUEST:
        raise BadRequest(f"at most {MAX_IMAGES_PER_REQUEST} images per request, got {n_images}")
    mode = options.get("mode", "gundam")
    if mode not in MODES:
        raise BadRequest(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    prompt = options.get("prompt") or "<image>" * n_images + DEFAULT_PROMPT.removeprefix("<image>")
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string")
    if count_image_tags(prompt) != n_images:
        raise BadRequest(f"prompt must contain one <image> tag per image: it has "
                         f"{count_image_tags(prompt)}, the request has {n_images} image(s)")
    stop = options.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of non-empty strings")
    ngram = options.get("ngram") or {}
    if not isinstance(ngram, dict) or set(ngram) - {"ngram_size", "window", "enabled"}:
        raise BadRequest("ngram must be an object with ngram_size, window and/or enabled")
    if ngram.get("enabled", True) is not False:
        size = _int(ngram, "ngram_size", 30, 2, 1000)
        window = _int(ngram, "window", max(90, size), size, 100_000)
        ngram = {"ngram_size": size, "window": window}
    return {"mode": mode, "prompt": prompt, "stop": stop, "ngram": ngram,
            "max_crops": _int(options, "max_crops", 6, MIN_CROPS, MAX_CROPS_LIMIT),
            "max_tokens": _int(options, "max_tokens", MAX_NEW_TOKENS, 1, MAX_NEW_TOKENS)}


def _decode_base64(value) -> bytes:
    if not isinstance(value, str):
        raise BadRequest("images in JSON must be base64 strings")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("image is not valid base64") from None


# A replica that dies mid-call (node loss, a CUDA fault that fails its health check) is
# replaced by Serve; encoding is idempotent, so the call is retried instead of failing the user.
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


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"type": kind, "message": message}})


@serve.deployment(max_ongoing_requests=200, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api)
class Router:
    def __init__(self, global_encoder: DeploymentHandle, local_encoder: DeploymentHandle,
                 decoder: DeploymentHandle | None, checkpoint: str | None = None):
        self.global_encoder, self.local_encoder, self.decoder = global_encoder, local_encoder, decoder
        directory, self.model_label = resolve_checkpoint(checkpoint)
        specials = read_tensors(directory, lambda k: k in ("model.image_newline", "model.view_seperator"))
        self.newline, self.separator = specials["model.image_newline"], specials["model.view_seperator"]
        # Encode-only apps need no tokenizer (and their checkpoints may carry none).
        self.tokenizer = load_tokenizer(directory if checkpoint else None) if decoder else None
        self.recent: deque[dict] = deque(maxlen=1000)  # per-request stage timings

    def timings(self) -> dict:
        """Median ms per stage over the last 1,000 requests: preprocess (until the crops are
        ready; the global view is already encoding by then), encode (until both paths
        answered), assemble, and the whole encoding of the request."""
        keys = ("preprocess_ms", "encode_ms", "assemble_ms", "total_ms")
        return {"requests": len(self.recent),
                **{k: statistics.median(t[k] for t in self.recent) if self.recent else None
                   for k in keys}}

    # -- Python handle API ------------------------------------------------------------------
    async def encode(self, image, mode: str = "gundam", max_crops: int = 6) -> list[torch.Tensor]:
        """One [num_tokens, D] sequence per image (a single image or a list)."""
        images = image if isinstance(image, list) else [image]
        options = check_options({"mode": mode, "max_crops": max_crops, "prompt": "<image>" * len(images)},
                                len(images))
        return (await self._encode(images, options))[0]

    def _need_decoder(self):
        if self.decoder is None:
            raise BadRequest("this deployment is encode-only (encode_only=true): use /v1/encode")

    async def ocr(self, image, prompt: str | None = None, **options) -> dict:
        """OCR one image (or a list): {text, usage, model, timings}."""
        self._need_decoder()
        images = image if isinstance(image, list) else [image]
        options = check_options({**options, "prompt": prompt}, len(images))
        seqs, timings = await self._encode(images, options)
        ids, embeds = self._prompt(seqs, options)
        start = time.perf_counter()
        result = await self.decoder.generate.remote(ids, embeds, options)
        timings["decode_ms"] = (time.perf_counter() - start) * 1e3
        return self._response(result, seqs, timings)

    async def ocr_stream(self, image, prompt: str | None = None, **options) -> AsyncIterator[dict]:
        """Like ocr, but yields text deltas as they are generated (handle.options(stream=True))."""
        async for delta in await self._start_stream(image, prompt, options):
            yield delta

    async def _start_stream(self, image, prompt, options) -> AsyncIterator[dict]:
        """Validate and encode now (errors surface before anything is streamed), then return
        the decoder's delta stream."""
        self._need_decoder()
        images = image if isinstance(image, list) else [image]
        options = check_options({**options, "prompt": prompt}, len(images))
        seqs, _ = await self._encode(images, options)
        ids, embeds = self._prompt(seqs, options)
        stream = self.decoder.options(stream=True).generate_stream.remote(ids, embeds, options)

        async def deltas():
            async for delta in stream:
                yield {**delta, "model": self.model_label}
        return deltas()

    # -- internals ----------------------------------------------------------------------------
    async def _encode(self, images: list, options: dict):
        start = time.perf_counter()
        results = await asyncio.gather(*(self._encode_one(image, options) for image in images))
        seqs = [seq for seq, _ in results]
        stages = [t for _, t in results]
        timings = {"preprocess_ms": max(t["preprocess_ms"] for t in stages),
                   "encode_ms": max(t["encode_ms"] for t in stages),
                   "assemble_ms": sum(t["assemble_ms"] for t in stages),
                   "total_ms": (time.perf_counter() - start) * 1e3}
        self.recent.append(timings)
        return seqs, timings

    async def _encode_one(self, image, options: dict):
        """One image: decode and build the global view (a worker thread, so the event loop
        stays free), send it to GlobalEncoder at once while the crops are still being resized,
        then send the crops to LocalEncoder; each encoder batches across requests. Stage times:
        preprocess until the crops are ready, encode until both paths answered."""
        start = time.perf_counter()
        pending = await asyncio.to_thread(start_preprocess, image, options["mode"],
                                          options["max_crops"])
        global_call = asyncio.ensure_future(
            call_with_retry(self.global_encoder.encode, to_wire(pending.global_view[None])))
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
        seq = assemble(global_tokens[0], crop_tokens, item.grid, self.newline, self.separator)
        assert seq.shape[0] == item.num_tokens, (seq.shape, item.num_tokens)
        return seq, {"preprocess_ms": (ready - start) * 1e3, "encode_ms": (encoded - ready) * 1e3,
                     "assemble_ms": (time.perf_counter() - encoded) * 1e3}

    def _prompt(self, seqs: list[torch.Tensor], options: dict):
        ids = build_prompt(self.tokenizer, options["prompt"], [s.shape[0] for s in seqs])
        return ids, [to_wire(s) for s in seqs]

    def _response(self, result: dict, seqs, timings: dict) -> dict:
        image_tokens = sum(s.shape[0] for s in seqs)
        return {"text": result["text"], "finish_reason": result["finish_reason"], "model": self.model_label,
                "usage": {"prompt_tokens": result["prompt_tokens"], "image_tokens": image_tokens,
                          "completion_tokens": result["completion_tokens"]},
                "timings": timings}

    # -- HTTP -----------------------------------------------------------------------------------
    async def _read(self, request: Request) -> tuple[list, dict]:
        content_type = request.headers.get("content-type", "")
        if content_type.startswith("multipart/form-data"):
            form = await request.form()
            images = [await f.read() for key in ("image", "file") for f in form.getlist(key)
                      if hasattr(f, "read")]
            options = {k: v for k, v in form.items() if k not in ("image", "file")}
            return images, options
        try:
            body = await request.json()
        except ValueError:
            raise BadRequest("body must be JSON or multipart/form-data") from None
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        raw = body.pop("image", None) or body.pop("images", None) or []
        return [_decode_base64(b) for b in (raw if isinstance(raw, list) else [raw])], body

    async def _guard(self, request: Request, work):
        try:
            images, options = await self._read(request)
            return await work(images, options)
        except (BadRequest, ImageError) as e:
            return _error(400, "invalid_request", str(e))
        except Exception as e:  # noqa: BLE001 - the replica must answer, not die
            return _error(500, "internal_error", f"{type(e).__name__}: {e}")

    @api.post("/v1/ocr")
    async def http_ocr(self, request: Request):
        async def work(images, options):
            prompt = options.pop("prompt", None)
            if str(options.pop("stream", "")).lower() not in ("true", "1"):
                return await self.ocr(images, prompt, **options)
            deltas = await self._start_stream(images, prompt, options)

            async def events():  # server-sent events: one JSON delta each, then [DONE]
                async for delta in deltas:
                    yield f"data: {json.dumps(delta)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return await self._guard(request, work)

    @api.post("/v1/encode")
    async def http_encode(self, request: Request):
        async def work(images, options):
            options = check_options({**options, "prompt": "<image>" * len(images)}, len(images))
            seqs, timings = await self._encode(images, options)
            return {"model": self.model_label, "timings": timings, "images": [
                {"num_tokens": s.shape[0], "dim": s.shape[1], "dtype": "float32",
                 "embedding_base64": base64.b64encode(s.float().numpy().tobytes()).decode()}
                for s in seqs]}
        return await self._guard(request, work)

    @api.get("/health")
    async def health(self):
        return {"status": "ok", "model": self.model_label}
