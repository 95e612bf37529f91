"""Repetition loops, caught as they are generated.

A page that loops (the most reported failure of these models at volume: DeepSeek-OCR issue
#151, DeepSeek-OCR-2 issue #28) would run to `max_tokens`, ten times a normal page, and its
text is useless. The no-repeat-n-gram rule bans exact repeats inside its window; a loop with
small variations, or of a period past the window, passes it. `LoopDetector` watches one
sequence's tokens as they come and ends the sequence (`finish_reason: "repetition"`) once a
suffix repeats with some period p for long enough:

  * candidates: a 6-token gram seen again p tokens later (1 <= p <= `max_period`) starts a
    candidate period p; each new token is compared with the one p back, and a candidate whose
    mismatches pass (1 - `similarity`) of its comparisons (+2) is dropped, so a loop that
    varies a token a period (a counter, a word) is still one, and text is not;
  * a candidate of at least `min_repeats` periods is a loop once its unit (the last p tokens,
    decoded) says what it repeats (`unit_kind`) and it has run long enough: text repeated
    exactly at `min_tokens`; text that varies (a counter, a changed word: also what lists of
    similar items do) at `varied_tokens`; markup and punctuation (empty cells, `| | |` rows,
    dotted leaders: what tables and tables of contents repeat) only exactly and at
    `varied_tokens` (rows of one shape whose cells differ are a table, however long); a unit
    holding a page mark (Unlimited-OCR's several pages a request, whose pages may share their
    furniture or be the same form) never.

The cost is incremental: per token, a few integer operations, one dict lookup and one
comparison per live candidate (none in most text), never a rescan of the sequence. The text up
to the end of the unit's first occurrence is what a whole answer keeps (`Loop.start_token`).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

TEXT, STRUCTURE, EXEMPT = "text", "structure", "exempt"
PAGE_MARK = "<PAGE>"  # Unlimited-OCR's mark between the pages of one answer
_TABLE_MARKUP = re.compile(r"</?t[dhr]\b|\|")
_LETTER = re.compile(r"[^\W\d_]")  # a letter of any script

# At most this fraction of a candidate's tokens differing from a period back, it repeats
# exactly (a counter or a changed word more often than once in 50 tokens: it varies).
EXACT_MISMATCHES = 0.02
GRAM = 6  # tokens that, seen again, propose a period
_BITS = 21  # a token id's bits in a gram's key (vocabularies up to 2M ids)
_KEY_MASK = (1 << (_BITS * GRAM)) - 1


@dataclass(frozen=True)
class RepetitionGuard:
    """Per-request settings of the loop detector (`repetition_guard`); validated on creation."""

    enabled: bool = True
    min_tokens: int = 200  # tokens repeating a text unit exactly (past its first occurrence) that make a loop
    varied_tokens: int = 2048  # the same for text that varies, and for markup repeated exactly
    max_period: int = 300  # longest unit, in tokens
    similarity: float = 0.85  # fraction of tokens equal to the one a period back
    min_repeats: int = 2  # the unit repeated at least this often past its first occurrence

    LIMITS = {"min_tokens": (16, 32768), "varied_tokens": (16, 32768), "max_period": (1, 2048),
              "min_repeats": (1, 64)}

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        for name, (low, high) in self.LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.varied_tokens < self.min_tokens:
            raise ValueError(f"varied_tokens ({self.varied_tokens}) must be at least "
                             f"min_tokens ({self.min_tokens})")
        if isinstance(self.similarity, bool) or not isinstance(self.similarity, (int, float)) \
                or not 0.5 <= self.similarity <= 1:
            raise ValueError(f"similarity must be in [0.5, 1], got {self.similarity!r}")

    def detector(self, decode: Callable[[list[int]], str]) -> LoopDetector | None:
        """A sequence's detector (None when off); `decode`: token ids to text (its unit's kind)."""
        return LoopDetector(self, decode) if self.enabled else None


@dataclass(frozen=True)
class Loop:
    """A detected loop: its unit of `period` tokens first ends, and its repeats begin, at
    generated token `start_token` (the tokens a whole answer keeps)."""

    start_token: int
    period: int


def unit_kind(text: str) -> str:
    """What a repeated unit is: EXEMPT (it holds a page mark), STRUCTURE (table markup, or no
    letter at all: cells, rules, leaders, numbers) or TEXT."""
    if PAGE_MARK in text:
        return EXEMPT
    if _TABLE_MARKUP.search(text) or not _LETTER.search(text):
        return STRUCTURE
    return TEXT


class LoopDetector:
    """One sequence's loop detector: `push` each generated token; it returns the `Loop` once
    the sequence loops (module docstring), else None."""

    def __init__(self, guard: RepetitionGuard, decode: Callable[[list[int]], str]):
        self.guard, self.decode = guard, decode
        self.tokens: list[int] = []
        self._key = 0  # the last GRAM tokens, packed
        self._seen: dict[int, int] = {}  # gram key -> where it last ended
        # period -> [tokens compared, mismatches, where the periodic stretch starts, its unit's kind]
        self._live: dict[int, list] = {}
        self._slack = 1.0 - guard.similarity

    def push(self, token: int) -> Loop | None:
        tokens, at = self.tokens, len(self.tokens)
        tokens.append(token)
        found = self._compare(token, at) if self._live else None
        key = self._key = ((self._key << _BITS) | token) & _KEY_MASK
        if at >= GRAM - 1:
            end = self._seen.get(key)
            self._seen[key] = at
            if end is not None and at - end <= self.guard.max_period and at - end not in self._live:
                self._live[at - end] = [GRAM, 0, end - GRAM + 1, None]
        return found

    def _compare(self, token: int, at: int) -> Loop | None:
        """Each live candidate's comparison of the new token with the one a period back."""
        guard, tokens, found = self.guard, self.tokens, None
        for period, candidate in list(self._live.items()):
            candidate[0] += 1
            if tokens[at - period] != token:
                candidate[1] += 1
                if candidate[1] > self._slack * candidate[0] + 2:
                    del self._live[period]
                    continue
            compared = candidate[0]
            if found is not None or compared < guard.min_tokens or compared < guard.min_repeats * period:
                continue
            if candidate[3] is None:  # long enough to be one: what does it repeat?
                candidate[3] = unit_kind(self.decode(tokens[at - period + 1:at + 1]))
            exact = candidate[1] <= EXACT_MISMATCHES * compared
            long_enough = compared >= guard.varied_tokens
            if (candidate[3] == TEXT and (exact or long_enough)) or (candidate[3] == STRUCTURE and exact and long_enough):
                found = Loop(start_token=candidate[2] + period, period=period)
        return found
