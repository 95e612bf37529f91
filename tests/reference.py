"""Independent implementations to test against (transformers), with key maps from the released
layout to theirs. Imported only by tests; skips cleanly where transformers lacks the model."""
from __future__ import annotations

import re

import pytest
import torch

from encoder.config import EncoderArgs


def unlimited_ocr():
    """transformers' UnlimitedOcr module (>= 5.20), or skip."""
    return pytest.importorskip("transformers.models.unlimited_ocr.modeling_unlimited_ocr",
                               reason="transformers >= 5.20 (unlimited_ocr) not installed")


def sam_config(args) -> dict:
    """transformers' SAM vision config (either family's) at `args`'s SAM dims."""
    return dict(hidden_size=args.sam_width, num_hidden_layers=args.sam_depth,
                num_attention_heads=args.sam_heads, mlp_dim=args.sam_mlp_dim,
                window_size=args.sam_window, global_attn_indexes=list(args.sam_global_blocks),
                output_channels=args.sam_out_chans, downsample_channels=list(args.downsample_channels))


def unlimited_ocr_config(args: EncoderArgs):
    from transformers import UnlimitedOcrConfig

    vision = {
        "sam_config": sam_config(args),
        "encoder_config": dict(hidden_size=args.clip_width, intermediate_size=args.clip_mlp_dim,
                               num_hidden_layers=args.clip_depth, num_attention_heads=args.clip_heads),
    }
    text = dict(vocab_size=300, hidden_size=args.n_embed, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, sliding_window=8192)
    return UnlimitedOcrConfig(vision_config=vision, text_config=text)


_SAM_RULES = [
    (r"^sam_model\.", "sam_encoder."),
    (r"\.blocks\.(\d+)\.norm(\d)\.", r".layers.\1.layer_norm\2."),
    (r"\.blocks\.", ".layers."),
    (r"\.patch_embed\.proj\.", ".patch_embed.projection."),
    (r"\.neck\.0\.", ".neck.conv1."), (r"\.neck\.1\.", ".neck.layer_norm1."),
    (r"\.neck\.2\.", ".neck.conv2."), (r"\.neck\.3\.", ".neck.layer_norm2."),
    (r"\.net_2\.", ".proj.conv1."), (r"\.net_3\.", ".proj.conv2."),
    (r"^vision_model\.", "vision_encoder."), (r"\.transformer\.", ".encoder."),
]


def to_unlimited_ocr_vision(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (released, `model.` stripped) vision keys -> UnlimitedOcrVisionModel keys."""
    out = {}
    for key, value in state.items():
        if not key.startswith(("sam_model.", "vision_model.")) or "patch_embedding" in key:
            continue  # CLIP's unused patch embedding has no counterpart
        for pattern, repl in _SAM_RULES:
            key = re.sub(pattern, repl, key)
        out |= unpack_rows(key, value)
    return out


# Our packed Linears (weight and bias) -> the separate ones they hold, in row order.
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def unpack_rows(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One of our tensors -> the reference's: a packed Linear's tensor split into its parts
    (`...qkv_proj.weight` -> q_proj, k_proj, v_proj), anything else as it is. The routed
    experts' `experts.gate_up_proj` is no Linear and stays packed, as the reference packs it."""
    for packed, names in _PACKED.items():
        if f".{packed}." in key:
            return {key.replace(f".{packed}.", f".{name}."): part
                    for name, part in zip(names, value.chunk(len(names), dim=0))}
    return {key: value}


def unlimited_ocr_model(encoder, args: EncoderArgs):
    """An UnlimitedOcrModel (tiny random text part) holding our encoder's weights."""
    mod = unlimited_ocr()
    model = mod.UnlimitedOcrModel(unlimited_ocr_config(args)).eval()
    ours = {k: v.float() for k, v in encoder.state_dict().items()}
    state = {f"vision_tower.{k}": v for k, v in to_unlimited_ocr_vision(ours).items()}
    state |= {"multi_modal_projector.weight": ours["projector.layers.weight"],
              "multi_modal_projector.bias": ours["projector.layers.bias"],
              "image_newline": ours["image_newline"], "view_separator": ours["view_seperator"]}
    missing, unexpected = model.load_state_dict(state, strict=False)
    vision_missing = [k for k in missing if not k.startswith("language_model.")]
    assert not vision_missing and not unexpected, (vision_missing, unexpected)
    return model


def deepseek_ocr2_text_model(decoder):
    """transformers' DeepseekOcr2TextModel (same decoder family) holding our decoder's weights."""
    mod = pytest.importorskip("transformers.models.deepseek_ocr2.modeling_deepseek_ocr2",
                              reason="transformers >= 5.10 (deepseek_ocr2) not installed")
    from transformers import DeepseekOcr2TextConfig

    a = decoder.args
    config = DeepseekOcr2TextConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads,
        n_routed_experts=a.n_experts, num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.moe_intermediate, n_shared_experts=a.n_shared_experts,
        routed_scaling_factor=a.routed_scaling, topk_method="greedy", n_group=1, topk_group=1,
        mlp_layer_types=["dense" if not a.is_moe(i) else "sparse" for i in range(a.n_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        max_position_embeddings=a.max_positions, rms_norm_eps=a.rms_eps,
        bos_token_id=a.bos_id, eos_token_id=a.eos_id)
    config._attn_implementation = "eager"
    model = mod.DeepseekOcr2TextModel(config).eval()
    # Their routed experts are packed like ours (gate_up_proj = cat(gate, up), down_proj), their
    # attention and MLP projections are not; keys lose the leading "model." and lm_head stays
    # with us.
    state = {}
    for key, value in decoder.state_dict().items():
        if key != "lm_head.weight":
            state |= unpack_rows(key.removeprefix("model."), value.float())
    model.load_state_dict(state, strict=True)
    return model
