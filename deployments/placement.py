"""Where the vision encoder runs, as strategies behind one interface: `prepare(image)` on a worker
thread of the router (what it reads or makes of the image: its header, its decoded pixels, or
its views), then `await encode(prepared)` -> the image's whole sequence [num_tokens, D] and its
stage timings. The Router picks one at build time (`encoder_strategy`); nothing else in the
router or the pipeline asks where the encoder is.

- `PathEncoders`: the GlobalEncoder and LocalEncoder deployments, each making its path's views
  from the image's bytes (decode_on_encoder: the router read only the header) or its pixels;
  the sequence is assembled here. `RouterViews` is the same pair sent views made here with PIL
  (views_on_encoder false, the reference path).
- `WholeImages`: one encoder of both paths that returns the assembled sequence: the Encoder
  deployment (one_encoder) or that Encoder's class in the router's process (encoder_in_router).

The decoder's client is here too (`DecoderClient`): the Ray calls the pipeline makes, retried
on replica loss and cancelled with their caller; and `model_pipeline`, one served model's
pipeline from its tiers (`ModelTiers`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from common.checkpoint import read_config
from decoder import DecoderArgs, load_tokenizer
from encoder.checkpoint import load_sequence_layout
from encoder.preprocess import Tiling, decode, read_header, start_preprocess

from .config import AppConfig, ServedModel
from .encoders import EncoderReplica
from .model_source import TINY_WARNING, is_tiny, resolve_checkpoint
from .pipeline import OcrPipeline

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


# A tier that is up answers `ready` in milliseconds. Half a second, not one: /ready waits for
# the slowest tier and must itself answer within a second (a probe's usual limit); with 1.0 s a
# tier still starting made /ready take 1.02 s on a loaded 2-core machine.
TIER_READY_WITHIN_S = 0.5


def remote_ready(handle) -> Callable[[], Awaitable[dict]]:
    """A tier's readiness through its handle: its `ready` answer within TIER_READY_WITHIN_S,
    else not ready with the reason (not up yet, or failing: both mean not ready)."""
    async def ready() -> dict:
        try:
            return await asyncio.wait_for(handle.ready.remote(), timeout=TIER_READY_WITHIN_S)
        except Exception as e:  # noqa: BLE001
            return {"ready": False, "reason": type(e).__name__}
    return ready


def _bytes_or_pixels(image, mode: str, max_crops: int, decode_on_encoder: bool, tiling: Tiling):
    """What an encoder that makes the views is sent: the image's bytes with their header
    (decode_on_encoder, PNG and JPEG: the encoder decodes), else its decoded pixels; measured
    for the model's family (`tiling`)."""
    return ((read_header(image, mode, max_crops, tiling=tiling) if decode_on_encoder else None)
            or decode(image, mode, max_crops, tiling=tiling))


class PathEncoders:
    """GlobalEncoder and LocalEncoder: the image to both at once, each making its path's views;
    the sequence assembled here, as the encoder's own `sequence` does (`sequence`: for
    DeepSeek-OCR the crops' grid with newlines, the global view, the separator)."""

    def __init__(self, global_encoder, local_encoder, tiling: Tiling, sequence: Callable,
                 config: AppConfig):
        self.global_encoder, self.local_encoder = global_encoder, local_encoder
        self.tiling, self.sequence = tiling, sequence
        self.decode_on_encoder = config.decode_on_encoder
        self.tiers = {"GlobalEncoder": remote_ready(global_encoder),
                      "LocalEncoder": remote_ready(local_encoder)}

    def prepare(self, image, mode: str, max_crops: int):
        return _bytes_or_pixels(image, mode, max_crops, self.decode_on_encoder, self.tiling)

    async def encode(self, item, priority: str = "interactive") -> tuple[torch.Tensor, dict]:
        start = time.perf_counter()
        # One copy into the object store for both encoders (each call would make its own).
        sent = ray.put(item) if item.tiled else item
        global_tokens, crop_tokens = await self._paths(sent, sent if item.tiled else None, priority)
        return self._assembled(item, global_tokens, crop_tokens, start, start)

    async def _paths(self, to_global, to_local, priority: str) -> tuple:
        """Both paths' tokens: the global view's call at once, the crops' beside it (`to_local`
        None: the image is not tiled)."""
        global_call = asyncio.ensure_future(call_with_retry(self.global_encoder.encode, to_global, priority))
        try:
            crop_tokens = (await call_with_retry(self.local_encoder.encode, to_local, priority)
                           if to_local is not None else None)
            return await global_call, crop_tokens
        finally:
            global_call.cancel()  # no-op when done; frees the call if the crops' failed

    def _assembled(self, item, global_tokens, crop_tokens, start: float, ready: float):
        encoded = time.perf_counter()
        seq = self.sequence(global_tokens, crop_tokens, item.grid)
        return seq, {"preprocess_ms": (ready - start) * 1e3, "encode_ms": (encoded - ready) * 1e3,
                     "assemble_ms": (time.perf_counter() - encoded) * 1e3}

    def stats(self) -> dict:
        return {}

    async def check_health(self) -> None:
        """The encoders' health is their own replicas' (Serve checks them)."""


