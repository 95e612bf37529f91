"""DeepSeek-OCR vision encoder: plain PyTorch (no Ray). See README for the public API."""
from common.checkpoint import CheckpointError

from .checkpoint import load_encoder, random_encoder, write_random_checkpoint
from .config import EncoderArgs
from .graphs import DualPathEncoder, PathTokens
from .model import DeepEncoder, assemble
from .preprocess import DecodedImage, ImageError, PreprocessedImage, decode, preprocess, views_of

__all__ = ["CheckpointError", "DecodedImage", "DeepEncoder", "DualPathEncoder", "EncoderArgs",
           "ImageError", "PathTokens", "PreprocessedImage", "assemble", "decode", "load_encoder",
           "preprocess", "random_encoder", "views_of", "write_random_checkpoint"]
