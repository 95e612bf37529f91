"""A decode step's MoE routing in one Triton kernel (CUDA; Triton's interpreter on CPU).

Between the gate and the two expert kernels (decoder/triton_moe.py) the reference runs about a
dozen small kernels a layer: the activations cast to fp32 and the gate's matmul, softmax, top-k,
the scaling, the ids cast to bytes, a sort, a range and a search for where each expert's rows
end (`Gate`, `Experts.sort_rows`), and for the shared experts riding in the expert kernels two
concatenations more. In a decode step of a few sequences each is a launch that moves almost
nothing: at batch 1 a step is bound by how many kernels run, not by bytes. `route` does all of
it in one program, on one block of tokens:
  1. the gate's logits (fp32 sums of the half-precision products), softmax, the top-k by
     repeated maxima (ties: the lower expert id), weights times the routed scaling; each
     token's shared experts appended as always chosen (ids E.., weight 1); a count per expert;
  2. the counts' running sum: where each expert's rows end;
  3. the (token, choice) pairs sorted by the key (expert, pair): unique keys, so the order is
     a stable sort's of the ids.
The program holds every token, so it is for small batches (`MAX_TOKENS`); larger ones take the
reference path, where those kernels are a small share of a step. (Its first form walked the
tokens in blocks of 16 and placed the pairs by running counts, 64 at a time: 34 us a layer at 64
tokens on an H100, 10.7% of that decode step, decoder-realistic-fusions-h100-2026-12-05.)
The reference twin is `model.route_reference` (tests compare the two).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel

MAX_TOKENS = 64  # one program, one block of tokens: decode batches up to here
MIN_BLOCK_T = 16  # the smallest token block (smaller batches are masked rows of it)


class RouteTile(NamedTuple):
    """The kernel's launch knobs: hidden columns per step of the gate's matmul, warps, and
    software-pipelining stages of that loop. On an H100 none of 18 beat the default by more than
    1 us at small batches (~8 us from 1 to 16 tokens whatever the knobs: the time is the top-k,
    the sort and their barriers, not the gate's 164 KB; tune-route-kernel-h100-2026-12-06.json)."""
    block_h: int = 128
    num_warps: int = 4
    num_stages: int = 3


TILE = RouteTile()  # bench/tune/tune_route_kernel.py times the others on a GPU


@triton.jit
def _route_kernel(X, GATE, WEIGHTS, EXPERT_OF, ORDER, ENDS, n_tokens, hidden, s_x, s_gate, scaling,
                  E: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr,
                  E_POW2: tl.constexpr, ALL_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, PAIRS: tl.constexpr, IEEE: tl.constexpr):
    K_ALL: tl.constexpr = TOP_K + N_SHARED
    offs_e = tl.arange(0, E_POW2)
    offs_all = tl.arange(0, ALL_POW2)
    tokens = tl.arange(0, BLOCK_T)
    t_ok = tokens < n_tokens
    # The gate's logits, x @ gate.T in fp32: half-precision products are exact in fp32, so only
    # the order of the sums differs from the reference's fp32 matmul of the converted operands.
    logits = tl.zeros([BLOCK_T, E_POW2], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < hidden
        x = tl.load(X + tokens[:, None] * s_x + offs_h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        w = tl.load(GATE + offs_h[:, None] + offs_e[None, :] * s_gate, mask=h_ok[:, None] & (offs_e < E)[None, :],
                    other=0.0)
        if IEEE:  # fp32 activations: no TF32 rounding
            logits = tl.dot(x, w, logits, input_precision="ieee")
        else:
            logits = tl.dot(x, w, logits)
    logits = tl.where((offs_e < E)[None, :], logits, -float("inf"))  # padding experts: probability 0
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where((offs_e < E)[None, :], p, -1.0)  # padding experts are never picked
    counts = tl.zeros([ALL_POW2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        pick = tl.min(tl.where(p == best[:, None], offs_e[None, :], E_POW2), 1)
        tl.store(WEIGHTS + tokens * K_ALL + j, best * scaling, mask=t_ok)
        tl.store(EXPERT_OF + tokens * K_ALL + j, pick, mask=t_ok)
        p = tl.where(offs_e[None, :] == pick[:, None], -1.0, p)
        counts += tl.sum(((offs_all[None, :] == pick[:, None]) & t_ok[:, None]).to(tl.int32), 0)
    for j in tl.static_range(N_SHARED):
        tl.store(WEIGHTS + tokens * K_ALL + TOP_K + j, tl.full([BLOCK_T], 1.0, tl.float32), mask=t_ok)
        tl.store(EXPERT_OF + tokens * K_ALL + TOP_K + j, tl.full([BLOCK_T], E + j, tl.int32), mask=t_ok)
    shared = (offs_all >= E) & (offs_all < E + N_SHARED)
    counts += tl.where(shared, n_tokens, 0)
    tl.store(ENDS + offs_all, tl.cumsum(counts, 0), mask=offs_all < E + N_SHARED)
    tl.debug_barrier()  # the pairs' expert ids, stored above by other threads, are read below
    # The stable sort of the pairs by expert: one sort of the keys (expert, pair), unique, so
    # the pairs of one expert keep their order; pairs past the end sort last.
    pairs = tl.arange(0, PAIRS)
    p_ok = pairs < n_tokens * K_ALL
    expert = tl.load(EXPERT_OF + pairs, mask=p_ok, other=ALL_POW2)
    keys = tl.sort(expert * PAIRS + pairs)
    tl.store(ORDER + pairs, keys % PAIRS, mask=p_ok)


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int, scaling: float, n_shared: int,
          tile: RouteTile | None = None):
    """x [N, H] activations, N <= MAX_TOKENS, and the gate's weight [E, H] (the same dtype) ->
    (route_weights [N * K] fp32, order [N * K] int32, ends [E + n_shared] int32),
    K = top_k + n_shared: the (token, choice) pairs' weights (the top_k of the softmax of the
    gate's fp32 logits, times `scaling`; then 1 for each shared expert), the pairs sorted
    (stably) by expert, and where each expert's sorted rows end, as `fused_experts` takes them.
    `tile`: the launch knobs (default `TILE`)."""
    tile = tile or TILE
    n, hidden = x.shape
    experts = gate.shape[0]
    assert n <= MAX_TOKENS and gate.shape[1] == hidden and x.dtype == gate.dtype
    assert x.stride(1) == gate.stride(1) == 1
    k_all = top_k + n_shared
    weights = torch.empty(n * k_all, device=x.device, dtype=torch.float32)
    expert_of = torch.empty(n * k_all, device=x.device, dtype=torch.int32)
    order = torch.empty(n * k_all, device=x.device, dtype=torch.int32)
    ends = torch.empty(experts + n_shared, device=x.device, dtype=torch.int32)
    block_t = max(MIN_BLOCK_T, triton.next_power_of_2(n))
    launch_kernel(_route_kernel, (1,), x, gate, weights, expert_of, order, ends, n, hidden, x.stride(0),
                  gate.stride(0), scaling, E=experts, TOP_K=top_k, N_SHARED=n_shared,
                  E_POW2=max(16, triton.next_power_of_2(experts)),  # a dot's dimensions are >= 16
                  ALL_POW2=triton.next_power_of_2(experts + n_shared), BLOCK_T=block_t, BLOCK_H=tile.block_h,
                  PAIRS=max(16, triton.next_power_of_2(n * k_all)),  # the sort's keys: 16 at one token
                  IEEE=x.dtype == torch.float32, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return weights, order, ends
