"""CUDA graphs of the two encoder paths, captured at token budgets, with eager fallback.

The story, top to bottom:
1. `PathGraphs(name, forward, budgets, view_shape)` owns one path (global: `forward_global` on
   [n, 3, 1024, 1024]; local: `forward_local` on [n, 3, 640, 640]). On CUDA it captures one graph
   per token budget, LARGEST FIRST, all into one memory pool of this path, so the smaller graphs
   reuse the largest one's activation memory. Each graph has its own static input buffer (uint8
   views) and its own output. Before each capture the forward runs on a side stream (warm-up:
   cuDNN/cuBLAS handles, Triton compilation, the allocator's pool). Capture happens on the
   calling thread: replay must come from that same thread (Serve: the replica's event loop).
   A memory cap drops graphs, largest first, until the path fits; dropped budgets run eagerly.
2. `run(pixels, plan)` executes one planned batch on this path: skip when it has no views; when
   a graph holds the planned budget, copy the real views into the first rows of its input,
   zero rows left over from a bigger earlier batch, replay, and CLONE the real output rows
   (the next replay overwrites the graph's output); otherwise run the same forward eagerly.
3. `DualPathEncoder` is the in-process engine: the scheduler plans batches across both paths,
   each path replays (or falls back) on its own (on CUDA the two paths of a batch run on two
   streams at once), and images are assembled and returned in queue order. On CPU the same API
   runs every batch eagerly.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from scheduler import Item, PathBudgets, PathPlan, PathStats, Planner, default_budgets, path_plan

from .model import DeepEncoder
from .preprocess import PreprocessedImage, preprocess

log = logging.getLogger(__name__)
GB = 1024 ** 3


def capture_graph(fn, pool=None, warmup: int = 1, device=None, stream=None):
    """Run `fn` `warmup` times on a side stream (handles, Triton compilation, allocator pool),
    then capture it on that same stream: (graph, fn's output, which every replay rewrites).

    cuBLAS keeps one workspace per stream and a graph bakes in the workspace of the stream it
    was captured on; torch.cuda.graph's default capture stream is one for the whole process.
    Graphs that may replay at the same time (the two encoder paths) must therefore be captured
    on different streams: pass one `stream` per group of graphs that never overlap."""
    side = stream or torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        out = fn()
    return graph, out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # static input [capacity, 3, S, S] uint8
    out: torch.Tensor  # static output [capacity, tokens, D]
    filled: int  # rows holding real data since the last zeroing


@dataclass
class CaptureReport:
    budgets: list[int] = field(default_factory=list)  # captured token budgets
    dropped: list[int] = field(default_factory=list)  # over the memory cap, run eagerly
    memory_bytes: int = 0  # pool + static buffers, as reserved by the allocator
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"budgets": self.budgets, "dropped": self.dropped,
                "memory_gb": self.memory_bytes / GB, "seconds": self.seconds}


class PathGraphs:
    def __init__(self, name: str, forward, budgets: PathBudgets, view_shape: tuple[int, int, int],
                 device, use_graphs: bool | None = None, max_memory_gb: float | None = None,
                 warmup: int = 2):
        self.name, self.forward, self.budgets = name, forward, budgets
        self.view_shape, self.device = tuple(view_shape), torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"{name}: CUDA graphs need a CUDA device, got {self.device}")
        self.graphs: dict[int, _Graph] = {}
        self.stats = PathStats()
        self.report = CaptureReport()
        if self.use_graphs:
            self._capture_all(max_memory_gb, warmup)

    # -- capture ----------------------------------------------------------------------------
    def _capture_all(self, max_memory_gb, warmup):
        cap = None if max_memory_gb is None else int(max_memory_gb * GB)
        pool = torch.cuda.graph_pool_handle()
        # This path's capture stream: its own cuBLAS workspace (see capture_graph).
        stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # capture empties the cache too: measure from the same floor
        base = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        for budget in sorted(self.budgets.budgets, reverse=True):
            self.graphs[budget] = self._capture(budget // self.budgets.unit, pool, warmup, stream)
            used = torch.cuda.memory_reserved(self.device) - base
            if cap is not None and used > cap:
                # Largest first: dropping this one frees its buffers; the pool stays sized by
                # the largest graph kept, so try the next smaller budget.
                del self.graphs[budget]
                self.report.dropped.append(budget)
                torch.cuda.empty_cache()
        torch.cuda.synchronize(self.device)
        self.report.budgets = sorted(self.graphs)
        self.report.memory_bytes = torch.cuda.memory_reserved(self.device) - base
        self.report.seconds = time.perf_counter() - start
        log.info("%s path: captured budgets %s (%.2f GB, %.1f s), dropped %s", self.name,
                 self.report.budgets, self.report.memory_bytes / GB, self.report.seconds,
                 self.report.dropped)

    @torch.inference_mode()
    def _capture(self, capacity: int, pool, warmup: int, stream) -> _Graph:
        gen = torch.Generator(device=self.device).manual_seed(capacity)
        pixels = torch.randint(0, 256, (capacity, *self.view_shape), dtype=torch.uint8,
                               device=self.device, generator=gen)
        graph, out = capture_graph(lambda: self.forward(pixels), pool, warmup, self.device, stream)
        return _Graph(graph, pixels, out, filled=capacity)

    # -- execution --------------------------------------------------------------------------
    def plan(self, views: int) -> PathPlan:
        """This path's plan for a batch of `views` views (what the encoder deployments use)."""
        return path_plan(self.budgets, views)

    @torch.inference_mode()
    def run(self, pixels: torch.Tensor, plan: PathPlan | None = None) -> torch.Tensor:
        """Encode `pixels` [n, 3, S, S] (uint8, any device) -> a fresh [n, tokens, D] tensor."""
        n = pixels.shape[0]
        plan = plan or self.plan(n)
        assert plan.units == n, f"{self.name}: plan for {plan.units} views, got {n}"
        if n == 0:
            raise ValueError(f"{self.name} path: empty batch (a path with no views is skipped)")
        entry = self.graphs.get(plan.budget) if tuple(pixels.shape[1:]) == self.view_shape else None
        self.stats.record(plan, replayed=entry is not None)
        if entry is None:
            return self.forward(pixels.to(self.device, non_blocking=True))
        entry.pixels[:n].copy_(pixels, non_blocking=True)
        if entry.filled > n:  # rows left over from a bigger batch: back to zeros
            entry.pixels[n:entry.filled].zero_()
        entry.filled = n
        entry.graph.replay()
        return entry.out[:n].clone()  # clone: the next replay overwrites this buffer


class DualPathEncoder:
    """Plan across both paths, replay each path's graphs (or run it eagerly), assemble."""

    def __init__(self, encoder: DeepEncoder, budgets: tuple[PathBudgets, PathBudgets] | None = None,
                 max_items: int = 32, use_graphs: bool | None = None,
                 max_graph_memory_gb: float | None = None, strategy: str = "dp",
                 compile: bool = False, overlap_paths: bool = True):
        self.encoder, self.overlap_paths = encoder, overlap_paths
        global_budgets, local_budgets = budgets or default_budgets(max_images=max_items)
        forward_global, forward_local = encoder.forward_global, encoder.forward_local
        if compile:  # a static compile for the first batch size, one dynamic one after that
            forward_global, forward_local = torch.compile(forward_global), torch.compile(forward_local)
        self.global_path = PathGraphs("global", forward_global, global_budgets, (3, 1024, 1024),
                                      encoder.device, use_graphs, max_graph_memory_gb)
        left = (None if max_graph_memory_gb is None
                else max_graph_memory_gb - self.global_path.report.memory_bytes / GB)
        self.local_path = PathGraphs("local", forward_local, local_budgets, (3, 640, 640),
                                     encoder.device, use_graphs, left)
        self.planner = Planner(global_budgets, local_budgets, max_items, strategy)
        self._side = None  # the global path's CUDA stream when both paths run (_run_both)

    @property
    def graph_memory_bytes(self) -> int:
        return self.global_path.report.memory_bytes + self.local_path.report.memory_bytes

    def stats(self) -> dict:
        return {"global": self.global_path.stats.as_dict(), "local": self.local_path.stats.as_dict(),
                "capture": {"global": self.global_path.report.as_dict(),
                            "local": self.local_path.report.as_dict()}}

    def encode_images(self, images, mode: str = "gundam", max_crops: int = 6) -> list[torch.Tensor]:
        if not isinstance(images, (list, tuple)):
            images = [images]
        if len(images) == 1:
            return self.encode([preprocess(images[0], mode=mode, max_crops=max_crops)])
        # Decoding and resizing dominate for pages (PIL releases the GIL): one thread per image.
        with ThreadPoolExecutor(max_workers=min(len(images), os.cpu_count() or 1, 16)) as pool:
            items = list(pool.map(lambda image: preprocess(image, mode=mode, max_crops=max_crops),
                                  images))
        return self.encode(items)

    def encode(self, items: list[PreprocessedImage]) -> list[torch.Tensor]:
        """One [num_tokens, D] sequence per preprocessed image, in the order given."""
        # Global views of different modes have different sizes: plan each size on its own.
        by_size: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            by_size.setdefault(tuple(item.global_view.shape), []).append(i)
        out: list = [None] * len(items)
        for indices in by_size.values():
            for i, seq in zip(indices, self._encode_same_size([items[i] for i in indices])):
                out[i] = seq
        return out

    def _encode_same_size(self, items: list[PreprocessedImage]) -> list[torch.Tensor]:
        plan = self.planner.plan([Item(1, len(it.crops)) for it in items])
        per_batch = []
        for batch in plan.batches:
            chosen = [items[i] for i in batch.indices]
            global_views = torch.stack([it.global_view for it in chosen])
            crop_tokens = iter(())
            if batch.local_path.skipped:
                global_tokens = self.global_path.run(global_views, batch.global_path)
            else:
                crops = torch.cat([it.crops for it in chosen if it.tiled])
                global_tokens, local_tokens = self._run_both(global_views, batch.global_path,
                                                             crops, batch.local_path)
                crop_tokens = iter(local_tokens.split([len(it.crops) for it in chosen if it.tiled]))
            per_batch.append([
                self.encoder.assemble(g, next(crop_tokens) if it.tiled else None, it.grid)
                for it, g in zip(chosen, global_tokens)])
        return plan.in_queue_order(per_batch)

    def _run_both(self, global_views, global_plan, crops, local_plan):
        """Both paths of one batch. On CUDA the global path runs on a side stream while the
        local path runs on the current one: at small batches neither fills the GPU alone (a
        batch-1 page is one 1024² view and six 640² crops), and each path has its own graph
        pool and buffers, so the two replays can overlap."""
        if self.encoder.device.type != "cuda" or not self.overlap_paths:
            return (self.global_path.run(global_views, global_plan),
                    self.local_path.run(crops, local_plan))
        current = torch.cuda.current_stream(self.encoder.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.encoder.device)
        self._side.wait_stream(current)  # inputs staged on the current stream come first
        with torch.cuda.stream(self._side):
            global_tokens = self.global_path.run(global_views, global_plan)
        local_tokens = self.local_path.run(crops, local_plan)
        current.wait_stream(self._side)
        # Made on the side stream, used and freed on the current one: keep the allocator from
        # handing its memory back to the side stream before the current stream is done with it.
        global_tokens.record_stream(current)
        return global_tokens, local_tokens
