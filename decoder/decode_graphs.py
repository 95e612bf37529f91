"""CUDA graphs of the decode step: one per (batch bucket, context bucket), replayed each step.

At one to a few dozen sequences a decode step is hundreds of small kernels, so Python launch
overhead, not the GPU, sets the pace. Each graph runs the same `Decoder.forward` as the eager
step on static buffers (newest token and position of each running sequence) and attends over a
fixed cache length; a step replays the smallest graph holding its sequences and its longest
context. Rows past the running sequences feed token 0 at position 0; their page-table rows point
at the KV cache's scratch page (rows stay compact, so rows >= S hold no pages).
Captured lazily on the thread that steps the engine (AsyncEngine's), by the first step.
bf16 on CUDA only: the MoE's grouped GEMM has no host sync there (the fp32 fallback does).
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time

import torch

from common.cuda_graphs import capture_graph

from .kv_cache import KVCache
from .model import CacheStep, Decoder

log = logging.getLogger(__name__)
# Beyond 64 the buckets step by at most 1.33x, so 128 sequences replay the 128 graph, never 256.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)
# The reference (gathered) attention reads a bucket's whole length (masked past each row's
# position), and at 64 sequences reading keys and values costs about as much as reading the
# weights: its buckets stay within 1.25-1.5x of each other. The paged kernel reads each row's own
# pages whatever the bucket, which only sets how many split programs are launched (those past a
# row's position return at once): two buckets, one for a page's OCR (a ~1,000-token prompt and
# up to ~1,000 generated) and the context limit, halve the graphs a replica captures at start-up
# (28 instead of 56 at 256 sequences, ~0.1 s each on an H200).
CONTEXT_BUCKETS = (512, 768, 1024, 1280, 1536, 2048, 3072, 4096, 6144, 8192)
KERNEL_CONTEXT_BUCKETS = (2048, 8192)


def buckets(candidates, limit: int) -> list[int]:
    return sorted({c for c in candidates if c < limit} | {limit})


def batch_buckets(max_batch: int) -> list[int]:
    return buckets(BATCH_BUCKETS, max_batch)


def context_buckets(cache: KVCache, max_len: int) -> list[int]:
    return buckets(KERNEL_CONTEXT_BUCKETS if cache.kernel == "triton" else CONTEXT_BUCKETS, max_len)


def graph_shapes(cache: KVCache, max_batch: int, max_len: int) -> list[tuple[int, int]]:
    """(batch bucket, context bucket) of every graph `DecodeGraphs` captures, largest first."""
    return sorted(itertools.product(batch_buckets(max_batch), context_buckets(cache, max_len)), reverse=True)


def decode_step(model: Decoder, cache: KVCache, batch: int, context: int):
    """The decode step a graph of this shape runs, on zeroed static inputs: (step() -> logits
    [batch, vocab], tokens [batch, 1], positions [batch], prompt_lens [batch] or None when the
    model has no R-SWA). Rows at position 0 with no pages attend to and write the cache's
    scratch page only."""
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=model.device)
    positions = torch.zeros(batch, dtype=torch.long, device=model.device)
    prompt_lens = (torch.zeros(batch, dtype=torch.long, device=model.device)
                   if model.args.sliding_window is not None else None)

    def step():
        return model(input_ids=tokens, positions=positions[:, None],
                     step=CacheStep(cache, positions=positions, kv_len=context,
                                    prompt_lens=prompt_lens))[:, -1]
    return step, tokens, positions, prompt_lens


class DecodeGraphs:
    def __init__(self, model: Decoder, cache: KVCache, max_batch: int, max_len: int):
        if not (model.device.type == "cuda" and model.dtype == torch.bfloat16):
            raise ValueError("decode graphs need a bf16 model on CUDA")
        # Not torch.compile'd: Inductor's step replayed at 30.5 ms against 6.45 ms plain (64
        # sequences, 1,280 cached tokens, H200, as a profile measured it).
        self.model, self.cache = model, cache
        self.batches, self.contexts = batch_buckets(max_batch), context_buckets(cache, max_len)
        self.graphs: dict[tuple[int, int], tuple] = {}
        # Host staging for each step's tokens, positions (and R-SWA's prompt lengths): pinned,
        # so the copies to the static inputs are asynchronous (the step's only host sync stays
        # the pick of its tokens). Two, used in turn, each refilled once its copies are done
        # (`_copied`): a step that launches the next before reading its picks has not waited.
        self._staged = [torch.zeros(3, self.batches[-1], dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._copied: list = [None, None]
        self._turn = 0
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(model.device)  # own cuBLAS workspace (see capture_graph)
        for key in graph_shapes(cache, max_batch, max_len):  # largest first: the rest reuse its pool
            self.graphs[key] = self._capture(*key, pool, stream)
        log.info("decode graphs: %d captured in %.1f s", len(self.graphs), time.perf_counter() - start)

    @torch.inference_mode()
    def _capture(self, batch: int, context: int, pool, stream):
        step, tokens, positions, prompt_lens = decode_step(self.model, self.cache, batch, context)
        graph, logits = capture_graph(step, pool, device=self.model.device, stream=stream)
        return graph, tokens, positions, prompt_lens, logits

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int],
            prompt_lens: list[int] | None = None) -> torch.Tensor:
        """Logits [S, vocab] for S running sequences (a fresh tensor, safe across replays);
        `tokens`: a list, or a tensor on the device (the last step's picks, not read back yet);
        `prompt_lens`: each one's prompt length, for R-SWA models."""
        n = len(positions)
        batch = self.batches[bisect.bisect_left(self.batches, n)]
        context = self.contexts[bisect.bisect_left(self.contexts, max(positions) + 1)]
        graph, static_tokens, static_positions, static_prompt_lens, logits = self.graphs[(batch, context)]
        assert (static_prompt_lens is None) == (prompt_lens is None), "R-SWA graphs take prompt_lens"
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # done long ago in practice: two steps back
        # Rows past n feed token 0 at position 0 (free slots).
        staged = self._staged[turn][:, :batch]
        staged.zero_()
        on_device = torch.is_tensor(tokens)
        if not on_device:
            staged[0, :n] = torch.tensor(tokens)
        staged[1, :n] = torch.tensor(positions)
        static_tokens[:, 0].copy_(staged[0], non_blocking=True)
        if on_device:
            static_tokens[:n, 0].copy_(tokens)
        static_positions.copy_(staged[1], non_blocking=True)
        if static_prompt_lens is not None:
            staged[2, :n] = torch.tensor(prompt_lens)
            static_prompt_lens.copy_(staged[2], non_blocking=True)
        self._copied[turn] = torch.cuda.current_stream(self.model.device).record_event()
        graph.replay()
        return logits[:n].clone()  # clone: the next replay overwrites this buffer
