"""DeepSeek-OCR vision encoder: plain PyTorch (no Ray). See README for the public API."""
from common.checkpoint import CheckpointError

from .checkpoint import load_encoder, random_encoder, write_random_checkpoint
from .config import EncoderArgs
from .graphs import DualPathEncoder, PathTokens
from .model import DeepEncoder, assemble
from .preprocess import ImageError, PreprocessedImage, preprocess

__all__ = ["CheckpointError", "DeepEncoder", "DualPathEncoder", "EncoderArgs", "ImageError",
           "PathTokens", "PreprocessedImage", "assemble", "load_encoder", "preprocess",
           "random_encoder", "write_random_checkpoint"]
