"""DeepSeek-OCR vision encoder: plain PyTorch (no Ray). See README for the public API."""
from .checkpoint import CheckpointError, load_encoder, write_random_checkpoint
from .config import EncoderArgs
from .model import DeepEncoder
from .preprocess import ImageError, PreprocessedImage, preprocess

__all__ = ["CheckpointError", "DeepEncoder", "EncoderArgs", "ImageError", "PreprocessedImage",
           "load_encoder", "preprocess", "write_random_checkpoint"]
