"""PIL's bicubic resize, pixel for pixel, as tensor math: the views can be made on the GPU.

A page's two resizes (global view, crop grid) are ~25 ms of a router's CPU each time (PIL), which
caps how many pages a CPU core feeds the encoders; on the encoder's GPU they are a few kernels.
The model was trained on PIL's pixels, so the GPU path must give exactly those, not "bicubic":

- Coefficients as Pillow's `precompute_coeffs` (libImaging/Resample.c): filter a = -0.5, support
  2 * max(scale, 1), taps from trunc(center -/+ support + 0.5), each normalised by the running
  sum, then fixed point with 22 fraction bits (`normalize_coeffs_8bpc`). Computed in float64 in
  the same order of operations as the C code, so they are the same numbers.
- Each pass sums uint8 * int32 weights from 2^21 (round half up), shifts right by 22 and clamps
  to 0..255: integer arithmetic, exact on any device and in any summation order.
- Passes: horizontal, then vertical on the rounded uint8 result, as Pillow; a dimension that
  keeps its size has no pass. Pillow 13 (PR #9549) goes vertical first when the height shrinks
  by more than twice as many pixels as the width; which rule the installed Pillow follows is
  probed once (`pil_rule`), and where it matches neither the exact path is off (`supported`).

The reference twin is PIL itself (`views.py`); the tests compare the two on many sizes. On a
GPU a pass is one Triton kernel (`triton_resize.py`), its twin torch's ops (`_resample_torch`).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from common import switches

from .relpos_attention import triton_enabled

PRECISION_BITS = 22  # Pillow: 32 - 8 - 2
_HALF = 1 << (PRECISION_BITS - 1)
# Gathered int32 elements per chunk of a pass: bounds the temporary memory of huge images.
_CHUNK_ELEMENTS = 1 << 26
# On a GPU each pass is one Triton kernel (`triton_resize.py`: the same integer arithmetic);
# DEEPSEEK_OCR_FUSED_RESIZE=0 (or this flag) keeps torch's ops, the reference twin.
FUSED_PASS = switches.on("DEEPSEEK_OCR_FUSED_RESIZE")


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's bicubic_filter (a = -0.5), the same operations in the same order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=1024)
def coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source index [out, ksize] int64, weights [out, ksize] int32) of one axis, as Pillow's
    precompute_coeffs + normalize_coeffs_8bpc for the whole axis (box 0..in_size). Taps past
    an output's last source pixel have weight 0 and a clamped (valid) index."""
    scale = in_size / out_size  # (double)(in1 - in0) / outSize; in0 = 0, in1 = in_size exactly
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    taps = np.arange(ksize)
    weights = _bicubic(((taps + xmin[:, None]).astype(np.float64) - center[:, None] + 0.5)
                       * (1.0 / filterscale))
    weights = np.where(taps < count[:, None], weights, 0.0)
    total = np.zeros(out_size)
    for t in range(ksize):  # the C loop's running sum, left to right (np.sum pairs terms up)
        total = total + weights[:, t]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None],
                       weights)
    scaled = weights * (1 << PRECISION_BITS)
    fixed = np.where(weights < 0, np.trunc(-0.5 + scaled), np.trunc(0.5 + scaled))
    return np.minimum(xmin[:, None] + taps, in_size - 1), fixed.astype(np.int32)


@functools.lru_cache(maxsize=256)
def _device_coefficients(in_size: int, out_size: int, device: torch.device, index_dtype=torch.int64):
    index, weights = coefficients(in_size, out_size)
    return torch.from_numpy(index).to(device, index_dtype), torch.from_numpy(weights).to(device)


@functools.cache
def _triton_resize():
    """encoder.triton_resize, or None where Triton is missing or switched off."""
    if not triton_enabled():
        return None
    try:
        from . import triton_resize
    except ImportError:
        return None
    return triton_resize


