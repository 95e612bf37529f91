"""LayerNorm (SAM, CLIP) and Qwen2's RMSNorm (DeepSeek-OCR 2), optionally after a residual add,
each in one Triton kernel (CUDA, bf16/fp16).

PyTorch's LayerNorm kernel gives each 768-wide row its own block and reaches ~1.4 TB/s on an
H200 (8 of a global view batch's 118 ms went to norms, profile-encoder-2026-12-02.txt); here a
program normalises ROWS rows at once. With a residual, `x + h` is rounded to the activations'
dtype first (what the separate add stores), stored, and normalised in fp32, as torch does; only
the order of the fp32 sums differs. Loaded only where Triton is importable; `model.py` falls
back to torch's ops elsewhere.

Qwen2's RMSNorm (`qwen2_model.RMSNorm`) ran as eight torch kernels over fp32 copies of the
stream (the cast, pow, mean, the epsilon, rsqrt, the product, the cast back, the weight's
product), 49 norms a view, plus a residual add before each: with the SiLU and RoPE around them,
at least a fifth of an 8-page batch's GPU time (ocr2-encoder-profile-h100-2026-12-05). Here
one pass: the sum rounded as the separate add rounds it, then x * rsqrt(mean(x²) + eps) in fp32,
rounded to the activations' dtype and only then multiplied by the weight, as Qwen2RMSNorm does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel


@triton.jit
def _layer_norm_fwd(X, R, T, W, B, S, Y, n_rows, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, HAS_SHIFT: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        if HAS_SHIFT:  # the stored sum carries a per-column shift; the norm does not see it
            shift = tl.load(T + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            tl.store(S + offs, (x.to(tl.float32) + shift[None, :]).to(x.dtype), mask=mask)
        else:
            tl.store(S + offs, x, mask=mask)
    x = x.to(tl.float32)
    mean = tl.sum(x, 1) / n_cols
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 1) / n_cols + eps)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None, shift: torch.Tensor | None = None):
    """LayerNorm over the last dim of contiguous `x` -> y; with `residual` (same shape):
    (x + residual, LayerNorm(x + residual)); with `shift` too ([last dim]): the sum is stored
    as (x + residual) + shift, rounded twice, and normalised without it."""
    if shift is not None and residual is None:
        raise ValueError("a shift is added to the residual sum: pass a residual")
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else y
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, 4096 // block_n)  # ~4k elements a program: a few rows of 768 or 1024
    launch_kernel(_layer_norm_fwd, (triton.cdiv(n_rows, rows),),
                  x, x if residual is None else residual, bias if shift is None else shift, weight, bias,
                  total, y, n_rows, n_cols, eps, HAS_RESIDUAL=residual is not None,
                  HAS_SHIFT=shift is not None, ROWS=rows, BLOCK_N=block_n, num_warps=4)
    return y if residual is None else (total, y)


@triton.jit
def _rms_norm_fwd(X, R, W, S, Y, n_rows, n_cols, eps, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(S + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / n_cols + eps)
    h = (h * rstd[:, None]).to(x.dtype).to(tl.float32)  # rounded before the weight, as Qwen2's
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(Y + offs, (w[None, :] * h).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Qwen2's RMSNorm over the last dim of contiguous `x` (weight in x's dtype) -> y; with
    `residual` (same shape and dtype): (x + residual, RMSNorm(x + residual))."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else y
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, 4096 // block_n)  # ~4k elements a program: four rows of 896
    launch_kernel(_rms_norm_fwd, (triton.cdiv(n_rows, rows),), x, x if residual is None else residual,
                  weight, total, y, n_rows, n_cols, eps, HAS_RESIDUAL=residual is not None, ROWS=rows,
                  BLOCK_N=block_n, num_warps=4)
    return y if residual is None else (total, y)
