"""Decode attention over the paged KV cache (Triton, CUDA): one query per (row, head).

Split-K in two kernels, the flash-decoding pattern (our own kernel; the shape of sglang's and
vLLM's Triton decode attention):
  1. program (row, head, split) walks its share of the row's pages, reading only pages that hold
     the row's positions 0..p (an unpaged cache reads the whole context bucket for every row),
     with an online softmax; it writes an unnormalised partial output, its max and its sum;
  2. program (row, head) folds the splits into the output, written as [S, H, d] (the layout
     the output projection reads).
A program walks at most SPLIT_TOKENS of its row: short dependent loops and many programs keep
enough loads in flight (one program walking a whole 1,280-token row reached ~0.3 TB/s on an
H200). Splits past a row's position return at once. The number of splits depends only on the
context bucket, static in a graph, so replays never resize.
Unlimited-OCR's R-SWA (`window`; decoder/model.py) is a gap in each row's positions: a row at
position p with a prompt of P tokens attends to 0..P-1 and max(P, p-window+1)..p. A program walks
its share of the two ranges in two loops and never reads the gap (a split wholly inside it
writes an empty part, which the combine weighs 0), so a long generation reads the prompt and
`window` positions per step, not its whole context. The prompt lengths are a tensor, read on the
device: graphs replay them like the positions.
The reference twin is `kv_cache.gathered_decode_attention` (tests compare the two).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel

from .pages import PAGE_TOKENS

# Tuned on an H200 (bench/tune/tune_paged_attention.py; results in bench/results/): tokens per loop
# step, the most tokens one program walks, warps, pipeline stages.
BLOCK_T, SPLIT_TOKENS, NUM_WARPS, NUM_STAGES = 32, 256, 2, 2
# Fewer tokens a program for a few rows: at one row a decode step launched 10 heads x a few
# live splits, each walking 256 tokens in 8 dependent steps, and its split kernel took 20 us a
# layer where its bytes take ~2 (H100 profile, decoder-realistic-fusions-h100-2026-12-05). Rows
# up to the first number walk at most the second's tokens. Set by that count, not yet tuned: the
# tuner's timings were of eager launches, which hide it.
SMALL_BATCH_SPLITS = ((4, 64), (16, 128))


def split_tokens_for(rows: int) -> int:
    """The most tokens one program walks, for a decode step of `rows` rows."""
    return next((split for most, split in SMALL_BATCH_SPLITS if rows <= most), SPLIT_TOKENS)


@triton.jit
def _walk(q, K, V, row_table, h, start, end, m_i, l_i, acc, sk_p, sk_h, sk_t,
          HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """The online softmax over the row's positions start..end-1 (every block holds at least one
    of them: a block of none would turn the running max into NaN)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK)
    for t0 in range(start, end, BLOCK):
        tokens = t0 + offs_t
        valid = tokens < end
        # Each token's page (a cached gather from the row's table), then its keys and values.
        page = tl.load(row_table + tokens // PAGE, mask=valid, other=0).to(tl.int64)
        offs = (page * sk_p + h * sk_h + (tokens % PAGE) * sk_t)[:, None] + offs_d[None, :]
        k = tl.load(K + offs, mask=valid[:, None], other=0.0)
        v = tl.load(V + offs, mask=valid[:, None], other=0.0)
        scores = tl.sum(k.to(tl.float32) * q[None, :], 1)
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _split_kernel(Q, K, V, TABLE, POS, PROMPT, O_PART, ML_PART,
                  sq_s, sq_h, sk_p, sk_h, sk_t, st_s, so_s, so_h, so_c, sml_s, sml_h, sml_c,
                  sm_scale, split_tokens, window,
                  HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                  SLIDING: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    pos = tl.load(POS + s)
    first = c * split_tokens
    if first <= pos:  # splits past the row's positions do nothing (the combine skips them)
        last = tl.minimum(first + split_tokens, pos + 1)
        offs_d = tl.arange(0, HEAD_DIM)
        log2e: tl.constexpr = 1.4426950408889634
        q = tl.load(Q + s * sq_s + h * sq_h + offs_d).to(tl.float32) * (sm_scale * log2e)
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        row_table = TABLE + s * st_s
        if SLIDING:  # R-SWA: positions gap_start..gap_end-1 (past the prompt, before the window) unseen
            gap_start = tl.load(PROMPT + s).to(pos.dtype)
            gap_end = tl.maximum(gap_start, pos - window + 1)
            m_i, l_i, acc = _walk(q, K, V, row_table, h, first, tl.minimum(last, gap_start), m_i, l_i,
                                  acc, sk_p, sk_h, sk_t, HEAD_DIM, PAGE, BLOCK)
            m_i, l_i, acc = _walk(q, K, V, row_table, h, tl.maximum(first, gap_end), last, m_i, l_i,
                                  acc, sk_p, sk_h, sk_t, HEAD_DIM, PAGE, BLOCK)
        else:
            m_i, l_i, acc = _walk(q, K, V, row_table, h, first, last, m_i, l_i, acc,
                                  sk_p, sk_h, sk_t, HEAD_DIM, PAGE, BLOCK)
        tl.store(O_PART + s * so_s + h * so_h + c * so_c + offs_d, acc)
        ml = ML_PART + s * sml_s + h * sml_h + c * sml_c
        tl.store(ml, m_i)
        tl.store(ml + 1, l_i)


@triton.jit
def _combine_kernel(O_PART, ML_PART, POS, OUT, n_splits, split_tokens,
                    so_s, so_h, so_c, sml_s, sml_h, sml_c, sout_s, sout_h,
                    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_c = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = (offs_c < n_splits) & (offs_c * split_tokens <= tl.load(POS + s))  # splits that ran
    ml = ML_PART + s * sml_s + h * sml_h + offs_c * sml_c
    m = tl.load(ml, mask=valid, other=-float("inf"))
    l_part = tl.load(ml + 1, mask=valid, other=0.0)
    # Split 0 always saw position 0 (a prompt position, or the row's only one): the max is
    # finite; the rest, and R-SWA splits wholly in the gap (max -inf, sum 0), weigh 0.
    w = tl.exp2(m - tl.max(m, 0))
    parts = tl.load(O_PART + s * so_s + h * so_h + offs_c[:, None] * so_c + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(l_part * w, 0)
    tl.store(OUT + s * sout_s + h * sout_h + offs_d, out.to(OUT.dtype.element_ty))


def paged_decode_attention(q, k_pages, v_pages, table, positions, kv_len: int,
                           block_t: int = BLOCK_T, split_tokens: int | None = None,
                           num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                           prompt_lens=None, window: int | None = None):
    """q [S, H, d]; k_pages, v_pages [pages, H, PAGE_TOKENS, d] (one layer); table [S, >=n] int32
    page ids; positions [S] (row s attends to its positions 0..positions[s] < kv_len) ->
    [S, H, d] in q's dtype. R-SWA: `window` and `prompt_lens` [S] (row s then attends to
    0..prompt_lens[s]-1 and its last `window` positions only). The other arguments are the
    tuning knobs (module defaults; `split_tokens` by default from the rows: split_tokens_for)."""
    s, h, d = q.shape
    split_tokens = split_tokens or split_tokens_for(s)
    assert k_pages.shape[-2:] == (PAGE_TOKENS, d) and k_pages.stride(-1) == 1 and q.stride(-1) == 1
    assert split_tokens % block_t == 0
    sliding = window is not None
    assert not sliding or (prompt_lens is not None and prompt_lens.shape == positions.shape), \
        "R-SWA attention needs each row's prompt length"
    n_splits = -(-kv_len // split_tokens)
    o_part = torch.empty(s, h, n_splits, d, device=q.device, dtype=torch.float32)
    ml_part = torch.empty(s, h, n_splits, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(s, h, d, device=q.device, dtype=q.dtype)
    launch_kernel(
        _split_kernel, (s, h, n_splits), q, k_pages, v_pages, table, positions,
        prompt_lens if sliding else positions, o_part, ml_part,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        ml_part.stride(0), ml_part.stride(1), ml_part.stride(2),
        1.0 / math.sqrt(d), split_tokens, window if sliding else 0, HEAD_DIM=d, PAGE=PAGE_TOKENS,
        BLOCK=block_t, SLIDING=sliding, num_warps=num_warps, num_stages=num_stages)
    launch_kernel(
        _combine_kernel, (s, h), o_part, ml_part, positions, out, n_splits, split_tokens,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        ml_part.stride(0), ml_part.stride(1), ml_part.stride(2), out.stride(0), out.stride(1),
        HEAD_DIM=d, SPLITS=triton.next_power_of_2(n_splits), num_warps=4)
    return out
