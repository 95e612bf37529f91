"""SAM attention with decomposed relative positions (MViTv2), without the dense bias.

SAM's logits are `scale * q.k + rel_h[q, kh] + rel_w[q, kw]`, where `rel_h = q . Rh[qh - kh]` and
`rel_w = q . Rw[qw - kw]` are small tables ([.., HW, H] and [.., HW, W]). DeepSeek's code adds them
into a dense `[B, heads, HW, HW]` bias and hands it to SDPA as `attn_mask`: ~400 MB per 1024²
image per global block in bf16, and a slow masked kernel.

The fused path never builds that tensor. It folds the two terms into the dot product:

    q' = [q * scale, rel_h, rel_w]         k' = [k, onehot(row of key), onehot(col of key)]
    q' . k' = scale * q.k + rel_h[q, kh] + rel_w[q, kw]

and runs plain SDPA (flash / memory-efficient kernels) with `scale=1` and `v` zero-padded to the
same head dim. Extra cost: head dim 64 -> 64 + H + W (192 for a 64x64 grid, 96 for 14x14 windows).
It is exact in real arithmetic and runs anywhere (CPU fp32 included).

On CUDA in bf16/fp16 the fused path uses a Triton flash-attention kernel that adds the two terms
inside the kernel (`triton_relpos.py`), keeping the real head dim; `supports()` guards it and
DEEPSEEK_OCR_TRITON=0 switches it off. On CPUs, which are bound by arithmetic rather than memory,
the augmented head dim costs 3x (real dims) to 9x (the tiny model's) the dot products, so the
fused path there adds the bias a block of queries at a time (`blocked_relpos_attention`: the bias
of ~4 MB of logits at once, never the whole [HW, HW]; a tiny global block 2.5x faster).
`dense_relpos_attention` is the reference twin used in tests and benchmarks;
DEEPSEEK_OCR_ATTENTION=dense forces it everywhere, =augmented the augmented SDPA.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from common import switches

from .derived import derived_table

IMPLS = ("fused", "augmented", "blocked", "dense")  # fused: Triton on CUDA, else augmented; blocked on CPUs


def default_impl() -> str:
    return switches.value("DEEPSEEK_OCR_ATTENTION")


def rel_table(size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """The [2*size-1, C] table of one axis: row d is the offset qi - ki = d - (size - 1).

    Tables are stored for one length (2*14-1 windowed, 2*64-1 global); other grids (a global
    block on a 40x40 crop needs 79) linearly interpolate it in fp32, as SAM's `get_rel_pos`.
    """
    length = 2 * size - 1
    if rel_pos.shape[0] != length:
        resized = F.interpolate(rel_pos.float().t()[None], size=length, mode="linear")
        rel_pos = resized[0].t().to(rel_pos.dtype)
    return rel_pos


def rel_table_as(size: int, rel_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`rel_table` in `dtype`, made once per size (`derived_table`): what the kernels read."""
    return derived_table(rel_pos, (size, dtype), lambda: rel_table(size, rel_pos).to(dtype))


