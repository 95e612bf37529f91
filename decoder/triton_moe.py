"""The routed experts of one MoE layer in two Triton kernels (CUDA; Triton's interpreter on CPU).

`Experts.forward` sorts the (token, choice) pairs by expert and finds where each expert's rows
end; then these two kernels replace the gather of the tokens' activations, the two grouped
matmuls, SiLU, the multiply and the weighted index-add (about ten kernels a layer):
  1. `_gate_up_kernel`: a program takes up to BLOCK_M sorted rows of one expert and a BLOCK_N
     slice of the intermediate width; it gathers its rows' activations itself, reads the
     expert's gate and up slices once and stores SiLU(gate) * up (computed in fp32);
  2. `_down_kernel`: the same blocks over the hidden width; it multiplies each row by its
     routing weight and adds it into its token's fp32 output (atomic adds: the sum over a
     token's experts), or, for large batches (prefills), stores it in the row's own place of
     an fp32 [N, top_k, H] buffer that one sum then reduces (no atomics, contention-free).
A program finds its expert from the experts' row ends (no padding pass): the grid is sized from
shapes alone (at most one partial block per expert), so CUDA graphs can hold it, and programs
past the last expert's rows return at once. The reference twin is the grouped-matmul path
(`Experts.kernel = "grouped_mm"`; tests compare the two). Numerics: the reference rounds gate,
up, SiLU(gate) * up and each expert's output to the activation dtype; these kernels keep fp32
until the intermediate's store and the output's sum.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel


class Tile(NamedTuple):
    """One kernel's tuning knobs: sorted rows, output columns and reduction step per program,
    warps, software-pipelining stages; for the down kernel also how rows reach their token's
    sum (atomic adds, or stores and one sum after)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    atomic_add: bool = True


# Picked by bench/tune/tune_moe_kernel.py on an H200 (2026-12-02): the least
# time summed over decode batches of 1-256 tokens, within 5% of each batch's own best tile from
# 64 tokens on. One row block covers a decode step's ~24 rows per expert at 256 sequences.
GATE_UP_TILE = Tile(32, 64, 128)
DOWN_TILE = Tile(32, 64, 64)
# From PREFILL_ROWS sorted rows on (a prefill's thousands of rows per expert), picked by
# bench/tune/tune_moe_kernel.py --prefill 1 (2026-12-02): the least
# time summed over 1,024-16,384 tokens. The down kernel's stores beat its best atomic adds at
# every size (738 against 1,096 us at 16,384 tokens); the experts forward reaches 384 TFLOP/s
# there, 1.9x the grouped matmuls.
PREFILL_ROWS = 4096
PREFILL_GATE_UP_TILE = Tile(128, 128, 64, 8, 3)
PREFILL_DOWN_TILE = Tile(128, 256, 64, 8, 4, atomic_add=False)
# Up to SMALL_ROWS sorted rows (8 tokens with the two shared experts: one page alone decodes 1),
# tiles of their own (bench/tune/tune_moe_kernel.py --small 1 picks them): there the decode
# tiles leave most SMs idle (one token's 8 experts x 14 gate/up column blocks: 112 programs on an
# H100's 132 SMs) and the two kernels took 18 and 16 us a layer against ~12 and ~6 us of bytes;
# narrow column blocks on 2 warps take 12.7 and 10.6 (H100). None: the decode tiles. (GPU tests
# that set DOWN_TILE set SMALL_DOWN_TILE too.)
SMALL_ROWS = 64
SMALL_GATE_UP_TILE: Tile | None = Tile(16, 32, 128, 2, 4)
SMALL_DOWN_TILE: Tile | None = Tile(16, 32, 128, 2, 2)


