"""Which sequences run each step: admission, preemption and leaving, over the KV cache's pages.

Waiting requests and preempted sequences are admitted in prefill groups (preempted ones first)
while rows and pages are free; a running sequence whose next token needs a page that none is
free for preempts the newest (its pages freed, its context recomputed by a prefill when it is
admitted again). A sequence that leaves frees its row and the last running one moves into it, so
the rows of a decode step are 0..S-1. With R-SWA (`window`: Unlimited-OCR), the pages of a
sequence's gap (past its prompt, before its window) go back as its window slides on, so a long
generation holds its prompt's pages and a window's, not its whole length. No tensors here: the
model runner (running.py) runs the rows this decides.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import deque

from common import switches

from .kv_cache import KVCache, pages_for
from .pages import PAGE_TOKENS
from .sequence import GenerationRequest, Sequence
from .tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cache: KVCache, tokenizer, max_batch: int, max_len: int, prefill_tokens: int,
                 window: int | None = None):
        self.cache, self.tokenizer = cache, tokenizer
        # R-SWA's window, when its gap's pages are given back (DEEPSEEK_OCR_RSWA_FREE_PAGES)
        self.window = window if switches.on("DEEPSEEK_OCR_RSWA_FREE_PAGES") else None
        self.max_batch, self.max_len = max_batch, max_len
        self.prefill_tokens = prefill_tokens  # padded tokens per batched prefill forward
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[Sequence] = []
        self.preempted: deque[Sequence] = deque()  # oldest first: they resume before new requests
        self.preemptions = 0
        self._admissions = itertools.count()
        # Sequences that finished while a decode step ran leave once it is done
        # (`leave_retired`): the page table must not change under a step in flight.
        self._leaving: list[Sequence] = []

    def add(self, request: GenerationRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def clear(self) -> None:
        self.waiting.clear()
        self.running.clear()
        self.preempted.clear()
        self._leaving = []

    # -- admission ---------------------------------------------------------------------------
    def next_prefill_group(self) -> list[Sequence]:
        """Sequences to prefill in one forward, preempted ones first, then waiting requests: as
        many as rows are free, the right-padded batch stays within `prefill_tokens` tokens, and
        the free pages hold their contexts while leaving one page per running sequence (its
        next token may start a page). Empty when the first does not fit yet."""
        group, longest, pages = [], 0, 0
        while len(self.running) + len(group) < self.max_batch:
            if self.preempted:
                seq, tokens = self.preempted[0], self.preempted[0].length
            elif self.waiting:
                seq, tokens = None, len(self.waiting[0].prompt_ids)
            else:
                break
            longest_next = max(longest, tokens)
            if group and longest_next * (len(group) + 1) > self.prefill_tokens:
                break
            pages_next = pages + pages_for(tokens + 1)
            if pages_next + len(self.running) + len(group) > self.cache.free_pages:
                break
            if seq is None:
                seq = self._sequence(self.waiting.popleft())
            else:
                self.preempted.popleft()
            group.append(seq)
            longest, pages = longest_next, pages_next
        return group

    def place(self, group: list[Sequence]) -> None:
        """The group's sequences into the next free rows, their contexts' pages reserved (the
        model runner prefills them there)."""
        started = time.monotonic()
        slot = len(self.running)
        for row, seq in enumerate(group):
            if seq.request.prefilled_at is None:
                seq.request.prefilled_at = started
            seq.slot, seq.length = slot + row, len(seq.context())
            seq.gap_freed_to = pages_for(len(seq.request.prompt_ids))  # its prefill fills every page
            assert self.cache.reserve(seq.slot, seq.length + 1), "admitted without its pages"
            self.running.append(seq)

    def unadmit(self, group: list[Sequence]) -> None:
        """A prefill ran out of GPU memory: its sequences go back to the front of their queues,
        pages freed, and later prefills take at most half the failed forward's tokens (running
        sequences and the requests in flight are untouched)."""
        padded = len(group) * max(seq.length for seq in group)  # the forward that failed
        for seq in reversed(group):  # the group's rows are the last ones
            self.running.remove(seq)
            self.cache.release(seq.slot)
            seq.slot = -1
            if seq.tokens:
                self.preempted.appendleft(seq)
            else:
                seq.request.prefilled_at = None
                self.waiting.appendleft(seq.request)
        self.prefill_tokens = max(1, min(self.prefill_tokens, padded) // 2)
        log.warning("a prefill of %d sequences ran out of GPU memory: retrying them with at most "
                    "%d prefill tokens per forward", len(group), self.prefill_tokens)

    def _sequence(self, request: GenerationRequest) -> Sequence:
        params = request.params
        n = len(request.prompt_ids)
        return Sequence(request, -1, n, min(params.max_tokens, self.max_len - n),
                        params.ngram.rule(request.prompt_ids), IncrementalDecoder(self.tokenizer),
                        params.repetition.detector(self.tokenizer.decode),
                        seed=secrets.randbits(32) if params.seed is None else params.seed,
                        admitted=next(self._admissions))

    # -- preemption --------------------------------------------------------------------------
    def grow(self) -> None:
        """Give each running sequence the page its pending token goes to; when none is free,
        preempt the newest sequence (its pages freed; `next_prefill_group` resumes it). R-SWA
        gaps are given back first."""
        if self.window is not None:
            self._free_gaps()
        # Most steps no sequence crosses into a new page (one in 64 does): only those are sorted.
        growing = [s for s in self.running if not self.cache.holds(s.slot, s.length + 1)]
        for seq in sorted(growing, key=lambda s: s.admitted):
            while seq.slot >= 0 and not self.cache.reserve(seq.slot, seq.length + 1):
                victim = max(self.running, key=lambda s: s.admitted)
                self.leave(victim)
                self.preempted.appendleft(victim)
                self.preemptions += 1

    def _free_gaps(self) -> None:
        """The whole pages each sequence's window has left behind, past its prompt, go back:
        the query at position `length` sees positions above length - window, and later queries
        see less, so positions up to length - window are never read again."""
        for seq in self.running:
            end = (seq.length - self.window + 1) // PAGE_TOKENS  # pages wholly at or below it
            if end > seq.gap_freed_to:
                self.cache.drop(seq.slot, seq.gap_freed_to, end)
                seq.gap_freed_to = end

    # -- leaving -----------------------------------------------------------------------------
    def retire(self, seq: Sequence, in_flight: bool) -> None:
        """End a sequence now (a stop string, an abort): a preempted one just goes; a running
        one leaves when the step in flight (`in_flight`) is done (`leave_retired` frees its
        row then)."""
        seq.done = True
        if seq.slot < 0:
            self.preempted.remove(seq)
        elif in_flight:
            self._leaving.append(seq)
        else:
            self.leave(seq)

    @property
    def leaving(self) -> list[Sequence]:
        """Running sequences retired while a step was in flight (their rows go at `leave_retired`)."""
        return self._leaving

    def grows_without_preempting(self) -> bool:
        """Whether `leave_retired` then `grow` will find a page for every staying sequence's next
        token without preempting any."""
        cache, leaving = self.cache, self._leaving
        freed = sum(cache.pages_held(s.slot) for s in leaving)
        short = sum(cache.pages_short(s.slot, s.length + 1) for s in self.running if s not in leaving)
        return short <= cache.free_pages + freed

    def leave_retired(self) -> None:
        """The rows of the sequences retired while a step was in flight, freed (it is done)."""
        for seq in self._leaving:
            self.leave(seq)
        self._leaving = []

    def leave(self, seq: Sequence) -> None:
        """Free seq's row and pages; the last running sequence moves into its row (rows stay
        compact)."""
        last = self.running[-1]
        self.running.remove(seq)
        self.cache.release(seq.slot)
        if last is not seq:
            self.cache.move(last.slot, seq.slot)
            last.slot = seq.slot
            self.running.remove(last)
            self.running.insert(seq.slot, last)
        seq.slot = -1
