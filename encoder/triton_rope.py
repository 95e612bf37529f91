"""RoPE of DeepSeek-OCR 2's Qwen2 stage in one pass (Triton, CUDA, bf16/fp16), bit for bit
torch's `apply_rope`.

`x * cos + rotate_half(x) * sin` is five torch kernels on the head-major view of q and of k (a
negation and a concatenation for the rotation, two products, a sum), each reading or writing the
[tokens, heads x 64] projections: on an 8-page batch the rotations' products and concatenations
took ~7% of the encoder's GPU time (ocr2-encoder-profile-h100-2026-12-05). Here one program per
token reads its row of every head once (and each element's rotation partner, the same row), and
rounds where torch's kernels store: x * cos and rotate_half(x) * sin each rounded to the
activations' dtype, then their sum. The output keeps the projection's [B, T, heads x head_dim]
layout; the attention takes its head-major view. Loaded only where Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    """fp32 v rounded to dtype (to nearest even), kept in fp32. bf16 by its bits: as a cast, the
    compiler turned bf16 products and sums into fused multiply-adds on an H100, which skip the
    rounding of x * cos that torch stores (1 ulp apart on an H100). fp16 (the interpreter's
    tests) by the cast; the model runs bf16 on GPUs."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _rope_fwd(X, COS, SIN, Y, seqlen, heads, sx, sy,
              HEAD_DIM: tl.constexpr, HEADS_POW2: tl.constexpr):
    row = tl.program_id(0)
    t = row % seqlen
    h = tl.arange(0, HEADS_POW2)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    half: tl.constexpr = HEAD_DIM // 2
    mask = (h < heads) & (d < HEAD_DIM)
    x = tl.load(X + row.to(tl.int64) * sx + h * HEAD_DIM + d, mask=mask, other=0.0)
    partner = tl.load(X + row.to(tl.int64) * sx + h * HEAD_DIM + (d + half) % HEAD_DIM, mask=mask, other=0.0)
    rotated = tl.where(d < half, -partner.to(tl.float32), partner.to(tl.float32))  # [-x2, x1]
    cos = tl.load(COS + t * HEAD_DIM + d).to(tl.float32)
    sin = tl.load(SIN + t * HEAD_DIM + d).to(tl.float32)
    a = _rounded(x.to(tl.float32) * cos, x.dtype)
    b = _rounded(rotated * sin, x.dtype)
    tl.store(Y + row.to(tl.int64) * sy + h * HEAD_DIM + d, (a + b).to(x.dtype), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x [B, T, heads * head_dim] (rows contiguous) rotated by position: cos, sin [T, head_dim]
    contiguous, in x's dtype (`qwen2_model.rope_tables`) -> a new [B, T, heads * head_dim]."""
    bsz, seqlen, width = x.shape
    assert x.stride(2) == 1 and x.stride(0) == seqlen * x.stride(1) and width % head_dim == 0
    assert cos.shape == sin.shape == (seqlen, head_dim) and cos.is_contiguous() and sin.is_contiguous()
    heads = width // head_dim
    y = torch.empty(bsz, seqlen, width, device=x.device, dtype=x.dtype)
    launch_kernel(_rope_fwd, (bsz * seqlen,), x, cos, sin, y, seqlen, heads, x.stride(1), y.stride(1),
                  HEAD_DIM=head_dim, HEADS_POW2=triton.next_power_of_2(heads), num_warps=4)
    return y
