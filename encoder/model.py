"""DeepSeek-OCR's vision encoder ("DeepEncoder"): SAM ViT-B -> CLIP-L -> linear projector.

Modules are named after the released checkpoint keys (minus the leading `model.`), so
`model.sam_model.blocks.3.attn.rel_pos_h` loads with strict=True. Upstream typos
(`pre_layrnorm`, `view_seperator`) are kept on purpose. Spec: DeepSeek's `deepencoder.py`
(SAM from segment-anything's `image_encoder.py`, CLIP from DeepSeek's `clip_sdpa.py`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from common import switches

from .config import EncoderArgs
from .derived import derived_table
from .relpos_attention import (default_impl, relpos_attention, triton_enabled, windowed_relpos_attention,
                               windows_in_kernel)
from .tiling import DEEPSEEK_OCR
from .views import normalize

# LayerNorms (and the residual add before one) and CLIP's quick_gelu in Triton kernels where
# they apply (`triton_norm.py`, `triton_activation.py`); DEEPSEEK_OCR_NORM_KERNEL=0 and
# DEEPSEEK_OCR_ACTIVATION_KERNEL=0 (or these flags) keep torch's ops, the reference.
NORM_KERNEL = switches.on("DEEPSEEK_OCR_NORM_KERNEL")
ACTIVATION_KERNEL = switches.on("DEEPSEEK_OCR_ACTIVATION_KERNEL")
# SAM's lin1 and GELU as one cuBLASLt matmul with a GELU epilogue on a GPU in half precision
# (`linear_gelu`): the [tokens, 3072] activation is written once, instead of written, then read
# and written again by a separate GELU (~7% of a page batch's GPU time). cuBLASLt's GELU is the
# tanh form, within 4.8e-4 of SAM's exact erf GELU (under one bf16 rounding of its outputs);
# DEEPSEEK_OCR_GELU_EPILOGUE=0 (or this flag) keeps nn.Linear + F.gelu, the reference.
GELU_EPILOGUE = switches.on("DEEPSEEK_OCR_GELU_EPILOGUE")
# The residual add after each MLP (SAM's 12 blocks, CLIP's 24 layers) done by the MLP's second
# matmul on a GPU in half precision (`add_norm_mlp`): the add + norm kernel before the MLP stores
# the residual stream with that matmul's bias already in it, and the matmul accumulates into it
# (beta = 1), so `x + mlp(h)` is no kernel of its own (36 a view, each reading two [tokens,
# width] tensors and writing one). The bias is rounded into the stream before the products are
# added, not with them (one layer lands 1.13-1.14x as far from fp32 as with the separate add;
# the whole encoder 1.54e-2, within its test's bound); DEEPSEEK_OCR_RESIDUAL_EPILOGUE=0 (or
# this flag) keeps the add, the reference.
RESIDUAL_EPILOGUE = switches.on("DEEPSEEK_OCR_RESIDUAL_EPILOGUE")
# The pixels normalised and unfolded into SAM's patch rows in one Triton pass on a GPU in half
# precision (`triton_pixels.py`, bit for bit torch's six kernels); DEEPSEEK_OCR_PATCH_KERNEL=0
# (or this flag) keeps torch's ops, the reference.
PATCH_KERNEL = switches.on("DEEPSEEK_OCR_PATCH_KERNEL")


@functools.cache
def _pointwise_kernels():
    """(triton_norm, triton_activation, triton_pixels), or None where Triton is missing or
    switched off."""
    if not triton_enabled():
        return None
    try:
        from . import triton_activation, triton_norm, triton_pixels
    except ImportError:  # CPU-only installs have no Triton
        return None
    return triton_norm, triton_activation, triton_pixels


def _takes(x: torch.Tensor, flag: bool) -> bool:
    """Whether a pointwise kernel (switched on by `flag`) takes `x`: never under torch.compile,
    which fuses these ops itself."""
    return (flag and not torch.compiler.is_compiling() and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous()
            and _pointwise_kernels() is not None)


def patch_kernel_takes(pixels: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether SAM's patch embedding in `dtype` takes these pixels as uint8 (PATCH_KERNEL)."""
    return (PATCH_KERNEL and not torch.compiler.is_compiling() and pixels.is_cuda
            and pixels.dtype == torch.uint8 and dtype in (torch.bfloat16, torch.float16)
            and pixels.dim() == 4 and pixels.shape[1] == 3 and pixels.is_contiguous()
            and _pointwise_kernels() is not None)


