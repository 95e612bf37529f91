"""FLOPs of one view (2 per multiply-add), counted from the config, for MFU figures.

Conservative "useful" count: every layer on the real tokens only (the zero padding of windowed
blocks, 64 -> 70, and the rel-pos terms are left out), attention at the real head dim (the fused
path's extra rel-pos columns are overhead, not model FLOPs). Real dims: 1.10 TFLOP per 1024²
view, 0.38 per 640² crop (DeepSeek-OCR notes: 1.085 / 0.374). DeepSeek-OCR 2 (`EncoderV2Args`):
its Qwen2 stage counts attention only where its mask lets a row look (image rows over the image
tokens, query i over the image tokens and queries 0..i), not the square SDPA computes.
"""
from __future__ import annotations

from .config import EncoderArgs, EncoderV2Args


def sam_flops(args: EncoderArgs | EncoderV2Args, size: int) -> int:
    """SAM ViT-B on a size² view, its neck and the two downsampling convolutions."""
    g = size // args.patch_size  # SAM grid side
    n, c, w = g * g, args.sam_width, args.sam_window
    flops = 2 * n * 3 * args.patch_size ** 2 * c  # patch embedding
    for i in range(args.sam_depth):
        keys = n if i in args.sam_global_blocks else w * w  # global grid or one window
        flops += 2 * n * 4 * c * c + 4 * n * keys * c + 2 * n * 2 * c * args.sam_mlp_dim
    out, (c2, c3) = args.sam_out_chans, args.downsample_channels
    flops += 2 * n * c * out + 2 * n * out * out * 9  # neck
    return flops + 2 * (n // 4) * out * c2 * 9 + 2 * (n // 16) * c2 * c3 * 9  # net_2, net_3


def view_flops(args: EncoderArgs | EncoderV2Args, size: int) -> int:
    if isinstance(args, EncoderV2Args):
        return view_flops_v2(args, size)
    n = (size // args.patch_size) ** 2
    t, d = n // 16 + 1, args.clip_width
    flops = sam_flops(args, size)
    flops += args.clip_depth * (2 * t * 4 * d * d + 4 * t * t * d + 2 * t * 2 * d * args.clip_mlp_dim)
    return flops + 2 * (t - 1) * args.projector_in * args.n_embed


def view_flops_v2(args: EncoderV2Args, size: int) -> int:
    """DeepEncoder V2: SAM, then 24 Qwen2 layers over [n SAM tokens ; n queries], then the
    projector on the queries."""
    n = (size // args.patch_size) ** 2 // 16  # SAM tokens after the 4x4 compressor = queries
    t, c, hd = 2 * n, args.qwen2_width, args.qwen2_head_dim
    kv = args.qwen2_kv_heads * hd
    attended = n * n + n * n + n * (n + 1) // 2  # image rows; query rows (all images + causal)
    per_layer = (2 * t * (2 * c * c + 2 * c * kv)  # q, o; k, v
                 + 4 * attended * args.qwen2_heads * hd  # scores and values
                 + 2 * t * 3 * c * args.qwen2_mlp_dim)  # gate, up, down
    return sam_flops(args, size) + args.qwen2_depth * per_layer + 2 * n * args.projector_in * args.n_embed
