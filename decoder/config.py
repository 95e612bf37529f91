"""Language-model configuration: DeepSeek-3B-MoE's real values by default, a tiny preset for tests.

The released `config.json` carries the language fields twice, at top level and under
`language_config` (DeepseekOCRConfig subclasses DeepseekV2Config); we prefer the latter. The model
is DeepSeek-V1-style MoE with plain MHA (`use_mla: false`), greedy softmax routing without
renormalisation; anything else in the config is refused rather than silently mis-served.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    name: str = field(default="deepseek-ocr", compare=False)

    def __post_init__(self):
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by {self.n_heads} heads")
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.n_experts}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense and self.n_experts > 0

    @classmethod
    def tiny(cls) -> "DecoderArgs":
        """Real vocabulary size (so the real special-token ids exist), tiny everything else."""
        return cls(hidden=64, n_layers=3, n_heads=4, intermediate=128, n_experts=8,
                   moe_intermediate=32, top_k=2, max_positions=4096, name="tiny-random")

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
                name=config.get("_name", d.name))
        except KeyError as e:
            raise ValueError(f"config.json lacks language field {e.args[0]!r}") from None

    def to_config(self) -> dict:
        """Language fields as the release writes them (top level and under language_config)."""
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
