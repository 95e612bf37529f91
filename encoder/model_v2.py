"""DeepSeek-OCR-2's vision encoder ("DeepEncoder V2"): SAM ViT-B -> Qwen2 encoder over
[SAM tokens ; learned queries] -> linear projector. The sibling of `model.py`'s DeepEncoder.

Modules are named after the released checkpoint keys (minus the leading `model.`):
`sam_model.*` (SAM exactly as DeepSeek-OCR's, `model.Sam`, except that `net_3` ends at the Qwen2
width, 896), `qwen2_model.*` (`qwen2_model.py`), `projector.layers` (Linear 896 -> 1280) and
`view_seperator` (sic); there is no `image_newline`. Spec: DeepSeek-OCR-2's
`DeepSeek-OCR2-vllm/deepseek_ocr2.py` and `deepencoderv2/{sam_vary_sdpa,qwen2_d2e,build_linear}.py`.

Every view becomes as many tokens as its learned queries, whatever its grid: 256 for a 1024²
view, 144 for a 768² crop. An image's sequence is its crops' tokens (row-major, each crop's in
order), then its global view's, then the view separator: no newline tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import EncoderV2Args
from .model import Projector, Sam, SamEncoder
from .qwen2_model import Qwen2Encoder
from .tiling import DEEPSEEK_OCR_2


class DeepEncoderV2(SamEncoder):
    """Per-view tokens and the two batched paths a graph engine captures, as DeepEncoder's."""

    tiling = DEEPSEEK_OCR_2  # its views: 768² crops, no newline tokens

    def __init__(self, args: EncoderV2Args):
        super().__init__()
        self.args = args
        self.sam_model = Sam(args)  # reads only the sam_* fields, which EncoderV2Args shares
        self.qwen2_model = Qwen2Encoder(args)
        self.projector = Projector(args)
        self.view_seperator = nn.Parameter(torch.zeros(args.n_embed))  # sic

    def features(self, pixels):
        """The queries' states before the projector: [B, (S/64)^2, qwen2_width]."""
        return self.qwen2_model(self.sam_features(pixels))  # SAM: [B, C, g, g]

    def forward_views(self, pixels):
        """[B, 3, S, S] -> [B, (S/64)^2, n_embed]: S = 1024 (256 tokens) or 768 (144)."""
        return self.projector(self.features(pixels))

    def forward_global(self, global_views):
        """Global path: [N, 3, 1024, 1024] -> [N, 256, n_embed] (no newline column)."""
        return self.forward_views(global_views)

    def forward_local(self, crops):
        """Local path: [P, 3, 768, 768] -> [P, 144, n_embed] (concatenated per image afterwards)."""
        return self.forward_views(crops)

    def sequence(self, global_tokens, crop_tokens, grid: tuple[int, int]) -> torch.Tensor:
        """One image's sequence with this encoder's view separator (`assemble_v2`)."""
        return assemble_v2(global_tokens, crop_tokens, grid, self.view_seperator)


def assemble_v2(global_tokens, crop_tokens, grid: tuple[int, int], separator) -> torch.Tensor:
    """One image's DeepSeek-OCR-2 sequence: every crop's tokens, then the global view's, then
    the view separator. [144 * w_t * h_t + 256 + 1, D] tiled, [256 + 1, D] untiled.

    global_tokens [256, D] from forward_global; crop_tokens [P, 144, D] (P = w_t * h_t, crops in
    row-major order, as cut) from forward_local, ignored when the image is untiled (grid (1, 1));
    separator [D] is the model's `view_seperator`. Plain tensor math, as `model.assemble`.
    """
    d = global_tokens.shape[-1]
    parts = []
    w_t, h_t = grid
    if (w_t, h_t) != (1, 1):
        assert crop_tokens.shape[0] == w_t * h_t, f"{crop_tokens.shape[0]} crops for a {w_t}x{h_t} grid"
        # Crop by crop, each crop's tokens in its own order: DeepSeek-OCR-2 does not stitch the
        # crops' token grids into one image-wide grid as DeepSeek-OCR does.
        parts.append(crop_tokens.reshape(-1, d))
    parts += [global_tokens, separator.to(global_tokens.dtype)[None]]
    return torch.cat(parts, dim=0)
