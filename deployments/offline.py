"""OCR of a dataset on Ray Data, no HTTP in between: the service's stages as a streaming
pipeline of Ray Data operators, each running the code its deployment runs.

  pages      a row per image, a row per PDF page (rendered lazily, a document at a time);
  views      decode and views on CPU tasks (`encoder.preprocess`, the Router's PIL path);
  global     the global views through `EncoderReplica("global")` in an actor pool (GPU);
  local      the crops through `EncoderReplica("local")` in an actor pool (GPU);
  assemble   each page's sequence (the checkpoint's layout: grid, newlines, global, separator),
             on CPU tasks;
  decode     the Decoder's class (`DecoderServer`) in an async actor pool: its continuous
             batching engine with many pages in flight per actor, each page through the
             request path's own pipeline (`OcrPipeline.ocr`: prompt, context check, n-gram
             rule, markdown / blocks), its encoder strategy `Encoded` (encoded upstream).

`ocr_dataset(ds, ...)` takes any dataset with a `bytes` column (and `path`, kept as `source`;
`max_tokens`, a row's own cap on each of its pages' tokens, 0 or none: the run's) and returns
one row per page: {source, content_sha256 (the file's), page, text (markdown with
output_format "markdown"), text_source ("ocr", or "text_layer": a PDF page whose every attempt
looped), finish_reason, prompt_tokens, image_tokens, completion_tokens (every attempt's),
attempts, error},
and with output_format "blocks" also `markdown` and `blocks` (the service's blocks, boxes in the
page's pixels, as a JSON string: one column type whatever a page's blocks hold). With
`pages_per_request` > 1 (base mode) a PDF's pages go through in windows of that many, each
window one request as the service's documents send them (how Unlimited-OCR reads documents),
its answer split per page at the model's page marks: the rows also say `window` (its pages)
and `split`. A page that cannot be read is a row with `error` (the job goes on). Greedy
outputs equal the service's for the same pages and options.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from documents import DocumentError, PdfDocument
from encoder import ImageError
from encoder.checkpoint import load_sequence_layout
from encoder.preprocess import preprocess

from .config import AppConfig
from .model_source import resolve_checkpoint
from .pages import USAGE_KEYS
from .pipeline import check_pages_per_request, failed, text_layer
from .protocol import BadRequest, OcrOptions, validate

PDF_MAGIC = b"%PDF-"
# A row is a unit of decoding: one page, or (`pages_per_request` > 1) a window of a PDF's pages
# read as one request, as Unlimited-OCR reads documents. Its arrays are stacked per page [K, ...]:
NO_PIXELS = np.zeros((0, 0, 0, 3), np.uint8)  # an image file's row (its `bytes` hold it), an unread page's
NO_VIEWS = np.zeros((0, 3, 0, 0), np.uint8)  # an unread row's global views
NO_CROPS = np.zeros((0, 3, 0, 0), np.uint8)  # an untiled page's crops
NO_SIZES = np.zeros((0, 2), np.int64)  # an unread row's page sizes
NOT_WRITTEN = np.zeros(1, np.uint8)  # a row of one page, not written before
NO_TEXT = [""]  # an image's text layer: none
NO_TOKENS = {"global": np.zeros((0, 0), np.float32), "local": np.zeros((0, 0, 0), np.float32),
             "sequence": np.zeros((0, 0, 0), np.float32)}  # a path's tokens where it has none
# Between stages a page's `error` is "" when it has none (a column of Nones would come back as
# NaNs); the result rows say None.


@functools.lru_cache(maxsize=8)
def sequence_layout(checkpoint: str | None) -> tuple:
    """The checkpoint's tiling and token layout (`load_sequence_layout`), read once per process:
    the CPU tasks' workers are reused batch after batch."""
    return load_sequence_layout(resolve_checkpoint(checkpoint)[0])


