"""The DeepSeek-OCR family's vision encoders (DeepSeek-OCR's DeepEncoder, DeepSeek-OCR-2's DeepEncoder
V2): plain PyTorch (no Ray). See README for the public API."""
from common.checkpoint import CheckpointError

from .checkpoint import load_encoder, load_encoder_v2, random_encoder, write_random_checkpoint
from .config import EncoderArgs, EncoderV2Args, is_ocr2_config
from .graphs import DualPathEncoder, PathTokens
from .model import DeepEncoder, assemble
from .model_v2 import DeepEncoderV2, assemble_v2
from .preprocess import (DEEPSEEK_OCR, DEEPSEEK_OCR_2, DecodedImage, ImageError, PreprocessedImage, Tiling,
                         decode, preprocess, views_of)

__all__ = ["CheckpointError", "DEEPSEEK_OCR", "DEEPSEEK_OCR_2", "DecodedImage", "DeepEncoder", "DeepEncoderV2", "DualPathEncoder",
           "EncoderArgs", "EncoderV2Args", "ImageError", "PathTokens", "PreprocessedImage",
           "assemble", "assemble_v2", "decode", "is_ocr2_config", "load_encoder", "load_encoder_v2",
           "preprocess", "random_encoder", "Tiling", "views_of", "write_random_checkpoint"]
