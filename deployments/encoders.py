"""GlobalEncoder and LocalEncoder: one deployment class, one path each.

A replica loads the encoder, builds its path's CUDA graphs in `__init__` (the user-code event
loop thread, which is also where `@serve.batch` handlers run: capture and replay share a thread),
and batches views across requests, counting views rather than requests. One batch at a time
(`max_concurrent_batches=1`): graphs own their static buffers. On CPU it runs eagerly.
"""
from __future__ import annotations

from collections import Counter

import ray
import torch
from ray import serve

from encoder import load_encoder
from encoder.graphs import PathGraphs
from scheduler import default_budgets

from .model_source import cap_gpu_memory, device_and_dtype, resolve_checkpoint
from .wire import Wire, from_wire, to_wire

VIEW_SHAPES = {"global": (3, 1024, 1024), "local": (3, 640, 640)}


def _views(requests: list[Wire]) -> int:
    return sum(r[0].shape[0] for r in requests)


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.25})
class PathEncoder:
    def __init__(self, path: str, checkpoint: str | None = None, max_images: int = 32,
                 use_graphs: bool | None = None, gpu_memory_fraction: float | None = None,
                 max_graph_memory_gb: float | None = None):
        if path not in VIEW_SHAPES:
            raise ValueError(f"path must be 'global' or 'local', got {path!r}")
        cap_gpu_memory(gpu_memory_fraction)
        device, dtype = device_and_dtype()
        directory, self.model_label = resolve_checkpoint(checkpoint)
        encoder = load_encoder(directory, device=device, dtype=dtype)
        budgets = default_budgets(max_images)[0 if path == "global" else 1]
        forward = encoder.forward_global if path == "global" else encoder.forward_local
        self.runner = PathGraphs(path, forward, budgets, VIEW_SHAPES[path], device, use_graphs,
                                 max_graph_memory_gb)
        self.encode_batch.set_max_batch_size(budgets.max_units)
        self.request_batches: Counter = Counter()  # requests per executed batch
        self.broken: str | None = None

    # A short wait: a lone request pays it in full, while under load batches fill up anyway
    # during the previous batch's GPU work.
    @serve.batch(max_batch_size=192, batch_wait_timeout_s=0.002, max_concurrent_batches=1,
                 batch_size_fn=_views)
    async def encode_batch(self, requests: list[Wire]) -> list[Wire]:
        return self._run_batch(requests)

    def _run_batch(self, requests: list[Wire]) -> list[Wire]:
        try:
            return self._encode_batch(requests)
        except RuntimeError as e:
            if "CUDA" in str(e):  # a CUDA fault poisons the context: let Serve replace us
                self.broken = f"{type(e).__name__}: {e}"
            raise

    def _encode_batch(self, requests: list[Wire]) -> list[Wire]:
        self.request_batches[len(requests)] += 1
        pixels = [from_wire(r) for r in requests]
        out = [None] * len(requests)
        # Views of one size run together (other modes send 512/640/1280 global views), in
        # chunks no larger than the biggest budget.
        by_shape: dict[tuple, list[int]] = {}
        for i, p in enumerate(pixels):
            by_shape.setdefault(tuple(p.shape[1:]), []).append(i)
        for indices in by_shape.values():
            views = torch.cat([pixels[i] for i in indices])
            step = self.runner.budgets.max_units
            tokens = torch.cat([self.runner.run(views[s:s + step]) for s in range(0, len(views), step)])
            for i, part in zip(indices, tokens.split([len(pixels[i]) for i in indices])):
                out[i] = to_wire(part)
        return out

    async def encode(self, pixels: Wire) -> Wire:
        """uint8 views [n, 3, S, S] of one image -> its tokens [n, T, D]."""
        return await self.encode_batch(pixels)

    def check_health(self):
        if self.broken:
            raise RuntimeError(f"{self.runner.name} encoder unusable after {self.broken}")

    def stats(self) -> dict:
        return {"path": self.runner.name, "model": self.model_label, "gpu_ids": ray.get_gpu_ids(),
                "requests_per_batch": dict(sorted(self.request_batches.items())),
                **self.runner.stats.as_dict(), "capture": self.runner.report.as_dict()}
