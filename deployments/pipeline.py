"""One OCR request's stages, in plain Python: validate -> preprocess -> encode (and assemble) ->
decode -> shape. The Router (deployments/router.py) is its HTTP and handle front; where the
encoder runs is `encoder`, a strategy of deployments/placement.py chosen when the app is built;
the decoder is `decoder`, a client with `generate` and `stream`. Tested without Serve.

  1. validate: `OcrOptions` (deployments/protocol.py) and the image count;
  2. preprocess, on a worker thread per image: its sequence from the cache, or what the
     strategy makes of it (its header, its pixels, or views); the prompt's length is known now
     and checked against the decoder's context before any GPU work;
  3. encode: the strategy's call(s), batched with other requests' in the encoders; the image's
     sequence assembled (local grid + newlines, global, separator);
  4. decode: the decoder generates from the prompt ids and the image sequences;
  5. shape: text, finish reason, usage, per-stage timings; markdown or blocks when asked.
A PDF's pages each go through 2-5 as their own request, a window of pages at a time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import torch

from decoder import DecoderArgs, NGramConfig, build_prompt, default_preset, ngram_defaults
from decoder.grounding import parse_blocks, to_markdown
from documents import DocumentError, PdfDocument, map_pages, parse_page_range
from encoder import ImageError

from . import pages
from . import protocol
from .config import AppConfig
from .encoded_cache import EncodedCache, content_key
from .media import crop_image_blocks
from .metrics import medians, router_metrics
from .protocol import BadRequest, Document, OcrOptions, replica_error

log = logging.getLogger("ray.serve")


@dataclass
class Prepared:
    """An image after preprocessing: its cache key, and its sequence from the cache (`cached`:
    (sequence, original size)) or what the encoder strategy made of it (`item`: it knows the
    image's token count, grid and original size)."""
    key: str | None
    item: object = None
    cached: tuple[torch.Tensor, tuple[int, int]] | None = None
    prepare_ms: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.cached[0].shape[0] if self.cached is not None else self.item.num_tokens

    @property
    def original_size(self) -> tuple[int, int]:
        return self.cached[1] if self.cached is not None else self.item.original_size


def of_image(error: Exception, index: int) -> Exception:
    """`error` (an ImageError, maybe raised in a replica) as this process's own exception,
    marked with the index of the request's image it is about (its field names it)."""
    error = replica_error(error)
    error.image_index = index
    return error


def check_pages_per_request(options: OcrOptions, max_images: int) -> int:
    """`pages_per_request`, checked for a document: more than 1 only in base mode (one 1024²
    view a page, no crops: how Unlimited-OCR reads many pages), at most the images a request
    may carry. The service's documents and the offline path's PDFs (deployments/offline.py)."""
    per_request = options.pages_per_request
    if per_request > 1 and options.mode != "base":
        raise BadRequest("pages_per_request > 1 sends pages together in base mode (one 1024² "
                         "view a page, no crops: how Unlimited-OCR reads many pages): send "
                         "mode 'base'", "mode")
    if per_request > max_images:
        raise BadRequest(f"pages_per_request {per_request} is over the {max_images} "
                         f"images a request may carry (max_images_per_request)", "pages_per_request")
    return per_request


def needs_retry(result: dict, options: OcrOptions) -> bool:
    """Whether an answer did not end cleanly: it looped, or (`retry.on_length`) ran to max_tokens."""
    return result["finish_reason"] == "repetition" or (options.retry.on_length and result["finish_reason"] == "length")


def text_layer(pdf: PdfDocument, index: int) -> str:
    """A page's text layer; "" when it has none or it cannot be read."""
    try:
        return pdf.text(index)
    except DocumentError:
        return ""


def failed(entry: dict, options: OcrOptions) -> bool:
    """Whether a document page's entry failed: it errored, or every attempt did not end cleanly."""
    return entry["error"] is not None or needs_retry(entry, options)


class OcrPipeline:
    def __init__(self, encoder, decoder, tokenizer, language: DecoderArgs | None, config: AppConfig,
                 model_fields: dict):
        """`decoder` None: an encode-only app. `language`: the checkpoint's language model (its
        context and its family's n-gram rule). `model_fields`: what every answer says of the
        model (its id, and the tiny random model's warning)."""
        self.encoder, self.decoder, self.tokenizer, self.language = encoder, decoder, tokenizer, language
        self.max_len = (config.max_len or language.max_positions) if language else None
        self.family = language.family if language else "deepseek-ocr"  # its prompts and n-gram rule
        self.config, self.model_fields = config, model_fields
        self.model_tag = {"model": model_fields["model"]}  # on its metrics
        self.cache = EncodedCache(config.encoder_cache_mb << 20) if config.encoder_cache_mb else None
        self.recent: deque[dict] = deque(maxlen=1000)  # per-request stage timings

    # -- requests -----------------------------------------------------------------------------
    async def encode(self, images: list, options: OcrOptions) -> tuple[list[torch.Tensor], dict]:
        """Each image's sequence [num_tokens, D], and the stages' timings."""
        options.prompt_for(len(images), self.config.max_images_per_request)
        return await self._encode(await self._preprocess(images, options), options.priority)

    async def ocr(self, images: list, options: OcrOptions, page: int = 0, arrived: float | None = None) -> dict:
        """One image request's answer; `timings` holds each stage and `total_ms`, the whole
        request from its arrival (`arrived`, else the HTTP request's, else now) to its answer."""
        arrived = arrived or protocol.REQUEST_ARRIVED.get() or time.perf_counter()
        ids, seqs, timings, sizes = await self._encode_prompt(images, options)
        start = time.perf_counter()
        result = await self._generate(ids, seqs, options, len(images))
        timings["decode_ms"] = (time.perf_counter() - start) * 1e3
        timings.update(result.get("timings", {}))  # the decoder's own stages
        self._record_generation(result, seqs, timings["decode_ms"])
        response = {"text": result["text"], "finish_reason": result["finish_reason"],
                    **self.model_fields,
                    "usage": {"prompt_tokens": result["prompt_tokens"],
                              "image_tokens": sum(s.shape[0] for s in seqs),
                              "completion_tokens": result["completion_tokens"],
                              **({"attempts": result["attempts"]} if "attempts" in result else {})},
                    "timings": timings}
        if "repetition" in result:  # the loop detector ended it: where, and the text before it
            response["repetition"] = result["repetition"]
        if options.output_format == "markdown":  # DeepSeek's clean-up of the grounding tags
            response["text"] = to_markdown(result["text"], page)
        elif options.output_format == "blocks":  # boxes in pixels of the (one) original image
            response["blocks"] = parse_blocks(result["text"], *sizes[0])
            response["width"], response["height"] = sizes[0]
            response["markdown"] = to_markdown(result["text"], page)
            if options.return_crops:
                await asyncio.to_thread(crop_image_blocks, images[0], response["blocks"])
        timings["total_ms"] = (time.perf_counter() - arrived) * 1e3
        return response

    async def ocr_stream(self, images: list, options: OcrOptions) -> AsyncIterator[dict]:
        """Validate and encode now (errors surface before anything is streamed), then return
        the decoder's deltas (the generation starts when its consumer first asks)."""
        if options.output_format != "text":
            raise BadRequest("output_format applies to whole answers: a stream of an image sends "
                             "raw text (a document's stream sends whole pages)", "output_format")
        ids, seqs, _, _ = await self._encode_prompt(images, options)

        async def deltas():
            start = time.perf_counter()
            async with aclosing(self.decoder.stream(ids, seqs, self._sampling(options, len(images)))) as stream:
                async for delta in stream:
                    if delta["finished"]:
                        self._record_generation(delta, seqs, (time.perf_counter() - start) * 1e3)
                    yield {**delta, **self.model_fields}
        return deltas()

    async def document(self, document: Document, options: OcrOptions) -> dict:
        """Every page through the image path; one response for the document."""
        async with aclosing(await self.document_pages(document, options)) as stream:
            entries = [entry async for entry in stream]
        return pages.document_response(entries, self.model_fields)

    async def document_pages(self, document: Document, options: OcrOptions) -> AsyncIterator[dict]:
        """Open the PDF and check the page range now (errors answer 4xx before any page is
        sent), then return its pages' entries in page order. Pages are rendered lazily, at most
        `pages_in_flight` requests at a time, and each goes through the encoders and the decoder
        as its own request (batched with every other request's pages), or with
        `pages_per_request` > 1 a window of pages as one multi-page request (`window_entries`);
        a page that fails is an entry with its error, never the document's failure."""
        self._require_decoder()
        options.prompt_for(1, 1)  # a prompt every page (or window: its tag repeated) can take
        self._check_views(options)
        per_request = check_pages_per_request(options, self.config.max_images_per_request)
        pdf = await asyncio.to_thread(PdfDocument, document.data, self.config.max_pages)
        try:
            indices = parse_page_range(options.page_range, pdf.page_count)
        except DocumentError:
            pdf.close()
            raise
        page_options = options.model_copy(update={"stream": False, "page_range": None})

        async def work(unit: int | tuple[int, ...], image):
            if isinstance(unit, tuple):  # a window of pages, `image` their images
                return await self.window_entries(unit, image, page_options)
            return (await self.ocr([image], page_options, page=unit, arrived=time.perf_counter()),
                    image.size)
        units = ([tuple(indices[i:i + per_request]) for i in range(0, len(indices), per_request)]
                 if per_request > 1 else indices)

        async def entries():
            try:
                async with aclosing(map_pages(pdf, units, options.dpi, work,
                                              self.config.pages_in_flight)) as results:
                    async for unit, outcome in results:
                        for index in unit if isinstance(unit, tuple) else (unit,):
                            if isinstance(outcome, BaseException):
                                entry = pages.failed_page(index, outcome, log)
                            elif isinstance(unit, tuple):
                                entry = outcome[unit.index(index)]
                            else:
                                entry = pages.page_entry(index, *outcome)
                            if options.text_layer_fallback and failed(entry, options):
                                entry = self.text_layer_entry(entry, await asyncio.to_thread(text_layer, pdf, index))
                            yield entry
            finally:
                await asyncio.to_thread(pdf.close)
        return entries()

    def text_layer_entry(self, entry: dict, text: str) -> dict:
        """A page whose every attempt failed, answered with its PDF text layer (`text`) when it
        has one (`source: "text_layer"`; the OCR's finish reason kept, or its error as
        `ocr_error`); without one, as it was."""
        if not text.strip():
            return entry
        router_metrics()["fallbacks"].inc(tags=self.model_tag)
        out = {**entry, "text": text, "source": "text_layer", "error": None}
        if entry["error"] is not None:
            out.update(ocr_error=entry["error"], usage=dict.fromkeys(pages.USAGE_KEYS, 0))
        if "blocks" in entry:  # the OCR's blocks were the failed attempt's
            out.update(blocks=[], markdown=text)
        return out

    async def window_entries(self, window: tuple[int, ...], images: list, options: OcrOptions) -> list[dict]:
        """A window of pages as one request (a caller's prompt gets its one <image> tag once per
        page), its answer split into the pages' entries where the model marks them
        (`pages.split_pages`); each page shaped as `output_format` asks."""
        prompt = options.prompt.replace("<image>", "<image>" * len(images), 1) if options.prompt else None
        result = await self.ocr(images, options.model_copy(update={
            "prompt": prompt, "output_format": "text", "return_crops": False}),
            page=window[0], arrived=time.perf_counter())
        entries = pages.split_pages(window, result, [image.size for image in images])
        for entry, image in zip(entries, images):
            if options.output_format == "markdown":
                entry["text"] = to_markdown(entry["text"], entry["index"])
            elif options.output_format == "blocks":
                entry["blocks"] = parse_blocks(entry["text"], *image.size)
                entry["markdown"] = to_markdown(entry["text"], entry["index"])
                if options.return_crops:
                    await asyncio.to_thread(crop_image_blocks, image, entry["blocks"])
        return entries

    def timings(self) -> dict:
        """Median ms per stage over the last 1,000 requests: preprocess (decoding, or reading
        the header, or making the views here until the crops are ready), encode (until the
        sequence is back), assemble, and the whole encoding of the request; and over the
        `encode` handle calls among them, the handler's whole time from its entry to its
        return (what Serve's call adds is outside it)."""
        keys = ("preprocess_ms", "encode_ms", "assemble_ms", "encoding_ms")
        handled = [t for t in self.recent if "handler_ms" in t]
        return {"requests": len(self.recent), **medians(self.recent, keys),
                **medians(handled, ("handler_ms",))}

    # -- stages -------------------------------------------------------------------------------
    def _require_decoder(self) -> None:
        if self.decoder is None:
            raise BadRequest("this deployment is encode-only (encode_only=true): use /v1/encode")

    async def _encode_prompt(self, images: list, options: OcrOptions):
        """Steps 1-3: validate, preprocess, check the context, encode -> (prompt ids, sequences,
        timings, the images' original sizes)."""
        self._require_decoder()
        if options.page_range is not None:
            raise BadRequest("page_range applies to documents (send a PDF as 'document')", "page_range")
        if options.output_format == "blocks" and len(images) != 1:
            raise BadRequest("output_format 'blocks' places boxes on one image: send one image",
                             "output_format")
        prompt = options.prompt_for(len(images), self.config.max_images_per_request,
                                    default_preset(self.family, len(images)))
        prepared = await self._preprocess(images, options)
        ids = build_prompt(self.tokenizer, prompt, [p.num_tokens for p in prepared])
        if len(ids) >= self.max_len:
            image_tokens = sum(p.num_tokens for p in prepared)
            raise BadRequest(f"the prompt is {len(ids)} tokens ({image_tokens} of them image "
                             f"tokens) but the decoder's context holds {self.max_len}: send fewer "
                             f"images, or a smaller mode or max_crops")
        seqs, timings = await self._encode(prepared, options.priority)
        return ids, seqs, timings, [p.original_size for p in prepared]

    async def _generate(self, ids: list[int], seqs: list, options: OcrOptions, num_images: int) -> dict:
        """The decoder's answer; one that looped (or, `retry.on_length`, ran to max_tokens) is
        generated again at each retry temperature in turn, seeded, until an attempt ends
        cleanly: that one answers, else the first. With retries, `completion_tokens` counts
        every attempt's tokens and `attempts` lists them."""
        params = self._sampling(options, num_images)
        result = first = await self.decoder.generate(ids, seqs, params)
        attempts = [{"temperature": params.temperature, "finish_reason": result["finish_reason"],
                     "completion_tokens": result["completion_tokens"]}]
        for number, temperature in enumerate(options.retry.temperatures, 1):
            if not needs_retry(result, options):
                break
            retried = dataclasses.replace(params, temperature=temperature, seed=(options.seed or 0) + number)
            result = await self.decoder.generate(ids, seqs, retried)
            attempts.append({"temperature": temperature, "finish_reason": result["finish_reason"],
                             "completion_tokens": result["completion_tokens"]})
        metrics = router_metrics()
        looped = sum(a["finish_reason"] == "repetition" for a in attempts)
        if looped:
            metrics["repetitions"].inc(looped, tags=self.model_tag)
        if len(attempts) == 1:
            return result
        metrics["retries"].inc(len(attempts) - 1, tags=self.model_tag)
        if needs_retry(result, options):  # none ended cleanly: the greedy answer stands
            result = first
        lost = sum(a["completion_tokens"] for a in attempts) - result["completion_tokens"]
        if lost:
            metrics["tokens"].inc(lost, tags={"kind": "lost_attempts", **self.model_tag})
        return {**result, "completion_tokens": sum(a["completion_tokens"] for a in attempts), "attempts": attempts}

    def _sampling(self, options: OcrOptions, num_images: int):
        """The request's decoder parameters, its n-gram rule completed by this model's own."""
        return options.sampling(ngram_defaults(self.language, num_images) if self.language else NGramConfig())

    def _check_views(self, options: OcrOptions) -> None:
        """The view options against this model's family (DeepSeek-OCR-2 has two modes and at
        most 6 crops), as a 400 naming the field; `OcrOptions` checked them against the widest."""
        tiling = self.encoder.tiling
        try:
            tiling.check(options.mode, options.max_crops)
        except ImageError as e:
            raise BadRequest(str(e), "mode" if options.mode not in tiling.modes else "max_crops") from None

    async def _preprocess(self, images: list, options: OcrOptions) -> list[Prepared]:
        """Each image's sequence from the cache, or what the encoder strategy makes of it, on
        a worker thread (the event loop stays free)."""
        self._check_views(options)
        def prepare(image) -> Prepared:
            key = content_key(image, options.mode, options.max_crops) if self.cache else None
            cached = self.cache.get(key) if self.cache else None
            if cached is not None:
                return Prepared(key, cached=cached)
            began = time.perf_counter()
            item = self.encoder.prepare(image, options.mode, options.max_crops)
            return Prepared(key, item, prepare_ms=(time.perf_counter() - began) * 1e3)

        async def one(index: int, image) -> Prepared:
            try:
                return await asyncio.to_thread(prepare, image)
            except ImageError as e:
                raise of_image(e, index) from None
        return await asyncio.gather(*(one(i, image) for i, image in enumerate(images)))

    async def _encode(self, prepared: list[Prepared], priority: str) -> tuple[list[torch.Tensor], dict]:
        start = time.perf_counter()

        async def one(index: int, image: Prepared):
            if image.cached is not None:
                return image.cached[0], {"preprocess_ms": 0.0, "encode_ms": 0.0, "assemble_ms": 0.0}
            try:
                seq, stages = await self.encoder.encode(image.item, priority)
            except ImageError as e:  # decoded in an encoder replica: its exception, this image's
                raise of_image(e, index) from None
            assert seq.shape[0] == image.num_tokens, (seq.shape, image.num_tokens)
            if self.cache is not None:
                self.cache.put(image.key, (seq, image.original_size), seq.numel() * seq.element_size())
            return seq, {**stages, "preprocess_ms": image.prepare_ms + stages["preprocess_ms"]}
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prepared)))
        seqs = [seq for seq, _ in results]
        stages = [t for _, t in results]
        timings = {"preprocess_ms": max(t["preprocess_ms"] for t in stages),
                   "encode_ms": max(t["encode_ms"] for t in stages),
                   "assemble_ms": sum(t["assemble_ms"] for t in stages),
                   "encoding_ms": (time.perf_counter() - start) * 1e3}
        self.recent.append(timings)
        for stage in ("preprocess", "encode", "assemble"):
            router_metrics()["stage"].observe(timings[f"{stage}_ms"], tags={"stage": stage, **self.model_tag})
        return seqs, timings

    def _record_generation(self, result: dict, seqs, decode_ms: float) -> None:
        metrics = router_metrics()
        metrics["stage"].observe(decode_ms, tags={"stage": "decode", **self.model_tag})
        metrics["finish"].inc(tags={"reason": result["finish_reason"] or "unknown", **self.model_tag})
        for kind, count in (("image", sum(s.shape[0] for s in seqs)),
                            ("prompt", result["prompt_tokens"]),
                            ("completion", result["completion_tokens"])):
            metrics["tokens"].inc(count, tags={"kind": kind, **self.model_tag})
