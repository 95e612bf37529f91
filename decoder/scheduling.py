"""Which sequences run each step: admission, preemption and leaving, over the KV cache's pages.

Waiting requests and preempted sequences are admitted in prefill groups (preempted ones first)
while rows and pages are free; a running sequence whose next token needs a page that none is
free for preempts the newest (its pages freed, its context recomputed by a prefill when it is
admitted again). A sequence that leaves frees its row and the last running one moves into it, so
the rows of a decode step are 0..S-1. With R-SWA (`window`: Unlimited-OCR), the pages of a
sequence's gap (past its prompt, before its window) go back as its window slides on, so a long
generation holds its prompt's pages and a window's, not its whole length. No tensors here: the
model runner (running.py) runs the rows this decides.

Two classes of work (`SamplingParams.priority`): interactive requests, and batch ones (batch
jobs' lines) that only fill what interactive work leaves. Batch requests are held outside the
queues and let in behind every interactive one; while interactive work is in the engine, and
for `batch_resume_s` after it leaves, batch sequences keep at most `batch_beside_interactive`
rows: the rest yield theirs (preempted as for pages: their context recomputed when they come
back), so an interactive step runs at about the size it would without the batch. A quiet
second lets the batch fill every row again; pages running out preempt batch sequences first.
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


BATCH_BESIDE_INTERACTIVE = 0  # rows batch sequences keep while interactive work runs
BATCH_RESUME_S = 1.0  # quiet time after interactive work before the batch fills the rows again


class Scheduler:
    def __init__(self, cache: KVCache, tokenizer, max_batch: int, max_len: int, prefill_tokens: int,
                 window: int | None = None, batch_beside_interactive: int = BATCH_BESIDE_INTERACTIVE,
                 batch_resume_s: float = BATCH_RESUME_S):
        self.cache, self.tokenizer = cache, tokenizer
        # R-SWA's window, when its gap's pages are given back (DEEPSEEK_OCR_RSWA_FREE_PAGES)
        self.window = window if switches.on("DEEPSEEK_OCR_RSWA_FREE_PAGES") else None
        self.max_batch, self.max_len = max_batch, max_len
        self.prefill_tokens = prefill_tokens  # padded tokens per batched prefill forward
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[Sequence] = []
        self.preempted: deque[Sequence] = deque()  # oldest first: they resume before new requests
        self.preemptions = 0
        # Batch work not let in yet: requests, and sequences that yielded their rows (or were
        # preempted for pages); `let_in_batch` moves them to the tails of the queues above.
        self.held: deque[GenerationRequest] = deque()
        self.held_preempted: deque[Sequence] = deque()
        self.batch_beside_interactive, self.batch_resume_s = batch_beside_interactive, batch_resume_s
        self.interactive_seen = float("-inf")  # when interactive work was last in the engine
        self.batch_running = 0  # of `running`
        self.yields = 0  # batch sequences that gave their rows to interactive work
        self._admissions = itertools.count()
        # Sequences that finished while a decode step ran leave once it is done
        # (`leave_retired`): the page table must not change under a step in flight.
        self._leaving: list[Sequence] = []

    def add(self, request: GenerationRequest) -> None:
        if is_batch(request):
            self.held.append(request)
            return
        at = len(self.waiting)  # ahead of the batch requests let in already (the queue's tail)
        while at and is_batch(self.waiting[at - 1]):
            at -= 1
        self.waiting.insert(at, request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted or self.held or self.held_preempted)

    def clear(self) -> None:
        for queue in (self.waiting, self.running, self.preempted, self.held, self.held_preempted):
            queue.clear()
        self._leaving, self.batch_running = [], 0

    # -- the two classes ---------------------------------------------------------------------
    def batch_rows(self) -> int:
        """How many rows batch sequences may hold now (the module docstring). Interactive work
        is always ahead of batch work in the queues, so their heads tell whether any waits."""
        now = time.monotonic()
        if len(self.running) > self.batch_running or (self.waiting and not is_batch(self.waiting[0])) \
                or (self.preempted and not is_batch(self.preempted[0].request)):
            self.interactive_seen = now
        if now - self.interactive_seen <= self.batch_resume_s:
            return min(self.batch_beside_interactive, self.max_batch)
        return self.max_batch

    def let_in_batch(self) -> None:
        """Held batch work into the queues' tails, as far as its rows allow (resumed sequences
        first), or, once interactive work has come, the batch work let in and not yet running
        back out of them (ahead of an interactive request, it would hold the queue's head);
        called before each step's admissions."""
        queued = (self.waiting and is_batch(self.waiting[-1])) or \
            (self.preempted and is_batch(self.preempted[-1].request))
        if not (self.held or self.held_preempted or queued):
            return
        room = self.batch_rows() - self.batch_running - sum(is_batch(s.request) for s in self.preempted) \
            - sum(map(is_batch, self.waiting))
        while room < 0 and self.waiting and is_batch(self.waiting[-1]):
            self.held.appendleft(self.waiting.pop())
            room += 1
        while room < 0 and self.preempted and is_batch(self.preempted[-1].request):
            self.held_preempted.appendleft(self.preempted.pop())
            room += 1
        while room > 0 and self.held_preempted:
            self.preempted.append(self.held_preempted.popleft())
            room -= 1
        while room > 0 and self.held:
            self.waiting.append(self.held.popleft())
            room -= 1

    @property
    def batch_held(self) -> int:
        """Batch requests and sequences held back (not in the queues)."""
        return len(self.held) + len(self.held_preempted)

    def must_yield(self) -> bool:
        """Whether batch sequences hold more rows than they may (`yield_rows` gives them back)."""
        return self.batch_running > 0 and self.batch_running > self.batch_rows()

    def yield_rows(self) -> None:
        """The newest batch sequences over their rows leave them (preempted, held back); called
        with no step in flight, before admissions (the freed rows go to interactive work)."""
        batch = sorted((s for s in self.running if is_batch(s.request)), key=lambda s: s.admitted)
        for seq in batch[self.batch_rows():][::-1]:
            self.leave(seq)
            self.held_preempted.appendleft(seq)
            self.yields += 1

    # -- admission ---------------------------------------------------------------------------
    def next_prefill_group(self) -> list[Sequence]:
        """Sequences to prefill in one forward, preempted ones first, then waiting requests: as
        many as rows are free, the right-padded batch stays within `prefill_tokens` tokens, and
        the free pages hold their contexts while leaving one page per running sequence (its
        next token may start a page). Empty when the first does not fit yet."""
        group, longest, pages = [], 0, 0
        batch_room = None  # rows batch sequences may still take (computed at the first one)
        while len(self.running) + len(group) < self.max_batch:
            if self.preempted:
                seq, tokens = self.preempted[0], self.preempted[0].length
            elif self.waiting:
                seq, tokens = None, len(self.waiting[0].prompt_ids)
            else:
                break
            if is_batch(seq.request if seq is not None else self.waiting[0]):
                if batch_room is None:
                    batch_room = self.batch_rows() - self.batch_running
                if batch_room <= 0:  # interactive work came after it was let in
                    break
                batch_room -= 1
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
            self.batch_running += is_batch(seq.request)

    def unadmit(self, group: list[Sequence]) -> None:
        """A prefill ran out of GPU memory: its sequences go back to the front of their queues,
        pages freed, and later prefills take at most half the failed forward's tokens (running
        sequences and the requests in flight are untouched)."""
        padded = len(group) * max(seq.length for seq in group)  # the forward that failed
        for seq in reversed(group):  # the group's rows are the last ones
            self.running.remove(seq)
            self.batch_running -= is_batch(seq.request)
            self.cache.release(seq.slot)
            seq.slot = -1
            if seq.tokens:
                (self.held_preempted if is_batch(seq.request) else self.preempted).appendleft(seq)
            else:
                seq.request.prefilled_at = None
                if is_batch(seq.request):
                    self.held.appendleft(seq.request)
                else:
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
                victim = max(self.running, key=lambda s: (is_batch(s.request), s.admitted))  # batch first
                self.leave(victim)
                (self.held_preempted if is_batch(victim.request) else self.preempted).appendleft(victim)
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
            (self.preempted if seq in self.preempted else self.held_preempted).remove(seq)
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
        self.batch_running -= is_batch(seq.request)
        self.cache.release(seq.slot)
        if last is not seq:
            self.cache.move(last.slot, seq.slot)
            last.slot = seq.slot
            self.running.remove(last)
            self.running.insert(seq.slot, last)
        seq.slot = -1


def is_batch(work: GenerationRequest) -> bool:
    return work.params.priority == "batch"
