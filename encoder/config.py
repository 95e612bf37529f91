"""Vision encoder configuration: DeepSeek-OCR's real values by default, a tiny preset for CPU tests.

The released `config.json` (model_type `deepseek_vl_v2`) describes the towers under
`vision_config.width["sam_vit_b"]` and `vision_config.width["clip-l-14-224"]` and the projector
under `projector_config`. DeepSeek's code hard-codes the rest (window 14, neck 256 channels,
MLP ratio 4); we read two optional extra fields (`window_size`, `out_chans`) that only our own
tiny checkpoints write, and fall back to the released values otherwise.

DeepSeek-OCR-2 (`EncoderV2Args`, at the end) says the same model_type; `is_ocr2_config` tells
the two apart.
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
        sam, clip, projector = _released_widths(config, "clip", "clip-l-14-224")
        default = cls()
        args = cls(
            **_sam_fields(sam, default),
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
        clip = {"heads": self.clip_heads, "image_size": self.clip_image_size, "layers": self.clip_depth,
                "patch_size": self.clip_patch_size, "width": self.clip_width}
        return _released_layout(self, "DeepseekOCRForCausalLM", "deeplip_b_l", {"clip-l-14-224": clip})


# --- DeepSeek-OCR-2 ("DeepEncoder V2") ------------------------------------------------------------
OCR2_ARCHITECTURE = "DeepseekOCR2ForCausalLM"


def is_ocr2_config(config: dict) -> bool:
    """Whether a released-layout `config.json` dict is DeepSeek-OCR-2's (DeepEncoder V2) rather
    than DeepSeek-OCR's. Both say model_type `deepseek_vl_v2`; OCR-2's names its architecture
    `DeepseekOCR2ForCausalLM`, its vision model `deepencoderv2` and a `qwen2-0-5b` tower (any one
    suffices: checkpoints re-saved by other tools keep some of them, SGLang checks the last two)."""
    vision = config.get("vision_config") if isinstance(config, dict) else None
    vision = vision if isinstance(vision, dict) else {}
    widths = vision.get("width") if isinstance(vision.get("width"), dict) else {}
    return (OCR2_ARCHITECTURE in (config.get("architectures") or [])
            or vision.get("model_name") == "deepencoderv2"
            or any(str(k).startswith("qwen2") for k in widths))


@dataclass(frozen=True)
class EncoderV2Args:
    """DeepEncoder V2: SAM ViT-B (as DeepSeek-OCR's, but `net_3` ends at the Qwen2 width) ->
    a Qwen2-0.5B-shaped transformer run as an encoder over [SAM tokens ; learned queries] ->
    linear projector. Defaults are DeepSeek-OCR-2's (its `deepencoderv2/` hard-codes them; the
    released config.json names only the SAM widths, `qwen2-0-5b.dim` and the projector).

    The SAM fields carry the names of `EncoderArgs`'s, so `encoder.model.Sam` builds from either.
    """
    # SAM ViT-B (checkpoint prefix model.sam_model.)
    sam_width: int = 768
    sam_depth: int = 12
    sam_heads: int = 12
    sam_global_blocks: tuple[int, ...] = (2, 5, 8, 11)
    sam_window: int = 14
    sam_out_chans: int = 256  # neck width
    downsample_channels: tuple[int, int] = (512, 896)  # net_2, net_3 (= qwen2_width)
    patch_size: int = 16
    sam_image_size: int = 1024  # pos_embed is [1, 64, 64, width]; 768 crops interpolate to 48x48
    sam_eps: float = 1e-6
    # Qwen2-0.5B as an encoder (checkpoint prefix model.qwen2_model.); no token embedding
    qwen2_width: int = 896
    qwen2_depth: int = 24
    qwen2_heads: int = 14
    qwen2_kv_heads: int = 2
    qwen2_mlp_dim: int = 4864
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    # projector: Linear(qwen2_width -> n_embed) = the decoder's width
    n_embed: int = 1280
    name: str = field(default="deepseek-ocr-2", compare=False)

    def __post_init__(self):
        if self.downsample_channels[-1] != self.qwen2_width:
            # SAM's last feature map is the Qwen2 stage's input, so the widths must agree.
            raise ValueError(f"downsample_channels[-1] {self.downsample_channels[-1]} must equal "
                             f"qwen2_width {self.qwen2_width}")
        if self.sam_width % self.sam_heads:
            raise ValueError(f"sam width {self.sam_width} is not divisible by {self.sam_heads} heads")
        if self.qwen2_width % self.qwen2_heads or self.qwen2_heads % self.qwen2_kv_heads:
            raise ValueError(f"qwen2 width {self.qwen2_width}, {self.qwen2_heads} heads and "
                             f"{self.qwen2_kv_heads} key/value heads do not divide evenly")
        if self.qwen2_head_dim % 2:
            raise ValueError(f"qwen2 head dim {self.qwen2_head_dim} is odd: RoPE rotates pairs")
        bad = [i for i in self.sam_global_blocks if not 0 <= i < self.sam_depth]
        if bad:
            raise ValueError(f"sam_global_blocks {bad} outside 0..{self.sam_depth - 1}")

    @property
    def sam_mlp_dim(self) -> int:
        return 4 * self.sam_width

    @property
    def sam_pos_grid(self) -> int:
        return self.sam_image_size // self.patch_size

    @property
    def qwen2_head_dim(self) -> int:
        return self.qwen2_width // self.qwen2_heads

    @property
    def projector_in(self) -> int:
        return self.qwen2_width

    @classmethod
    def tiny(cls) -> "EncoderV2Args":
        """Small widths and depths (same geometry, so token counts stay real) for CPU tests;
        grouped key/value heads as in the real model."""
        return cls(sam_width=32, sam_depth=4, sam_heads=2, sam_global_blocks=(1, 3),
                   sam_out_chans=16, downsample_channels=(32, 64), qwen2_width=64, qwen2_depth=2,
                   qwen2_heads=4, qwen2_kv_heads=2, qwen2_mlp_dim=128, n_embed=80,
                   name="tiny-random-ocr2")

    # -- released config.json layout --------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict) -> "EncoderV2Args":
        """Read the vision/projector fields of DeepSeek-OCR-2's released `config.json` dict."""
        sam, qwen2, projector = _released_widths(config, "qwen2", "qwen2-0-5b")
        try:
            width = qwen2["dim"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"config.json lacks vision_config.width.qwen2-0-5b.dim ({e!r})") from None
        default = cls()
        # The released config copies DeepSeek-OCR's SAM `downsample_channels` ([512, 1024]);
        # DeepSeek-OCR-2's code ignores it and builds net_3 with the Qwen2 width as its output
        # (the released net_3 weight is [896, 512, 3, 3]). The code is what was trained: the
        # last entry is the Qwen2 width, whatever the config says.
        net_2 = sam.get("downsample_channels", default.downsample_channels)[0]
        args = cls(
            **_sam_fields(sam, default),
            downsample_channels=(net_2, width),
            qwen2_width=width,
            # Only our own tiny checkpoints write these; the release relies on the code's values.
            qwen2_depth=qwen2.get("layers", default.qwen2_depth),
            qwen2_heads=qwen2.get("heads", default.qwen2_heads),
            qwen2_kv_heads=qwen2.get("kv_heads", default.qwen2_kv_heads),
            qwen2_mlp_dim=qwen2.get("intermediate_size", default.qwen2_mlp_dim),
            n_embed=projector["n_embed"], name=config.get("_name", default.name),
        )
        if projector.get("input_dim", args.projector_in) != args.projector_in:
            raise ValueError(f"projector_config.input_dim {projector['input_dim']} != "
                             f"qwen2-0-5b.dim {args.projector_in}")
        return args

    def to_config(self) -> dict:
        """The vision/projector part of a released-layout DeepSeek-OCR-2 `config.json`."""
        qwen2 = {"dim": self.qwen2_width}
        default = type(self)()
        extras = {"layers": (self.qwen2_depth, default.qwen2_depth),
                  "heads": (self.qwen2_heads, default.qwen2_heads),
                  "kv_heads": (self.qwen2_kv_heads, default.qwen2_kv_heads),
                  "intermediate_size": (self.qwen2_mlp_dim, default.qwen2_mlp_dim)}
        if any(value != released for value, released in extras.values()):
            qwen2 |= {k: value for k, (value, _) in extras.items()}
        return _released_layout(self, OCR2_ARCHITECTURE, "deepencoderv2", {"qwen2-0-5b": qwen2})


