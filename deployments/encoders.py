"""GlobalEncoder, LocalEncoder and Encoder: one deployment class running the encode engine in the
role it was built for (`encoder_roles.ROLES`): one path each, or (one_encoder, and the Router's
own process with encoder_in_router) both paths and the image's whole sequence.

A replica loads the encoder and builds `DualPathEncoder(paths=role.paths)`, the same engine the
in-process API and the benchmarks run: requests that queued while the batch before ran
(`scheduler.BatchQueue`, counting views, not requests; the Encoder counts images) are planned
into token-budget batches by the scheduler's planner and replayed from its paths' CUDA graphs,
or run eagerly. The engine runs on one worker thread of the replica (capture and every replay),
so the replica's event loop stays free for health checks and new arrivals while a batch runs;
one batch at a time, since graphs own their static buffers. On CPU it runs eagerly.

What a replica is sent, each image as it stands at one stage of its way:
  `ImageHeader`   its bytes and what their header says (decode_on_encoder): decoded here;
  `DecodedImage`  its decoded pixels with its grid: this replica makes its role's views;
  a tensor        views the router made (views_on_encoder false): a global view [3, S, S] to
                  the GlobalEncoder, an image's crops [P, 3, C, C] to the LocalEncoder (C: the
                  family's crop side, 640 or 768).
Tensors cross processes in one format: raw bytes out of band (`protocol.send_tensors_out_of_band`,
which every replica process calls).

On a GPU, views made here are made as each request arrives, on a views thread and a CUDA stream
of their own (`views_on_arrival`): while one batch runs the next one's views are made, instead
of the GPU waiting ~2 ms a page for them before each batch. Otherwise (the switch off, or a
CPU) they are made in the batch, on the worker thread: the reference twin.
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

import torch
from ray import serve

from encoder import DecodedImage, DualPathEncoder, load_encoder
from encoder.preprocess import ImageHeader, decode_header
from scheduler import BatchQueue

from .config import PROBE_EVERY_S, SHUTDOWN, STUCK_AFTER_S, AppConfig
from .encoder_roles import ROLES
from .metrics import encoder_metrics, medians
from .model_source import (device_and_dtype, gpu_ids, gpu_memory_gb, prepare_replica_process, replica_id,
                           resolve_checkpoint, start_cuda, startup_phases)
from .protocol import to_host

Sent = ImageHeader | DecodedImage | torch.Tensor  # what `encode` takes (see above)


@dataclass
class DeviceViews:
    """One image's views on this replica's device, as its role's paths take them: the global
    view [3, S, S] and the crops [P, 3, C, C], None where the role sends nothing to that
    path; `ready` (CUDA): recorded on the stream that made them, which the batch's stream waits
    for."""

    global_view: torch.Tensor | None
    crops: torch.Tensor | None
    ready: torch.cuda.Event | None = None
    ms: float = 0.0  # making them took


@dataclass
class QueuedImage:
    """An image in this replica's batch queue: as sent (views, or a decoded image whose views
    are made here), its views once made (on arrival, or in the batch), and its stage times."""

    sent: DecodedImage | torch.Tensor
    arrived: float = field(default_factory=time.perf_counter)
    views: DeviceViews | None = None
    decode_ms: float = 0.0  # decoding the bytes it was sent as took (decode_on_encoder)


class EncoderReplica:
    """What a GlobalEncoder, LocalEncoder or Encoder replica runs (`PathEncoder` below is its
    deployment); with encoder_in_router the Router builds one in its own process. A plain class
    at module level, so pickling the Router (`serve.ingress` does) refers to it by name."""

    def __init__(self, path: str, config: AppConfig):
        if path not in ROLES:
            raise ValueError(f"path must be one of {', '.join(map(repr, ROLES))}, got {path!r}")
        self.role = ROLES[path]
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
        self.batches = BatchQueue(self.encode_batch, self.runners[0].budgets.max_units,
                                  lambda images: sum(self.role.units(image.sent) for image in images))
        self.request_batches: Counter = Counter()  # requests per executed batch
        self.recent: deque[dict] = deque(maxlen=1000)  # per-batch stage timings
        self.handled: deque[float] = deque(maxlen=1000)  # per request: encode's entry to return, ms
        self.broken: str | None = None
        self.busy_since: float | None = None  # when the batch on the worker thread started
        self.probed = time.monotonic()  # last real-path probe (none needed right after start-up)

    def _load(self, config: AppConfig, constructor_start: float, cuda: float) -> DualPathEncoder:
        device, dtype = device_and_dtype()
        directory, self.model_label = resolve_checkpoint(config.checkpoint)
        self.model_name = config.served_model_name or self.model_label  # its metrics' `model`
        start, reads = time.perf_counter(), {}
        encoder = load_encoder(directory, device=device, dtype=dtype, timings=reads)
        loaded = time.perf_counter()
        engine = DualPathEncoder(encoder, max_images=config.max_images, use_graphs=config.use_graphs,
                                 max_graph_memory_gb=config.max_graph_memory_gb, paths=self.role.paths)
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

    async def encode(self, sent: Sent, priority: str = "interactive") -> torch.Tensor:
        """One image, as sent (module docstring) -> what its role returns (`encoder_roles`): the
        GlobalEncoder its global view's tokens, the LocalEncoder its crops' tokens, the Encoder
        its whole sequence [num_tokens, D] in its family's layout. A batch job's image
        (`priority` "batch") waits behind interactive ones (`BatchQueue`)."""
        entered = time.perf_counter()
        image = await self._arrive(sent)
        result = await self.batches.submit(image, batch=priority == "batch")
        self.handled.append((time.perf_counter() - entered) * 1e3)
        return result

    async def _arrive(self, sent: Sent) -> QueuedImage:
        """An image as it joins the batch queue: its bytes decoded, checked, its views made
        (views_on_arrival)."""
        loop, decode_ms = asyncio.get_running_loop(), 0.0
        if isinstance(sent, ImageHeader):
            start = time.perf_counter()
            # ImageError: this request alone fails
            sent = await loop.run_in_executor(self.decode_worker, decode_header, sent)
            decode_ms = (time.perf_counter() - start) * 1e3
        self.role.check(sent, self.engine.encoder.tiling)
        image = QueuedImage(sent, decode_ms=decode_ms)
        if self.views_on_arrival and isinstance(sent, DecodedImage):
            image.views = await loop.run_in_executor(self.views_worker, self._views_of, sent)
        return image

    def encode_now(self, sent: list[DecodedImage | torch.Tensor]) -> list[torch.Tensor]:
        """A batch of images (decoded, or views), checked and encoded at once on this thread:
        what the offline path's encoder stages (deployments/offline.py) call with a block of
        rows; Serve's calls queue through `encode` instead."""
        for one in sent:
            self.role.check(one, self.engine.encoder.tiling)
        return self._run_batch([QueuedImage(one) for one in sent])

    async def encode_batch(self, images: list[QueuedImage]) -> list[torch.Tensor]:
        return await asyncio.get_running_loop().run_in_executor(self.worker, self._run_batch, images)

    def _run_batch(self, images: list[QueuedImage]) -> list[torch.Tensor]:
        self.busy_since = time.monotonic()
        try:
            return self._encode(images)
        finally:
            self.busy_since = None

    def _encode(self, images: list[QueuedImage]) -> list[torch.Tensor]:
        self.request_batches[len(images)] += 1
        before, start = self.engine.stats(), time.perf_counter()
        try:
            views = [image.views or self._views_of(image.sent) for image in images]
            made = time.perf_counter()
            for v in views:
                if v.ready is not None:  # made on the views stream: this stream waits for them
                    self.batch_stream.wait_event(v.ready)
            out = self.engine.run([v.global_view for v in views], [v.crops for v in views])
            encoded = time.perf_counter()
            results = to_host(self.role.results(self.engine, out, [image.sent for image in images]))
        except RuntimeError as e:
            if "CUDA" in str(e):  # a CUDA fault poisons the context: let Serve replace us
                self.broken = f"{type(e).__name__}: {e}"
            raise
        self._record((encoded - start) * 1e3, views, before, self.engine.stats())
        if images:
            self.recent.append({"decode_ms": statistics.median(i.decode_ms for i in images),
                                "wait_ms": statistics.median((start - i.arrived) * 1e3 for i in images),
                                "views_ms": statistics.median(v.ms for v in views),
                                "batch_views_ms": (made - start) * 1e3, "run_ms": (encoded - made) * 1e3,
                                "results_ms": (time.perf_counter() - encoded) * 1e3})
        return results

    def _views_of(self, sent: DecodedImage | torch.Tensor) -> DeviceViews:
        """An image's views for this role: as sent, or made here from its decoded pixels (on a
        GPU with the exact tensor resize, on the views stream; on a CPU with PIL:
        `global_view_of`, `crops_of`)."""
        if isinstance(sent, torch.Tensor):
            return DeviceViews(*self.role.as_sent(sent))
        start, stream = time.perf_counter(), self.views_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            global_view, crops = self.role.views_of(sent, sent.pixels.to(self.engine.encoder.device))
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
                # Read by the batch's stream, maybe after their last reference is dropped here:
                # the allocator must not hand their memory back to this stream before that.
                for t in (global_view, crops):
                    if t is not None:
                        t.record_stream(self.batch_stream)
        return DeviceViews(global_view, crops, ready, (time.perf_counter() - start) * 1e3)

    def _record(self, ms: float, views: list[DeviceViews], before: dict, after: dict) -> None:
        metrics = encoder_metrics(self.model_name)
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
            raise RuntimeError(f"{self.role.label} unusable after {self.broken}")
        if self.busy_since is not None:
            if time.monotonic() - self.busy_since > STUCK_AFTER_S:
                raise RuntimeError(f"{self.role.label} stuck: one batch running for over "
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
        return {"ready": True, "path": self.role.name, "graphs": sum(len(r.graphs) for r in self.runners),
                "device": str(self.engine.encoder.device), "startup_s": self.startup_s,
                "gpu_memory_gb": gpu_memory_gb()}

    def stats(self) -> dict:
        return {"path": self.role.name, "model": self.model_label, "replica": replica_id(),
                "pid": os.getpid(), "gpu_ids": gpu_ids(),
                "requests_per_batch": dict(sorted(self.request_batches.items())),
                "stages_p50_ms": self.stage_medians(),
                **self.role.stats(self.engine.stats())}


# max_queued_requests: past it, callers get BackPressureError at once (the router answers 503
# with Retry-After) instead of queueing without bound.
PathEncoder = serve.deployment(EncoderReplica, name="PathEncoder", max_ongoing_requests=256,
                               max_queued_requests=1024, ray_actor_options={"num_cpus": 0.25},
                               **SHUTDOWN)