def _resample(x: torch.Tensor, dim: int, out_size: int) -> torch.Tensor:
    """One pass over `dim` (1 = rows, 2 = columns) of uint8 x [C, H, W]: on a GPU one Triton
    kernel (`triton_resize`), else torch's ops (`_resample_torch`, the reference twin)."""
    kernel = _triton_resize() if x.is_cuda and FUSED_PASS else None
    if kernel is None:
        return _resample_torch(x, dim, out_size)
    index, weights = _device_coefficients(x.shape[dim], out_size, x.device, torch.int32)
    return kernel.resample(x, dim, index, weights, PRECISION_BITS)


def _resample_torch(x: torch.Tensor, dim: int, out_size: int) -> torch.Tensor:
    """`_resample` in torch's ops: the taps gathered, multiplied, summed, shifted, clamped."""
    index, weights = _device_coefficients(x.shape[dim], out_size, x.device)
    ksize = weights.shape[1]
    other = 3 - dim  # the dimension chunked to bound the gathered temporary
    step = max(1, _CHUNK_ELEMENTS // (x.shape[0] * out_size * ksize))
    parts = []
    for start in range(0, x.shape[other], step):
        part = x.narrow(other, start, min(step, x.shape[other] - start))
        taps = part.index_select(dim, index.reshape(-1))  # uint8; * int32 weights promotes
        if dim == 2:  # [C, h, out * k] -> [C, h, out, k]
            total = (taps.view(*taps.shape[:2], out_size, ksize) * weights).sum(-1, dtype=torch.int32)
        else:  # [C, out * k, w] -> [C, out, k, w]
            total = (taps.view(taps.shape[0], out_size, ksize, -1) * weights[..., None]).sum(
                2, dtype=torch.int32)
        parts.append(((total + _HALF) >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=other)


def _passes(x: torch.Tensor, size: tuple[int, int], vertical_first: bool) -> torch.Tensor:
    w, h = size
    order = ((1, h), (2, w)) if vertical_first else ((2, w), (1, h))
    for dim, out_size in order:
        if x.shape[dim] != out_size:
            x = _resample(x, dim, out_size)
    return x


def _shrinks_height_first(src: tuple[int, int], size: tuple[int, int]) -> bool:
    """Pillow >= 13's order (PR #9549): vertical first when the height loses more than twice
    as many pixels as the width."""
    (w_in, h_in), (w, h) = src, size
    return h < h_in and h_in - h > 2 * (w_in - w)


@functools.cache
def pil_rule() -> str | None:
    """Which pass order the installed Pillow follows: "horizontal-first" (Pillow <= 12),
    "height-first" (Pillow 13's rule) or None (neither: the exact path is off). One probe
    resize of a small noise image whose two orders differ."""
    from PIL import Image
    src, size = (57, 285), (9, 156)  # height shrinks by 129, width by 48: the orders differ
    noise = np.random.default_rng(0).integers(0, 256, (src[1], src[0]), dtype=np.uint8)
    reference = torch.from_numpy(np.asarray(Image.fromarray(noise).resize(size, Image.BICUBIC)).copy())
    x = torch.from_numpy(noise)[None]
    for rule, vertical_first in (("horizontal-first", False), ("height-first", True)):
        if torch.equal(_passes(x, size, vertical_first)[0], reference):
            return rule
    return None


def supported() -> bool:
    return pil_rule() is not None


def warm_up(device) -> None:
    """One tiny resize on `device`, both passes: inside `compile_ahead` (graphs.py) the pass's
    Triton kernel compiles with the encoder's, instead of in the first request's views."""
    _passes(torch.zeros((1, 4, 6), dtype=torch.uint8, device=device), (3, 2), vertical_first=False)


def resize(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """PIL's `Image.resize(size, BICUBIC)` of uint8 pixels [C, H, W] (any device), exactly."""
    rule = pil_rule()
    if rule is None:
        raise RuntimeError("this Pillow's bicubic resize matches neither known pass order: "
                           "make the views with PIL (exact_resize off)")
    if pixels.dtype != torch.uint8 or pixels.dim() != 3:
        raise TypeError(f"resize takes uint8 [C, H, W] pixels, got {pixels.dtype} {tuple(pixels.shape)}")
    src = (pixels.shape[2], pixels.shape[1])
    return _passes(pixels, size, rule == "height-first" and _shrinks_height_first(src, size))
