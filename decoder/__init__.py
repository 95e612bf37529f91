"""DeepSeek-3B-MoE language model and its continuous-batching generation engine (plain PyTorch)."""
from .checkpoint import load_decoder, random_decoder, write_random_model
from .config import DecoderArgs
from .engine import AsyncEngine, Delta, GenerationEngine, GenerationRequest, SamplingParams
from .model import Decoder
from .ngram import NGramConfig
from .prompt import DEFAULT_PROMPT, PROMPTS, build_prompt
from .tokenizer import load_tokenizer

__all__ = ["DEFAULT_PROMPT", "PROMPTS", "AsyncEngine", "Decoder", "DecoderArgs", "Delta",
           "GenerationEngine", "GenerationRequest", "NGramConfig", "SamplingParams", "build_prompt",
           "load_decoder", "load_tokenizer", "random_decoder", "write_random_model"]
