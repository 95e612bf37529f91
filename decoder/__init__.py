"""DeepSeek-3B-MoE language model and its continuous-batching generation engine (plain PyTorch)."""
from .async_engine import AsyncEngine
from .checkpoint import load_decoder, random_decoder, write_random_checkpoint
from .config import DecoderArgs
from .engine import GenerationEngine
from .model import Decoder
from .ngram import NGramConfig, ngram_defaults
from .repetition import RepetitionGuard
from .sequence import Delta, GenerationRequest, SamplingParams
from .tokenizer import DEFAULT_PROMPT, build_prompt, default_preset, load_tokenizer

__all__ = ["DEFAULT_PROMPT", "AsyncEngine", "Decoder", "DecoderArgs", "Delta", "GenerationEngine",
           "GenerationRequest", "NGramConfig", "RepetitionGuard", "SamplingParams", "build_prompt", "default_preset", "load_decoder",
           "load_tokenizer", "ngram_defaults", "random_decoder", "write_random_checkpoint"]