@triton.jit
def _program_tile(ENDS, ORDER, n_cols, E: tl.constexpr, E_POW2: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert (E: none, past the last expert's rows), its sorted rows and their
    (token, choice) pairs, and its output columns, with their masks."""
    offs_e = tl.arange(0, E_POW2)
    in_range = offs_e < E
    ends = tl.load(ENDS + offs_e, mask=in_range, other=0)
    starts = tl.load(ENDS + offs_e - 1, mask=in_range & (offs_e > 0), other=0)
    blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
    through = tl.cumsum(blocks, 0)  # blocks of experts 0..e
    pid = tl.program_id(0)
    expert = tl.sum((through <= pid).to(tl.int32), 0)
    mine = offs_e == expert  # picks one expert's entries out of the vectors
    block_in_expert = pid - tl.sum(tl.where(mine, through - blocks, 0), 0)
    rows = tl.sum(tl.where(mine, starts, 0), 0) + block_in_expert * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.sum(tl.where(mine, ends, 0), 0)
    pair = tl.load(ORDER + rows, mask=row_ok, other=0)  # token * TOP_K + choice
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, row_ok, pair, cols, cols < n_cols


@triton.jit
def _expert_weights(W, WS, expert, sw_e, sw_n, shared_e, sws_n, ROUTED: tl.constexpr, N_SHARED: tl.constexpr):
    """Where this expert's weight matrix starts and its row stride: routed experts in W [E, rows,
    K]; shared ones (ids ROUTED..) in WS, one matrix of every shared expert's rows, expert s's
    starting `shared_e` elements after expert s-1's (module docstring)."""
    if N_SHARED > 0:
        routed = expert < ROUTED
        return (tl.where(routed, W + expert.to(tl.int64) * sw_e, WS + (expert - ROUTED).to(tl.int64) * shared_e),
                tl.where(routed, sw_n, sws_n))
    return W + expert.to(tl.int64) * sw_e, sw_n


@triton.jit
def _gate_up_kernel(X, W, WS, ENDS, ORDER, OUT, hidden, inter, sx, sw_e, sw_n, sws_n, so,
                    TOP_K: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr, ROUTED: tl.constexpr,
                    N_SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    expert, rows, row_ok, pair, cols, col_ok = _program_tile(ENDS, ORDER, inter, E, E_POW2, BLOCK_M, BLOCK_N)
    if expert < E:
        token = pair // TOP_K
        # A shared expert s: gate rows s*I.. and up rows (N_SHARED + s)*I.. of the shared MLP's
        # packed [2 * N_SHARED * I, H]; a routed one: gate rows 0.. and up rows I.. of its own.
        w, sw_n = _expert_weights(W, WS, expert, sw_e, sw_n, inter * sws_n, sws_n, ROUTED, N_SHARED)
        up_rows = inter if N_SHARED == 0 else tl.where(expert < ROUTED, inter, inter * N_SHARED)
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a = tl.load(X + token[:, None] * sx + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            w_gate = tl.load(w + cols[None, :] * sw_n + ks[:, None], mask=w_ok, other=0.0)
            w_up = tl.load(w + (up_rows + cols)[None, :] * sw_n + ks[:, None], mask=w_ok, other=0.0)
            gate = tl.dot(a, w_gate, gate)
            up = tl.dot(a, w_up, up)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(OUT + rows[:, None] * so + cols[None, :], act.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(A, W, WS, ENDS, ORDER, ROUTE_W, OUT, inter, hidden, sa, sw_e, sw_n, sws_n, so,
                 TOP_K: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr, ROUTED: tl.constexpr,
                 N_SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, ATOMIC_ADD: tl.constexpr):
    expert, rows, row_ok, pair, cols, col_ok = _program_tile(ENDS, ORDER, hidden, E, E_POW2, BLOCK_M, BLOCK_N)
    if expert < E:
        # A shared expert s: columns s*I.. of the shared MLP's down [H, N_SHARED * I].
        w, sw_n = _expert_weights(W, WS, expert, sw_e, sw_n, inter, sws_n, ROUTED, N_SHARED)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a = tl.load(A + rows[:, None] * sa + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_down = tl.load(w + cols[None, :] * sw_n + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                             other=0.0)
            acc = tl.dot(a, w_down, acc)
        acc = acc * tl.load(ROUTE_W + pair, mask=row_ok, other=0.0)[:, None]
        if ATOMIC_ADD:  # OUT [N, H]: this row's token
            tl.atomic_add(OUT + (pair // TOP_K)[:, None] * so + cols[None, :], acc,
                          mask=row_ok[:, None] & col_ok[None, :])
        else:  # OUT [N * TOP_K, H]: this (token, choice) pair's own row
            tl.store(OUT + pair[:, None] * so + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def _launch_meta(tile: Tile, top_k: int, experts: int, n_shared: int) -> dict:
    return dict(TOP_K=top_k, E=experts + n_shared, E_POW2=triton.next_power_of_2(experts + n_shared),
                ROUTED=experts, N_SHARED=n_shared, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages)


def module_tiles(rows: int) -> tuple[Tile, Tile]:
    """The module's (gate/up, down) tiles for `rows` sorted rows, read at call time (the tuner
    sets them for its process)."""
    if rows >= PREFILL_ROWS:
        return PREFILL_GATE_UP_TILE, PREFILL_DOWN_TILE
    if rows <= SMALL_ROWS:
        return SMALL_GATE_UP_TILE or GATE_UP_TILE, SMALL_DOWN_TILE or DOWN_TILE
    return GATE_UP_TILE, DOWN_TILE


def _row_blocks(rows: int, experts: int, block_m: int) -> int:
    return triton.cdiv(rows, block_m) + experts  # at most one partial block per expert


def gate_up_silu(x, order, ends, gate_up, top_k: int, tile: Tile | None = None,
                 shared_gate_up: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(gate) * up of each sorted (token, choice) row under its expert: [N * top_k, I]."""
    tile = tile or module_tiles(order.numel())[0]
    experts, two_inter, hidden = gate_up.shape
    inter, rows = two_inter // 2, order.numel()
    shared = gate_up if shared_gate_up is None else shared_gate_up
    n_shared = 0 if shared_gate_up is None else shared.shape[0] // two_inter
    act = torch.empty(rows, inter, device=x.device, dtype=x.dtype)
    launch_kernel(
        _gate_up_kernel, (_row_blocks(rows, experts + n_shared, tile.block_m), triton.cdiv(inter, tile.block_n)),
        x, gate_up, shared, ends, order, act, hidden, inter, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), shared.stride(0), act.stride(0), **_launch_meta(tile, top_k, experts, n_shared))
    return act


def down_combine(act, order, ends, route_weights, down, tokens: int, top_k: int,
                 tile: Tile | None = None, shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """Each sorted row's down projection times its routing weight, summed per token: [N, H] fp32."""
    tile = tile or module_tiles(order.numel())[1]
    experts, hidden, inter = down.shape
    shared = down if shared_down is None else shared_down
    n_shared = 0 if shared_down is None else shared.shape[1] // inter
    if tile.atomic_add:
        out = torch.zeros(tokens, hidden, device=act.device, dtype=torch.float32)
    else:  # every (token, choice) row is stored: nothing to zero
        out = torch.empty(tokens * top_k, hidden, device=act.device, dtype=torch.float32)
    launch_kernel(
        _down_kernel, (_row_blocks(order.numel(), experts + n_shared, tile.block_m), triton.cdiv(hidden, tile.block_n)),
        act, down, shared, ends, order, route_weights, out, inter, hidden, act.stride(0), down.stride(0),
        down.stride(1), shared.stride(0), out.stride(0), ATOMIC_ADD=tile.atomic_add,
        **_launch_meta(tile, top_k, experts, n_shared))
    return out if tile.atomic_add else out.view(tokens, top_k, hidden).sum(1)


def fused_experts(x, route_weights, order, ends, gate_up, down, top_k: int,
                  gate_up_tile: Tile | None = None, down_tile: Tile | None = None,
                  shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [N, H]; route_weights [N * top_k] fp32 (flattened (token, choice) order); order [N *
    top_k] the pairs sorted by expert; ends [E] int32 where each expert's sorted rows end;
    gate_up [E, 2I, H]; down [E, H, I] -> sum over each token's choices of weight * expert(x),
    [N, H] in `out_dtype` (default x's; fp32: the sum as accumulated, no rounding copy). The
    tiles are the two kernels' tuning knobs (default: the module's).
    `shared`: the shared experts' MLP weights as stored (gate_up [2 S I, H], gate rows then up
    rows; down [H, S I]), read in place as experts E..E+S-1 of I columns each: each token's
    pairs then include one per shared expert (`top_k` counts them; `ends` has E + S entries)."""
    assert x.stride(1) == gate_up.stride(2) == down.stride(2) == 1 and order.numel() == x.shape[0] * top_k
    gate_up_shared, down_shared = shared or (None, None)
    assert shared is None or (gate_up_shared.is_contiguous() and down_shared.is_contiguous())
    act = gate_up_silu(x, order, ends, gate_up, top_k, gate_up_tile, gate_up_shared)
    return down_combine(act, order, ends, route_weights, down, x.shape[0], top_k, down_tile,
                        down_shared).to(out_dtype or x.dtype)
