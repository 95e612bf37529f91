"""Generation with continuous batching: requests join and leave at step boundaries.

`GenerationEngine.step()` is one iteration:
  1. admit waiting requests while slots are free: prefill them in right-padded batches of up to
     `prefill_tokens` tokens (prompt embeddings, image embeddings merged at the placeholder
     positions) into their KV-cache slots; each row's last real logits give its first token.
     While sequences are running, a step prefills one such batch at most, so a burst of new
     requests interleaves with decode steps instead of stalling the running ones;
  2. one decode step for every running sequence together: each feeds its newest token, the
     model writes one KV entry per sequence and returns one row of logits per sequence;
  3. per sequence: the no-repeat-n-gram rule bans tokens, argmax (or, for a request with a
     temperature, seeded sampling: decoder/sampling.py) picks the next one, text deltas
     are decoded incrementally, and EOS / max_tokens / stop strings / the context limit finish it;
     a finished sequence leaves and the last running one moves into its row of the page table
     (rows stay compact: the decode step's rows are 0..S-1).
Steps are pipelined: step 2 is launched at the end of `step()` and picked at the start of the
next one, so the host's per-token work of step 3 runs while the GPU decodes. While sequences
run, a step launches their decode step before the new group's prefill (`prefill_behind_decode`):
the host launches the prefill's kernels while the GPU decodes, and the group's first tokens are
picked with that decode step's, at the start of the next step. With `overlap_picks`, a step
with no preemption due picks on the device and launches the next decode step (and a prefill
behind it) from those picks before reading them back. The KV cache is a
budget of pages (decoder/kv_cache.py): admission waits for free pages, and a sequence that
finds none preempts the newest (resumed later by one prefill of its context).
Decoding of each sequence does not depend on its neighbours: rows never attend to each other,
padded cache positions are masked, and a sampled token's randomness is a function of its own
request's seed and step, so batching reproduces generating alone.

The parts, one job each: scheduling.py (`Scheduler`: admission, preemption, which sequences run
this step), running.py (`ModelRunner`: inputs, forwards, decode graphs, picking tokens),
output.py (`OutputProcessor`: tokens into text and deltas, stop strings) and sequence.py (a
request's state); this file is the loop that composes them. async_engine.py runs it on a thread.
"""
from __future__ import annotations

import itertools

import torch

from common import switches

from .kv_cache import KVCache, cache_pages, kv_dtype
from .model import Decoder
from .output import OutputProcessor
from .running import ModelRunner
from .scheduling import Scheduler
from .sequence import MAX_TEMPERATURE, Delta, GenerationRequest, SamplingParams, Sequence
from .tokenizer import IMAGE_TOKEN_ID

__all__ = ["MAX_TEMPERATURE", "Delta", "GenerationEngine", "GenerationRequest", "SamplingParams"]


