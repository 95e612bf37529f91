"""Flash attention with SAM's decomposed rel-pos bias added inside the kernel (Triton, CUDA).

One program owns BLOCK_M queries of one (image, head) and walks the key grid ROWS rows at a
time with an online softmax. The bias of query m and key (kh, kw) is `rel_h[m, kh] + rel_w[m, kw]`.
A key block is laid out as ROWS grid rows of ROW_PAD columns (the row width W rounded up to a
power of two, extra columns masked), so that
  - the rel_w part is the same [BLOCK_M, ROW_PAD] tile for every key block: loaded once;
  - the rel_h part is one value per (query, key row): a [BLOCK_M, ROWS] load per block;
no gather per score, nothing of size HW x HW ever written, and the dot products keep the real
head dim (64). Same idea as segment-anything-fast's `flash_4.py`; our own kernel. The output goes
straight into the [B, HW, heads, C] layout the projection reads, so no transpose copy follows.

Loaded only where Triton is importable; `relpos_attention.fused_relpos_attention` decides when to
use it (CUDA, bf16/fp16) and falls back to SDPA otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _relpos_attention_fwd(
    Q, K, V, RH, RW, O,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
    srh_b, srh_h, srh_m, srw_b, srw_h, srw_m, so_b, so_h, so_m,
    n_heads, seq_len, grid_h, grid_w, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, ROW_PAD: tl.constexpr,
    EVEN_N: tl.constexpr,  # every key block full (W == ROW_PAD, H % ROWS == 0): no key masks
):
    BLOCK_N: tl.constexpr = ROWS * ROW_PAD
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < seq_len

    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)
    # rel_w[m, kw] for every column of a key row; identical for every key block.
    offs_c = tl.arange(0, ROW_PAD)
    rw = tl.load(RW + b * srw_b + h * srw_h + offs_m[:, None] * srw_m + offs_c[None, :],
                 mask=mask_m[:, None] & (offs_c < grid_w)[None, :], other=0.0).to(tl.float32)
    rw = tl.reshape(tl.broadcast_to(rw[:, None, :], (BLOCK_M, ROWS, ROW_PAD)), (BLOCK_M, BLOCK_N))
    rh_rows = RH + b * srh_b + h * srh_h + offs_m[:, None] * srh_m
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h

    offs_j = tl.arange(0, BLOCK_N)
    j_row = offs_j // ROW_PAD
    j_col = offs_j % ROW_PAD
    offs_r = tl.arange(0, ROWS)
    log2e: tl.constexpr = 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for row0 in range(0, grid_h, ROWS):
        key_idx = (row0 + j_row) * grid_w + j_col
        if EVEN_N:
            k = tl.load(k_base + key_idx[None, :] * sk_n + offs_d[:, None])
            rh = tl.load(rh_rows + (row0 + offs_r)[None, :], mask=mask_m[:, None], other=0.0)
        else:
            key_ok = (j_col < grid_w) & (row0 + j_row < grid_h)
            k = tl.load(k_base + key_idx[None, :] * sk_n + offs_d[:, None], mask=key_ok[None, :],
                        other=0.0)
            rh = tl.load(rh_rows + (row0 + offs_r)[None, :],
                         mask=mask_m[:, None] & (row0 + offs_r < grid_h)[None, :], other=0.0)
        s = tl.dot(q, k) * sm_scale + rw  # [BLOCK_M, BLOCK_N], fp32
        s += tl.reshape(tl.broadcast_to(rh.to(tl.float32)[:, :, None], (BLOCK_M, ROWS, ROW_PAD)),
                        (BLOCK_M, BLOCK_N))
        if not EVEN_N:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2((s - m_new[:, None]) * log2e)
        alpha = tl.math.exp2((m_i - m_new) * log2e)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EVEN_N:
            v = tl.load(v_base + key_idx[:, None] * sv_n + offs_d[None, :])
        else:
            v = tl.load(v_base + key_idx[:, None] * sv_n + offs_d[None, :], mask=key_ok[:, None],
                        other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=mask_m[:, None])


# Tile configs per grid width (64: global block on a 1024 view, 40: on a 640 crop, 14: windows),
# measured on an H200 by bench/tune_relpos_kernel.py (bench/results/relpos-kernel-tuning-*.json).
TUNED: dict[int, dict] = {
    64: dict(BLOCK_M=64, ROWS=2, ROW_PAD=64, num_warps=4, num_stages=3),
    40: dict(BLOCK_M=64, ROWS=2, ROW_PAD=64, num_warps=4, num_stages=3),
    14: dict(BLOCK_M=128, ROWS=4, ROW_PAD=16, num_warps=8, num_stages=2),
}


def config(grid_w: int, seq_len: int) -> dict:
    """Tuned tiles where measured; otherwise key blocks of ~128 columns, as the tuned ones."""
    if grid_w in TUNED:
        return TUNED[grid_w]
    row_pad = triton.next_power_of_2(grid_w)
    return dict(BLOCK_M=64, ROWS=max(1, 128 // row_pad), ROW_PAD=row_pad, num_warps=4, num_stages=2)


def launch(q, k, v, rel_h, rel_w, out, BLOCK_M, ROWS, ROW_PAD, num_warps, num_stages):
    bsz, n, hw, c = q.shape
    grid_h, grid_w = rel_h.shape[-1], rel_w.shape[-1]
    _relpos_attention_fwd[(triton.cdiv(hw, BLOCK_M), bsz * n)](
        q, k, v, rel_h, rel_w, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        rel_h.stride(0), rel_h.stride(1), rel_h.stride(2),
        rel_w.stride(0), rel_w.stride(1), rel_w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        n, hw, grid_h, grid_w, c ** -0.5, HEAD_DIM=c, BLOCK_M=BLOCK_M, ROWS=ROWS, ROW_PAD=ROW_PAD,
        EVEN_N=grid_w == ROW_PAD and grid_h % ROWS == 0, num_warps=num_warps, num_stages=num_stages)
    return out


def _empty_output(q: torch.Tensor) -> torch.Tensor:
    bsz, n, hw, c = q.shape
    return q.new_empty(bsz, hw, n, c).transpose(1, 2)  # [B, n, HW, C] view of [B, HW, n, C]


@torch.library.custom_op("deepseek_ocr::relpos_attention", mutates_args=())
def relpos_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            rel_h: torch.Tensor, rel_w: torch.Tensor) -> torch.Tensor:
    """softmax(q.k / sqrt(C) + rel_h[kh] + rel_w[kw]) v; q, k, v [B, n, H*W, C], rel_h [B, n, HW, H],
    rel_w [B, n, HW, W], last dims contiguous."""
    return launch(q, k, v, rel_h, rel_w, _empty_output(q), **config(rel_w.shape[-1], q.shape[2]))


@relpos_attention_triton.register_fake
def _(q, k, v, rel_h, rel_w):
    return _empty_output(q)
