"""FLOPs of one view (2 per multiply-add), counted from the config, for MFU figures.

Conservative "useful" count: every layer on the real tokens only (the zero padding of windowed
blocks, 64 -> 70, and the rel-pos terms are left out), attention at the real head dim (the fused
path's extra rel-pos columns are overhead, not model FLOPs). Real dims: 1.10 TFLOP per 1024²
view, 0.38 per 640² crop (DeepSeek-OCR notes: 1.085 / 0.374).
"""
from __future__ import annotations

from .config import EncoderArgs


def view_flops(args: EncoderArgs, size: int) -> int:
    g = size // args.patch_size  # SAM grid side
    n, c, w = g * g, args.sam_width, args.sam_window
    flops = 2 * n * 3 * args.patch_size ** 2 * c  # patch embedding
    for i in range(args.sam_depth):
        keys = n if i in args.sam_global_blocks else w * w  # global grid or one window
        flops += 2 * n * 4 * c * c + 4 * n * keys * c + 2 * n * 2 * c * args.sam_mlp_dim
    out, (c2, c3) = args.sam_out_chans, args.downsample_channels
    flops += 2 * n * c * out + 2 * n * out * out * 9  # neck
    flops += 2 * (n // 4) * out * c2 * 9 + 2 * (n // 16) * c2 * c3 * 9  # net_2, net_3
    t, d = n // 16 + 1, args.clip_width
    flops += args.clip_depth * (2 * t * 4 * d * d + 4 * t * t * d + 2 * t * 2 * d * args.clip_mlp_dim)
    return flops + 2 * (t - 1) * args.projector_in * args.n_embed
