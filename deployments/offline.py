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
output_format "markdown"), finish_reason, prompt_tokens, image_tokens, completion_tokens, error},
and with output_format "blocks" also `markdown` and `blocks` (the service's blocks, boxes in the
page's pixels, as a JSON string: one column type whatever a page's blocks hold). A page that
cannot be read is a row with `error` (the job goes on). Greedy outputs equal the service's for
the same pages and options.
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
from .protocol import BadRequest, OcrOptions, validate

PDF_MAGIC = b"%PDF-"
NO_VIEW = np.zeros((3, 0, 0), np.uint8)  # an unread page's global view: a tensor column's rank kept
NO_CROPS = np.zeros((0, 3, 0, 0), np.uint8)  # an untiled (or unread) page's crops
NO_TOKENS = {"global": np.zeros((0, 0), np.float32), "local": np.zeros((0, 0, 0), np.float32),
             "sequence": np.zeros((0, 0), np.float32)}  # a path's tokens where it has none
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


def ocr_dataset(ds, checkpoint: str | None = None, *, config: AppConfig | None = None,
                stages: Stages = Stages(), skip: frozenset = frozenset(), **options):
    """`ds` (a `bytes` column, and `path` if it has one) OCR'd page by page: a lazy Ray
    Dataset of result rows (module docstring). `options`: the request's (`OcrOptions`: mode,
    max_crops, prompt, prompt_preset, output_format, max_tokens, ngram, dpi),
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
    # In a pool's actors each batch's pages are in flight together; the Decoder admits a full
    # batch plus its queue, over which Ray Data runs up to 4 batches per actor at once.
    decode_batch = max(1, (config.max_batch + config.decoder_queue) // 4)
    return (ds.flat_map(pages_of, fn_kwargs={"dpi": opts.dpi, "max_pages": config.max_pages,
                                             "skip": frozenset(skip)})
            .map_batches(views_of, fn_kwargs={"checkpoint": config.checkpoint, "mode": opts.mode,
                                              "max_crops": opts.max_crops}, batch_size=4)
            .map_batches(PathStage, fn_constructor_args=("global", config), concurrency=stages.encoders,
                         num_gpus=stages.encoder_gpus, num_cpus=stages.actor_cpus, resources=stages.encoder_resources,
                         batch_size=stages.encoder_batch)
            .map_batches(PathStage, fn_constructor_args=("local", config), concurrency=stages.encoders,
                         num_gpus=stages.encoder_gpus, num_cpus=stages.actor_cpus, resources=stages.encoder_resources,
                         batch_size=stages.encoder_batch)
            .map_batches(assemble, fn_kwargs={"checkpoint": config.checkpoint}, batch_size=stages.encoder_batch)
            .map_batches(Decode, fn_constructor_args=(config, opts), concurrency=stages.decoders,
                         num_gpus=stages.decoder_gpus, num_cpus=stages.actor_cpus, resources=stages.decoder_resources,
                         batch_size=decode_batch))


def pages_of(row: dict, dpi: int, max_pages: int, skip: frozenset = frozenset()) -> Iterator[dict]:
    """An image's row, or a PDF's rows: each page rendered (RGB pixels) as its row is taken, so
    a long PDF is never in memory whole; a PDF that cannot be opened is one row with its error.
    Each row names its file's content (`content_sha256`); the pages in `skip` ((content, page):
    done before) are left out unrendered."""
    data = row["bytes"]
    base = {"source": row.get("path") or "", "content_sha256": hashlib.sha256(data).hexdigest(),
            "max_tokens": int(row.get("max_tokens") or 0)}  # 0: the run's
    if bytes(data[:len(PDF_MAGIC)]) != PDF_MAGIC:
        if (base["content_sha256"], 0) not in skip:
            yield {**base, "page": 0, "bytes": data, "pixels": NO_VIEW, "error": ""}
        return
    try:
        pdf = PdfDocument(bytes(data), max_pages)
    except DocumentError as e:
        if (base["content_sha256"], 0) not in skip:
            yield {**base, "page": 0, "bytes": b"", "pixels": NO_VIEW, "error": f"document: {e}"}
        return
    with pdf:
        for index in range(pdf.page_count):
            if (base["content_sha256"], index) in skip:
                continue
            try:
                pixels, error = np.asarray(pdf.render(index, dpi)), ""
            except DocumentError as e:  # this page alone
                pixels, error = NO_VIEW, f"page: {e}"
            yield {**base, "page": index, "bytes": b"", "pixels": pixels, "error": error}


def views_of(batch: dict, checkpoint: str | None, mode: str, max_crops: int) -> dict:
    """Each page decoded and its views made with PIL (uint8: the global view [3, S, S], the
    crops [P, 3, C, C]), its grid and size; a page that cannot be read keeps its error."""
    tiling, _ = sequence_layout(checkpoint)
    out = {key: [] for key in ("global_view", "crops", "grid", "original_size", "num_tokens", "error")}
    for data, pixels, error in zip(batch["bytes"], batch["pixels"], batch["error"]):
        image = Image.fromarray(pixels) if pixels.size else bytes(data)
        try:
            if error:
                raise ImageError(error)
            item = preprocess(image, mode, max_crops, tiling=tiling)
        except ImageError as e:
            for key, empty in (("global_view", NO_VIEW), ("crops", NO_CROPS), ("grid", (0, 0)),
                               ("original_size", (0, 0)), ("num_tokens", 0)):
                out[key].append(empty)
            out["error"].append(str(e) if error else f"image: {e}")
            continue
        out["global_view"].append(item.global_view.numpy())
        out["crops"].append(item.crops.numpy() if item.tiled else NO_CROPS)
        out["grid"].append(item.grid)
        out["original_size"].append(item.original_size)
        out["num_tokens"].append(item.num_tokens)
        out["error"].append("")  # (not None: a column of Nones is read back as NaNs)
    keep = {key: batch[key] for key in ("source", "content_sha256", "page", "max_tokens")}
    return {**keep, **{key: (np.array(values) if key in ("grid", "original_size", "num_tokens") else values)
                       for key, values in out.items()}}


def tensor(array: np.ndarray) -> torch.Tensor:
    """A column's array as a tensor of its own (Ray Data hands out read-only views)."""
    return torch.from_numpy(np.array(array))


