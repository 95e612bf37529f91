"""GlobalEncoder and LocalEncoder: one deployment class, one path each, running the encode engine.

A replica loads the encoder and builds `DualPathEncoder(paths=(path,))`, the same engine the
in-process API and the benchmarks run: requests that arrive together (`@serve.batch`, counting
views, not requests) are planned into token-budget batches by the scheduler's planner and
replayed from this path's CUDA graphs, or run eagerly. The engine runs on one worker thread of
the replica (capture and every replay), so the replica's event loop stays free for health
checks and new arrivals while a batch runs; one batch at a time, since graphs own their static
buffers. On CPU it runs eagerly.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve

from encoder import DualPathEncoder, load_encoder

from .config import PROBE_EVERY_S, STUCK_AFTER_S, AppConfig
from .metrics import encoder_metrics
from .model_source import cap_gpu_memory, device_and_dtype, replica_id, resolve_checkpoint, startup_phases
from .protocol import Wire, from_wire, to_wire


def _views(requests: list[Wire]) -> int:
    """Views in a batch of requests (a global view is [3, S, S], crops [P, 3, 640, 640])."""
    return sum(1 if r[0].ndim == 3 else r[0].shape[0] for r in requests)


# max_queued_requests: past it, callers get BackPressureError at once (the router answers 503
# with Retry-After) instead of queueing without bound.
@serve.deployment(max_ongoing_requests=256, max_queued_requests=1024,
                  ray_actor_options={"num_cpus": 0.25})
class PathEncoder:
    def __init__(self, path: str, config: AppConfig):
        if path not in ("global", "local"):
            raise ValueError(f"path must be 'global' or 'local', got {path!r}")
        self.path = path
        cap_gpu_memory(config.gpu_memory_fraction(path))
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{path}-encoder")
        self.engine = self.worker.submit(self._load, config).result()
        self.runner = self.engine.global_path or self.engine.local_path  # this path's graphs
        self.encode_batch.set_max_batch_size(self.runner.budgets.max_units)
        self.request_batches: Counter = Counter()  # requests per executed batch
        self.broken: str | None = None
        self.busy_since: float | None = None  # when the batch on the worker thread started
        self.probed = time.monotonic()  # last real-path probe (none needed right after start-up)

    def _load(self, config: AppConfig) -> DualPathEncoder:
        device, dtype = device_and_dtype()
        directory, self.model_label = resolve_checkpoint(config.checkpoint)
        start = time.perf_counter()
        encoder = load_encoder(directory, device=device, dtype=dtype)
        loaded = time.perf_counter()
        engine = DualPathEncoder(encoder, max_images=config.max_images, use_graphs=config.use_graphs,
                                 max_graph_memory_gb=config.max_graph_memory_gb, paths=(self.path,))
        self.startup_s = startup_phases(weights=loaded - start, graphs=time.perf_counter() - loaded)
        return engine

    async def encode(self, pixels: Wire) -> Wire:
        """GlobalEncoder: a global view [3, S, S] -> its tokens [g*(g+1), D].
        LocalEncoder: one image's crops [P, 3, 640, 640] -> their tokens [P, 100, D]."""
        return await self.encode_batch(pixels)

    # A short wait: a lone request pays it in full, while under load batches fill up anyway
    # during the previous batch's GPU work.
    @serve.batch(batch_wait_timeout_s=0.002, max_concurrent_batches=1, batch_size_fn=_views)
    async def encode_batch(self, requests: list[Wire]) -> list[Wire]:
        return await asyncio.get_running_loop().run_in_executor(self.worker, self._run_batch, requests)

    def _run_batch(self, requests: list[Wire]) -> list[Wire]:
        self.busy_since = time.monotonic()
        try:
            return self._encode(requests)
        finally:
            self.busy_since = None

    def _encode(self, requests: list[Wire]) -> list[Wire]:
        self.request_batches[len(requests)] += 1
        pixels = [from_wire(r) for r in requests]
        none = [None] * len(pixels)
        before, start = self.engine.stats()[self.path], time.perf_counter()
        try:
            if self.path == "global":
                out = [to_wire(out.global_tokens) for out in self.engine.run(pixels, none)]
            else:
                out = [to_wire(out.crop_tokens) for out in self.engine.run(none, pixels)]
        except RuntimeError as e:
            if "CUDA" in str(e):  # a CUDA fault poisons the context: let Serve replace us
                self.broken = f"{type(e).__name__}: {e}"
            raise
        views = sum(len(p) if p.dim() == 4 else 1 for p in pixels)
        self._record((time.perf_counter() - start) * 1e3, views, before, self.engine.stats()[self.path])
        return out

    def _record(self, ms: float, views: int, before: dict, after: dict) -> None:
        metrics, tags = encoder_metrics(), {"path": self.path}
        metrics["batch_ms"].observe(ms, tags=tags)
        metrics["batch_views"].observe(views, tags=tags)
        for result, key in (("hit", "graph_hits"), ("miss", "graph_misses")):
            if after[key] > before[key]:
                metrics["graph_batches"].inc(after[key] - before[key], tags={**tags, "result": result})
        for kind, key in (("real", "real_tokens"), ("padded", "padded_tokens")):
            if after[key] > before[key]:
                metrics["tokens"].inc(after[key] - before[key], tags={**tags, "kind": kind})

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
        probe = asyncio.get_running_loop().run_in_executor(self.worker, self.runner.probe)
        try:
            await asyncio.wait_for(asyncio.shield(probe), timeout=20)
        except asyncio.TimeoutError:  # a batch arrived first and holds the worker: not a fault
            return
        except RuntimeError as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def ready(self) -> dict:
        """Answers once the constructor (weights, graph capture) has finished."""
        return {"ready": True, "path": self.path, "graphs": len(self.runner.graphs),
                "device": str(self.engine.encoder.device), "startup_s": self.startup_s}

    def stats(self) -> dict:
        return {"path": self.path, "model": self.model_label, "replica": replica_id(),
                "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids(),
                "requests_per_batch": dict(sorted(self.request_batches.items())),
                **self.engine.stats()[self.path]}
