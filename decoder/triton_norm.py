"""RMSNorm after the residual add in one Triton kernel (CUDA; Triton's interpreter on CPU).

Each decoder layer adds its attention's output to the residual stream and normalises the sum
for the MLP, then adds the MLP's output and normalises for the next layer: torch runs each add
and each norm as its own kernel, 48 kernels a decode step that move a few KB each, where a step
of few sequences is bound by how many kernels run. Here one program takes ROWS rows: the sum
rounded to the activations' dtype (what the separate add stores) and stored, then normalised in
fp32 and scaled by the weight, rounded once. Only the order of the fp32 sums differs from torch's
`x + delta` then `F.rms_norm`, the reference twin (`RMSNorm.kernel = "torch"`). The output added
may come in fp32 (the fused MoE kernels' sum), added before any rounding: one rounding fewer than
the reference, which rounds it to the activations' dtype first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel


@triton.jit
def _add_rms_norm(X, D, W, S, Y, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0)
    x = (x.to(tl.float32) + tl.load(D + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    tl.store(S + offs, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, delta [..., n] (same shape; delta in x's dtype or fp32) -> (x + delta rounded to x's
    dtype, RMSNorm(x + delta) * weight)."""
    assert x.shape == delta.shape and delta.dtype in (x.dtype, torch.float32)
    x, delta = x.contiguous(), delta.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    total, y = torch.empty_like(x), torch.empty_like(x)
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, 4096 // block_n)  # ~4k elements a program: two rows of 1,280
    launch_kernel(_add_rms_norm, (triton.cdiv(n_rows, rows),), x, delta, weight, total, y, n_rows, n_cols,
                  eps, ROWS=rows, BLOCK_N=block_n, num_warps=4)
    return total, y