class GenerationEngine:
    # While sequences decode, a step launches their decode step first and a new group's prefill
    # behind it, and picks the group's first tokens with that step's at the start of the next:
    # the host launches the prefill's eager kernels while the GPU decodes. (On an H100 a step
    # with a page's prefill took ~23 ms more than a decode step at 256 sequences, where the
    # prefill's bytes and FLOPs take ~4 ms: the host's launches are the likely rest, not yet
    # profiled.) False (DEEPSEEK_OCR_PREFILL_BEHIND_DECODE=0): the prefill first, its tokens
    # picked at once, then the decode step (the reference twin).
    prefill_behind_decode = switches.on("DEEPSEEK_OCR_PREFILL_BEHIND_DECODE")
    # While sequences decode and no preemption is due, a step picks the tokens of the decode
    # step in flight (and of the prefill behind it) on the device, launches the next decode
    # step from them (and a new group's prefill behind it), and only then reads them back: the
    # host's per-token work no longer sits between two decode steps (H100, realistic mix: 13,323
    # against 12,600 tokens/s at 64 sequences, 21,120 against 19,763 at 256; one page 0.757
    # against 0.804 s). The host is then one token behind: a sequence that ends by EOS runs one
    # more row, unused (one that reaches max_tokens leaves before the launch: its end is known).
    # False (DEEPSEEK_OCR_OVERLAP_PICKS=0): every pick read before the next launch (the
    # reference twin).
    overlap_picks = switches.on("DEEPSEEK_OCR_OVERLAP_PICKS")

    def __init__(self, model: Decoder, tokenizer, max_batch: int = 256, max_len: int | None = None,
                 decode_graphs: bool | None = None, prefill_tokens: int = 16384,
                 kv_cache_gb: float | None = None, kv_cache_dtype: str = "auto"):
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        max_len = max_len or model.args.max_positions
        # The KV cache is a budget of pages (decoder/kv_cache.py): up to max_batch sequences run
        # while their pages fit; when they run out, the newest sequences are preempted (their
        # pages freed, their context recomputed by a prefill when pages are free again).
        # kv_cache_dtype "fp8": keys and values in 8-bit floats (decoder/kv_cache.py).
        args, cache_dtype = model.args, kv_dtype(kv_cache_dtype, model.dtype)
        per_token = KVCache.bytes_per_token(args.n_layers, args.n_heads, args.head_dim, cache_dtype)
        self.cache = KVCache(args.n_layers, args.n_heads, args.head_dim,
                             cache_pages(kv_cache_gb, per_token, max_batch, max_len, model.device),
                             max_batch, max_len, model.device, cache_dtype)
        self.max_len = min(max_len, self.cache.capacity_tokens)  # one sequence always fits
        self.scheduler = Scheduler(self.cache, tokenizer, max_batch, self.max_len, prefill_tokens,
                                   window=args.sliding_window)
        self.runner = ModelRunner(model, self.cache, max_batch, self.max_len, decode_graphs)
        self.output = OutputProcessor(args.eos_id, frozenset(tokenizer.special_ids))
        # The decode step launched at the end of the last `step()` and not yet picked from:
        # (its rows' sequences, its logits). Sequences that finished while it ran leave once
        # it is done (`Scheduler.leave_retired`): the page table must not change under it.
        self._inflight: tuple[list[Sequence], torch.Tensor] | None = None
        # A prefill launched behind that decode step (`prefill_behind_decode`): (its fresh
        # sequences, its logits, their rows in them or None for all), picked with it.
        self._prefilled: tuple[list[Sequence], torch.Tensor, list[int] | None] | None = None
        self._ids = itertools.count()
        self.tokens_generated = 0  # since the engine started (its deployment's metrics read it)
        self.overlapped_steps = 0  # steps that launched the next decode before reading their picks

    # -- the parts' state, read by the deployment, benchmarks and tests -----------------------
    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    @property
    def preempted(self):
        return self.scheduler.preempted

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def prefill_tokens(self) -> int:
        return self.scheduler.prefill_tokens

    @property
    def use_decode_graphs(self) -> bool:
        return self.runner.use_decode_graphs

    @property
    def decode_graphs(self):
        return self.runner.decode_graphs

    @property
    def sampler_graphs(self):
        return self.runner.sampler_graphs

    @property
    def compile_ahead_s(self) -> float:
        return self.runner.compile_ahead_s

    # -- requests ---------------------------------------------------------------------------
    def add(self, request: GenerationRequest) -> str:
        """Validate and queue a request; returns its id."""
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n >= self.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit the context of {self.max_len}")
        placeholders = sum(1 for t in request.prompt_ids if t == IMAGE_TOKEN_ID)
        given = sum(e.shape[0] for e in request.image_embeds)
        if placeholders != given:
            raise ValueError(f"prompt has {placeholders} image placeholder tokens but the image "
                             f"embeddings have {given} rows")
        bad = [e.shape for e in request.image_embeds
               if e.dim() != 2 or e.shape[1] != self.model.args.hidden]
        if bad:
            raise ValueError(f"image embeddings must be [n, {self.model.args.hidden}], got {bad}")
        request.request_id = request.request_id or f"req-{next(self._ids)}"
        self.scheduler.add(request)
        return request.request_id

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def only_held_work(self) -> bool:
        """Whether all the work there is is batch work held back (waiting out the quiet after
        interactive work): a step would do nothing yet."""
        s = self.scheduler
        return bool(s.batch_held) and not (s.waiting or s.running or s.preempted or self._inflight or self._prefilled)

    def probe(self) -> None:
        """A cheap run of the real model on one token, outside the cache (health checks); on a
        GPU it waits for the device, so a broken CUDA context raises here."""
        self.runner.probe()

    def reset(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted)."""
        self.scheduler.clear()
        self._inflight = self._prefilled = None
        self.cache.clear()

    def abort(self, request_id: str) -> Delta | None:
        for queue in (self.waiting, self.scheduler.held):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    return Delta(request_id, "", [], True, "aborted", len(request.prompt_ids))
        for seq in itertools.chain(self.running, self.preempted, self.scheduler.held_preempted):
            if seq.request.request_id == request_id and not seq.done:
                self._retire(seq)
                return self.output.delta(seq, [], "aborted")
        return None

    # -- one iteration ----------------------------------------------------------------------
    def prepare(self) -> None:
        """Capture the decode graphs if they are on (the first `step` does it otherwise), and on
        CUDA run one page-sized prefill: the prefill kernels' first launch compiles them (Triton:
        ~2 s on a fresh node, which the first request would otherwise wait). Before either, the
        Triton kernels both meet are compiled on threads at once (common/triton_compile.py)."""
        self.runner.prepare(idle=not self.running)

    @torch.inference_mode()
    def step(self) -> list[Delta]:
        """One iteration, pipelined with the GPU: pick the tokens of the decode step launched
        last time (waiting for it; and of the prefill behind it), admit and prefill, launch the
        next decode step (while sequences run: the decode step, then the prefill behind it), and
        only then do the per-token host work (n-gram state, detokenising, stop strings, deltas)
        while that step runs."""
        self.prepare()
        self.scheduler.let_in_batch()
        if self.overlap_picks and self._overlap_ready():
            return self._overlapped_step()
        scheduler = self.scheduler
        picked: list[tuple[Sequence, int, str | None]] = []
        if self._inflight is not None:
            rows, logits = self._inflight
            self._inflight = None
            picked += self._take(rows, logits)  # waits for the step: the table may change now
        if self._prefilled is not None:  # the prefill behind it: its sequences' first tokens
            seqs, logits, rows = self._prefilled
            self._prefilled = None
            picked += self._take(seqs, logits if rows is None else logits[rows])
        scheduler.leave_retired()
        if scheduler.must_yield():  # batch rows to interactive work (never in the overlapped path)
            scheduler.yield_rows()
        if scheduler.running and self.prefill_behind_decode:
            self._decode_then_prefill()
            return self.output.report(picked, self._retire)
        decoding = bool(scheduler.running)
        while (scheduler.preempted or scheduler.waiting) and len(scheduler.running) < self.max_batch:
            group = scheduler.next_prefill_group()
            if not group:  # the next prompt's pages are not free yet
                break
            scheduler.place(group)
            try:
                logits = self.runner.prefill(group)
            except torch.cuda.OutOfMemoryError:
                if len(group) == 1:  # nothing smaller to try: the step fails as any other
                    raise
                scheduler.unadmit(group)
                self.runner.empty_cache()
                continue
            fresh = [row for row, seq in enumerate(group) if not seq.tokens]  # resumed ones hold theirs
            picked += self._take([group[row] for row in fresh],
                                 logits if len(fresh) == len(group) else logits[fresh])
            if decoding:  # running sequences wait on this step: at most one prefill forward
                break
        if scheduler.running:
            scheduler.grow()
            rows = list(scheduler.running)
            self._inflight = (rows, self.runner.decode(rows))  # launched; picked by the next step()
        return self.output.report(picked, self._retire)

    def _overlap_ready(self) -> bool:
        """A decode step is in flight and no preemption is due this step (that takes the step
        that reads its picks first); nor, without `prefill_behind_decode`, a prefill group."""
        scheduler = self.scheduler
        if self._inflight is None or scheduler.must_yield():  # yielding rows is preempting
            return False
        staying = len(scheduler.running) - len(scheduler.leaving) - len(self._ending_at_pick())
        if staying == 0:
            return False
        if not self.prefill_behind_decode and (scheduler.preempted or scheduler.waiting) \
                and staying < self.max_batch:
            return False
        return scheduler.grows_without_preempting()

    def _ending_at_pick(self) -> list[Sequence]:
        """The sequences the pending pick (of the step in flight and of the prefill behind it)
        brings to their max_tokens (which holds the context limit too): they end there whatever
        the token, so they need no row in the next decode step."""
        picked = self._inflight[0] + (self._prefilled[0] if self._prefilled is not None else [])
        return [seq for seq in picked if not seq.done and len(seq.tokens) + 1 >= seq.max_tokens]

    def _overlapped_step(self) -> list[Delta]:
        """`overlap_picks`: the in-flight step's picks (and those of the prefill behind it) made
        on the device (their n-gram bans need only the tokens read back already), their copy to
        the host queued, retired rows freed, then the next decode step launched from the picks
        (with a group's prefill behind it, as `step` does), and only then the picks read and
        appended. A sequence this pick brings to its max_tokens leaves before the launch; one
        that ends here otherwise (EOS, a stop string) has a row in the step just launched and
        leaves when that step is done."""
        scheduler, runner = self.scheduler, self.runner
        ending = {id(seq) for seq in self._ending_at_pick()}
        rows, logits = self._inflight
        picked_rows, sources = list(rows), [runner.pick_on_device(rows, logits)]  # retired rows: unused
        if self._prefilled is not None:
            fresh, fresh_logits, fresh_rows = self._prefilled
            self._prefilled = None
            if fresh_rows is not None:
                fresh_logits = fresh_logits.index_select(0, runner.staged(fresh_rows))
            picked_rows += fresh
            sources.append(runner.pick_on_device(fresh, fresh_logits))
        picks = torch.cat(sources) if len(sources) > 1 else sources[0]
        read = runner.read_back(picks)
        for seq in picked_rows:  # ending at this pick: they leave now, not a step later
            if id(seq) in ending:
                scheduler.retire(seq, in_flight=True)
        scheduler.leave_retired()
        row_of = {id(seq): row for row, seq in enumerate(picked_rows)}

        def tokens_for(staying: list[Sequence]) -> torch.Tensor:
            """Each staying row's token: its pick, or (resumed after a preemption: not picked
            here) the pending token the host holds."""
            held = [seq for seq in staying if id(seq) not in row_of]
            table = picks if not held else torch.cat(
                [picks, runner.staged([seq.pending for seq in held])])
            at = {**row_of, **{id(seq): len(picked_rows) + i for i, seq in enumerate(held)}}
            order = [at[id(seq)] for seq in staying]
            if order == list(range(len(order))):
                return table[:len(order)]
            return table.index_select(0, runner.staged(order))

        if self.prefill_behind_decode:
            self._decode_then_prefill(tokens_for)
        else:
            scheduler.grow()  # no preemption: _overlap_ready checked
            staying = list(scheduler.running)
            self._inflight = (staying, runner.decode(staying, tokens_for(staying)))
        self.overlapped_steps += 1
        live = [(seq, token) for seq, token in zip(picked_rows, read()) if not seq.done or id(seq) in ending]
        picked = self.output.append_tokens([seq for seq, _ in live], [token for _, token in live])
        self.tokens_generated += len(picked)
        in_flight = {id(seq) for seq in self._inflight[0]}
        for seq, _, reason in picked:
            if id(seq) in in_flight:
                seq.pending = None  # fed to the step just launched
            if reason is not None and id(seq) not in ending:
                scheduler.retire(seq, in_flight=True)
        return self.output.report(picked, self._retire)

    def _decode_then_prefill(self, tokens_for=None) -> None:
        """`prefill_behind_decode`: the running sequences' pages for their next token, a group
        placed after their rows, their decode step launched, then the group's prefill behind it
        (one forward); its fresh sequences' first tokens are picked at the next step.
        `tokens_for(rows)`: the rows' tokens on the device (overlapped picks); None: pending."""
        scheduler = self.scheduler
        scheduler.grow()  # before placing a group: preempting never reaches its rows
        rows = list(scheduler.running)
        group = []
        if (scheduler.preempted or scheduler.waiting) and len(rows) < self.max_batch:
            group = scheduler.next_prefill_group()
            scheduler.place(group)  # before the decode step's table copy, which then holds its rows
        # A decode graph's padded rows may write position 0 of the group's first pages; the
        # prefill behind it on the same stream writes them again.
        self._inflight = (rows, self.runner.decode(rows, None if tokens_for is None else tokens_for(rows)))
        if not group:
            return
        try:
            logits = self.runner.prefill(group)
        except torch.cuda.OutOfMemoryError:
            if len(group) == 1:  # nothing smaller to try: the step fails as any other
                raise
            scheduler.unadmit(group)  # its rows are past the decode step's
            self.runner.empty_cache()
            return
        fresh = [row for row, seq in enumerate(group) if not seq.tokens]  # resumed ones hold theirs
        if fresh:  # their rows of the logits are taken at the pick (indexing by a list copies it to the device)
            self._prefilled = ([group[row] for row in fresh], logits, None if len(fresh) == len(group) else fresh)

    def _take(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, int, str | None]]:
        """Pick each live sequence's next token from its logits row (the step's one host sync);
        sequences done by EOS or max_tokens leave at once. -> (sequence, token, "eos" /
        "length" / None) for each."""
        live = [row for row, seq in enumerate(seqs) if not seq.done]
        if len(live) < len(seqs):
            seqs, logits = [seqs[row] for row in live], logits[live]
        if not seqs:
            return []
        picked = self.output.append_tokens(seqs, self.runner.sample(seqs, logits))
        self.tokens_generated += len(picked)
        for seq, _, reason in picked:
            if reason is not None:
                self.scheduler.leave(seq)
        return picked

    def _retire(self, seq: Sequence) -> None:
        """End a sequence now (a stop string, an abort): a preempted one just goes; a running
        one leaves when the step in flight is done (`step` frees its row then)."""
        self.scheduler.retire(seq, in_flight=self._inflight is not None)

    # -- offline helper ---------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest]) -> list[Delta]:
        """Run requests to completion; one Delta per request with all text and tokens."""
        ids = [self.add(r) for r in requests]
        results = {i: Delta(i, "", []) for i in ids}
        while self.has_work():
            for d in self.step():
                results[d.request_id].merge(d)
        return [results[i] for i in ids]
