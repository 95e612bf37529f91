"""Language-model configuration: DeepSeek-3B-MoE's real values by default, a tiny preset for tests.

The released `config.json` carries the language fields twice, at top level and under
`language_config` (DeepseekOCRConfig subclasses DeepseekV2Config); we prefer the latter. The model
is DeepSeek-V1-style MoE with plain MHA (`use_mla: false`), greedy softmax routing without
renormalisation; anything else in the config is refused rather than silently mis-served.

Two families share this decoder. DeepSeek-OCR's (and DeepSeek-OCR-2's) attends causally to the
whole sequence. baidu's Unlimited-OCR (top-level architecture `UnlimitedOCRForCausalLM`, model_type
`unlimited-ocr`) has the same weights' layout but reference sliding-window attention (R-SWA, its
`SlidingWindowLlamaAttention`): a token attends to every prompt token (images and text) and to
the last `sliding_window` tokens of the sequence, so a generated token sees the prompt plus the
newest `sliding_window` generated tokens, itself included. Its release states the window as
`sliding_window_size` (top level and in `language_config`) and `sliding_window` (top level); its
code reads `sliding_window_size or sliding_window` of the top level, transformers'
`unlimited_ocr` reads the top-level `sliding_window`. We read all of them and refuse a config
where they disagree, an Unlimited-OCR config without a window, and a window on an architecture
whose code has none.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = ("deepseek-ocr", "unlimited-ocr")
UNLIMITED_OCR_ARCHITECTURE = "UnlimitedOCRForCausalLM"
WINDOW_KEYS = ("sliding_window_size", "sliding_window")


@dataclass(frozen=True)
class DecoderArgs:
    vocab_size: int = 129280
    hidden: int = 1280
    n_layers: int = 12
    n_heads: int = 10  # MHA: as many KV heads; head_dim = hidden / n_heads = 128
    intermediate: int = 6848  # dense MLP of the first `first_k_dense` layers
    first_k_dense: int = 1
    n_experts: int = 64
    moe_intermediate: int = 896
    top_k: int = 6
    n_shared_experts: int = 2  # fused into one MLP of width n_shared * moe_intermediate
    routed_scaling: float = 1.0
    rope_theta: float = 10000.0  # absent from the released config; DeepSeek's code default
    max_positions: int = 8192
    rms_eps: float = 1e-6
    bos_id: int = 0
    eos_id: int = 1
    family: str = "deepseek-ocr"  # "unlimited-ocr": R-SWA attention, its own n-gram defaults
    # R-SWA (Unlimited-OCR only): generated tokens see the prompt and the last `sliding_window`
    # tokens; None: plain causal attention (DeepSeek-OCR)
    sliding_window: int | None = None
    name: str = field(default="deepseek-ocr", compare=False)

    def __post_init__(self):
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by {self.n_heads} heads")
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.n_experts}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
        if (window is not None) != (self.family == "unlimited-ocr"):
            raise ValueError(f"family {self.family!r} with sliding_window {window!r}: Unlimited-OCR "
                             "needs its R-SWA window and DeepSeek-OCR has none")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense and self.n_experts > 0

    @classmethod
    def tiny(cls, sliding_window: int | None = None) -> "DecoderArgs":
        """Real vocabulary size (so the real special-token ids exist), tiny everything else;
        with `sliding_window`, Unlimited-OCR's decoder (R-SWA) at that window."""
        family = "deepseek-ocr" if sliding_window is None else "unlimited-ocr"
        return cls(hidden=64, n_layers=3, n_heads=4, intermediate=128, n_experts=8,
                   moe_intermediate=32, top_k=2, max_positions=4096, family=family,
                   sliding_window=sliding_window, name="tiny-random")

    @classmethod
    def unlimited_ocr(cls) -> "DecoderArgs":
        """baidu's Unlimited-OCR: DeepSeek-OCR's decoder dims, a 32k context, R-SWA window 128."""
        return cls(max_positions=32768, family="unlimited-ocr", sliding_window=128, name="unlimited-ocr")

    @classmethod
    def from_config(cls, config: dict) -> "DecoderArgs":
        lang = config.get("language_config") or config
        checks = {"use_mla": (False, None), "topk_method": ("greedy", None),
                  "norm_topk_prob": (False, None), "scoring_func": ("softmax", None)}
        for key, allowed in checks.items():
            if lang.get(key, allowed[0]) not in allowed:
                raise ValueError(f"language config {key}={lang[key]!r} is not supported "
                                 f"(DeepSeek-OCR uses {allowed[0]!r})")
        if lang.get("num_key_value_heads", lang.get("num_attention_heads")) != lang.get("num_attention_heads"):
            raise ValueError("only MHA (num_key_value_heads == num_attention_heads) is supported")
        family, window = _family_and_window(config, lang)
        d = cls()
        try:
            return cls(
                vocab_size=lang["vocab_size"], hidden=lang["hidden_size"],
                n_layers=lang["num_hidden_layers"], n_heads=lang["num_attention_heads"],
                intermediate=lang["intermediate_size"],
                first_k_dense=lang.get("first_k_dense_replace", d.first_k_dense),
                n_experts=lang.get("n_routed_experts") or 0,
                moe_intermediate=lang.get("moe_intermediate_size", d.moe_intermediate),
                top_k=lang.get("num_experts_per_tok", d.top_k),
                n_shared_experts=lang.get("n_shared_experts", d.n_shared_experts),
                routed_scaling=lang.get("routed_scaling_factor", d.routed_scaling),
                rope_theta=lang.get("rope_theta", d.rope_theta),
                max_positions=lang.get("max_position_embeddings", d.max_positions),
                rms_eps=lang.get("rms_norm_eps", d.rms_eps),
                bos_id=lang.get("bos_token_id", d.bos_id), eos_id=lang.get("eos_token_id", d.eos_id),
                family=family, sliding_window=window, name=config.get("_name", family))
        except KeyError as e:
            raise ValueError(f"config.json lacks language field {e.args[0]!r}") from None

    def to_config(self) -> dict:
        """Language fields as the release writes them (top level and under language_config);
        Unlimited-OCR's in its release's layout, with its architecture and window."""
        if self.family == "unlimited-ocr":
            return self._unlimited_ocr_config()
        lang = {
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_heads, "intermediate_size": self.intermediate,
            "first_k_dense_replace": self.first_k_dense, "n_routed_experts": self.n_experts,
            "moe_intermediate_size": self.moe_intermediate, "num_experts_per_tok": self.top_k,
            "n_shared_experts": self.n_shared_experts, "routed_scaling_factor": self.routed_scaling,
            "topk_method": "greedy", "norm_topk_prob": False, "scoring_func": "softmax",
            "use_mla": False, "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_eps, "bos_token_id": self.bos_id, "eos_token_id": self.eos_id,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        }
        if self.rope_theta != 10000.0:
            lang["rope_theta"] = self.rope_theta
        top = {k: v for k, v in lang.items() if k not in ("architectures", "model_type")}
        return top | {"language_config": lang}

    def _unlimited_ocr_config(self) -> dict:
        """baidu/Unlimited-OCR's config.json, its language part: the fields its release writes
        (DeepseekV2Config's defaults stand for the rest: RMSNorm eps 1e-6, RoPE theta 10000,
        softmax routing without renormalisation, scaling 1.0; written only where they differ)."""
        lang = {
            "architectures": ["DeepseekOCRForCausalLM"], "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id, "first_k_dense_replace": self.first_k_dense,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate, "kv_lora_rank": None,
            "lm_head": True, "max_position_embeddings": self.max_positions,
            "moe_intermediate_size": self.moe_intermediate, "n_group": 1,
            "n_routed_experts": self.n_experts, "n_shared_experts": self.n_shared_experts,
            "num_attention_heads": self.n_heads, "num_experts_per_tok": self.top_k,
            "num_hidden_layers": self.n_layers, "num_key_value_heads": self.n_heads,
            "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "rm_head": False,
            "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16", "use_mla": False,
            "v_head_dim": self.head_dim, "vocab_size": self.vocab_size,
            "sliding_window_size": self.sliding_window,
        }
        d = DecoderArgs()
        for key, value, default in (("rms_norm_eps", self.rms_eps, d.rms_eps),
                                    ("rope_theta", self.rope_theta, d.rope_theta),
                                    ("routed_scaling_factor", self.routed_scaling, d.routed_scaling)):
            if value != default:
                lang[key] = value
        top = {k: v for k, v in lang.items() if k not in ("architectures", "torch_dtype")}
        return top | {"architectures": [UNLIMITED_OCR_ARCHITECTURE], "model_type": "unlimited-ocr",
                      "sliding_window": self.sliding_window, "torch_dtype": "bfloat16",
                      "language_config": lang}


def _family_and_window(config: dict, lang: dict) -> tuple[str, int | None]:
    """The decoder family from the top-level architecture (or model_type), and the R-SWA window
    from every place a release states it; contradictions are refused."""
    architectures = config.get("architectures") or []
    unlimited = (UNLIMITED_OCR_ARCHITECTURE in architectures
                 or config.get("model_type") in ("unlimited-ocr", "unlimited_ocr"))
    sources = [("", config)] + ([("language_config.", lang)] if lang is not config else [])
    stated = {where + key: fields[key] for where, fields in sources for key in WINDOW_KEYS
              if fields.get(key) is not None}
    if len(set(map(repr, stated.values()))) > 1:
        raise ValueError(f"config.json states different sliding windows: {stated}")
    window = next(iter(stated.values()), None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"config.json sliding window must be a positive int, got {stated}")
    if unlimited and window is None:
        raise ValueError(f"an Unlimited-OCR config ({UNLIMITED_OCR_ARCHITECTURE}) must state its "
                         f"sliding window ({' or '.join(WINDOW_KEYS)}): its attention is R-SWA")
    if not unlimited and window is not None:
        raise ValueError(f"config.json states sliding window {stated}, but architecture "
                         f"{architectures or 'unnamed'} has no sliding-window attention (only "
                         f"{UNLIMITED_OCR_ARCHITECTURE} does)")
    return ("unlimited-ocr" if unlimited else "deepseek-ocr"), window
