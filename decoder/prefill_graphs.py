"""CUDA graphs of a one-sequence prefill, one per token bucket, replayed instead of its eager
forward.

A page's prefill (~1,000 tokens) is ~560 kernels whose GPU work takes ~6 ms on an H100, but its
eager forward took 20-26 ms of host time to launch them (decoder_bench's prefill profile,
decoder-realistic-prefill-order-h100-2026-12-05): with 256 sequences decoding, the steps that
prefill a page were still ~12 ms longer than the others, and 43% of the time. Each graph runs
the same `Decoder.forward` as the eager prefill on static buffers: the embeddings (prompt and
image) right-padded with zeros to the bucket, the position of the last real token (its logits
are the result), and the sequence's row of the page table, which the cache writes read
(`CacheStep.table`). Padded positions past the row's pages write the scratch page; those inside
its last page are masked until decoding overwrites them, as in a right-padded group. Causal
attention keeps the real positions from seeing the padding.

Only one sequence at a time (most steps' prefills once the batch is full: one page arrives as
another leaves), of a model without R-SWA, up to the largest bucket; everything else runs
eagerly. On a CPU (`use_graphs=False`) the same buffers and forward run eagerly: the path's
equality test runs there; the graphs' on a GPU.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from common.cuda_graphs import capture_graph

from .kv_cache import KVCache
from .model import CacheStep, Decoder

log = logging.getLogger(__name__)
# Token buckets: a page's prompt is 293-953 image tokens plus the text (bench/workload.py);
# 128 apart, so a prefill computes at most 127 padded positions.
BUCKETS = (256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1536)


class PrefillGraphs:
    def __init__(self, model: Decoder, cache: KVCache, max_len: int, buckets=BUCKETS,
                 use_graphs: bool = True):
        if model.args.sliding_window is not None:
            raise ValueError("prefill graphs run plain causal attention; R-SWA models prefill eagerly")
        if use_graphs and not (model.device.type == "cuda" and model.dtype == torch.bfloat16):
            raise ValueError("prefill graphs need a bf16 model on CUDA")
        self.model, self.cache = model, cache
        self.buckets = [b for b in sorted(buckets) if b <= max_len] or [max_len]
        device = model.device
        self.embeds = torch.zeros(1, self.buckets[-1], model.args.hidden, device=device, dtype=model.dtype)
        self.last = torch.zeros(1, dtype=torch.long, device=device)
        self.table = torch.zeros(1, cache.table.shape[1], dtype=cache.table.dtype, device=device)
        self.graphs: dict[int, tuple] = {}
        if not use_graphs:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)  # own cuBLAS workspace (see capture_graph)
        with torch.inference_mode():  # the table's zeros: every write goes to the scratch page
            for bucket in reversed(self.buckets):  # largest first: the rest reuse its pool
                self.graphs[bucket] = capture_graph(lambda b=bucket: self._forward(b), pool,
                                                    device=device, stream=stream)
        log.info("prefill graphs: %d captured in %.1f s", len(self.graphs), time.perf_counter() - start)

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(inputs_embeds=self.embeds[:, :bucket],
                          step=CacheStep(self.cache, slot=0, table=self.table), logits_at=self.last)

    def fits(self, tokens: int) -> bool:
        return tokens <= self.buckets[-1]

    def run(self, embeds: torch.Tensor, row: int) -> torch.Tensor:
        """embeds [1, T, hidden] of the sequence in cache row `row` (its pages reserved, the table
        synced) -> the logits of its last position [1, vocab], a fresh tensor."""
        tokens = embeds.shape[1]
        bucket = self.buckets[bisect.bisect_left(self.buckets, tokens)]
        self.embeds[:, :tokens].copy_(embeds)
        self.embeds[:, tokens:bucket].zero_()
        self.last.fill_(tokens - 1)
        self.table.copy_(self.cache.table[row:row + 1])
        if not self.graphs:  # CPU: the same buffers, eagerly
            return self._forward(bucket)[:, -1]
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:, -1].clone()  # clone: the next replay overwrites this buffer
