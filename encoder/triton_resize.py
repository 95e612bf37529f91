"""One pass of PIL's bicubic resize (resize.py) in one kernel (Triton, CUDA).

Torch's pass (`resize._resample_torch`, the twin) is five kernels over a widening temporary: the taps gathered
as uint8, multiplied into int32 [.., out, taps], summed, shifted, clamped and cast; a text page's
views took 33 kernels and 0.48 ms of GPU time, a colour page's 1.42 ms (H200, as a probe
measured), on the GPU the encoder's batches run on. Here each output pixel reads
its taps, multiplies and sums them in int32 registers and stores its uint8: the same integer
arithmetic (a sum of int32 products, round half up by 2^21, an arithmetic shift by 22, a clamp
to 0..255), so the same pixels in any order. The tap count is a runtime loop bound and no
integer argument is specialised, so one compiled kernel serves every image size and both
passes. Loaded only where Triton is importable; resize.py falls back to torch's pass elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel

BLOCK = 1024


@triton.jit(do_not_specialize=["total", "length", "out_len", "inner", "ksize"])
def _resample_fwd(X, INDEX, WEIGHTS, Y, total, length, out_len, inner, ksize,
                  PRECISION: tl.constexpr, BLOCK: tl.constexpr):
    """X [outer, length, inner] uint8 -> Y [outer, out_len, inner] uint8 along the middle axis;
    one program: BLOCK consecutive output elements (consecutive along `inner`, then `out_len`)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    i = offs % inner
    o = (offs // inner) % out_len
    b = offs // (inner * out_len)
    base = b * length * inner + i
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(ksize):
        source = tl.load(INDEX + o * ksize + k, mask=mask, other=0)
        weight = tl.load(WEIGHTS + o * ksize + k, mask=mask, other=0)
        pixel = tl.load(X + base + source.to(tl.int64) * inner, mask=mask, other=0)
        acc += pixel.to(tl.int32) * weight
    acc = (acc + (1 << (PRECISION - 1))) >> PRECISION
    acc = tl.minimum(tl.maximum(acc, 0), 255)
    tl.store(Y + offs, acc.to(tl.uint8), mask=mask)


def resample(x: torch.Tensor, dim: int, index: torch.Tensor, weights: torch.Tensor,
             precision_bits: int) -> torch.Tensor:
    """One pass over `dim` (1 = rows, 2 = columns) of uint8 x [C, H, W]: output position o is
    sum_k x[.., index[o, k], ..] * weights[o, k] (int32 [out, taps] each), rounded, shifted by
    `precision_bits` and clamped, as `resize._resample_torch`."""
    x = x.contiguous()
    out_len, ksize = weights.shape
    outer = x.shape[0] * (x.shape[1] if dim == 2 else 1)
    inner = x.shape[2] if dim == 1 else 1
    shape = list(x.shape)
    shape[dim] = out_len
    y = torch.empty(shape, dtype=torch.uint8, device=x.device)
    total = outer * out_len * inner
    launch_kernel(_resample_fwd, (triton.cdiv(total, BLOCK),), x, index, weights, y, total,
                  x.shape[dim], out_len, inner, ksize, PRECISION=precision_bits, BLOCK=BLOCK,
                  num_warps=4)
    return y
