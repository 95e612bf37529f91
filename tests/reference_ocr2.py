"""DeepSeek-OCR-2 references for the tests (not a test file):

- DeepSeek's own preprocessing rule, re-implemented from its `DeepSeek-OCR2-vllm/process/
  image_process.py` (`find_closest_aspect_ratio`, `count_tiles`, `dynamic_preprocess`, the image
  part of `tokenize_with_images`) line for line where it matters: that file imports its
  `config.py`, which downloads a tokenizer at import, so it cannot be loaded here. Its
  `ImageTransform` (torchvision's ToTensor + Normalize(0.5, 0.5)) is written out in torch ops.
- transformers' `deepseek_ocr2` model (>= 5.20), loaded from one of our released-layout
  checkpoints by its own `from_pretrained`, which maps the released key names itself
  (transformers' `conversion_mapping.py`, "deepseek_ocr2"): no key map of ours in between.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from encoder.config import EncoderV2Args
from tests.reference import sam_config

# DeepSeek-OCR-2's config.py
BASE_SIZE, IMAGE_SIZE, MIN_CROPS, MAX_CROPS = 1024, 768, 2, 6


# --- DeepSeek's rule ---------------------------------------------------------------------------
def find_closest_aspect_ratio(aspect_ratio, target_ratios, width, height, image_size):
    best_ratio_diff = float("inf")
    best_ratio = (1, 1)
    area = width * height
    for ratio in target_ratios:
        target_aspect_ratio = ratio[0] / ratio[1]
        ratio_diff = abs(aspect_ratio - target_aspect_ratio)
        if ratio_diff < best_ratio_diff:
            best_ratio_diff = ratio_diff
            best_ratio = ratio
        elif ratio_diff == best_ratio_diff:
            if area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
                best_ratio = ratio
    return best_ratio


def target_ratios(min_num=MIN_CROPS, max_num=MAX_CROPS):
    ratios = set((i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1)
                 for j in range(1, n + 1) if i * j <= max_num and i * j >= min_num)
    return sorted(ratios, key=lambda x: x[0] * x[1])


def count_tiles(orig_width, orig_height, image_size=IMAGE_SIZE):
    return find_closest_aspect_ratio(orig_width / orig_height, target_ratios(), orig_width,
                                     orig_height, image_size)


def dynamic_preprocess(image, image_size=IMAGE_SIZE):
    orig_width, orig_height = image.size
    target_aspect_ratio = count_tiles(orig_width, orig_height, image_size)
    target_width = image_size * target_aspect_ratio[0]
    target_height = image_size * target_aspect_ratio[1]
    blocks = target_aspect_ratio[0] * target_aspect_ratio[1]
    resized_img = image.resize((target_width, target_height))  # PIL's default filter, as theirs
    processed_images = []
    for i in range(blocks):
        box = ((i % (target_width // image_size)) * image_size,
               (i // (target_width // image_size)) * image_size,
               ((i % (target_width // image_size)) + 1) * image_size,
               ((i // (target_width // image_size)) + 1) * image_size)
        processed_images.append(resized_img.crop(box))
    return processed_images, target_aspect_ratio


def image_transform(pil_img) -> torch.Tensor:
    """torchvision's ToTensor (uint8 HWC -> float CHW / 255) then Normalize(0.5, 0.5)."""
    x = torch.from_numpy(np.array(pil_img, np.uint8, copy=True)).permute(2, 0, 1).contiguous()
    return x.to(torch.float32).div(255).sub(0.5).div(0.5)


