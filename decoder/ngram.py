"""The windowed no-repeat-n-gram rule of DeepSeek-OCR's vLLM `NoRepeatNGramLogitsProcessor`.

Over the generated tokens only (the prompt excluded): a token is banned when, appended to the
last n-1 tokens, it would repeat an n-gram that starts within the last `window` tokens. The
table-cell tags `<td>` and `</td>` are whitelisted, since tables legitimately repeat them.

Unlimited-OCR's rule (its `SlidingWindowNoRepeatNgramProcessor`, SGLang's
`DeepseekOCRNoRepeatNGramLogitProcessor` as its README calls it, transformers'
`UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor`) is the same scan over the prompt and
the generated tokens together (`include_prompt`: the window reaches back into the prompt for its
first `window` tokens), with no whitelist; size 35 over 128 tokens for one page, 1,024 for
several (`ngram_defaults`).

`NoRepeatNGram` keeps the n-grams of the window in a table keyed by their (n-1)-token prefix,
updated per token, so a decode step costs O(n) instead of a scan of the window.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .tokenizer import TD_CLOSE_ID, TD_ID

if TYPE_CHECKING:
    from .config import DecoderArgs


def _check_sizes(ngram_size, window) -> None:
    for name, value in (("ngram_size", ngram_size), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if ngram_size < 2:
        raise ValueError(f"ngram_size must be at least 2, got {ngram_size}")
    if window < ngram_size:
        raise ValueError(f"window {window} must be at least ngram_size {ngram_size}")


def _check_whitelist(whitelist) -> tuple[int, ...]:
    whitelist = tuple(whitelist)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in whitelist):
        raise ValueError(f"whitelist must hold token ids (ints >= 0), got {whitelist!r}")
    return whitelist


@dataclass(frozen=True)
class NGramConfig:
    """Per-request settings; the engine builds one `NoRepeatNGram` per request from them."""

    ngram_size: int = 30
    window: int = 90
    whitelist: tuple = (TD_ID, TD_CLOSE_ID)
    enabled: bool = True
    include_prompt: bool = False  # True: the window spans the prompt too (Unlimited-OCR's rule)

    def __post_init__(self):
        _check_sizes(self.ngram_size, self.window)
        object.__setattr__(self, "whitelist", _check_whitelist(self.whitelist))
        for name in ("enabled", "include_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def off(cls) -> "NGramConfig":
        return cls(enabled=False)

    def rule(self, prompt_ids=()) -> "NoRepeatNGram | None":
        """A request's rule state (None when off), primed with its prompt's last `window`
        tokens when the rule spans the prompt."""
        if not self.enabled:
            return None
        rule = NoRepeatNGram(self.ngram_size, self.window, self.whitelist)
        for token in prompt_ids[-self.window:] if self.include_prompt else ():
            rule.push(token)
        return rule


def ngram_defaults(args: DecoderArgs, num_images: int) -> NGramConfig:
    """The n-gram guard a model's own release uses (by `args.family`): DeepSeek-OCR's
    30 over 90 generated tokens (table tags exempt); Unlimited-OCR's 35 over the last 128 tokens
    for one image, 1,024 for several, prompt included, nothing exempt (its README and code)."""
    if num_images < 0:
        raise ValueError(f"num_images must be >= 0, got {num_images}")
    if args.family == "unlimited-ocr":
        return NGramConfig(ngram_size=35, window=128 if num_images <= 1 else 1024, whitelist=(),
                           include_prompt=True)
    return NGramConfig()


class NoRepeatNGram:
    """Incremental state of the rule for one request: `push` each generated token, then
    `banned()` before picking the next."""

    def __init__(self, ngram_size: int = 30, window: int = 90,
                 whitelist=(TD_ID, TD_CLOSE_ID)):
        _check_sizes(ngram_size, window)
        self.ngram_size, self.window = ngram_size, window
        self.whitelist = frozenset(_check_whitelist(whitelist))
        self._last = deque(maxlen=ngram_size - 1)  # the current (n-1)-token prefix
        # n-grams starting within the window, oldest first, and the same as a table:
        # prefix -> how often each next token follows it.
        self._ngrams: deque[tuple[tuple[int, ...], int]] = deque()
        self._next_tokens: dict[tuple[int, ...], Counter] = {}

    def push(self, token: int) -> None:
        if len(self._last) == self.ngram_size - 1:  # `token` completes an n-gram
            prefix = tuple(self._last)
            self._ngrams.append((prefix, token))
            self._next_tokens.setdefault(prefix, Counter())[token] += 1
        self._last.append(token)
        # With L tokens, the n-grams starting at L - window .. L - n count: window - n + 1.
        while len(self._ngrams) > self.window - self.ngram_size + 1:
            self._forget(*self._ngrams.popleft())

    def _forget(self, prefix: tuple[int, ...], token: int) -> None:
        counts = self._next_tokens[prefix]
        counts[token] -= 1
        if not counts[token]:
            del counts[token]
            if not counts:
                del self._next_tokens[prefix]

    def banned(self) -> set[int]:
        """Tokens that would repeat an n-gram of the window after the current prefix."""
        # Before n tokens the table is empty, so nothing is banned, as in the reference.
        counts = self._next_tokens.get(tuple(self._last))
        return set(counts) - self.whitelist if counts else set()
