"""Picking the next token on the device: greedy, or temperature / top-p sampling, per row.

`pick_tokens` is one function of tensors only (no host sync, no data-dependent shapes), so the
engine runs it eagerly or replays it from a CUDA graph per batch bucket (`SamplerGraphs`), and
both give the same tokens. Greedy rows (temperature 0) take `argmax(logits)` of exactly the
logits they would have without sampling, so greedy output is unchanged by it.

Randomness is counter-based, not a generator's state: the uniform draw for (request seed,
generated-token index, vocabulary id) is a hash of those three numbers. A seeded request
therefore samples the same tokens whatever else is in its batch, in which slot, after how many
other steps, with or without graphs. The draw becomes a token by the Gumbel-max trick: the argmax
of `logits / T - log(-log(u))` over the tokens top-p keeps is a sample of softmax(logits / T)
restricted to them.
"""
from __future__ import annotations

import torch

from common import switches

_MASK32 = 0xFFFFFFFF
# A greedy pick of few rows as two reductions, a max per chunk of the vocabulary and then the
# argmax of the chunks' maxima: torch's argmax walks a row of 129,280 logits in one block, 29 us
# at batch 1 on an H100 (2.3% of a decode step, decoder-realistic-fusions-h100-2026-12-05) for
# ~0.1 us of bytes. Both reductions return the first maximum, so the pick is argmax's, ties
# included. DEEPSEEK_OCR_SPLIT_ARGMAX=0: one argmax (the twin).
SPLIT_ARGMAX = switches.on("DEEPSEEK_OCR_SPLIT_ARGMAX")
ARGMAX_CHUNKS, SPLIT_ARGMAX_ROWS = 128, 16  # 129,280 = 128 chunks of 1,010


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of logits [rows, vocab]; for few rows in two reductions."""
    rows, vocab = logits.shape
    if not SPLIT_ARGMAX or rows > SPLIT_ARGMAX_ROWS or vocab % ARGMAX_CHUNKS:
        return logits.argmax(dim=-1)
    chunk_max, within = logits.view(rows, ARGMAX_CHUNKS, vocab // ARGMAX_CHUNKS).max(dim=-1)
    chunk = chunk_max.argmax(dim=-1, keepdim=True)
    return within.gather(1, chunk)[:, 0] + chunk[:, 0] * (vocab // ARGMAX_CHUNKS)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values below
    2^32. The multipliers are below 2^31, so no product leaves int64's range: the same bits on
    every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def uniform_draws(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 in (0, 1): a fixed function of (seed, step, token id) per row."""
    row = _mix32((_mix32(seeds & _MASK32) + steps) & _MASK32)
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32((row[:, None] + _mix32(token)[None, :]) & _MASK32) >> 8  # 24 bits: exact in fp32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def pick_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Next token per row of `logits` [rows, vocab] (banned tokens already at -inf).

    temperature [rows] float32 (0: greedy), top_p [rows] float32 in (0, 1], seeds and steps
    [rows] int64 (the request's seed and how many tokens it has generated)."""
    greedy = logits.argmax(dim=-1)
    scaled = logits.float() / temperature.clamp_min(1e-6)[:, None]
    # top-p: keep the most likely tokens until their mass reaches top_p (the one that crosses
    # it included); rows with top_p 1 keep every token (no rounding of the tail's mass).
    probs = scaled.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    gumbel = -torch.log(-torch.log(uniform_draws(seeds, steps, logits.shape[-1])))
    sampled = (scaled + gumbel).masked_fill(drop, float("-inf")).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


class SamplerGraphs:
    """`pick_tokens` captured once per batch bucket on static inputs (CUDA only): a sampling
    step replays one graph instead of launching its ~30 kernels."""

    def __init__(self, batches: list[int], vocab: int, device, pool=None):
        from common.cuda_graphs import capture_graph

        self.batches = sorted(batches)
        self.graphs = {}
        stream = torch.cuda.Stream(device)
        for batch in sorted(batches, reverse=True):  # largest first: the rest reuse its pool
            inputs = (torch.zeros(batch, vocab, device=device, dtype=torch.float32),
                      torch.zeros(batch, device=device), torch.ones(batch, device=device),
                      torch.zeros(batch, device=device, dtype=torch.int64),
                      torch.zeros(batch, device=device, dtype=torch.int64))
            graph, tokens = capture_graph(lambda inputs=inputs: pick_tokens(*inputs), pool,
                                          device=device, stream=stream)
            self.graphs[batch] = graph, inputs, tokens

    def fits(self, rows: int) -> bool:
        return rows <= self.batches[-1]

    def run(self, logits: torch.Tensor, temperature, top_p, seeds, steps) -> torch.Tensor:
        rows = logits.shape[0]
        batch = next(b for b in self.batches if b >= rows)
        graph, inputs, tokens = self.graphs[batch]
        for static, value in zip(inputs, (logits, temperature, top_p, seeds, steps)):
            static[:rows].copy_(value)
        inputs[1][rows:] = 0  # rows past the batch: greedy on stale logits, never read
        graph.replay()
        return tokens[:rows].clone()