def deepseek_views(image: Image.Image):
    """(global view [3, 1024, 1024], crops [P, 3, 768, 768] or None, [w_t, h_t], image tokens),
    normalised, for one RGB image, as `tokenize_with_images(cropping=True)` makes them."""
    if image.size[0] <= 768 and image.size[1] <= 768:
        crop_ratio = [1, 1]
    else:
        images_crop_raw, crop_ratio = dynamic_preprocess(image, image_size=IMAGE_SIZE)
    global_view = ImageOps.pad(image, (BASE_SIZE, BASE_SIZE),
                               color=tuple(int(x * 255) for x in (0.5, 0.5, 0.5)))
    num_width_tiles, num_height_tiles = crop_ratio
    crops = None
    if num_width_tiles > 1 or num_height_tiles > 1:
        crops = torch.stack([image_transform(c) for c in images_crop_raw])
    num_queries = math.ceil((IMAGE_SIZE // 16) / 4)
    num_queries_base = math.ceil((BASE_SIZE // 16) / 4)
    tokens = num_queries_base * num_queries_base + 1
    if num_width_tiles > 1 or num_height_tiles > 1:
        tokens += (num_queries * num_width_tiles) * (num_queries * num_height_tiles)
    return image_transform(global_view), crops, [num_width_tiles, num_height_tiles], tokens


def deepseek_mask(token_type_ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """`_create_custom_4d_mask` of `deepencoderv2/qwen2_d2e.py` for one sequence (0 = image
    token, 1 = query): an additive [T, T] mask, 0 where attention is allowed. It lives in an
    override of transformers 4.46's `Qwen2Model._update_causal_mask`, which later transformers
    no longer call (their Qwen2Model builds its mask with `create_causal_mask`): DeepSeek's
    code run under them silently gets a plain causal mask. Hence the pin, transformers 4.46.3."""
    sequence_length = token_type_ids.shape[0]
    min_dtype = torch.finfo(dtype).min
    mask = torch.full((sequence_length, sequence_length), fill_value=min_dtype, dtype=dtype)
    image_positions = (token_type_ids == 0).nonzero(as_tuple=True)[0]
    text_positions = (token_type_ids == 1).nonzero(as_tuple=True)[0]
    if len(image_positions) > 0:
        mask[image_positions[:, None], image_positions] = 0.0
    for i, text_pos in enumerate(text_positions):
        if len(image_positions) > 0:
            mask[text_pos, image_positions] = 0.0
        mask[text_pos, text_positions[:i + 1]] = 0.0
    return mask


# --- transformers ------------------------------------------------------------------------------
def deepseek_ocr2():
    """transformers' deepseek_ocr2 modeling module (>= 5.20), or skip."""
    return pytest.importorskip("transformers.models.deepseek_ocr2.modeling_deepseek_ocr2",
                               reason="transformers >= 5.20 (deepseek_ocr2) not installed")


def deepseek_ocr2_config(args: EncoderV2Args):
    """transformers' DeepseekOcr2Config at `args`'s vision dims, a tiny random text part."""
    from transformers import DeepseekOcr2Config

    vision = {
        "sam_config": sam_config(args),
        "encoder_config": dict(hidden_size=args.qwen2_width, intermediate_size=args.qwen2_mlp_dim,
                               num_hidden_layers=args.qwen2_depth, num_attention_heads=args.qwen2_heads,
                               num_key_value_heads=args.qwen2_kv_heads, rms_norm_eps=args.rms_eps,
                               rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta}),
    }
    text = dict(vocab_size=300, hidden_size=args.n_embed, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, mlp_layer_types=["dense"],
                n_group=1, topk_group=1)
    return DeepseekOcr2Config(vision_config=vision, text_config=text)


def deepseek_ocr2_model(checkpoint: str, args: EncoderV2Args, workdir, attn: str = "sdpa"):
    """transformers' DeepseekOcr2Model holding the vision weights of our released-layout
    checkpoint at `checkpoint` (its language part random), fp32, eval mode. Asserts that their
    loader found every vision weight under the released names and nothing it did not know."""
    deepseek_ocr2()
    from transformers import DeepseekOcr2ForConditionalGeneration
    from transformers.utils import logging

    os.makedirs(workdir, exist_ok=True)
    deepseek_ocr2_config(args).save_pretrained(workdir)  # their config.json beside our weights
    os.symlink(os.path.abspath(os.path.join(checkpoint, "model.safetensors")),
               os.path.join(workdir, "model.safetensors"))
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the language part is missing on purpose: no load report
    try:
        model, info = DeepseekOcr2ForConditionalGeneration.from_pretrained(
            workdir, output_loading_info=True, attn_implementation=attn, dtype=torch.float32)
    finally:
        logging.set_verbosity(verbosity)
    vision_missing = [k for k in info["missing_keys"]
                      if not k.startswith(("model.language_model.", "lm_head."))]
    assert not vision_missing and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.model.eval()