class RouterViews(PathEncoders):
    """The same two deployments sent views made here with PIL (views_on_encoder false, the
    reference path): the global view as soon as it is made, the crops when resized (a helper
    thread); `preprocess_ms` is until the crops are ready."""

    def prepare(self, image, mode: str, max_crops: int):
        return start_preprocess(image, mode, max_crops, tiling=self.tiling)

    async def encode(self, pending, priority: str = "interactive") -> tuple[torch.Tensor, dict]:
        start = time.perf_counter()
        global_call = asyncio.ensure_future(call_with_retry(self.global_encoder.encode, pending.global_view,
                                                            priority))
        try:
            views = await asyncio.to_thread(pending.result)
            ready = time.perf_counter()
            crop_tokens = (await call_with_retry(self.local_encoder.encode, views.crops, priority)
                           if views.tiled else None)
            global_tokens = await global_call
        finally:
            global_call.cancel()
        return self._assembled(views, global_tokens, crop_tokens, start, ready)


class WholeImages:
    """One encoder of both paths, which makes the views, encodes and assembles: one call per
    image (`call(image)`: its header or its decoded pixels -> its sequence)."""

    def __init__(self, call, tiers: dict, tiling: Tiling, config: AppConfig,
                 replica: EncoderReplica | None = None):
        self.call, self.tiers, self.tiling, self.replica = call, tiers, tiling, replica
        self.decode_on_encoder = config.decode_on_encoder

    @classmethod
    def deployment(cls, encoder, tiling: Tiling, config: AppConfig) -> WholeImages:
        """The Encoder deployment (one_encoder)."""
        return cls(lambda image, priority: call_with_retry(encoder.encode, image, priority),
                   {"Encoder": remote_ready(encoder)}, tiling, config)

    @classmethod
    def in_process(cls, config: AppConfig) -> WholeImages:
        """That Encoder's class in this process, on its GPU share (encoder_in_router)."""
        replica = EncoderReplica("both", config)

        async def ready() -> dict:  # in this process: ready, as this replica answers
            return replica.ready()
        return cls(replica.encode, {"Encoder": ready}, replica.engine.encoder.tiling, config, replica)

    def prepare(self, image, mode: str, max_crops: int):
        return _bytes_or_pixels(image, mode, max_crops, self.decode_on_encoder, self.tiling)

    async def encode(self, item, priority: str = "interactive") -> tuple[torch.Tensor, dict]:
        start = time.perf_counter()
        seq = await self.call(item, priority)
        return seq, {"preprocess_ms": 0.0, "encode_ms": (time.perf_counter() - start) * 1e3,
                     "assemble_ms": 0.0}

    def stats(self) -> dict:
        """The encoder in this process's stats (encoder_in_router), under `encoder`."""
        return {"encoder": self.replica.stats()} if self.replica is not None else {}

    async def check_health(self) -> None:
        """In this process, the encoder's health check (a CUDA fault, a stuck batch) is the
        router's: Serve replaces the router with its encoder."""
        if self.replica is not None:
            await self.replica.check_health()


@dataclass
class EncodedImage:
    """An image encoded before it reached the pipeline (the offline path's encoder stages,
    deployments/offline.py): its whole sequence [num_tokens, D] and the size it was read at."""

    sequence: torch.Tensor
    original_size: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return self.sequence.shape[0]

    @property
    def size(self) -> tuple[int, int]:  # as a PIL image's: a window's pages are shaped by it
        return self.original_size


