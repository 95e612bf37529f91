"""Flash attention with SAM's decomposed rel-pos bias added inside the kernel (Triton, CUDA).

One program owns BLOCK_M queries of one (image, window, head; unwindowed: the window is the
whole grid) and walks the window's keys ROWS rows at a time with an online softmax. The bias
of query m and key (kh, kw) is `rel_h[m, kh] + rel_w[m, kw]`. A key block is laid out as ROWS
grid rows of ROW_PAD columns (the row width W rounded up to a power of two, extra columns
masked; or, where that would waste much, W split in two power-of-two parts, each walked in
blocks of its own: a 40-wide row as 32 + 8 columns), so that
  - the rel_w part is the same [BLOCK_M, ROW_PAD] tile for every key block: loaded once;
  - the rel_h part is one value per (query, key row): a [BLOCK_M, ROWS] load per block;
no gather per score, nothing of size HW x HW ever written, and the dot products keep the real
head dim (64). Scores are kept in the log2 domain (one exp2 per score). Same idea as
segment-anything-fast's `flash_4.py`; our own kernel. The output goes straight into the
[B, HW, heads, C] layout the projection reads, so no transpose copy follows.

A second kernel makes rel_h and rel_w from q in place (`rel_pos_terms`); with `Windows` both
address SAM's windows inside the unpadded grid (`windowed_attention`), so no pad, partition or
unpartition copy is made.

Loaded only where Triton is importable; `relpos_attention.fused_relpos_attention` decides when to
use it (CUDA, bf16/fp16) and falls back to SDPA otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel


@triton.jit
def _queries(pid_m, pid_g, n_heads, n_win, n_win_w, grid_h, grid_w, full_h, full_w,
             BLOCK_M: tl.constexpr):
    """Program (pid_m, pid_g) -> its image, (image, window) row, head, BLOCK_M local query
    indices, their token rows in the image's [H*W] sequence and which are real tokens. A window
    is a grid_h x grid_w tile of the full_h x full_w token grid (n_win_w tiles a row, n_win in
    all; the last ones hang over the edge: those queries are padding). Unwindowed: one window,
    the whole grid."""
    h = pid_g % n_heads
    row = pid_g // n_heads  # (image, window)
    win = row % n_win
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    y = (win // n_win_w) * grid_h + offs_m // grid_w
    x = (win % n_win_w) * grid_w + offs_m % grid_w
    real = (offs_m < grid_h * grid_w) & (y < full_h) & (x < full_w)
    return row // n_win, row, h, win, offs_m, y * full_w + x, real


@triton.jit
def _table_dot(q, table, size, offs_d, HEAD_DIM: tl.constexpr, T_PAD: tl.constexpr):
    """q . every row of an axis's [2 size - 1, C] table: [BLOCK_M, T_PAD] fp32 (rows past the
    table are 0). Row d is the offset q_pos - k_pos = d - (size - 1)."""
    offs_t = tl.arange(0, T_PAD)
    rows = tl.load(table + offs_t[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=(offs_t < 2 * size - 1)[:, None], other=0.0)
    return tl.dot(q, tl.trans(rows))


@triton.jit
def _rel_term(rows, first, size, mask_m, N: tl.constexpr, MASK: tl.constexpr):
    """One axis's bias for key positions first .. first + N - 1 along it, loaded from the terms'
    rows (`rows`, [BLOCK_M, 1] pointers): [BLOCK_M, N] fp32 in the log2 domain, -inf past `size`
    (MASK)."""
    pos = first + tl.arange(0, N)
    ok = pos < size
    if MASK:
        term = tl.load(rows + pos[None, :], mask=mask_m[:, None] & ok[None, :], other=0.0)
        term = tl.where(ok[None, :], term.to(tl.float32) * 1.4426950408889634, float("-inf"))
    else:
        term = tl.load(rows + pos[None, :], mask=mask_m[:, None], other=0.0)
        term = term.to(tl.float32) * 1.4426950408889634
    return term


@triton.jit
def _key_blocks(acc, m_i, l_i, q, k_base, v_base, rh_rows, rw_rows, k_pad, v_pad, mask_m, offs_d,
                col0, grid_h, grid_w, full_h, full_w, y0, x0, sk_n, sv_n, qk_scale,
                BLOCK_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr, PADDED: tl.constexpr):
    """The online softmax over the window's key columns [col0, col0 + COLS), ROWS grid rows a
    key block, in the log2 domain (scores times log2 e, so p is one exp2 of s - m). Keys outside
    the window (columns or rows past it) get a bias of -inf: their rel_w column or rel_h row is
    -inf, so no score needs a mask, and their addresses are clamped into the window so the loads
    need none either (what they load is multiplied by p = 0)."""
    BLOCK_N: tl.constexpr = ROWS * COLS
    # rel_w[m, kw] for this part's columns: the same [BLOCK_M, BLOCK_N] tile for every key block.
    rw = _rel_term(rw_rows, col0, grid_w, mask_m, COLS, MASK_COLS)
    rw = tl.reshape(tl.broadcast_to(rw[:, None, :], (BLOCK_M, ROWS, COLS)), (BLOCK_M, BLOCK_N))
    offs_j = tl.arange(0, BLOCK_N)
    j_row = offs_j // COLS
    key_col = col0 + offs_j % COLS
    if MASK_COLS:
        key_col = tl.minimum(key_col, grid_w - 1)
    for row0 in range(0, grid_h, ROWS):
        key_row = row0 + j_row
        if MASK_ROWS:
            key_row = tl.minimum(key_row, grid_h - 1)
        key_tok = (y0 + key_row) * full_w + x0 + key_col
        if PADDED:  # window keys past the grid's edge are the zero tokens' projections
            key_real = (y0 + key_row < full_h) & (x0 + key_col < full_w)
            k = tl.load(k_base + key_tok[None, :] * sk_n + offs_d[:, None], mask=key_real[None, :])
            k = tl.where(key_real[None, :], k, k_pad[:, None])
        else:
            k = tl.load(k_base + key_tok[None, :] * sk_n + offs_d[:, None])
        rh = _rel_term(rh_rows, row0, grid_h, mask_m, ROWS, MASK_ROWS)
        s = tl.dot(q, k) * qk_scale + rw  # [BLOCK_M, BLOCK_N], fp32, log2 domain
        s += tl.reshape(tl.broadcast_to(rh[:, :, None], (BLOCK_M, ROWS, COLS)), (BLOCK_M, BLOCK_N))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PADDED:
            v = tl.load(v_base + key_tok[:, None] * sv_n + offs_d[None, :], mask=key_real[:, None])
            v = tl.where(key_real[:, None], v, v_pad[None, :])
        else:
            v = tl.load(v_base + key_tok[:, None] * sv_n + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _relpos_attention_fwd(
    Q, K, V, RH, RW, O, KB, VB,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
    srh_b, srh_h, srh_m, srw_b, srw_h, srw_m, so_b, so_h, so_m,
    n_heads, grid_h, grid_w, full_h, full_w, n_win, n_win_w, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, ROW_PAD: tl.constexpr,
    MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr,
    TAIL_ROWS: tl.constexpr, TAIL_PAD: tl.constexpr,  # TAIL_ROWS 0: one part covers every column
    TAIL_MASK_ROWS: tl.constexpr, TAIL_MASK_COLS: tl.constexpr,
    PADDED: tl.constexpr,  # windows hang over the grid: their outside keys are k = KB, v = VB
):
    b, row, h, win, offs_m, q_tok, q_real = _queries(
        tl.program_id(0), tl.program_id(1), n_heads, n_win, n_win_w, grid_h, grid_w, full_h, full_w,
        BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < grid_h * grid_w
    q = tl.load(Q + b * sq_b + h * sq_h + q_tok[:, None] * sq_m + offs_d[None, :],
                mask=q_real[:, None], other=0.0)
    rh_rows = RH + row * srh_b + h * srh_h + offs_m[:, None] * srh_m
    rw_rows = RW + row * srw_b + h * srw_h + offs_m[:, None] * srw_m
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h
    y0 = (win // n_win_w) * grid_h  # the window's first token row and column in the grid
    x0 = (win % n_win_w) * grid_w
    if PADDED:  # a zero token's projection is its bias: what the reference's zero padding attends to
        k_pad = tl.load(KB + h * HEAD_DIM + offs_d)
        v_pad = tl.load(VB + h * HEAD_DIM + offs_d)
    else:
        k_pad = offs_d  # unused
        v_pad = offs_d
    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain: p = exp2(s - m)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _key_blocks(
        acc, m_i, l_i, q, k_base, v_base, rh_rows, rw_rows, k_pad, v_pad, mask_m, offs_d, 0,
        grid_h, grid_w, full_h, full_w, y0, x0, sk_n, sv_n, qk_scale,
        BLOCK_M, ROWS, ROW_PAD, MASK_ROWS, MASK_COLS, PADDED)
    if TAIL_ROWS > 0:  # the columns past the first ROW_PAD, in blocks of TAIL_ROWS rows
        acc, m_i, l_i = _key_blocks(
            acc, m_i, l_i, q, k_base, v_base, rh_rows, rw_rows, k_pad, v_pad, mask_m, offs_d,
            ROW_PAD, grid_h, grid_w, full_h, full_w, y0, x0, sk_n, sv_n, qk_scale,
            BLOCK_M, TAIL_ROWS, TAIL_PAD, TAIL_MASK_ROWS, TAIL_MASK_COLS, PADDED)
    acc = acc / l_i[:, None]
    tl.store(O + b * so_b + h * so_h + q_tok[:, None] * so_m + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=q_real[:, None])


@triton.jit
def _rel_terms_fwd(
    Q, TH, TW, RH, RW, sq_b, sq_h, sq_m, n_heads, grid_h, grid_w, full_h, full_w, n_win, n_win_w,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, H_PAD: tl.constexpr, W_PAD: tl.constexpr,
    TH_PAD: tl.constexpr, TW_PAD: tl.constexpr,
):
    """rel_h[m, kh] = q[m] . TH[qh - kh + H - 1] and rel_w[m, kw] = q[m] . TW[qw - kw + W - 1]
    for BLOCK_M queries of one (image, window, head): one dot with each whole table, then a
    per-row gather of the offsets. Written [(image, window), head, query, kh or kw]."""
    b, row, h, win, offs_m, q_tok, q_real = _queries(
        tl.program_id(0), tl.program_id(1), n_heads, n_win, n_win_w, grid_h, grid_w, full_h, full_w,
        BLOCK_M)
    seq_len = grid_h * grid_w
    mask_m = offs_m < seq_len
    offs_d = tl.arange(0, HEAD_DIM)
    # Padding queries (q = 0 here) get terms no output uses; the reference's are q = bias.
    q = tl.load(Q + b * sq_b + h * sq_h + q_tok[:, None] * sq_m + offs_d[None, :],
                mask=q_real[:, None], other=0.0)
    out_rows = (row * n_heads + h) * seq_len + offs_m
    # Rows past seq_len compute garbage offsets: clamp them into the table, never stored.
    q_row = tl.minimum(offs_m // grid_w, grid_h - 1)
    q_col = offs_m % grid_w

    scores = _table_dot(q, TH, grid_h, offs_d, HEAD_DIM, TH_PAD)  # [BLOCK_M, TH_PAD], fp32
    offs_k = tl.arange(0, H_PAD)
    index = tl.where((offs_k < grid_h)[None, :], q_row[:, None] - offs_k[None, :] + grid_h - 1, 0)
    tl.store(RH + out_rows[:, None] * grid_h + offs_k[None, :],
             tl.gather(scores, index, 1).to(RH.dtype.element_ty),
             mask=mask_m[:, None] & (offs_k < grid_h)[None, :])

    scores = _table_dot(q, TW, grid_w, offs_d, HEAD_DIM, TW_PAD)
    offs_k = tl.arange(0, W_PAD)
    index = tl.where((offs_k < grid_w)[None, :], q_col[:, None] - offs_k[None, :] + grid_w - 1, 0)
    tl.store(RW + out_rows[:, None] * grid_w + offs_k[None, :],
             tl.gather(scores, index, 1).to(RW.dtype.element_ty),
             mask=mask_m[:, None] & (offs_k < grid_w)[None, :])


@dataclass(frozen=True)
class Windows:
    """Attention in `side` x `side` windows over an H x W token grid (`grid`), the last row and
    column of windows hanging over the edge where `side` does not divide it (SAM's padding:
    zero tokens, whose keys and values are the projection's biases `k_bias`, `v_bias` [n, C])."""

    side: int
    grid: tuple[int, int]
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None

    @property
    def counts(self) -> tuple[int, int]:  # windows down, across
        return -(-self.grid[0] // self.side), -(-self.grid[1] // self.side)

    @property
    def padded(self) -> bool:
        return self.grid[0] % self.side != 0 or self.grid[1] % self.side != 0


def _layout(rel_grid, windows):
    """(n_win, n_win_w, full_h, full_w) of the kernels' addressing."""
    if windows is None:
        return 1, 1, *rel_grid
    down, across = windows.counts
    return down * across, across, *windows.grid


def _dot_pad(size: int) -> int:
    """A table's rows padded for tl.dot (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(size))


def rel_pos_terms(q: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor,
                  hw: tuple[int, int], windows: Windows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`relpos_attention.rel_pos_terms` from the axes' tables ([2H-1, C], [2W-1, C], q's dtype):
    rel_h [B, n, HW, H] and rel_w [B, n, HW, W], contiguous, q read in place (any strides with
    the last dim contiguous). With `windows`, q is the whole grid's [B, n, H*W, C] and `hw` the
    window's: the terms are per window, [B * windows, n, side², side] each."""
    grid_h, grid_w = hw
    bsz, n, _, c = q.shape
    n_win, n_win_w, full_h, full_w = _layout(hw, windows)
    seq_len = grid_h * grid_w
    rel_h = q.new_empty(bsz * n_win, n, seq_len, grid_h)
    rel_w = q.new_empty(bsz * n_win, n, seq_len, grid_w)
    block_m = 64
    launch_kernel(_rel_terms_fwd, (triton.cdiv(seq_len, block_m), bsz * n_win * n),
                  q, table_h.contiguous(), table_w.contiguous(), rel_h, rel_w,
                  q.stride(0), q.stride(1), q.stride(2), n, grid_h, grid_w, full_h, full_w, n_win, n_win_w,
                  HEAD_DIM=c, BLOCK_M=block_m, H_PAD=_dot_pad(grid_h), W_PAD=_dot_pad(grid_w),
                  TH_PAD=_dot_pad(2 * grid_h - 1), TW_PAD=_dot_pad(2 * grid_w - 1), num_warps=4)
    return rel_h, rel_w


# Tile configs per grid width (64: global block on a 1024 view, 40: on a 640 crop, 14: windows),
# measured on an H200 by bench/tune/tune_relpos_kernel.py (the whole op, rel terms included; 8 views
# or 48 crops, windows in place on both grids; relpos-kernel-tuning-2026-12-03.json). 40: a
# 32-column part in blocks of 4 rows, then the 8-column tail in blocks of 8 rows, 1.88 ms against
# 2.49 with each row padded to 64; 14: 4 warps and 3 stages, 0.33 / 0.65 ms against 0.47 / 0.94.
# Also measured there, and slower everywhere: each program making its queries' rel terms from
# the tables (q . table, gathered per key block) instead of the rel-terms kernel writing them
# (1.79 against 1.43 ms on the 64-wide grid, 3.15 against 1.88 on the crops); and before
# (relpos-kernel-tuning-{40-onehot,40,64}-2026-12-02.json) the 40-wide rows packed back to back
# in 128-key blocks (rel_h spread by selects or a one-hot dot: 4.09 / 2.45 ms against 2.20).
TUNED: dict[int, dict] = {
    64: dict(BLOCK_M=64, ROWS=1, ROW_PAD=64, TAIL_ROWS=0, num_warps=4, num_stages=3),
    40: dict(BLOCK_M=64, ROWS=4, ROW_PAD=32, TAIL_ROWS=8, num_warps=4, num_stages=3),
    14: dict(BLOCK_M=128, ROWS=4, ROW_PAD=16, TAIL_ROWS=0, num_warps=4, num_stages=3),
}


def config(grid_w: int, seq_len: int) -> dict:
    """Tuned tiles where measured; otherwise key blocks of ~128 columns, as the tuned ones."""
    if grid_w in TUNED:
        return TUNED[grid_w]
    row_pad = triton.next_power_of_2(grid_w)
    return dict(BLOCK_M=64, ROWS=max(1, 128 // row_pad), ROW_PAD=row_pad, num_warps=4, num_stages=2)


def launch(q, k, v, rel_h, rel_w, out, BLOCK_M, ROWS, ROW_PAD, num_warps, num_stages, TAIL_ROWS=0,
           windows: Windows | None = None):
    """The attention kernel with one tile config. ROW_PAD >= the window's width: one part, each
    key block ROWS rows of ROW_PAD columns (those past the width masked). ROW_PAD < the width
    (a power of two, TAIL_ROWS > 0): the first ROW_PAD columns in blocks of ROWS rows, then the
    rest (padded to a power of two) in blocks of TAIL_ROWS rows: a 40-wide grid as 4 x 32 and
    8 x 8 blocks, every column real, where one part would pad each row to 64."""
    bsz, n, _, c = q.shape
    grid_h, grid_w = rel_h.shape[-1], rel_w.shape[-1]
    n_win, n_win_w, full_h, full_w = _layout((grid_h, grid_w), windows)
    padded = windows is not None and windows.padded
    k_bias = windows.k_bias if padded else q  # unread unless padded
    v_bias = windows.v_bias if padded else q
    tail_cols = grid_w - ROW_PAD if TAIL_ROWS else 0
    assert tail_cols > 0 or not TAIL_ROWS, (grid_w, ROW_PAD, TAIL_ROWS)
    tail_pad = triton.next_power_of_2(tail_cols) if tail_cols else 1
    launch_kernel(
        _relpos_attention_fwd, (triton.cdiv(grid_h * grid_w, BLOCK_M), bsz * n_win * n),
        q, k, v, rel_h, rel_w, out, k_bias, v_bias,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        rel_h.stride(0), rel_h.stride(1), rel_h.stride(2),
        rel_w.stride(0), rel_w.stride(1), rel_w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        n, grid_h, grid_w, full_h, full_w, n_win, n_win_w, c ** -0.5, HEAD_DIM=c, BLOCK_M=BLOCK_M,
        ROWS=ROWS, ROW_PAD=ROW_PAD, MASK_ROWS=grid_h % ROWS != 0,
        MASK_COLS=not tail_cols and ROW_PAD != grid_w,
        TAIL_ROWS=TAIL_ROWS, TAIL_PAD=tail_pad, TAIL_MASK_ROWS=bool(TAIL_ROWS) and grid_h % TAIL_ROWS != 0,
        TAIL_MASK_COLS=tail_pad != tail_cols,
        PADDED=padded, num_warps=num_warps, num_stages=num_stages)
    return out


def _empty_output(q: torch.Tensor) -> torch.Tensor:
    bsz, n, hw, c = q.shape
    return q.new_empty(bsz, hw, n, c).transpose(1, 2)  # [B, n, HW, C] view of [B, HW, n, C]


def relpos_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     rel_h: torch.Tensor, rel_w: torch.Tensor) -> torch.Tensor:
    """softmax(q.k / sqrt(C) + rel_h[kh] + rel_w[kw]) v; q, k, v [B, n, H*W, C], rel_h [B, n, HW, H],
    rel_w [B, n, HW, W], last dims contiguous."""
    return launch(q, k, v, rel_h, rel_w, _empty_output(q), **config(rel_w.shape[-1], q.shape[2]))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table_h: torch.Tensor,
              table_w: torch.Tensor, hw: tuple[int, int], windows: Windows | None = None,
              tiles: dict | None = None) -> torch.Tensor:
    """The same from the axes' tables ([2H-1, C], [2W-1, C], q's dtype) of the H x W grid `hw`
    (with `windows`: of one window; q, k, v the whole grid's): the rel-terms kernel, then the
    attention kernel with `tiles` (default: `config`)."""
    rel_h, rel_w = rel_pos_terms(q, table_h, table_w, hw, windows)
    return launch(q, k, v, rel_h, rel_w, _empty_output(q), **(tiles or config(hw[1], hw[0] * hw[1])),
                  windows=windows)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table_h: torch.Tensor,
                       table_w: torch.Tensor, windows: Windows) -> torch.Tensor:
    """SAM's windowed attention read and written in place: q, k, v are the whole grid's
    [B, n, H*W, C] (strided views of the projection); no padding, partition or unpartition
    copies. -> [B, n, H*W, C], a view of [B, H*W, n, C] (what the output projection reads)."""
    return attention(q, k, v, table_h, table_w, (windows.side, windows.side), windows)


# The same as a custom op, for torch.compile (which would otherwise trace into the launch).
relpos_attention_triton = torch.library.custom_op(
    "deepseek_ocr::relpos_attention", relpos_attention, mutates_args=())


@relpos_attention_triton.register_fake
def _(q, k, v, rel_h, rel_w):
    return _empty_output(q)