@dataclass(frozen=True)
class Stages:
    """How many actors each stage's pool runs, and what of a GPU each takes (0 on CPU; a
    fraction lets the pools share one card); custom resources each asks for besides, which put
    the encoders and the decoder on the nodes declaring them (gpu-separate.yaml's
    `encoder_gpu` / `decoder_gpu`, as cluster.yaml's node types declare them)."""

    encoders: int = 1
    decoders: int = 1
    encoder_gpus: float = 0.0
    decoder_gpus: float = 0.0
    encoder_resources: dict = field(default_factory=dict)
    decoder_resources: dict = field(default_factory=dict)
    encoder_batch: int = 16  # pages to an encoder call (its planner cuts them to its budgets)
    actor_cpus: float = 0.25  # what each actor reserves of a CPU (the replicas': their threads
    # wait on the device or on each other; a whole CPU each would starve the CPU tasks)


# A run on a cluster with GPUs that names no GPU shares shares one card as gpu-shared.yaml does:
# each encoder path's pool a quarter, the decoder's half, each capping its memory as that
# config's tier (its `gpu_memory_fraction_*`), so the decoder's KV cache leaves the encoders
# theirs. Other layouts (a GPU per pool, the pools on node groups): `Stages` given.
ONE_GPU = {"encoder_gpus": 0.25, "decoder_gpus": 0.5}
ONE_GPU_MEMORY = {"gpu_memory_fraction_global": 0.15, "gpu_memory_fraction_local": 0.25,
                  "gpu_memory_fraction_decoder": 0.5}


DECODE_CALLS_IN_FLIGHT = 8  # batches one Decoder actor works on at once


def default_layout(checkpoint: str | None, gpus: float, **given) -> tuple[Stages, AppConfig]:
    """The stages and app config of a run on a cluster with `gpus` GPUs, `given` (Stages'
    fields) as asked: with GPUs and no share given, one card shared (ONE_GPU)."""
    if gpus and not {"encoder_gpus", "decoder_gpus"} & set(given):
        return Stages(**ONE_GPU, **given), AppConfig(checkpoint=checkpoint, **ONE_GPU_MEMORY)
    return Stages(**given), AppConfig(checkpoint=checkpoint)