class Encoded:
    """Images already encoded (`EncodedImage`): `prepare` takes each as it is (its views were
    made with the request's mode and max_crops where it was encoded), `encode` hands back its
    sequence."""

    def __init__(self, tiling: Tiling):
        self.tiling = tiling

    def prepare(self, image: EncodedImage, mode: str, max_crops: int) -> EncodedImage:
        return image

    async def encode(self, item: EncodedImage, priority: str = "interactive") -> tuple[torch.Tensor, dict]:
        return item.sequence, {"preprocess_ms": 0.0, "encode_ms": 0.0, "assemble_ms": 0.0}

    def stats(self) -> dict:
        return {}

    async def check_health(self) -> None:
        """Nothing here to fail."""


def encoder_strategy(global_encoder, local_encoder, tiling: Tiling, sequence: Callable,
                     config: AppConfig):
    """The placement the app was built with: both handles (two path deployments), the global
    one only (one Encoder), or none (the encoder in this process); `tiling` and `sequence`: the
    checkpoint's (`encoder.checkpoint.load_sequence_layout`)."""
    if config.encoder_in_router:
        return WholeImages.in_process(config)
    if local_encoder is None:
        return WholeImages.deployment(global_encoder, tiling, config)
    kind = PathEncoders if config.views_on_encoder else RouterViews
    return kind(global_encoder, local_encoder, tiling, sequence, config)


class DecoderClient:
    """The Decoder deployment, as the pipeline calls it: a whole generation, or its deltas."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.ready = remote_ready(decoder)

    async def generate(self, ids: list[int], seqs: list[torch.Tensor], params) -> dict:
        return await call_with_retry(self.decoder.generate, ids, seqs, params)

    async def stream(self, ids: list[int], seqs: list[torch.Tensor], params) -> AsyncIterator[dict]:
        """The generation's deltas; closed early (time limit, client gone), it is cancelled."""
        stream = self.decoder.options(stream=True).generate_stream.remote(ids, seqs, params)
        finished = False
        try:
            async for delta in stream:
                finished = delta["finished"]
                yield delta
        finally:
            if not finished:
                stream.cancel()


@dataclass
class ModelTiers:
    """One served model's deployments, as the app was built: its handles (None where its
    placement has no such deployment) and its config."""

    model: ServedModel
    global_encoder: object | None
    local_encoder: object | None
    decoder: object | None

    @classmethod
    def of(cls, config: AppConfig, global_encoder, local_encoder, decoder) -> list[ModelTiers]:
        """The Router's argument for an app of one model (`config`'s) built from these handles."""
        (model,) = config.served_models()
        return [cls(model, global_encoder, local_encoder, decoder)]


def model_pipeline(tiers: ModelTiers) -> OcrPipeline:
    """The pipeline of one served model: its encoder strategy (from the handles it was built
    with) and its decoder client."""
    config = tiers.model.config
    directory, _ = resolve_checkpoint(config.checkpoint)
    encoder = encoder_strategy(tiers.global_encoder, tiers.local_encoder,
                               *load_sequence_layout(directory), config)
    return pipeline_of(config, encoder, DecoderClient(tiers.decoder) if tiers.decoder else None)


def pipeline_of(config: AppConfig, encoder, decoder) -> OcrPipeline:
    """A model's pipeline over this encoder strategy and decoder client, with the model's
    tokenizer and context, and what every answer says of it."""
    directory, model_label = resolve_checkpoint(config.checkpoint)
    # Encode-only apps need no tokenizer (and their checkpoints may carry none), and have no
    # language model to bound prompts or choose the n-gram rule (an encoder-only checkpoint
    # has no language config).
    tokenizer = load_tokenizer(None if is_tiny(config.checkpoint) else directory) if decoder else None
    language = DecoderArgs.from_config(read_config(directory)) if decoder else None
    # In every answer: the model's id (what clients call it), and the tiny random model's
    # warning in its own field.
    model_fields = {"model": config.served_model_name or model_label,
                    **({"warning": TINY_WARNING} if is_tiny(config.checkpoint) else {})}
    return OcrPipeline(encoder, decoder, tokenizer, language, config, model_fields)
