"""GlobalEncoder and LocalEncoder: one deployment class, one path each, running the encode engine;
or, with `one_encoder`, one `Encoder` deployment serving both paths.

A replica loads the encoder and builds `DualPathEncoder(paths=(path,))` (the Encoder: both
paths), the same engine the in-process API and the benchmarks run: requests that queued while
the batch before ran (`scheduler.BatchQueue`, counting views, not requests; the Encoder counts
images) are planned into token-budget batches by the scheduler's planner and replayed from this
path's CUDA graphs, or run eagerly. The engine runs on one worker thread of the replica
(capture and every replay), so the replica's event loop stays free for health checks and new
arrivals while a batch runs; one batch at a time, since graphs own their static buffers. On CPU
it runs eagerly.

On a GPU, views made here from decoded pixels are made as each request arrives, on a views
thread and a CUDA stream of their own (`views_on_arrival`): while one batch runs the next one's
views are made, instead of the GPU waiting ~2 ms a page for them before each batch. Otherwise
(the switch off, or a CPU) they are made in the batch, on the worker thread: the reference twin.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
import torch
from ray import serve

from encoder import DualPathEncoder, assemble, load_encoder
from encoder.preprocess import (DEFAULT_MAX_CROPS, MAX_CROPS_LIMIT, ImageHeader, check_view_options,
                                crops_of, decode_header, global_view_of)
from scheduler import BatchQueue

from .config import PROBE_EVERY_S, SHUTDOWN, STUCK_AFTER_S, AppConfig
from .metrics import encoder_metrics, medians
from .model_source import (device_and_dtype, prepare_replica_process, replica_id, resolve_checkpoint,
                           start_cuda, startup_phases)
from .protocol import Wire, from_wire, to_wire, to_wire_all


ViewSpec = tuple[str, str, tuple[int, int]]


@dataclass
class Views:
    """One request's views on this replica's device: the global view [3, S, S] and the crops
    [P, 3, 640, 640], None where it sends nothing to that path; `ready` (CUDA): recorded on the
    stream that made them, which the batch's stream waits for."""

    global_view: torch.Tensor | None
    crops: torch.Tensor | None
    ready: torch.cuda.Event | None = None
    ms: float = 0.0  # making them took


@dataclass
class Request:
    """What a request asks for: its views as sent (a global view [3, S, S], or crops [P, 3, 640,
    640]) with `view` None; or decoded pixels [C, H, W] with `view` = (path, mode, grid), from
    which this replica makes its path's views (views_on_encoder; path "both": the Encoder of
    one_encoder makes the global view and, for a tiled image, the crops). `views`: made on
    arrival (views_on_arrival), else in the batch."""

    pixels: Wire
    view: ViewSpec | None = None
    arrived: float = field(default_factory=time.perf_counter)
    views: Views | None = None
    decode_ms: float = 0.0  # decoding the bytes it was sent as took (decode_on_encoder)


def _views(requests: list[Request]) -> int:
    """Views in a batch of requests (the batch size Serve counts)."""
    def count(request: Request) -> int:
        (array, _), view = request.pixels, request.view
        if view is not None:
            path, _, (w_tiles, h_tiles) = view
            return w_tiles * h_tiles if path == "local" else 1  # "both": counted in images
        return 1 if array.ndim == 3 else array.shape[0]
    return sum(count(r) for r in requests)


def check_view(path: str, pixels: Wire, view: ViewSpec) -> None:
    """A ValueError naming what is wrong with a request of decoded pixels (before it joins a
    batch, where it would fail every request of the batch)."""
    array, dtype = pixels
    if dtype != "uint8" or array.ndim != 3 or array.shape[0] not in (1, 3) or min(array.shape) < 1:
        raise ValueError(f"decoded pixels must be uint8 [1 or 3, H, W], got {dtype} {array.shape}")
    if not (isinstance(view, tuple) and len(view) == 3):
        raise ValueError(f"view must be (path, mode, grid), got {view!r}")
    sent_path, mode, grid = view
    if sent_path != path:
        target = "Encoder of both paths" if path == "both" else f"{path} encoder"
        raise ValueError(f"a {sent_path!r} view sent to the {target}")
    check_view_options(mode, DEFAULT_MAX_CROPS)
    if path == "global":
        return
    tiles = grid[0] * grid[1] if (isinstance(grid, tuple) and len(grid) == 2
                                  and all(isinstance(n, int) and n >= 1 for n in grid)) else 0
    untiled_ok = path == "both" and grid == (1, 1)  # the Encoder also takes untiled images
    if not (untiled_ok or 2 <= tiles <= MAX_CROPS_LIMIT):
        raise ValueError(f"grid must be (width tiles, height tiles) of 2..{MAX_CROPS_LIMIT} crops"
                         f"{' (or (1, 1): not tiled)' if path == 'both' else ''}, got {grid!r}")


