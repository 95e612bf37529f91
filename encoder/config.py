"""Vision encoder configuration: DeepSeek-OCR's real values by default, a tiny preset for CPU tests.

The released `config.json` (model_type `deepseek_vl_v2`) describes the towers under
`vision_config.width["sam_vit_b"]` and `vision_config.width["clip-l-14-224"]` and the projector
under `projector_config`. DeepSeek's code hard-codes the rest (window 14, neck 256 channels,
MLP ratio 4); we read two optional extra fields (`window_size`, `out_chans`) that only our own
tiny checkpoints write, and fall back to the released values otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncoderArgs:
    # SAM ViT-B (checkpoint prefix model.sam_model.)
    sam_width: int = 768
    sam_depth: int = 12
    sam_heads: int = 12
    sam_global_blocks: tuple[int, ...] = (2, 5, 8, 11)
    sam_window: int = 14
    sam_out_chans: int = 256  # neck width
    downsample_channels: tuple[int, int] = (512, 1024)  # net_2, net_3
    # CLIP-L (checkpoint prefix model.vision_model.); fed SAM features instead of patches
    clip_width: int = 1024
    clip_depth: int = 24
    clip_heads: int = 16
    # projector: Linear(clip_width + downsample_channels[-1] -> n_embed) = the decoder's width
    n_embed: int = 1280
    # Geometry both towers were pre-trained at; position tables are interpolated for other sizes.
    patch_size: int = 16  # SAM patch; SAM + net_2 + net_3 reduce a side by 64
    sam_image_size: int = 1024  # pos_embed is [1, 64, 64, width]
    clip_patch_size: int = 14  # only for the unused patch_embedding weight
    clip_image_size: int = 224  # position_embedding has (224/14)^2 + 1 = 257 rows
    sam_eps: float = 1e-6
    clip_eps: float = 1e-5
    name: str = field(default="deepseek-ocr", compare=False)

    def __post_init__(self):
        if self.clip_width != self.downsample_channels[-1]:
            # SAM's last feature map is CLIP's patch embedding, so the widths must agree.
            raise ValueError(f"clip_width {self.clip_width} must equal downsample_channels[-1] "
                             f"{self.downsample_channels[-1]}")
        for width, heads, tower in ((self.sam_width, self.sam_heads, "sam"),
                                    (self.clip_width, self.clip_heads, "clip")):
            if width % heads:
                raise ValueError(f"{tower} width {width} is not divisible by {heads} heads")
        bad = [i for i in self.sam_global_blocks if not 0 <= i < self.sam_depth]
        if bad:
            raise ValueError(f"sam_global_blocks {bad} outside 0..{self.sam_depth - 1}")

    @property
    def sam_mlp_dim(self) -> int:
        return 4 * self.sam_width

    @property
    def clip_mlp_dim(self) -> int:
        return 4 * self.clip_width

    @property
    def projector_in(self) -> int:
        return self.clip_width + self.downsample_channels[-1]

    @property
    def sam_pos_grid(self) -> int:
        return self.sam_image_size // self.patch_size

    @property
    def clip_pos_grid(self) -> int:
        return self.clip_image_size // self.clip_patch_size

    @classmethod
    def tiny(cls) -> "EncoderArgs":
        """Small widths and depths (same geometry, so token counts stay real) for CPU tests."""
        return cls(sam_width=32, sam_depth=4, sam_heads=2, sam_global_blocks=(1, 3),
                   sam_out_chans=16, downsample_channels=(32, 64), clip_width=64, clip_depth=2,
                   clip_heads=4, n_embed=64, name="tiny-random")

    # -- released config.json layout --------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict) -> "EncoderArgs":
        """Read the vision/projector fields of a released-layout `config.json` dict."""
        try:
            widths = config["vision_config"]["width"]
            sam = next(v for k, v in widths.items() if k.startswith("sam"))
            clip = next(v for k, v in widths.items() if k.startswith("clip"))
            projector = config["projector_config"]
        except (KeyError, StopIteration, TypeError, AttributeError) as e:
            raise ValueError("config.json lacks vision_config.width.{sam_vit_b,clip-l-14-224} "
                             f"or projector_config ({e!r})") from None
        if projector.get("projector_type", "linear") != "linear":
            raise ValueError(f"unsupported projector_type {projector['projector_type']!r}")
        default = cls()
        args = cls(
            sam_width=sam["width"], sam_depth=sam["layers"], sam_heads=sam["heads"],
            sam_global_blocks=tuple(sam.get("global_attn_indexes", default.sam_global_blocks)),
            sam_window=sam.get("window_size", default.sam_window),
            sam_out_chans=sam.get("out_chans", default.sam_out_chans),
            downsample_channels=tuple(sam.get("downsample_channels", default.downsample_channels)),
            clip_width=clip["width"], clip_depth=clip["layers"], clip_heads=clip["heads"],
            clip_patch_size=clip.get("patch_size", default.clip_patch_size),
            clip_image_size=clip.get("image_size", default.clip_image_size),
            n_embed=projector["n_embed"], name=config.get("_name", default.name),
        )
        if projector.get("input_dim", args.projector_in) != args.projector_in:
            raise ValueError(f"projector_config.input_dim {projector['input_dim']} != "
                             f"clip width + SAM channels {args.projector_in}")
        return args

    def to_config(self) -> dict:
        """The vision/projector part of a released-layout `config.json`."""
        sam = {"downsample_channels": list(self.downsample_channels),
               "global_attn_indexes": list(self.sam_global_blocks),
               "heads": self.sam_heads, "layers": self.sam_depth, "width": self.sam_width}
        if self.sam_window != 14 or self.sam_out_chans != 256:
            sam |= {"window_size": self.sam_window, "out_chans": self.sam_out_chans}
        return {
            "model_type": "deepseek_vl_v2",
            "architectures": ["DeepseekOCRForCausalLM"],
            "tile_tag": "2D",
            "global_view_pos": "head",
            "candidate_resolutions": [[1024, 1024]],
            "projector_config": {"input_dim": self.projector_in, "model_type": "mlp_projector",
                                 "n_embed": self.n_embed, "projector_type": "linear"},
            "vision_config": {
                "image_size": self.sam_image_size, "mlp_ratio": 3.7362,
                "model_name": "deeplip_b_l", "model_type": "vision",
                "width": {
                    "clip-l-14-224": {"heads": self.clip_heads, "image_size": self.clip_image_size,
                                      "layers": self.clip_depth, "patch_size": self.clip_patch_size,
                                      "width": self.clip_width},
                    "sam_vit_b": sam,
                },
            },
            "_name": self.name,
        }


__all__ = ["EncoderArgs"]