def get_rel_pos(size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """Relative-position table [size(q), size(k), C] for a query/key axis of `size` positions."""
    return rel_table(size, rel_pos)[_relative_index(size, rel_pos.device)]


@functools.cache
def _relative_index(size: int, device: torch.device) -> torch.Tensor:
    """[size, size] table of qi - ki + size - 1 (cached: eager runs are launch-bound). A normal
    tensor even when first made under inference mode, so that later autograd can use it."""
    with torch.inference_mode(False):
        idx = torch.arange(size, device=device)
        return idx[:, None] - idx[None, :] + (size - 1)


def rel_pos_terms(q, rel_pos_h, rel_pos_w, hw: tuple[int, int]):
    """rel_h [B, n, HW, H] and rel_w [B, n, HW, W] for q [B, n, HW, C] on an H x W grid."""
    h, w = hw
    bsz, n, _, c = q.shape
    r_q = q.reshape(bsz, n, h, w, c)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", r_q, get_rel_pos(h, rel_pos_h).to(q.dtype))
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", r_q, get_rel_pos(w, rel_pos_w).to(q.dtype))
    return rel_h.reshape(bsz, n, h * w, h), rel_w.reshape(bsz, n, h * w, w)


def dense_relpos_attention(q, k, v, rel_h, rel_w):
    """Reference: materialise the [B, n, HW, HW] bias and pass it as attn_mask (DeepSeek's way)."""
    bsz, n, hw, h = rel_h.shape
    bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(bsz, n, hw, hw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


# One block of queries' bias on a CPU: rows enough for ~4 MB of it, which stays in cache until
# the attention reads it (at 64 MB, past the caches, a tiny global block was 2x slower).
BLOCK_BYTES = 4 << 20


def blocked_relpos_attention(q, k, v, rel_h, rel_w, block_bytes: int = BLOCK_BYTES):
    """`dense_relpos_attention` a block of query rows at a time (each row's softmax is its own):
    the bias of those rows only, so memory stays bounded while the dot products keep the real
    head dim (the CPU's way: `augmented_relpos_attention` multiplies them)."""
    bsz, n, hw, h = rel_h.shape
    # Rows per block from one image's size, not the batch's: an image's result must not depend
    # on what it is batched with (SDPA's sums over a block can differ in the last bit by its rows).
    rows = max(1, block_bytes // (n * hw * q.element_size()))
    if rows >= hw:
        return dense_relpos_attention(q, k, v, rel_h, rel_w)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    # One buffer for every block (a fresh one each cost 1.6x); fresh ones where autograd records.
    reuse = not (torch.is_grad_enabled() and (rel_h.requires_grad or rel_w.requires_grad))
    block = q.new_empty(bsz, n, rows, h, rel_w.shape[-1]) if reuse else None
    for start in range(0, hw, rows):
        end = min(start + rows, hw)
        terms = rel_h[:, :, start:end, :, None], rel_w[:, :, start:end, None, :]
        bias = torch.add(*terms, out=block[:, :, :end - start]) if reuse else torch.add(*terms)
        out[:, :, start:end] = F.scaled_dot_product_attention(q[:, :, start:end], k, v,
                                                              attn_mask=bias.flatten(-2))
    return out


def _key_onehots(hw: tuple[int, int], device, dtype):
    """onehot(row) [HW, H] and onehot(col) [HW, W] of each key position (row-major grid)."""
    h, w = hw
    rows = torch.eye(h, device=device, dtype=dtype).repeat_interleave(w, dim=0)
    cols = torch.eye(w, device=device, dtype=dtype).repeat(h, 1)
    return rows, cols


def triton_enabled() -> bool:
    """DEEPSEEK_OCR_TRITON=0 turns every Triton kernel off (common/switches.py)."""
    return switches.triton()


@functools.cache
def _triton():
    """The attention kernels' module, or None where Triton is missing or switched off. (An
    import statement, not importlib: torch.compile traces this, fullgraph included.)"""
    if not triton_enabled():
        return None
    try:
        from . import triton_relpos
    except ImportError:  # CPU-only installs have no Triton
        return None
    return triton_relpos


def _kernel_runs(t: torch.Tensor, head_dim: int) -> bool:
    """The Triton kernels' limits: CUDA, half precision, these head dims, Triton on."""
    return (t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and head_dim in (16, 32, 64, 128)
            and _triton() is not None)


def kernel_takes(q, k, v) -> bool:
    """Whether the Triton kernels take these q, k, v (else the SDPA paths run)."""
    return _kernel_runs(q, q.shape[-1]) and all(t.stride(-1) == 1 for t in (q, k, v))


def supports(q, rel_h, rel_w) -> bool:
    """Whether the Triton attention kernel takes these inputs (else the SDPA paths do)."""
    return (kernel_takes(q, q, q) and rel_h.dtype == rel_w.dtype == q.dtype
            and all(t.stride(-1) == 1 for t in (rel_h, rel_w)))


def fused_relpos_attention(q, k, v, rel_h, rel_w):
    """The dense-bias result without the [HW, HW] tensor: Triton kernel, else augmented SDPA on
    CUDA, blocks of the bias on CPUs."""
    if supports(q, rel_h, rel_w) and k.stride(-1) == 1 and v.stride(-1) == 1:
        if torch.compiler.is_compiling():  # the custom op: torch.compile keeps it opaque
            return _triton().relpos_attention_triton(q, k, v, rel_h, rel_w)
        # Eager and graph capture launch the kernel directly: a custom op's first call imports
        # torch._dynamo (~900 modules, seconds of every encoder replica's start-up).
        return _triton().relpos_attention(q, k, v, rel_h, rel_w)
    if q.device.type == "cpu":
        return blocked_relpos_attention(q, k, v, rel_h, rel_w)
    return augmented_relpos_attention(q, k, v, rel_h, rel_w)


# SAM's windowed blocks on the whole grid in the Triton kernels (no pad / partition copies);
# DEEPSEEK_OCR_WINDOW_KERNEL=0 (or this flag) keeps the reference's windows for the fused path.
WINDOWS_IN_KERNEL = switches.on("DEEPSEEK_OCR_WINDOW_KERNEL")


def windows_in_kernel(x: torch.Tensor, head_dim: int, impl: str) -> bool:
    """Whether a windowed block on activations `x` runs `windowed_relpos_attention`."""
    return (impl == "fused" and WINDOWS_IN_KERNEL and not torch.compiler.is_compiling()
            and _kernel_runs(x, head_dim))


def windowed_relpos_attention(q, k, v, rel_pos_h, rel_pos_w, side: int, grid: tuple[int, int],
                              qkv_bias: torch.Tensor | None):
    """SAM's attention in side x side windows, q, k, v [B, n, H*W, C] of the whole (unpadded)
    grid: the windows are addressed in place, and the zero tokens padding the last windows
    attend as the reference's do, as keys and values equal to the projection's bias."""
    kernels = _triton()
    n, c = q.shape[1], q.shape[3]
    bias = (q.new_zeros(3, n, c) if qkv_bias is None else qkv_bias.to(q.dtype).view(3, n, c))
    windows = kernels.Windows(side, grid, bias[1], bias[2])
    return kernels.windowed_attention(q, k, v, rel_table_as(side, rel_pos_h, q.dtype),
                                      rel_table_as(side, rel_pos_w, q.dtype), windows)


def augmented_relpos_attention(q, k, v, rel_h, rel_w):
    """SDPA over rel-augmented q/k: same result as the dense bias, no [HW, HW] tensor."""
    bsz, n, hw, c = q.shape
    h, w = rel_h.shape[-1], rel_w.shape[-1]
    rows, cols = _key_onehots((h, w), q.device, q.dtype)
    dim = c + h + w
    pad = -dim % 8  # flash / memory-efficient kernels want head dims in multiples of 8
    q_aug = torch.cat([q * c ** -0.5, rel_h, rel_w], dim=-1)
    k_aug = torch.cat([k, rows.expand(bsz, n, hw, h), cols.expand(bsz, n, hw, w)], dim=-1)
    if pad:
        q_aug, k_aug = F.pad(q_aug, (0, pad)), F.pad(k_aug, (0, pad))
    v_aug = F.pad(v, (0, dim + pad - c))
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, scale=1.0)
    return out[..., :c]


def relpos_attention(q, k, v, rel_pos_h, rel_pos_w, hw: tuple[int, int], impl: str = "fused"):
    """Attention over an H x W grid with decomposed rel-pos; q, k, v are [B, n, HW, C]."""
    if impl == "fused" and not torch.compiler.is_compiling() and kernel_takes(q, k, v):
        # Both terms from one Triton kernel reading q where the projection left it: the
        # einsums copy the strided q twice and permute their outputs (~15% of a global view's
        # time in copies). Under torch.compile the einsums stay (Inductor fuses them).
        return _triton().attention(q, k, v, rel_table_as(hw[0], rel_pos_h, q.dtype),
                                   rel_table_as(hw[1], rel_pos_w, q.dtype), hw)
    rel_h, rel_w = rel_pos_terms(q, rel_pos_h, rel_pos_w, hw)
    if impl == "fused":
        return fused_relpos_attention(q, k, v, rel_h, rel_w)
    if impl == "augmented":
        return augmented_relpos_attention(q, k, v, rel_h, rel_w)
    if impl == "blocked":
        return blocked_relpos_attention(q, k, v, rel_h, rel_w)
    if impl == "dense":
        return dense_relpos_attention(q, k, v, rel_h, rel_w)
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