def norm(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    if not _takes(x, NORM_KERNEL):
        return module(x)
    return _pointwise_kernels()[0].layer_norm(x, module.weight, module.bias, module.eps)


def _add_norm_takes(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the norm kernel adds `residual` to `x` in its pass (NORM_KERNEL)."""
    return (_takes(x, NORM_KERNEL) and residual.is_contiguous() and residual.shape == x.shape
            and residual.dtype == x.dtype)


def add_norm(module: nn.LayerNorm, x: torch.Tensor, residual: torch.Tensor):
    """(x + residual, module(x + residual))."""
    if not _add_norm_takes(x, residual):
        x = x + residual
        return x, module(x)
    return _pointwise_kernels()[0].layer_norm(x, module.weight, module.bias, module.eps,
                                              residual=residual)


def add_norm_mlp(module: nn.LayerNorm, x: torch.Tensor, residual: torch.Tensor, hidden,
                 out: nn.Linear) -> torch.Tensor:
    """A block's second half: s = x + residual, then s + out(hidden(module(s)))."""
    if RESIDUAL_EPILOGUE and out.bias is not None and _add_norm_takes(x, residual):
        total, h = _pointwise_kernels()[0].layer_norm(x, module.weight, module.bias, module.eps,
                                                      residual=residual, shift=out.bias)
        inner = hidden(h)
        total.view(-1, total.shape[-1]).addmm_(inner.reshape(-1, inner.shape[-1]), out.weight.t())
        return total
    x, h = add_norm(module, x, residual)
    return x + out(hidden(h))


def _epilogue_takes(linear: nn.Linear, x: torch.Tensor) -> bool:
    return (GELU_EPILOGUE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and linear.bias is not None and not torch.compiler.is_compiling())


def linear_gelu(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """gelu(linear(x)): on a GPU in half precision (GELU_EPILOGUE) one matmul whose epilogue adds
    the bias and applies GELU's tanh form; else the two ops, exact GELU."""
    if not _epilogue_takes(linear, x):
        return F.gelu(linear(x))
    out = torch._addmm_activation(linear.bias, x.reshape(-1, x.shape[-1]), linear.weight.t(),
                                  use_gelu=True)
    return out.view(*x.shape[:-1], out.shape[-1])


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's x * sigmoid(1.702 x)."""
    if not _takes(x, ACTIVATION_KERNEL):
        return x * torch.sigmoid(1.702 * x)
    return _pointwise_kernels()[1].quick_gelu(x)


def interpolate_grid(table: torch.Tensor, size: int) -> torch.Tensor:
    """Bicubic-antialias resize of a [1, C, g, g] position grid to size x size, in fp32."""
    if table.shape[-1] == size:
        return table
    out = F.interpolate(table.float(), size=(size, size), mode="bicubic", antialias=True,
                        align_corners=False)
    return out.to(table.dtype)


# --- SAM ViT-B ---------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, width: int):
        super().__init__()
        self.patch = patch_size
        self.proj = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        """Normalised pixels [B, 3, S, S] in the weights' dtype, or uint8 pixels where the
        patch kernel takes them (`patch_kernel_takes`) -> [B, S/16, S/16, width]."""
        # The stride-16 conv as one matmul over unfolded patches: cuDNN picks a slow generic
        # kernel for 3 input channels in bf16 (~2 ms for 8 views on an H200).
        bsz, c, s, _ = x.shape
        g, p = s // self.patch, self.patch
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)
        if x.dtype == torch.uint8:
            patches = _pointwise_kernels()[2].normalized_patches(x, p, weight.dtype)
        else:
            patches = x.reshape(bsz, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(bsz, g, g, c * p * p)
        return F.linear(patches, weight, self.proj.bias)


class SamAttention(nn.Module):
    def __init__(self, width: int, heads: int, grid: int):
        super().__init__()
        self.heads = heads
        head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * grid - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * grid - 1, head_dim))
        self.impl = default_impl()

    def forward(self, x, window: int = 0):
        """x [B, H, W, C] -> [B, H, W, C]: attention over x's grid, or with `window` in window x
        window tiles of it, addressed in place by the Triton kernels (`windows_in_kernel`)."""
        bsz, h, w, c = x.shape
        qkv = self.qkv(x).reshape(bsz, h * w, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, n, HW, C/n] each
        if window:
            out = windowed_relpos_attention(q, k, v, self.rel_pos_h, self.rel_pos_w, window, (h, w),
                                            self.qkv.bias)
        else:
            out = relpos_attention(q, k, v, self.rel_pos_h, self.rel_pos_w, (h, w), self.impl)
        return self.proj(out.transpose(1, 2).reshape(bsz, h, w, c))


class SamMLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.lin1 = nn.Linear(width, hidden)
        self.lin2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.lin2(self.hidden(x))

    def hidden(self, x):
        return linear_gelu(self.lin1, x)


def window_partition(x, size: int):
    """[B, H, W, C] -> [B * nWin, size, size, C], zero-padding H and W up to multiples of size."""
    bsz, h, w, c = x.shape
    x = F.pad(x, (0, 0, 0, -w % size, 0, -h % size))
    hp, wp = x.shape[1], x.shape[2]
    x = x.reshape(bsz, hp // size, size, wp // size, size, c).transpose(2, 3)
    return x.reshape(-1, size, size, c), (hp, wp)


def window_unpartition(windows, size: int, padded: tuple[int, int], hw: tuple[int, int]):
    hp, wp = padded
    c = windows.shape[-1]
    x = windows.reshape(-1, hp // size, wp // size, size, size, c).transpose(2, 3)
    return x.reshape(-1, hp, wp, c)[:, :hw[0], :hw[1]]


class SamBlock(nn.Module):
    def __init__(self, args: EncoderArgs, window: int):
        super().__init__()
        self.window = window  # 0 = global attention over the whole grid
        self.norm1 = nn.LayerNorm(args.sam_width, eps=args.sam_eps)
        self.attn = SamAttention(args.sam_width, args.sam_heads, window or args.sam_pos_grid)
        self.norm2 = nn.LayerNorm(args.sam_width, eps=args.sam_eps)
        self.mlp = SamMLP(args.sam_width, args.sam_mlp_dim)

    def forward(self, x):
        h = norm(self.norm1, x)
        if self.window and windows_in_kernel(h, self.attn.rel_pos_h.shape[-1], self.attn.impl):
            h = self.attn(h, window=self.window)
        elif self.window:
            hw = h.shape[1:3]
            # Padded tokens stay in the windows as zero vectors and are attended to, as upstream.
            h, padded = window_partition(h, self.window)
            h = window_unpartition(self.attn(h), self.window, padded, hw)
        else:
            h = self.attn(h)
        return add_norm_mlp(self.norm2, x, h, self.mlp.hidden, self.mlp.lin2)


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of an NCHW map."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        x = F.layer_norm(x.permute(0, 2, 3, 1), x.shape[1:2], self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Sam(nn.Module):
    """pixels [B, 3, S, S] -> features [B, downsample_channels[-1], S/64, S/64]."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        g = args.sam_pos_grid
        self.patch_embed = PatchEmbed(args.patch_size, args.sam_width)
        self.pos_embed = nn.Parameter(torch.zeros(1, g, g, args.sam_width))
        self.blocks = nn.ModuleList(
            SamBlock(args, 0 if i in args.sam_global_blocks else args.sam_window)
            for i in range(args.sam_depth))
        out = args.sam_out_chans
        self.neck = nn.Sequential(
            nn.Conv2d(args.sam_width, out, kernel_size=1, bias=False), LayerNorm2d(out, args.sam_eps),
            nn.Conv2d(out, out, kernel_size=3, padding=1, bias=False), LayerNorm2d(out, args.sam_eps))
        c2, c3 = args.downsample_channels
        self.net_2 = nn.Conv2d(out, c2, kernel_size=3, stride=2, padding=1, bias=False)
        self.net_3 = nn.Conv2d(c2, c3, kernel_size=3, stride=2, padding=1, bias=False)

    def forward(self, x):
        x = self.patch_embed(x)  # [B, g, g, C]
        g = x.shape[1]
        pos = derived_table(self.pos_embed, (g,), lambda: interpolate_grid(
            self.pos_embed.permute(0, 3, 1, 2), g).permute(0, 2, 3, 1))
        x = x + pos
        for block in self.blocks:
            x = block(x)
        x = self.neck(x.permute(0, 3, 1, 2))
        return self.net_3(self.net_2(x))


# --- CLIP-L, fed SAM features ------------------------------------------------------------------
class ClipEmbeddings(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(args.clip_width))
        # In the checkpoint but never run: SAM's feature map replaces CLIP's patch embedding.
        self.patch_embedding = nn.Conv2d(3, args.clip_width, kernel_size=args.clip_patch_size,
                                         stride=args.clip_patch_size, bias=False)
        self.position_embedding = nn.Embedding(args.clip_pos_grid ** 2 + 1, args.clip_width)

    def forward(self, features):
        bsz, c, g, _ = features.shape
        x = features.flatten(2).transpose(1, 2)  # [B, g*g, C]
        x = torch.cat([self.class_embedding.to(x.dtype).expand(bsz, 1, c), x], dim=1)
        table = self.position_embedding.weight  # [1 + G*G, C]: CLS row, then the G x G grid
        return x + derived_table(table, (g,), lambda: self._positions(table, g))

    @staticmethod
    def _positions(table: torch.Tensor, g: int) -> torch.Tensor:
        """[1 + g*g, C]: the CLS row, then the position grid resized to g x g."""
        side, c = math.isqrt(table.shape[0] - 1), table.shape[1]
        grid = table[1:].reshape(1, side, side, c).permute(0, 3, 1, 2)
        grid = interpolate_grid(grid, g).permute(0, 2, 3, 1).reshape(g * g, c)
        return torch.cat([table[:1], grid], dim=0)


class ClipAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x):
        bsz, t, c = x.shape
        qkv = self.qkv_proj(x).reshape(bsz, t, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(bsz, t, c))


class ClipMLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(self.hidden(x))

    def hidden(self, x):
        return quick_gelu(self.fc1(x))


class ClipLayer(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.clip_width, eps=args.clip_eps)
        self.self_attn = ClipAttention(args.clip_width, args.clip_heads)
        self.layer_norm2 = nn.LayerNorm(args.clip_width, eps=args.clip_eps)
        self.mlp = ClipMLP(args.clip_width, args.clip_mlp_dim)

    def forward(self, x):
        attended = self.self_attn(norm(self.layer_norm1, x))
        return add_norm_mlp(self.layer_norm2, x, attended, self.mlp.hidden, self.mlp.fc2)


class ClipTransformer(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(args) for _ in range(args.clip_depth))


class Clip(nn.Module):
    """SAM features [B, C, g, g] -> [B, 1 + g*g, C] (CLS first; no post-LayerNorm)."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.embeddings = ClipEmbeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.clip_width, eps=args.clip_eps)  # sic
        self.transformer = ClipTransformer(args)

    def forward(self, features):
        x = norm(self.pre_layrnorm, self.embeddings(features))
        for layer in self.transformer.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.layers = nn.Linear(args.projector_in, args.n_embed)  # "linear" projector_type

    def forward(self, x):
        return self.layers(x)


# --- the encoder and its two paths ----------------------------------------------------------------
class SamEncoder(nn.Module):
    """What both families' encoders share: SAM first (`sam_model`), a projector last, and
    pixels entering as uint8 [B, 3, S, S], normalised here on the encoder's device (so only
    uint8 crosses process boundaries; float input is taken as already normalised)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.layers.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.projector.layers.weight.device

    def set_attention(self, impl: str):
        """Switch every SAM block between the fused and the dense-bias reference attention."""
        for block in self.sam_model.blocks:
            block.attn.impl = impl
        return self

    def sam_features(self, pixels):
        """SAM's features [B, C, g, g] of the views (normalised here unless the patch kernel
        takes the uint8 pixels itself)."""
        if not patch_kernel_takes(pixels, self.dtype):
            pixels = (normalize(pixels) if pixels.dtype == torch.uint8 else pixels).to(self.dtype)
        return self.sam_model(pixels)


class DeepEncoder(SamEncoder):
    """DeepSeek-OCR's: per-view features and the two batched paths the graph engine captures."""

    tiling = DEEPSEEK_OCR  # its views: 640² crops, newline tokens

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.sam_model = Sam(args)
        self.vision_model = Clip(args)
        self.projector = Projector(args)
        self.image_newline = nn.Parameter(torch.zeros(args.n_embed))
        self.view_seperator = nn.Parameter(torch.zeros(args.n_embed))  # sic

    def features(self, pixels):
        """Fused per-view features before the projector: [B, g*g, clip_width + sam_channels]."""
        sam = self.sam_features(pixels)  # [B, C, g, g]
        clip = self.vision_model(sam)  # [B, 1 + g*g, C]
        return torch.cat([clip[:, 1:], sam.flatten(2).transpose(1, 2)], dim=-1)  # CLIP, then SAM

    def forward_views(self, pixels):
        """[B, 3, S, S] -> [B, (S/64)^2, n_embed]."""
        return self.projector(self.features(pixels))

    def forward_global(self, global_views):
        """Global path: [B, 3, S, S] -> [B, g*(g+1), n_embed], a newline after each grid row."""
        x = self.forward_views(global_views)
        bsz, t, d = x.shape
        g = math.isqrt(t)
        newline = self.image_newline.to(x.dtype).expand(bsz, g, 1, d)
        return torch.cat([x.reshape(bsz, g, g, d), newline], dim=2).reshape(bsz, g * (g + 1), d)

    def forward_local(self, crops):
        """Local path: [P, 3, 640, 640] -> [P, 100, n_embed] (stitched per image afterwards)."""
        return self.forward_views(crops)

    def sequence(self, global_tokens, crop_tokens, grid: tuple[int, int]) -> torch.Tensor:
        """One image's sequence with this encoder's newline and separator (`assemble`); the same
        method as DeepEncoderV2's, so a caller holding either encoder need not know which."""
        return assemble(global_tokens, crop_tokens, grid, self.image_newline, self.view_seperator)


def assemble(global_tokens, crop_tokens, grid: tuple[int, int], newline, separator):
    """One image's sequence: stitched local grid + newlines, then global, then separator.

    global_tokens [g*(g+1), D] from forward_global; crop_tokens [P, m*m, D] (P = w_t * h_t,
    row-major) from forward_local, ignored when the image is untiled (grid (1, 1)); newline and
    separator [D] are the model's `image_newline` and `view_seperator`. Plain tensor math, so the
    router assembles on CPU without the model; the engine (`DualPathEncoder.encode`), the one
    Encoder deployment (on its device) and the router are its callers.
    """
    d = global_tokens.shape[-1]
    parts = []
    w_t, h_t = grid
    if (w_t, h_t) != (1, 1):
        p, t, _ = crop_tokens.shape
        assert p == w_t * h_t, f"{p} crops for a {w_t}x{h_t} grid"
        m = math.isqrt(t)
        local = crop_tokens.reshape(h_t, w_t, m, m, d).permute(0, 2, 1, 3, 4).reshape(h_t * m, w_t * m, d)
        rows = newline.to(local.dtype).expand(h_t * m, 1, d)
        parts.append(torch.cat([local, rows], dim=1).reshape(-1, d))
    parts += [global_tokens, separator.to(global_tokens.dtype)[None]]
    return torch.cat(parts, dim=0)
