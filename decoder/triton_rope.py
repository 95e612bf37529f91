"""RoPE and the KV-cache write of a forward in one Triton kernel (CUDA; Triton's interpreter on CPU).

The reference path (decoder/model.py `Attention` with `rope_kernel = "torch"`) rotates q and k
on a head-major view of the packed q/k/v projection (a multiply, a roll and an addcmul, each over
strided memory), then writes k and v into the cache's pages (a prefill pads, transposes and
scatters them; a decode step scatters one position per row): about ten passes over a prefill's
activations a layer (~9 ms of a 16 x 1,000-token prefill on an H200) and five kernels a layer in
a decode step. Here a program takes up to PAGE_TOKENS consecutive positions of one row and one
head: it reads q, k and v from the projection's output once, writes rotated q and k token-major
([B, T, 2n, d], the layout attention reads through a transposed view) and k (rotated) and v
straight into the row's pages. Rows start at position 0 (a prefill) or at their own position (a
decode step's one token); positions past a row's pages go to the scratch page, as in the
reference. Numerics: the reference's roundings are kept (x * cos rounded to the activation dtype
before the sin term is added, as torch's multiply then addcmul), so the two agree to the last
bit but for fused multiply-adds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_compile import launch_kernel

from .pages import FP8, FP8_MAX, PAGE_TOKENS


# Not specialised on the lengths, which vary from call to call (each new value divisible by 16,
# or 1, would otherwise compile the kernel again while a request waits).
@triton.jit(do_not_specialize=["t_len", "blocks_per_row"])
def _rope_cache_kernel(QKV, COS, SIN, START, QK, KC, VC, TABLE, t_len, blocks_per_row,
                       s_qkv_t, s_qk_t, s_cs_t, s_c_page, s_c_head, s_table,
                       N_HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_T: tl.constexpr, HAS_START: tl.constexpr, CACHE_MAX: tl.constexpr):
    row_block = tl.program_id(0)
    h = tl.program_id(1)
    b = row_block // blocks_per_row
    t = (row_block % blocks_per_row) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < t_len
    if HAS_START:
        pos = t + tl.load(START + b)
    else:
        pos = t
    cols = tl.arange(0, D)
    rolled = (cols + D // 2) % D  # roll(x, d/2): the other half; the sign is in sin
    token = (b * t_len + t).to(tl.int64)[:, None]
    mask = t_ok[:, None]
    cos = tl.load(COS + token * s_cs_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + token * s_cs_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    page = tl.load(TABLE + b * s_table + pos // PAGE, mask=t_ok, other=0).to(tl.int64)
    cache = (page * s_c_page + h * s_c_head + (pos % PAGE) * D)[:, None] + cols[None, :]
    for part in tl.static_range(2):  # q, then k
        src = QKV + token * s_qkv_t + (part * N_HEADS + h) * D
        x = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x_rolled = tl.load(src + rolled[None, :], mask=mask, other=0.0).to(tl.float32)
        x_cos = (x * cos).to(QK.dtype.element_ty).to(tl.float32)
        out = (x_cos + x_rolled * sin).to(QK.dtype.element_ty)
        tl.store(QK + token * s_qk_t + (part * N_HEADS + h) * D + cols[None, :], out, mask=mask)
        if part == 1:
            tl.store(KC + cache, _to_cache(out, KC.dtype.element_ty, CACHE_MAX), mask=mask)
    v = tl.load(QKV + token * s_qkv_t + (2 * N_HEADS + h) * D + cols[None, :], mask=mask, other=0.0)
    tl.store(VC + cache, _to_cache(v, VC.dtype.element_ty, CACHE_MAX), mask=mask)


@triton.jit
def _to_cache(x, dtype: tl.constexpr, CACHE_MAX: tl.constexpr):
    """x in the cache's type; an fp8 cache (CACHE_MAX its largest value) saturates first, as
    kv_cache.stored does (a plain conversion of a larger value is no number)."""
    if CACHE_MAX > 0:
        x = tl.clamp(x.to(tl.float32), -CACHE_MAX, CACHE_MAX)
    return x.to(dtype)


def rope_and_write_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, table_rows: torch.Tensor,
                         n_heads: int, start: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, T, 3 n d] (the packed projection, contiguous), cos/sin [B, T, d] from
    `model.rope`; k_cache/v_cache one layer's pages [P, n, PAGE_TOKENS, d]; table_rows [B,
    pages] the rows' page-table rows; start [B] each row's first position (None: 0) -> rotated
    q and k [B, T, 2n, d], with k and v written into the rows' pages."""
    b, t, width = qkv.shape
    d = width // (3 * n_heads)
    cos, sin = cos.contiguous(), sin.contiguous()  # [B, T, d] as `rope` makes them: no copy
    assert qkv.is_contiguous() and cos.shape == (b, t, d)
    assert k_cache.stride(-1) == 1 and k_cache.stride(-2) == d and k_cache.stride() == v_cache.stride()
    qk = torch.empty(b, t, 2 * n_heads, d, device=qkv.device, dtype=qkv.dtype)
    block_t = min(PAGE_TOKENS, max(16, triton.next_power_of_2(t)))  # a decode step: t = 1
    blocks_per_row = triton.cdiv(t, block_t)
    launch_kernel(
        _rope_cache_kernel, (b * blocks_per_row, n_heads),
        qkv, cos, sin, table_rows if start is None else start, qk, k_cache, v_cache, table_rows, t,
        blocks_per_row, qkv.stride(1), qk.stride(1), cos.stride(1), k_cache.stride(0),
        k_cache.stride(1), table_rows.stride(0), N_HEADS=n_heads, D=d, PAGE=PAGE_TOKENS,
        BLOCK_T=block_t, HAS_START=start is not None,
        CACHE_MAX=FP8_MAX if k_cache.dtype == FP8 else 0.0)
    return qk
