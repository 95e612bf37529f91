"""CLIP's quick_gelu, and SiLU(gate) * up of DeepSeek-OCR 2's Qwen2 MLP, each in one pass
(Triton, CUDA, bf16/fp16), bit for bit torch's.

`x * sigmoid(1.702 * x)` is three kernels in torch (two muls and a sigmoid), each reading and
writing the [tokens, 4096] activations: 0.28 ms for a 32-page batch's local-path layer, 0.13 ms
here (H200). Each intermediate torch stores is rounded to the activations' dtype at the same
point, and each op is the one torch's kernels compute (fp32, IEEE division, libdevice's expf),
so the output is torch's exactly. (SAM's exact GELU, one torch kernel already at the memory
bound, gained nothing from the same treatment: 1.27 against 1.23 ms.) `silu_mul` does the same
for the Qwen2 MLP's two kernels (SiLU, then the product), which read and write its [tokens,
4864] activations five times where this reads them twice and writes once. Loaded only where
Triton is importable; `model.py` falls back to torch's ops elsewhere.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from common.triton_compile import launch_kernel


@triton.jit
def _quick_gelu_fwd(X, Y, n, BLOCK: tl.constexpr,
                    LIBDEVICE_EXP: tl.constexpr):  # expf as CUDA's (tl.exp is ex2.approx)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    t = (xf * 1.702).to(x.dtype).to(tl.float32)  # torch stores 1.702 * x, then sigmoid of it
    e = libdevice.exp(-t) if LIBDEVICE_EXP else tl.exp(-t)
    s = tl.math.div_rn(1.0, 1.0 + e).to(x.dtype).to(tl.float32)
    tl.store(Y + offs, (xf * s).to(x.dtype), mask=mask)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x) of contiguous `x`."""
    y = torch.empty_like(x)
    block = 4096
    launch_kernel(_quick_gelu_fwd, (triton.cdiv(x.numel(), block),),
                  x, y, x.numel(), BLOCK=block, num_warps=8,
                  # the CPU interpreter lacks libdevice
                  LIBDEVICE_EXP=os.environ.get("TRITON_INTERPRET") != "1")
    return y


@triton.jit
def _silu_mul_fwd(G, U, Y, n, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    e = libdevice.exp(-gf) if LIBDEVICE_EXP else tl.exp(-gf)
    s = tl.math.div_rn(gf, 1.0 + e).to(g.dtype).to(tl.float32)  # torch stores SiLU(gate)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (s * u).to(g.dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of contiguous `gate` and `up` (same shape and dtype)."""
    assert gate.shape == up.shape and gate.dtype == up.dtype and gate.is_contiguous() and up.is_contiguous()
    y = torch.empty_like(gate)
    block = 4096
    launch_kernel(_silu_mul_fwd, (triton.cdiv(gate.numel(), block),), gate, up, y, gate.numel(),
                  BLOCK=block, num_warps=8, LIBDEVICE_EXP=os.environ.get("TRITON_INTERPRET") != "1")
    return y