class EncoderReplica:
    """What a GlobalEncoder, LocalEncoder or Encoder replica runs (`PathEncoder` below is its
    deployment); with encoder_in_router the Router builds one in its own process. A plain class
    at module level, so pickling the Router (`serve.ingress` does) refers to it by name."""

    def __init__(self, path: str, config: AppConfig):
        if path not in ("global", "local", "both"):
            raise ValueError(f"path must be 'global', 'local' or 'both', got {path!r}")
        self.path = path
        constructor_start = time.perf_counter()
        prepare_replica_process()
        cuda = start_cuda(config.gpu_memory_fraction(path))
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{path}-encoder")
        self.views_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{path}-views")
        # Images sent as their bytes (decode_on_encoder) are decoded here as they arrive, a few
        # at once (PIL releases the GIL while it inflates).
        self.decode_worker = ThreadPoolExecutor(max_workers=config.encoder_decode_threads,
                                                thread_name_prefix=f"{path}-decode")
        self.views_stream = self.batch_stream = None  # CUDA: made with the engine
        self.engine = self.worker.submit(self._load, config, constructor_start, cuda).result()
        self.runners = self.engine.paths  # this replica's paths' graphs
        # One batch at a time, each taking what queued while the one before ran, up to the
        # path's largest budget in views (the Encoder: in images; the planner cuts a batch to
        # both paths' budgets).
        self.batches = BatchQueue(self.encode_batch, self.runners[0].budgets.max_units, _views)
        self.request_batches: Counter = Counter()  # requests per executed batch
        self.recent: deque[dict] = deque(maxlen=1000)  # per-batch stage timings
        self.handled: deque[float] = deque(maxlen=1000)  # per request: encode's entry to return, ms
        self.broken: str | None = None
        self.busy_since: float | None = None  # when the batch on the worker thread started
        self.probed = time.monotonic()  # last real-path probe (none needed right after start-up)

    def _load(self, config: AppConfig, constructor_start: float, cuda: float) -> DualPathEncoder:
        device, dtype = device_and_dtype()
        directory, self.model_label = resolve_checkpoint(config.checkpoint)
        start, reads = time.perf_counter(), {}
        encoder = load_encoder(directory, device=device, dtype=dtype, timings=reads)
        loaded = time.perf_counter()
        engine = DualPathEncoder(encoder, max_images=config.max_images, use_graphs=config.use_graphs,
                                 max_graph_memory_gb=config.max_graph_memory_gb,
                                 paths=("global", "local") if self.path == "both" else (self.path,))
        # Only a GPU's batch leaves the host free to make views meanwhile (on a CPU both compete
        # for the same cores, and batches would shrink to the requests whose views are done).
        self.views_on_arrival = config.views_on_arrival and encoder.device.type == "cuda"
        if encoder.device.type == "cuda":
            self.views_stream = torch.cuda.Stream(encoder.device)
            self.batch_stream = torch.cuda.current_stream(encoder.device)  # this worker thread's
        self.startup_s = startup_phases(constructor_start, cuda=cuda, weights=loaded - start,
                                        **{f"weights_{k}": v for k, v in reads.items() if k != "gb"},
                                        graphs=time.perf_counter() - loaded)
        return engine

    async def encode(self, pixels: Wire | ImageHeader, view: ViewSpec | None = None) -> Wire:
        """GlobalEncoder: a global view [3, S, S] -> its tokens [g*(g+1), D].
        LocalEncoder: one image's crops [P, 3, 640, 640] -> their tokens [P, 100, D].
        With `view` = (path, mode, grid), `pixels` are an image's decoded pixels [C, H, W], or
        its bytes with their header (`ImageHeader`, decoded here first), and this replica makes
        the views, on its device (`encoder.preprocess`).
        Encoder (one_encoder; `view` = ("both", mode, grid)): an image -> its whole sequence
        [num_tokens, D], assembled here (crops' grid with newlines, global view, separator)."""
        entered = time.perf_counter()
        request = await self._arrive(pixels, view)
        result = await self.batches.submit(request)
        self.handled.append((time.perf_counter() - entered) * 1e3)
        return result

    async def _arrive(self, pixels: Wire | ImageHeader, view: ViewSpec | None) -> Request:
        """A request as it joins the batch queue: its bytes decoded, its view checked, its views
        made (views_on_arrival)."""
        decode_ms = 0.0
        if isinstance(pixels, ImageHeader):
            if view is None:
                raise ValueError("an image's bytes need a view (path, mode, grid) to make")
            start = time.perf_counter()
            decoded = await asyncio.get_running_loop().run_in_executor(
                self.decode_worker, decode_header, pixels)  # ImageError: this request alone fails
            pixels, decode_ms = to_wire(decoded.pixels), (time.perf_counter() - start) * 1e3
        request = Request(pixels, view, decode_ms=decode_ms)
        if view is not None:
            check_view(self.path, pixels, view)
            if self.views_on_arrival:
                request.views = await asyncio.get_running_loop().run_in_executor(
                    self.views_worker, self._views_of, pixels, view)
        return request

    async def encode_batch(self, requests: list[Request]) -> list[Wire]:
        return await asyncio.get_running_loop().run_in_executor(self.worker, self._run_batch, requests)

    def _run_batch(self, requests: list[Request]) -> list[Wire]:
        self.busy_since = time.monotonic()
        try:
            return self._encode(requests)
        finally:
            self.busy_since = None

    def _encode(self, requests: list[Request]) -> list:
        self.request_batches[len(requests)] += 1
        before, start = self.engine.stats(), time.perf_counter()
        try:
            views = [r.views or self._views_of(r.pixels, r.view) for r in requests]
            made = time.perf_counter()
            for v in views:
                if v.ready is not None:  # made on the views stream: this stream waits for them
                    self.batch_stream.wait_event(v.ready)
            out = self.engine.run([v.global_view for v in views], [v.crops for v in views])
        except RuntimeError as e:
            if "CUDA" in str(e):  # a CUDA fault poisons the context: let Serve replace us
                self.broken = f"{type(e).__name__}: {e}"
            raise
        encoded = time.perf_counter()
        self._record((encoded - start) * 1e3, views, before, self.engine.stats())
        if self.path == "global":
            results = to_wire_all([o.global_tokens for o in out])
        elif self.path == "local":
            results = to_wire_all([o.crop_tokens for o in out])
        else:  # each image's sequence, assembled on the device: one tensor back per image
            encoder = self.engine.encoder
            results = to_wire_all([assemble(o.global_tokens, o.crop_tokens, r.view[2],
                                            encoder.image_newline, encoder.view_seperator)
                                   for o, r in zip(out, requests)])
        if requests:
            self.recent.append({"decode_ms": statistics.median(r.decode_ms for r in requests),
                                "wait_ms": statistics.median((start - r.arrived) * 1e3 for r in requests),
                                "views_ms": statistics.median(v.ms for v in views),
                                "batch_views_ms": (made - start) * 1e3, "run_ms": (encoded - made) * 1e3,
                                "results_ms": (time.perf_counter() - encoded) * 1e3})
        return results

    def _views_of(self, pixels: Wire, view: ViewSpec | None) -> Views:
        """A request's views: as sent, or made here from decoded pixels (on a GPU with the
        exact tensor resize, on the views stream; on a CPU with PIL: `global_view_of`,
        `crops_of`)."""
        if view is None:
            sent = from_wire(pixels)
            return Views(sent, None) if self.path == "global" else Views(None, sent)
        start, (_, mode, grid) = time.perf_counter(), view
        stream = self.views_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            decoded = from_wire(pixels).to(self.engine.encoder.device)
            global_view = global_view_of(decoded, mode) if self.path != "local" else None
            crops = crops_of(decoded, grid) if self.path != "global" and grid != (1, 1) else None
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
                # Read by the batch's stream, maybe after their last reference is dropped here:
                # the allocator must not hand their memory back to this stream before that.
                for t in (global_view, crops):
                    if t is not None:
                        t.record_stream(self.batch_stream)
        return Views(global_view, crops, ready, (time.perf_counter() - start) * 1e3)

    def _record(self, ms: float, views: list[Views], before: dict, after: dict) -> None:
        metrics = encoder_metrics()
        counts = {"global": sum(v.global_view is not None for v in views),
                  "local": sum(len(v.crops) for v in views if v.crops is not None)}
        for path, count in counts.items():
            if path not in after:
                continue
            tags = {"path": path}
            metrics["batch_ms"].observe(ms, tags=tags)
            metrics["batch_views"].observe(count, tags=tags)
            for result, key in (("hit", "graph_hits"), ("miss", "graph_misses")):
                if after[path][key] > before[path][key]:
                    metrics["graph_batches"].inc(after[path][key] - before[path][key],
                                                 tags={**tags, "result": result})
            for kind, key in (("real", "real_tokens"), ("padded", "padded_tokens")):
                if after[path][key] > before[path][key]:
                    metrics["tokens"].inc(after[path][key] - before[path][key], tags={**tags, "kind": kind})

    async def check_health(self):
        """Runs on the event loop while a batch runs on the worker thread, so it answers at
        once. Fails when the CUDA context faulted or one batch has run for minutes; when idle,
        now and then runs the path's real code (`PathGraphs.probe`) on the worker thread."""
        if self.broken:
            raise RuntimeError(f"{self.path} encoder unusable after {self.broken}")
        if self.busy_since is not None:
            if time.monotonic() - self.busy_since > STUCK_AFTER_S:
                raise RuntimeError(f"{self.path} encoder stuck: one batch running for over "
                                   f"{STUCK_AFTER_S} s")
            return  # busy: the batch itself exercises the path
        if time.monotonic() - self.probed < PROBE_EVERY_S:
            return
        self.probed = time.monotonic()
        probe = asyncio.get_running_loop().run_in_executor(
            self.worker, lambda: [runner.probe() for runner in self.runners])
        try:
            await asyncio.wait_for(asyncio.shield(probe), timeout=20)
        except asyncio.TimeoutError:  # a batch arrived first and holds the worker: not a fault
            return
        except RuntimeError as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def stage_medians(self) -> dict:
        """Median ms per stage over the last 1,000 batches: decoding a request sent as bytes,
        a request's wait from arrival (decoded) to its batch's start (the median request of
        each batch), making one request's views, the batch's time making views (none when made
        on arrival), the engine's run (on a GPU, queuing the work) and the results copied off
        the device (on a GPU, until the work is done); and over the last 1,000 requests,
        `encode`'s whole time from its entry to its return (`handler_ms`: the stages and the
        hand-offs between its threads; what Serve's call adds is outside it)."""
        keys = ("decode_ms", "wait_ms", "views_ms", "batch_views_ms", "run_ms", "results_ms")
        return {"batches": len(self.recent), **medians(self.recent, keys),
                "handler_ms": statistics.median(self.handled) if self.handled else None}

    def ready(self) -> dict:
        """Answers once the constructor (weights, graph capture) has finished."""
        return {"ready": True, "path": self.path, "graphs": sum(len(r.graphs) for r in self.runners),
                "device": str(self.engine.encoder.device), "startup_s": self.startup_s}

    def stats(self) -> dict:
        return {"path": self.path, "model": self.model_label, "replica": replica_id(),
                "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids(),
                "requests_per_batch": dict(sorted(self.request_batches.items())),
                "stages_p50_ms": self.stage_medians(),
                **(self.engine.stats() if self.path == "both" else self.engine.stats()[self.path])}


# max_queued_requests: past it, callers get BackPressureError at once (the router answers 503
# with Retry-After) instead of queueing without bound.
PathEncoder = serve.deployment(EncoderReplica, name="PathEncoder", max_ongoing_requests=256,
                               max_queued_requests=1024, ray_actor_options={"num_cpus": 0.25},
                               **SHUTDOWN)