__all__ = ["EncoderArgs", "EncoderV2Args", "is_ocr2_config"]


def _released_widths(config: dict, tower: str, tower_name: str) -> tuple[dict, dict, dict]:
    """SAM's and the second tower's entries of `vision_config.width` (`tower`: the prefix of
    its key, CLIP's or Qwen2's), and the linear projector's config; ValueError naming what a
    config.json lacks."""
    try:
        widths = config["vision_config"]["width"]
        sam = next(v for k, v in widths.items() if k.startswith("sam"))
        second = next(v for k, v in widths.items() if k.startswith(tower))
        projector = config["projector_config"]
    except (KeyError, StopIteration, TypeError, AttributeError) as e:
        raise ValueError(f"config.json lacks vision_config.width.{{sam_vit_b,{tower_name}}} "
                         f"or projector_config ({e!r})") from None
    if projector.get("projector_type", "linear") != "linear":
        raise ValueError(f"unsupported projector_type {projector['projector_type']!r}")
    return sam, second, projector


def _sam_fields(sam: dict, default) -> dict:
    """The SAM fields both families read from `vision_config.width.sam_vit_b`."""
    return dict(sam_width=sam["width"], sam_depth=sam["layers"], sam_heads=sam["heads"],
                sam_global_blocks=tuple(sam.get("global_attn_indexes", default.sam_global_blocks)),
                sam_window=sam.get("window_size", default.sam_window),
                sam_out_chans=sam.get("out_chans", default.sam_out_chans))


def _released_layout(args: EncoderArgs | EncoderV2Args, architecture: str, model_name: str,
                     widths: dict) -> dict:
    """The released `config.json` around a family's own vision widths: SAM's, the projector,
    the architecture's names."""
    sam = {"downsample_channels": list(args.downsample_channels),
           "global_attn_indexes": list(args.sam_global_blocks),
           "heads": args.sam_heads, "layers": args.sam_depth, "width": args.sam_width}
    if args.sam_window != 14 or args.sam_out_chans != 256:
        sam |= {"window_size": args.sam_window, "out_chans": args.sam_out_chans}
    return {
        "model_type": "deepseek_vl_v2",
        "architectures": [architecture],
        "tile_tag": "2D",
        "global_view_pos": "head",
        "candidate_resolutions": [[1024, 1024]],
        "projector_config": {"input_dim": args.projector_in, "model_type": "mlp_projector",
                             "n_embed": args.n_embed, "projector_type": "linear"},
        "vision_config": {"image_size": args.sam_image_size, "mlp_ratio": 3.7362,
                          "model_name": model_name, "model_type": "vision",
                          "width": {**widths, "sam_vit_b": sam}},
        "_name": args.name,
    }