class PathStage:
    """One encoder path's actor: the replica class its deployment runs, each batch of pages'
    views encoded at once (their tokens as float32: bf16 widened exactly)."""

    def __init__(self, path: str, config: AppConfig):
        from .encoders import EncoderReplica
        self.path, self.replica = path, EncoderReplica(path, config)
        self.column = {"global": "global_view", "local": "crops"}[path]

    def __call__(self, batch: dict) -> dict:
        views = batch.pop(self.column)
        todo = [i for i, view in enumerate(views) if view.shape[0] and not batch["error"][i]]
        tokens = self.replica.encode_now([tensor(views[i]) for i in todo])
        out = [NO_TOKENS[self.path]] * len(views)
        for i, result in zip(todo, tokens):
            out[i] = result.float().numpy()
        batch[f"{self.path}_tokens"] = out
        return batch


def assemble(batch: dict, checkpoint: str | None) -> dict:
    """Each page's sequence from its paths' tokens, in the checkpoint's layout (the Router's
    `PathEncoders` assembles with the same `sequence`); CPU tasks."""
    _, sequence = sequence_layout(checkpoint)
    sequences = []
    for global_tokens, crop_tokens, grid, error in zip(batch.pop("global_tokens"), batch.pop("local_tokens"),
                                                       batch["grid"], batch["error"]):
        if error:
            sequences.append(NO_TOKENS["sequence"])
            continue
        crops = tensor(crop_tokens) if crop_tokens.size else None
        sequences.append(sequence(tensor(global_tokens), crops, tuple(grid)).numpy())
    batch["sequence"] = sequences
    return batch


class Decode:
    """The Decoder's class in this actor, every page of a batch through the request path's
    pipeline at once (its engine batches them with the other batches in flight here)."""

    def __init__(self, config: AppConfig, options: OcrOptions):
        from .decoder_server import DecoderServer
        from .placement import Encoded, pipeline_of
        tiling, _ = sequence_layout(config.checkpoint)
        # The replica class in process is the pipeline's decoder client as it is: its
        # `generate` takes what `DecoderClient.generate` forwards to the deployment.
        self.server = DecoderServer.func_or_class(config)
        self.pipeline = pipeline_of(config, Encoded(tiling), self.server)
        self.options = options

    async def __call__(self, batch: dict) -> dict:
        from .placement import EncodedImage

        async def one(sequence, size, page: int, error: str, max_tokens: int) -> dict:
            if error:
                return {"error": error}
            image = EncodedImage(tensor(sequence), tuple(size))
            try:  # a row's own max_tokens is checked as the run's was
                options = self.options if not max_tokens else validate(
                    OcrOptions, {**self.options.model_dump(), "max_tokens": int(max_tokens)}, strict=False)
                answer = await self.pipeline.ocr([image], options, page=int(page))
            except BadRequest as e:  # its max_tokens out of range, or its prompt over the context
                return {"error": f"request: {e}"}
            return {**answer["usage"], "text": answer["text"], "finish_reason": answer["finish_reason"],
                    "error": None, **({"markdown": answer["markdown"], "blocks": json.dumps(answer["blocks"])}
                                      if "blocks" in answer else {})}
        answers = await asyncio.gather(*(one(*row) for row in zip(
            batch["sequence"], batch["original_size"], batch["page"], batch["error"], batch["max_tokens"])))
        columns = ("text", "finish_reason", "prompt_tokens", "image_tokens", "completion_tokens", "error",
                   *(("markdown", "blocks") if self.options.output_format == "blocks" else ()))
        return {"source": batch["source"], "content_sha256": batch["content_sha256"], "page": batch["page"],
                **{key: [answer.get(key) for answer in answers] for key in columns}}
