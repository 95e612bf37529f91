"""A generation request and its state: what a caller asks (`GenerationRequest` with its
`SamplingParams`), what it gets back (`Delta`s), and `Sequence`, the request while the engine
runs it (its row, its tokens, its text so far)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ngram import NGramConfig, NoRepeatNGram
from .repetition import LoopDetector, RepetitionGuard
from .tokenizer import IncrementalDecoder

MAX_TEMPERATURE = 2.0  # OpenAI's range
PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 8192
    stop: tuple[str, ...] = ()
    ngram: NGramConfig = field(default_factory=NGramConfig)
    repetition: RepetitionGuard = field(default_factory=RepetitionGuard)  # the loop detector's settings
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens
    temperature: float = 0.0  # 0: greedy (the default, as DeepSeek's scripts run the model)
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    skip_special_tokens: bool = False  # drop the tokenizer's special tokens (grounding tags) from text
    priority: str = "interactive"  # or "batch": admitted below interactive work (scheduling.py)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")


@dataclass(eq=False)  # identity: requests hold tensors, and two may be equal
class GenerationRequest:
    prompt_ids: list[int]
    image_embeds: list[torch.Tensor] = field(default_factory=list)  # [n_i, hidden] per image
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    prefilled_at: float | None = None  # time.monotonic() when its prefill started (queue time)


@dataclass
class Delta:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "eos", "length", "stop", "repetition", "aborted"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None  # time.monotonic() of the first token (merged deltas)
    # finish_reason "repetition": where the loop began (`start_token`, in generated tokens), its
    # `period`, and `text_chars`, the characters of the text before it (what a whole answer
    # keeps; a stream has sent the text up to the detection)
    repetition: dict | None = None

    def merge(self, later: Delta) -> None:
        """Fold a later delta of the same request into this one (a loop's repeats cut off)."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens
        if later.repetition is not None:
            self.repetition = later.repetition
            self.text = self.text[:later.repetition["text_chars"]]



@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    slot: int
    length: int  # tokens in the KV cache
    max_tokens: int
    ngram: NoRepeatNGram | None
    detok: IncrementalDecoder
    loop: LoopDetector | None = None  # the repetition guard's state (None: off)
    tokens: list[int] = field(default_factory=list)  # generated, EOS included
    text: str = ""  # decoded so far (before any stop truncation)
    emitted: int = 0  # characters of text already sent
    pending: int | None = None  # newest token, not yet in the cache
    seed: int = 0  # the request's seed (a random one when it gave none)
    admitted: int = 0  # admission order: when pages run out, the newest give theirs back
    done: bool = False  # finished or aborted (it may still hold a row of the step in flight)
    gap_freed_to: int = 0  # R-SWA: its pages before this index, past its prompt's, are given back
    text_ends: list[int] = field(default_factory=list)  # with a loop detector: len(text) after each token

    def context(self) -> list[int]:
        """The tokens its cache holds: the prompt and all generated but the pending one."""
        return self.request.prompt_ids + self.tokens[:-1]
