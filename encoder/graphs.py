"""The encode engine: CUDA graphs of the two encoder paths, captured at token budgets, batches
planned by the scheduler, eager fallback per path. The in-process API, the GlobalEncoder and
LocalEncoder deployments and the benchmarks all run this one engine.

The story, top to bottom:
1. `PathGraphs(name, forward, budgets, view_shape)` owns one path (global: `forward_global` on
   [n, 3, 1024, 1024]; local: `forward_local` on [n, 3, C, C], C the family's crop side: 640 for
   DeepSeek-OCR, 768 for DeepSeek-OCR-2). On CUDA it captures one graph
   per token budget, LARGEST FIRST, all into one memory pool of this path, so the smaller graphs
   reuse the largest one's activation memory. Each graph has its own static input buffer (uint8
   views) and its own output. First the path's Triton kernels are compiled on threads at once
   (`common.triton_compile`); before each capture the forward runs on a side stream (warm-up:
   cuDNN/cuBLAS handles, the allocator's pool), and each path captures on its own stream
   (`common.cuda_graphs.capture_graph` says why). A memory cap drops graphs, largest first,
   until the path fits; dropped budgets run eagerly.
2. `PathGraphs.run(pixels, plan)` executes one planned batch on this path: when a graph holds
   the planned budget, copy the real views into the first rows of its input, zero rows left over
   from a bigger earlier batch, replay, and CLONE the real output rows (the next replay
   overwrites the graph's output); otherwise run the same forward eagerly.
3. `DualPathEncoder` is the engine over the paths one process serves (both in-process; one in
   each encoder deployment). `run` takes a queue of images' views, groups them by view size,
   lets the scheduler's `Planner` cut each group into batches that fit both paths' budgets, runs
   each batch's paths (on CUDA, when a batch has both, the local path launched first on the
   current stream, then the global path on a side stream) and returns every image's tokens in
   queue order.
   `encode` / `encode_images` add preprocessing before and `assemble` after. On CPU the same code
   runs every batch eagerly. On a GPU `encode_images` only decodes on the CPU and makes the
   views on the GPU, with PIL's exact bicubic arithmetic (`resize.py`; `views_on_device`).
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common import switches
from common.cuda_graphs import capture_graph
from common.triton_compile import compile_ahead
from scheduler import Item, PathBudgets, PathPlan, PathStats, Planner, default_budgets

from .model import DeepEncoder
from .decoding import decode
from .resize import supported as resize_supported
from .resize import warm_up as resize_warm_up
from .views import PreprocessedImage, preprocess, views_of

log = logging.getLogger(__name__)
GB = 1024 ** 3
# Views on the host reach a graph's input through page-locked memory: a copy from pageable
# memory holds the launching thread until it is done (a page's 7.4 MB of crops: 0.57 ms on the
# H200 machine, before the local path's launch); one from pinned memory is a DMA queued on the
# stream (0.15 ms), after a copy into pinned memory on torch's CPU threads (0.41 ms on 2
# threads, 0.21 on 4, 0.68 on 1: with one thread pinning loses, so it needs two). Torch keeps
# the pinned blocks for reuse: up to ~0.4 GB for a full 32-page batch of host views.
# Better still, views pinned where they are made (`preprocess(pin_memory=True)`, as
# `encode_images` does): the engine's call then only queues the DMA (~1 ms less CPU before a
# page's paths start).
# DEEPSEEK_OCR_PIN_HOST_VIEWS=0 (or this flag) copies from where the views are, the reference.
PIN_HOST_VIEWS = switches.on("DEEPSEEK_OCR_PIN_HOST_VIEWS")
# A batch whose views would pad its smallest budget by more than a view replays two smaller
# budgets one after the other instead (scheduler.PathBudgets.replays): on an H100, 8 and 16
# OCR-2 pages ran slower from one replay than eagerly (61.7 and 58.3 against 69 pages/s),
# padded 12.5% and 19%; with two replays 66.3 and 68.7. DEEPSEEK_OCR_SPLIT_REPLAYS=0: one.
SPLIT_REPLAYS = switches.on("DEEPSEEK_OCR_SPLIT_REPLAYS")


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
    compile_ahead_s: float = 0.0  # the path's Triton kernels compiled on threads before capture
    # Warm-up and capture per budget, in capture order (largest first): the first one also pays
    # this process's first launches (kernel compiles, library handles, lazily loaded modules).
    budget_seconds: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"budgets": self.budgets, "dropped": self.dropped,
                "memory_gb": self.memory_bytes / GB, "seconds": self.seconds,
                "compile_ahead_s": self.compile_ahead_s, "budget_seconds": self.budget_seconds}


class PathGraphs:
    def __init__(self, name: str, forward, budgets: PathBudgets, view_shape: tuple[int, int, int],
                 device, use_graphs: bool | None = None, max_memory_gb: float | None = None,
                 warmup: int = 2, compile_also=None):
        """`compile_also()`: more work whose Triton kernels compile with this path's, ahead."""
        self.name, self.forward, self.budgets = name, forward, budgets
        self.compile_also = compile_also
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
        # The kernels the captures meet, compiled on threads at once first: the largest
        # budget's and the next one's. Triton specialises integer arguments on divisibility by
        # 16; at 32 images the largest view counts are multiples of 16 (192 crops, 32 global
        # views) and the next are not (168, 28), and a fresh node's profile saw that second
        # capture compile too (0.8 s against 0.3 warm); smaller budgets met no new variants.
        largest_two = sorted(self.budgets.budgets, reverse=True)[:2]

        def forwards():
            for budget in largest_two:
                self.forward(self._views(budget // self.budgets.unit))
            if self.compile_also is not None:
                self.compile_also()
        with torch.inference_mode():
            self.report.compile_ahead_s = compile_ahead(forwards)
        for budget in sorted(self.budgets.budgets, reverse=True):
            began = time.perf_counter()
            # The first capture's warm-ups do this process's one-time work (compiles, handles);
            # one run before each later capture is enough to settle the allocator's blocks.
            runs = warmup if not self.report.budget_seconds else min(warmup, 1)
            self.graphs[budget] = self._capture(budget // self.budgets.unit, pool, runs, stream)
            torch.cuda.synchronize(self.device)
            self.report.budget_seconds[budget] = round(time.perf_counter() - began, 3)
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

    def _views(self, capacity: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(capacity)
        return torch.randint(0, 256, (capacity, *self.view_shape), dtype=torch.uint8,
                             device=self.device, generator=gen)

    @torch.inference_mode()
    def _capture(self, capacity: int, pool, warmup: int, stream) -> _Graph:
        pixels = self._views(capacity)
        graph, out = capture_graph(lambda: self.forward(pixels), pool, warmup, self.device, stream)
        return _Graph(graph, pixels, out, filled=capacity)

    # -- execution --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, pixels: torch.Tensor | list[torch.Tensor], plan: PathPlan) -> torch.Tensor:
        """Encode `pixels` [n, 3, S, S] (uint8, any device) as the planner planned them
        -> a fresh [n, tokens, D] tensor. `pixels` may also be a list of parts ([3, S, S] views
        or [k, 3, S, S] stacks): a graph's input takes each part in place (no stacked copy on the
        host first, whose time would sit before the replay)."""
        parts = [pixels] if torch.is_tensor(pixels) else pixels
        parts = [p[None] if p.dim() == 3 else p for p in parts]
        n = sum(p.shape[0] for p in parts)
        if n == 0:
            raise ValueError(f"{self.name} path: empty batch (a path with no views is skipped)")
        assert plan.units == n, f"{self.name}: plan for {plan.units} views, got {n}"
        shapes_fit = all(tuple(p.shape[1:]) == self.view_shape for p in parts)
        entries = [self.graphs.get(budget) for budget in plan.replays] if shapes_fit else [None]
        replayed = bool(entries) and None not in entries
        self.stats.record(plan, replayed=replayed)
        if not replayed:
            staged = [p.to(self.device, non_blocking=True) for p in parts]
            return self.forward(staged[0] if len(staged) == 1 else torch.cat(staged))
        if len(entries) == 1:
            return self._replay(entries[0], parts, n).clone()  # clone: the next replay overwrites it
        out, row = None, 0
        for entry, views in zip(entries, split_views(parts, [e.pixels.shape[0] for e in entries])):
            tokens = self._replay(entry, views, sum(v.shape[0] for v in views))
            out = out if out is not None else tokens.new_empty(n, *tokens.shape[1:])
            out[row:row + tokens.shape[0]].copy_(tokens)
            row += tokens.shape[0]
        return out

    def _replay(self, entry: _Graph, parts: list[torch.Tensor], n: int) -> torch.Tensor:
        """`parts` (n views in all) into the graph's input, replayed: its output's first n rows
        (the graph's own buffer, until its next replay)."""
        row = 0
        for part in parts:
            if (PIN_HOST_VIEWS and self.device.type == "cuda" and not part.is_cuda
                    and torch.get_num_threads() >= 2 and not part.is_pinned()):
                # From torch's caching host allocator: the block is not reused before the DMA
                # out of it is done (the copy records an event on it).
                part = part.pin_memory()
            entry.pixels[row:row + part.shape[0]].copy_(part, non_blocking=True)
            row += part.shape[0]
        if entry.filled > n:  # rows left over from a bigger batch: back to zeros
            entry.pixels[n:entry.filled].zero_()
        entry.filled = n
        entry.graph.replay()
        return entry.out[:n]

    @torch.inference_mode()
    def probe(self) -> None:
        """A cheap run of this path's real code for health checks, not counted in the stats:
        the smallest graph replays on its own buffers (results are clones, so nothing handed
        out changes), or the forward runs on one view. On a GPU it waits for the device, so a
        broken CUDA context raises here."""
        if self.graphs:
            self.graphs[min(self.graphs)].graph.replay()
        else:
            self.forward(torch.zeros((1, *self.view_shape), dtype=torch.uint8, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def split_views(parts: list[torch.Tensor], capacities: list[int]) -> list[list[torch.Tensor]]:
    """[k, 3, S, S] stacks (n views in all, in order) cut into consecutive groups of at most
    `capacities[i]` views each (views of one stack may fall in two groups), every view in one."""
    groups: list[list[torch.Tensor]] = [[] for _ in capacities]
    group, room = 0, capacities[0]
    for part in parts:
        start = 0
        while start < part.shape[0]:
            while room == 0:
                group += 1
                room = capacities[group]
            take = min(room, part.shape[0] - start)
            groups[group].append(part[start:start + take])
            start, room = start + take, room - take
    return groups


@dataclass(frozen=True, eq=False)
class PathTokens:
    """One image's encoder output: global tokens [g*(g+1), D] and crop tokens [P, 100, D] (DeepSeek-
    OCR-2: [256, D] and [P, 144, D]); None
    for a part the image did not send (untiled: no crops) or this engine does not serve."""

    global_tokens: torch.Tensor | None
    crop_tokens: torch.Tensor | None


class DualPathEncoder:
    """Plan across the served paths, replay each path's graphs (or run it eagerly), assemble."""

    def __init__(self, encoder: DeepEncoder, budgets: tuple[PathBudgets, PathBudgets] | None = None,
                 max_images: int = 32, use_graphs: bool | None = None,
                 max_graph_memory_gb: float | None = None,
                 overlap_paths: bool = True, paths: tuple[str, ...] = ("global", "local"),
                 views_on_device: bool | None = None):
        unknown = set(paths) - {"global", "local"}
        if unknown or not paths:
            raise ValueError(f"paths must be some of ('global', 'local'), got {paths!r}")
        self.encoder, self.overlap_paths = encoder, overlap_paths
        # The views' resizes on this device (exact tensor math) instead of PIL on the CPU:
        # by default on a GPU, where they cost ~nothing and free ~25 ms of CPU per page.
        if views_on_device is None:
            views_on_device = encoder.device.type == "cuda" and resize_supported()
        self.views_on_device = views_on_device
        tiling = encoder.tiling  # the family's view sizes and tokens per view
        global_budgets, local_budgets = budgets or default_budgets(
            max_images=max_images, global_unit=tiling.view_tokens(1024), local_unit=tiling.crop_tokens)
        forward_global, forward_local = encoder.forward_global, encoder.forward_local
        self.global_path = self.local_path = None
        left = max_graph_memory_gb
        # The views' resize kernel compiles ahead with the first path's kernels.
        views = (lambda: resize_warm_up(encoder.device)) if views_on_device else None
        if "global" in paths:
            self.global_path = PathGraphs("global", forward_global, global_budgets, (3, 1024, 1024),
                                          encoder.device, use_graphs, left, compile_also=views)
            left = None if left is None else left - self.global_path.report.memory_bytes / GB
            views = None
        if "local" in paths:
            self.local_path = PathGraphs("local", forward_local, local_budgets,
                                         (3, tiling.crop_size, tiling.crop_size),
                                         encoder.device, use_graphs, left, compile_also=views)
        self.planner = Planner(global_budgets, local_budgets, max_images, split_replays=SPLIT_REPLAYS)
        self._side = None  # the global path's CUDA stream when both paths run (_run_both)

    @property
    def paths(self) -> list[PathGraphs]:
        return [p for p in (self.global_path, self.local_path) if p is not None]

    @property
    def graph_memory_bytes(self) -> int:
        return sum(p.report.memory_bytes for p in self.paths)

    def stats(self) -> dict:
        """Per served path: graph hits/misses, padding, batch sizes, and its capture report."""
        return {p.name: {**p.stats.as_dict(), "capture": p.report.as_dict()} for p in self.paths}

    # -- images in, sequences out -------------------------------------------------------------
    def encode_images(self, images, mode: str = "gundam", max_crops: int = 6) -> list[torch.Tensor]:
        """Images (bytes, paths, PIL images) -> one [num_tokens, D] sequence each."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        prepare = decode if self.views_on_device else preprocess
        # Page-locked on a GPU: the pixels' copy there is a DMA, not a stall of this thread.
        options = dict(mode=mode, max_crops=max_crops, tiling=self.encoder.tiling,
                       pin_memory=PIN_HOST_VIEWS and self.encoder.device.type == "cuda")
        if len(images) <= 1:
            items = [prepare(image, **options) for image in images]
        else:  # decoding (and PIL's resizes) dominate for pages and release the GIL: threads
            with ThreadPoolExecutor(max_workers=min(len(images), os.cpu_count() or 1, 16)) as pool:
                items = list(pool.map(lambda image: prepare(image, **options), images))
        if self.views_on_device:
            items = [views_of(item, self.encoder.device, exact=True) for item in items]
        return self.encode(items)

    def encode(self, items: list[PreprocessedImage]) -> list[torch.Tensor]:
        """One [num_tokens, D] sequence per preprocessed image, in the order given."""
        outputs = self.run([it.global_view for it in items], [it.crops if it.tiled else None for it in items])
        seqs = self.sequences(outputs, [it.grid for it in items])
        for item, seq in zip(items, seqs):
            assert seq.shape[0] == item.num_tokens, (seq.shape, item.num_tokens)
        return seqs

    def sequences(self, outputs: list[PathTokens], grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each image's [num_tokens, D] sequence from its tokens (`run`'s output) and its grid,
        in the encoder's own layout (`sequence`: for DeepSeek-OCR the crops' token grid with
        newlines, the global view's, the view separator)."""
        return [self.encoder.sequence(out.global_tokens, out.crop_tokens, grid)
                for out, grid in zip(outputs, grids)]

    # -- views in, tokens out -----------------------------------------------------------------
    @torch.inference_mode()
    def run(self, global_views: list[torch.Tensor | None],
            crops: list[torch.Tensor | None]) -> list[PathTokens]:
        """A queue of images' views -> their tokens, in queue order.

        Image i sends `global_views[i]` (uint8 [3, S, S]) and/or `crops[i]` (uint8 [P, 3, C, C],
        C the family's crop side); None where it sends nothing to that path. Global views of one size are planned
        together (other modes make 512/640/1280 views); each planned batch runs both paths."""
        if len(global_views) != len(crops):
            raise ValueError(f"{len(global_views)} global-view entries for {len(crops)} crop entries")
        for views, path in ((global_views, self.global_path), (crops, self.local_path)):
            if path is None and any(v is not None for v in views):
                name = "global" if views is global_views else "local"
                raise ValueError(f"this engine does not serve the {name} path")
        groups: dict[tuple | None, list[int]] = {}
        for i, view in enumerate(global_views):
            groups.setdefault(None if view is None else tuple(view.shape), []).append(i)
        out: list[PathTokens | None] = [None] * len(crops)
        for indices in groups.values():
            items = [Item(int(global_views[i] is not None), 0 if crops[i] is None else len(crops[i]))
                     for i in indices]
            plan = self.planner.plan(items)
            per_batch = [self._run_batch([global_views[indices[k]] for k in batch.indices],
                                         [crops[indices[k]] for k in batch.indices], batch)
                         for batch in plan.batches]
            for i, tokens in zip(indices, plan.in_queue_order(per_batch)):
                out[i] = tokens
        return out

    def _run_batch(self, global_views, crops, batch) -> list[PathTokens]:
        """One planned batch: stack each path's views, run the paths, split per image."""
        views = [v for v in global_views if v is not None]
        tiles = [c for c in crops if c is not None]
        for path, plan, parts in ((self.global_path, batch.global_path, views),
                                  (self.local_path, batch.local_path, tiles)):
            if path is not None and not parts:
                path.stats.record(plan, replayed=False)  # counted as skipped
        global_tokens = crop_tokens = None
        if tiles and views:
            global_tokens, crop_tokens = self._run_both(views, batch.global_path, tiles, batch.local_path)
        elif views:
            global_tokens = self.global_path.run(views, batch.global_path)
        elif tiles:
            crop_tokens = self.local_path.run(tiles, batch.local_path)
        per_global = iter(global_tokens if global_tokens is not None else ())
        per_crops = iter(crop_tokens.split([len(c) for c in tiles]) if crop_tokens is not None else ())
        return [PathTokens(None if v is None else next(per_global), None if c is None else next(per_crops))
                for v, c in zip(global_views, crops)]

    def _run_both(self, global_views, global_plan, crops, local_plan):
        """Both paths of one batch. On CUDA the local path is staged and launched first, on the
        current stream (a page's six crops are its longer path), then the global path on a side
        stream: at small batches neither fills the GPU alone (a batch-1 page is one 1024² view
        and six 640² crops), and each path has its own graph pool and buffers, so the two
        replays overlap. `overlap_paths=False`: one stream, global first (the reference twin)."""
        if self.encoder.device.type != "cuda" or not self.overlap_paths:
            return (self.global_path.run(global_views, global_plan),
                    self.local_path.run(crops, local_plan))
        current = torch.cuda.current_stream(self.encoder.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.encoder.device)
        inputs_ready = current.record_event()  # what the current stream staged so far (views)
        local_tokens = self.local_path.run(crops, local_plan)
        self._side.wait_event(inputs_ready)  # not on the local replay: the paths overlap
        with torch.cuda.stream(self._side):
            global_tokens = self.global_path.run(global_views, global_plan)
        current.wait_stream(self._side)
        # Made on the side stream, used and freed on the current one: keep the allocator from
        # handing its memory back to the side stream before the current stream is done with it.
        global_tokens.record_stream(current)
        return global_tokens, local_tokens