def ocr_dataset(ds, checkpoint: str | None = None, *, config: AppConfig | None = None,
                stages: Stages = Stages(), skip: frozenset = frozenset(), **options):
    """`ds` (a `bytes` column, and `path` if it has one) OCR'd page by page: a lazy Ray
    Dataset of result rows (module docstring). `options`: the request's (`OcrOptions`: mode,
    max_crops, prompt, prompt_preset, output_format, max_tokens, ngram, dpi, pages_per_request),
    checked now: a bad one raises `BadRequest` naming it before any work. `skip`: pages done
    before, (content_sha256, page), left out."""
    config = config or AppConfig(checkpoint=checkpoint)
    opts = validate(OcrOptions, options, strict=False)
    for name in ("return_crops", "stream", "page_range"):
        if getattr(opts, name):
            raise BadRequest(f"{name} is the service's: offline OCR writes a row per page", name)
    tiling, _ = sequence_layout(config.checkpoint)
    try:
        tiling.check(opts.mode, opts.max_crops)
    except ImageError as e:
        raise BadRequest(str(e), "mode" if opts.mode not in tiling.modes else "max_crops") from None
    per_request = check_pages_per_request(opts, config.max_images_per_request)
    from ray.data import ActorPoolStrategy
    # A Decoder actor's calls run together (`max_concurrent_calls_per_actor`: Ray Data's actors
    # take one call at a time otherwise, and a batch's longest page then leaves the engine half
    # idle), each a batch of pages; the calls in flight hold twice what the engine admits (a full
    # batch plus its queue: Decode holds the rest back), so a batch ending is replaced while
    # others decode.
    decode_batch = max(1, (config.max_batch + config.decoder_queue) // (DECODE_CALLS_IN_FLIGHT // 2))
    return (ds.flat_map(pages_of, fn_kwargs={"dpi": opts.dpi, "max_pages": config.max_pages,
                                             "skip": frozenset(skip), "per_request": per_request})
            .map_batches(views_of, fn_kwargs={"checkpoint": config.checkpoint, "mode": opts.mode,
                                              "max_crops": opts.max_crops}, batch_size=4)
            .map_batches(PathStage, fn_constructor_args=("global", config), compute=ActorPoolStrategy(size=stages.encoders),
                         num_gpus=stages.encoder_gpus, num_cpus=stages.actor_cpus, resources=stages.encoder_resources,
                         batch_size=stages.encoder_batch)
            .map_batches(PathStage, fn_constructor_args=("local", config), compute=ActorPoolStrategy(size=stages.encoders),
                         num_gpus=stages.encoder_gpus, num_cpus=stages.actor_cpus, resources=stages.encoder_resources,
                         batch_size=stages.encoder_batch)
            .map_batches(assemble, fn_kwargs={"checkpoint": config.checkpoint}, batch_size=stages.encoder_batch)
            .map_batches(Decode, fn_constructor_args=(config, opts), compute=ActorPoolStrategy(
                             size=stages.decoders, max_concurrent_calls_per_actor=DECODE_CALLS_IN_FLIGHT),
                         num_gpus=stages.decoder_gpus, num_cpus=stages.actor_cpus, resources=stages.decoder_resources,
                         batch_size=decode_batch))


def pages_of(row: dict, dpi: int, max_pages: int, skip: frozenset = frozenset(),
             per_request: int = 1) -> Iterator[dict]:
    """An image's row, or a PDF's rows: a page each, or with `per_request` > 1 a window of that
    many pages each, read as one request (`window`; `pages`: how many, from `page`). Pages are
    rendered (RGB pixels, stacked [K, H, W, 3], padded to the largest; `sizes`: each one's
    width and height) as their row is taken, so a long PDF is never in memory whole; a PDF that
    cannot be opened is one row with its error. Each row names its file's content
    (`content_sha256`); the pages in `skip` ((content, page): done before) are left out
    unrendered, and a window with some of them is done whole, those pages flagged in `written`
    and left out of its result rows. A PDF page's text layer goes along (`text_layers`): the
    answer of a page whose every attempt looped."""
    data = row["bytes"]
    base = {"source": row.get("path") or "", "content_sha256": hashlib.sha256(data).hexdigest(),
            "max_tokens": int(row.get("max_tokens") or 0),  # 0: the run's
            "page": 0, "pages": 1, "window": False, "written": NOT_WRITTEN, "bytes": b"",
            "pixels": NO_PIXELS, "sizes": NO_SIZES, "text_layers": NO_TEXT, "error": ""}
    if bytes(data[:len(PDF_MAGIC)]) != PDF_MAGIC:
        if (base["content_sha256"], 0) not in skip:
            yield {**base, "bytes": data}
        return
    try:
        pdf = PdfDocument(bytes(data), max_pages)
    except DocumentError as e:
        if (base["content_sha256"], 0) not in skip:
            yield {**base, "error": f"document: {e}"}
        return
    with pdf:
        for first in range(0, pdf.page_count, per_request):
            window = range(first, min(first + per_request, pdf.page_count))
            written = [(base["content_sha256"], index) in skip for index in window]
            if all(written):
                continue
            unit = {**base, "page": first, "pages": len(window), "window": per_request > 1,
                    "written": np.array(written, np.uint8)}
            try:
                pixels, sizes = stacked([np.asarray(pdf.render(index, dpi)) for index in window])
            except DocumentError as e:  # this page (its window) alone
                yield {**unit, "error": f"page: {e}"}
                continue
            yield {**unit, "pixels": pixels, "sizes": sizes, "text_layers": [text_layer(pdf, index) for index in window]}


def stacked(pages: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Pages of any sizes as one array [K, H, W, 3] (padded to the largest) and their sizes
    [K, 2] (width, height)."""
    height, width = max(p.shape[0] for p in pages), max(p.shape[1] for p in pages)
    out = np.zeros((len(pages), height, width, 3), np.uint8)
    for k, page in enumerate(pages):
        out[k, :page.shape[0], :page.shape[1]] = page
    return out, np.array([(p.shape[1], p.shape[0]) for p in pages], np.int64)


def images_of(data: bytes, pixels: np.ndarray, sizes: np.ndarray) -> list:
    """A row's pages for `preprocess`: its pixels, unpadded, or its file's bytes."""
    if not pixels.size:
        return [bytes(data)]
    return [Image.fromarray(pixels[k, :height, :width]) for k, (width, height) in enumerate(sizes)]


def views_of(batch: dict, checkpoint: str | None, mode: str, max_crops: int) -> dict:
    """Each row's pages decoded and their views made with PIL (uint8, stacked per page: the
    global views [K, 3, S, S], the crops [K, P, 3, C, C]), their grids and sizes; a row that
    cannot be read keeps its error."""
    tiling, _ = sequence_layout(checkpoint)
    out = {key: [] for key in ("global_view", "crops", "grid", "original_size", "num_tokens", "error")}
    for data, pixels, sizes, error in zip(batch["bytes"], batch["pixels"], batch["sizes"], batch["error"]):
        try:
            if error:
                raise ImageError(error)
            items = [preprocess(image, mode, max_crops, tiling=tiling) for image in images_of(data, pixels, sizes)]
        except ImageError as e:
            for key, empty in (("global_view", NO_VIEWS), ("crops", np.zeros((0, *NO_CROPS.shape), np.uint8)),
                               ("grid", NO_SIZES), ("original_size", NO_SIZES), ("num_tokens", np.zeros(0, np.int64))):
                out[key].append(empty)
            out["error"].append(str(e) if error else f"image: {e}")
            continue
        out["global_view"].append(np.stack([item.global_view.numpy() for item in items]))
        out["crops"].append(np.stack([item.crops.numpy() if item.tiled else NO_CROPS for item in items]))
        out["grid"].append(np.array([item.grid for item in items], np.int64))
        out["original_size"].append(np.array([item.original_size for item in items], np.int64))
        out["num_tokens"].append(np.array([item.num_tokens for item in items], np.int64))
        out["error"].append("")  # (not None: a column of Nones is read back as NaNs)
    keep = {key: batch[key] for key in ("source", "content_sha256", "page", "pages", "window", "written",
                                        "text_layers", "max_tokens")}
    return {**keep, **out}


def tensor(array: np.ndarray) -> torch.Tensor:
    """A column's array as a tensor of its own (Ray Data hands out read-only views)."""
    return torch.from_numpy(np.array(array))


class PathStage:
    """One encoder path's actor: the replica class its deployment runs, every page of a batch of
    rows encoded at once (their tokens as float32: bf16 widened exactly), stacked per row."""

    def __init__(self, path: str, config: AppConfig):
        from .encoders import EncoderReplica
        self.path, self.replica = path, EncoderReplica(path, config)
        self.column = {"global": "global_view", "local": "crops"}[path]

    def __call__(self, batch: dict) -> dict:
        views = batch.pop(self.column)  # per row [K, ...]: a page's global view, or its crops
        todo = [(i, k) for i, row in enumerate(views) if not batch["error"][i]
                for k in range(row.shape[0]) if row[k].shape[0]]
        tokens = dict(zip(todo, self.replica.encode_now([tensor(views[i][k]) for i, k in todo])))
        empty = NO_TOKENS[self.path]
        batch[f"{self.path}_tokens"] = [
            np.stack([tokens[i, k].float().numpy() if (i, k) in tokens else empty for k in range(row.shape[0])])
            if row.shape[0] else np.zeros((0, *empty.shape), np.float32) for i, row in enumerate(views)]
        return batch


def assemble(batch: dict, checkpoint: str | None) -> dict:
    """Each page's sequence from its paths' tokens, in the checkpoint's layout (the Router's
    `PathEncoders` assembles with the same `sequence`), stacked per row [K, L, D]; CPU tasks."""
    _, sequence = sequence_layout(checkpoint)
    sequences = []
    for global_tokens, crop_tokens, grids, error in zip(batch.pop("global_tokens"), batch.pop("local_tokens"),
                                                        batch["grid"], batch["error"]):
        if error:
            sequences.append(NO_TOKENS["sequence"])
            continue
        sequences.append(np.stack([
            sequence(tensor(global_tokens[k]), tensor(crop_tokens[k]) if crop_tokens[k].size else None,
                     tuple(grids[k])).numpy() for k in range(len(grids))]))
    batch["sequence"] = sequences
    return batch


class Decode:
    """The Decoder's class in this actor, every row of a batch through the request path's
    pipeline at once (its engine batches them with the other batches in flight here): a page
    as the service's image request, a window of pages as its document's window (the answer
    split per page where the model marks pages); a row out per page."""

    def __init__(self, config: AppConfig, options: OcrOptions):
        from .decoder_server import DecoderServer
        from .placement import Encoded, pipeline_of
        tiling, _ = sequence_layout(config.checkpoint)
        # The replica class in process is the pipeline's decoder client as it is: its
        # `generate` takes what `DecoderClient.generate` forwards to the deployment.
        self.server = DecoderServer.func_or_class(config)
        self.pipeline = pipeline_of(config, Encoded(tiling), self.server)
        self.options = options
        # Pages beyond what the engine admits wait here, not refused by it as overloaded.
        self.admitted = asyncio.Semaphore(config.max_batch + config.decoder_queue)
        self.columns = ("text", "text_source", "finish_reason", "prompt_tokens", "image_tokens",
                        "completion_tokens", "attempts", "error",
                        *(("markdown", "blocks") if options.output_format == "blocks" else ()),
                        *(("window", "split") if options.pages_per_request > 1 else ()))

    async def __call__(self, batch: dict) -> dict:
        answers = await asyncio.gather(*(self.row(*row) for row in zip(
            batch["sequence"], batch["original_size"], batch["page"], batch["pages"], batch["window"],
            batch["text_layers"], batch["error"], batch["max_tokens"])))
        out = {key: [] for key in ("source", "content_sha256", "page", *self.columns)}
        for i, pages in enumerate(answers):
            for k, answer in enumerate(pages):
                if batch["written"][i][k]:  # written by an earlier run (a flag a page of the row)
                    continue
                out["source"].append(batch["source"][i])
                out["content_sha256"].append(batch["content_sha256"][i])
                out["page"].append(int(batch["page"][i]) + k)
                for key in self.columns:
                    out[key].append(answer.get(key))
        return out

    async def row(self, sequences, sizes, page: int, pages: int, as_window: bool, text_layers, error: str,
                  max_tokens: int) -> list[dict]:
        """A row's pages' answers (result columns), in page order; a page whose every attempt
        looped answers with its text layer, as the service's documents do."""
        from .placement import EncodedImage
        window = tuple(range(int(page), int(page) + int(pages)))
        if error:
            return [{"error": error, **self.window_columns(window)}] * len(window)
        images = [EncodedImage(tensor(sequence), tuple(size)) for sequence, size in zip(sequences, sizes)]
        try:  # a row's own max_tokens is checked as the run's was
            options = self.options if not max_tokens else validate(
                OcrOptions, {**self.options.model_dump(), "max_tokens": int(max_tokens)}, strict=False)
            async with self.admitted:
                if as_window:
                    entries = await self.pipeline.window_entries(window, images, options)
                else:
                    entries = [{**await self.pipeline.ocr(images, options, page=window[0]), "error": None}]
        except BadRequest as e:  # its max_tokens out of range, or its prompt over the context
            return [{"error": f"request: {e}", **self.window_columns(window)}] * len(window)
        if options.text_layer_fallback:
            entries = [self.pipeline.text_layer_entry(entry, text) if failed(entry, options) else entry
                       for entry, text in zip(entries, text_layers)]
        return [{**self.answered(entry), **({"window": entry["window"], "split": entry["split"]} if as_window
                                              else self.window_columns(window))} for entry in entries]

    def window_columns(self, window: tuple[int, ...]) -> dict:
        """A window run's columns for a row that is not split (a page alone, an error)."""
        return {"window": list(window), "split": False} if self.options.pages_per_request > 1 else {}

    @staticmethod
    def answered(answer: dict) -> dict:
        """A page's answer (or window entry) as result columns: its text, finish reason, usage,
        the attempts it took (1 unless it looped and was retried); with output_format "blocks"
        its markdown and its blocks as a JSON string (one column type whatever they hold)."""
        usage = answer["usage"]
        return {**{key: usage[key] for key in USAGE_KEYS},
                "attempts": len(usage["attempts"]) if "attempts" in usage else 1, "text": answer["text"],
                "finish_reason": answer["finish_reason"], "text_source": answer.get("source", "ocr"), "error": None,
                **({"markdown": answer["markdown"], "blocks": json.dumps(answer["blocks"])} if "blocks" in answer else {})}
