"""uint8 pixels -> normalised patches for SAM's patch embedding, in one pass (Triton, CUDA).

Torch makes them in six kernels over a page's 10 M bytes: the cast to fp32, `/ 255`, `- 0.5`,
`/ 0.5` (`preprocess.normalize`, each reading and writing fp32), the cast to the weights'
dtype, and the unfold of 16 x 16 patches into rows (`PatchEmbed`, a strided copy). This kernel
reads each byte once and writes the patch rows. The arithmetic is torch's on CUDA, step by step:
a division by a scalar there is a multiply by its fp32 reciprocal (1/0.5 is exactly 2), each
step rounded to fp32 (no fused multiply-add: `enable_fp_fusion=False`), then one rounding to
the output dtype; so the patches equal torch's bit for bit. Loaded only where Triton is
importable; `model.py` falls back to torch's ops elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel


@triton.jit
def _normalized_patches_fwd(X, Y, size, inv_255, CHANNELS: tl.constexpr, PATCH: tl.constexpr,
                            BLOCK: tl.constexpr):
    """One program: one pixel row (image, channel, y) of the [B, C, S, S] input, written into
    the [B, S/P, S/P, C * P * P] patch rows (within a row: channel, then y, then x in the patch)."""
    r = tl.program_id(0)  # (b * C + ch) * S + y
    y = r % size
    ch = (r // size) % CHANNELS
    b = r // (size * CHANNELS)
    x = tl.arange(0, BLOCK)
    mask = x < size
    pixels = tl.load(X + r.to(tl.int64) * size + x, mask=mask, other=0)
    v = pixels.to(tl.float32) * inv_255  # x / 255
    v = (v - 0.5) * 2.0  # - 0.5, then / 0.5
    grid = size // PATCH
    row = (b * grid + y // PATCH).to(tl.int64) * grid + x // PATCH  # the patch's row
    col = (ch * PATCH + y % PATCH) * PATCH + x % PATCH
    tl.store(Y + row * (CHANNELS * PATCH * PATCH) + col, v.to(Y.dtype.element_ty), mask=mask)


def normalized_patches(pixels: torch.Tensor, patch: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [B, C, S, S] (contiguous) -> [B, S/patch, S/patch, C * patch * patch] in `dtype`:
    `preprocess.normalize(pixels).to(dtype)` unfolded into patch rows."""
    bsz, channels, size, _ = pixels.shape
    grid = size // patch
    out = torch.empty((bsz, grid, grid, channels * patch * patch), dtype=dtype, device=pixels.device)
    launch_kernel(_normalized_patches_fwd, (bsz * channels * size,), pixels, out, size,
                  1.0 / 255.0, CHANNELS=channels, PATCH=patch, BLOCK=triton.next_power_of_2(size),
                  num_warps=4, enable_fp_fusion=False)
    return out
