"""DeepSeek-OCR vision encoder: plain PyTorch (no Ray). See README for the public API."""
from common.checkpoint import CheckpointError

from .checkpoint import load_encoder, load_encoder_v2, random_encoder, write_random_checkpoint
from .config import EncoderArgs, EncoderV2Args, is_ocr2_config
from .graphs import DualPathEncoder, PathTokens
from .model import DeepEncoder, assemble
from .model_v2 import DeepEncoderV2, assemble_v2
from .ocr2_views import preprocess_ocr2
from .preprocess import DecodedImage, ImageError, PreprocessedImage, decode, preprocess, views_of

__all__ = ["CheckpointError", "DecodedImage", "DeepEncoder", "DeepEncoderV2", "DualPathEncoder",
           "EncoderArgs", "EncoderV2Args", "ImageError", "PathTokens", "PreprocessedImage",
           "assemble", "assemble_v2", "decode", "is_ocr2_config", "load_encoder", "load_encoder_v2",
           "preprocess", "preprocess_ocr2", "random_encoder", "views_of", "write_random_checkpoint"]
