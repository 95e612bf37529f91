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
next one, so the host's per-token work of step 3 runs while the GPU decodes. The KV cache is a
budget of pages (decoder/kv_cache.py): admission waits for free pages, and a sequence that
finds none preempts the newest (resumed later by one prefill of its context).
Decoding of each sequence does not depend on its neighbours: rows never attend to each other,
padded cache positions are masked, and a sampled token's randomness is a function of its own
request's seed and step, so batching reproduces generating alone.

`AsyncEngine` runs `step()` on one background thread (all GPU work on that thread) and streams
each request's deltas to an asyncio queue; the decoder deployment uses it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from common.triton_compile import compile_ahead

from .kv_cache import KVCache, cache_pages, pages_for
from .model import CacheStep, Decoder
from .ngram import NGramConfig, NoRepeatNGram
from .sampling import SamplerGraphs, pick_tokens
from .tokenizer import IMAGE_TOKEN_ID, IncrementalDecoder, find_stop, holdback

log = logging.getLogger(__name__)
MAX_TEMPERATURE = 2.0  # OpenAI's range


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 8192
    stop: tuple[str, ...] = ()
    ngram: NGramConfig = field(default_factory=NGramConfig)
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens
    temperature: float = 0.0  # 0: greedy (the default, as DeepSeek's scripts run the model)
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    skip_special_tokens: bool = False  # drop the tokenizer's special tokens (grounding tags) from text

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
    finish_reason: str | None = None  # "eos", "length", "stop", "aborted"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None  # time.monotonic() of the first token (merged deltas)

    def merge(self, later: Delta) -> None:
        """Fold a later delta of the same request into this one."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    slot: int
    length: int  # tokens in the KV cache
    max_tokens: int
    ngram: NoRepeatNGram | None
    detok: IncrementalDecoder
    tokens: list[int] = field(default_factory=list)  # generated, EOS included
    text: str = ""  # decoded so far (before any stop truncation)
    emitted: int = 0  # characters of text already sent
    pending: int | None = None  # newest token, not yet in the cache
    seed: int = 0  # the request's seed (a random one when it gave none)
    admitted: int = 0  # admission order: when pages run out, the newest give theirs back
    done: bool = False  # finished or aborted (it may still hold a row of the step in flight)

    def context(self) -> list[int]:
        """The tokens its cache holds: the prompt and all generated but the pending one."""
        return self.request.prompt_ids + self.tokens[:-1]


class GenerationEngine:
    def __init__(self, model: Decoder, tokenizer, max_batch: int = 256, max_len: int | None = None,
                 decode_graphs: bool | None = None, prefill_tokens: int = 16384,
                 kv_cache_gb: float | None = None):
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.prefill_tokens = prefill_tokens  # padded tokens per batched prefill forward
        self.max_len = max_len or model.args.max_positions
        # The KV cache is a budget of pages (decoder/kv_cache.py): up to max_batch sequences run
        # while their pages fit; when they run out, the newest sequences are preempted (their
        # pages freed, their context recomputed by a prefill when pages are free again).
        args = model.args
        per_token = KVCache.bytes_per_token(args.n_layers, args.n_heads, args.head_dim, model.dtype)
        self.cache = KVCache(args.n_layers, args.n_heads, args.head_dim,
                             cache_pages(kv_cache_gb, per_token, max_batch, self.max_len, model.device),
                             max_batch, self.max_len, model.device, model.dtype)
        self.max_len = min(self.max_len, self.cache.capacity_tokens)  # one sequence always fits
        self.preempted: deque[_Sequence] = deque()  # oldest first: they resume before new requests
        self.preemptions = 0
        self._admissions = itertools.count()
        # The decode step launched at the end of the last `step()` and not yet picked from:
        # (its rows' sequences, its logits). Sequences that finished while it ran leave once
        # it is done (`_leaving`): the page table must not change under a step in flight.
        self._inflight: tuple[list[_Sequence], torch.Tensor] | None = None
        self._leaving: list[_Sequence] = []
        # CUDA graphs of the decode step (decoder/decode_graphs.py), captured by `prepare()` (on
        # the thread that steps the engine, before any prefill). Default: on for a bf16 model on
        # CUDA, where they measured faster at every concurrency (bench/results/decoder-*.json).
        graphable = model.device.type == "cuda" and model.dtype == torch.bfloat16
        if decode_graphs and not graphable:
            raise ValueError(f"decode graphs need a bf16 model on CUDA, got {model.dtype} on "
                             f"{model.device}")
        self.use_decode_graphs = graphable if decode_graphs is None else decode_graphs
        self.decode_graphs = None
        self.sampler_graphs = None  # pick_tokens per batch bucket, captured with the decode graphs
        self._warmed_prefill = False
        self.compile_ahead_s = 0.0  # the Triton kernels compiled on threads before capture
        self.special_ids = frozenset(tokenizer.special_ids)
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[_Sequence] = []
        self._ids = itertools.count()

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
        self.waiting.append(request)
        return request.request_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted or self._inflight)

    @torch.inference_mode()
    def probe(self) -> None:
        """A cheap run of the real model on one token, outside the cache (health checks); on a
        GPU it waits for the device, so a broken CUDA context raises here."""
        self.model(input_ids=torch.tensor([[self.model.args.bos_id]], device=self.model.device))
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def reset(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted)."""
        self.waiting.clear()
        self.running.clear()
        self.preempted.clear()
        self._inflight, self._leaving = None, []
        self.cache.clear()

    def abort(self, request_id: str) -> Delta | None:
        for request in list(self.waiting):
            if request.request_id == request_id:
                self.waiting.remove(request)
                return Delta(request_id, "", [], True, "aborted", len(request.prompt_ids))
        for seq in itertools.chain(self.running, self.preempted):
            if seq.request.request_id == request_id and not seq.done:
                self._retire(seq)
                return self._delta(seq, [], "aborted")
        return None

    # -- one iteration ----------------------------------------------------------------------
    def prepare(self) -> None:
        """Capture the decode graphs if they are on (the first `step` does it otherwise), and on
        CUDA run one page-sized prefill: the prefill kernels' first launch compiles them (Triton:
        ~2 s on a fresh node, which the first request would otherwise wait). Before either, the
        Triton kernels both meet are compiled on threads at once (common/triton_compile.py)."""
        capture = self.use_decode_graphs and self.decode_graphs is None
        warm_prefill = self.model.device.type == "cuda" and not self._warmed_prefill
        if capture or warm_prefill:
            # Capture and warm-up write into the cache: before any request holds a slot.
            assert not self.running, "decode graphs and the warm-up prefill come before the first request"
            self.compile_ahead_s = compile_ahead(lambda: self._first_forwards(capture, warm_prefill))
        if capture:
            from .decode_graphs import DecodeGraphs
            self.decode_graphs = DecodeGraphs(self.model, self.cache, self.max_batch, self.max_len)
            self.sampler_graphs = SamplerGraphs(self.decode_graphs.batches,
                                                self.model.args.vocab_size, self.model.device)
        if warm_prefill:
            self._first_forwards(capture=False, warm_prefill=True)
            self._warmed_prefill = True

    @torch.inference_mode()
    def _first_forwards(self, capture: bool, warm_prefill: bool) -> None:
        """The decode step of every graph shape (`capture`) and one page-sized prefill."""
        if capture:
            from .decode_graphs import decode_step, graph_shapes
            for batch, context in graph_shapes(self.cache, self.max_batch, self.max_len):
                decode_step(self.model, self.cache, batch, context)[0]()
        if warm_prefill:
            # 1,024 tokens: past the MoE kernels' prefill rows (triton_moe.PREFILL_ROWS) and a
            # page of RoPE positions per program. Row 0 holds no pages: it writes the scratch page.
            embeds = torch.zeros(1, min(1024, self.max_len), self.model.args.hidden,
                                 device=self.model.device, dtype=self.model.dtype)
            self.model(inputs_embeds=embeds, step=CacheStep(self.cache, slot=0), last_only=True)

    @torch.inference_mode()
    def step(self) -> list[Delta]:
        """One iteration, pipelined with the GPU: pick the tokens of the decode step launched
        last time (waiting for it), admit and prefill, launch the next decode step, and only
        then do the per-token host work (n-gram state, detokenising, stop strings, deltas)
        while that step runs."""
        self.prepare()
        picked: list[tuple[_Sequence, int, str | None]] = []
        if self._inflight is not None:
            rows, logits = self._inflight
            self._inflight = None
            picked += self._take(rows, logits)  # waits for the step: the table may change now
        for seq in self._leaving:
            self._leave(seq)
        self._leaving = []
        decoding = bool(self.running)
        while (self.preempted or self.waiting) and len(self.running) < self.max_batch:
            group = self._next_prefill_group()
            if not group:  # the next prompt's pages are not free yet
                break
            try:
                logits = self._prefill(group)
            except torch.cuda.OutOfMemoryError:
                if len(group) == 1:  # nothing smaller to try: the step fails as any other
                    raise
                self._unadmit(group)
                continue
            fresh = [row for row, seq in enumerate(group) if not seq.tokens]  # resumed ones hold theirs
            picked += self._take([group[row] for row in fresh],
                                 logits if len(fresh) == len(group) else logits[fresh])
            if decoding:  # running sequences wait on this step: at most one prefill forward
                break
        if self.running:
            self._grow()
            rows = list(self.running)
            self._inflight = (rows, self._decode(rows))  # launched; picked by the next step()
        return self._report(picked)

    def _next_prefill_group(self) -> list[_Sequence]:
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

    def _unadmit(self, group: list[_Sequence]) -> None:
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
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sequence(self, request: GenerationRequest) -> _Sequence:
        params = request.params
        n = len(request.prompt_ids)
        return _Sequence(request, -1, n, min(params.max_tokens, self.max_len - n),
                         NoRepeatNGram(params.ngram.ngram_size, params.ngram.window,
                                       params.ngram.whitelist) if params.ngram.enabled else None,
                         IncrementalDecoder(self.tokenizer),
                         seed=secrets.randbits(32) if params.seed is None else params.seed,
                         admitted=next(self._admissions))

    def _prefill(self, seqs: list[_Sequence]) -> torch.Tensor:
        """Contexts right-padded into one batch (causal rows never attend to their padding, and
        the padded cache positions are masked until decoding overwrites them), image
        embeddings merged at the prompts' placeholders, written into the next free rows'
        pages; the last real position's logits of each row [B, vocab]."""
        contexts = [seq.context() for seq in seqs]
        lengths = [len(c) for c in contexts]
        started = time.monotonic()
        slot = len(self.running)
        for row, seq in enumerate(seqs):
            if seq.request.prefilled_at is None:
                seq.request.prefilled_at = started
            seq.slot, seq.length = slot + row, lengths[row]
            assert self.cache.reserve(seq.slot, seq.length + 1), "admitted without its pages"
            self.running.append(seq)
        self.cache.sync()
        ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        prompt = torch.zeros(ids.shape, dtype=torch.bool)  # generated tokens are never image slots
        for row, context in enumerate(contexts):
            ids[row, :lengths[row]] = torch.tensor(context)
            prompt[row, :len(seqs[row].request.prompt_ids)] = True
        ids = ids.to(self.model.device)
        embeds = self.model.embed(ids)
        images = [e for seq in seqs for e in seq.request.image_embeds]
        if images:  # placeholders in row-major order, as the images are concatenated
            images = torch.cat([e.to(embeds.device, embeds.dtype) for e in images])
            embeds[(ids == IMAGE_TOKEN_ID) & prompt.to(ids.device)] = images
        last = torch.tensor(lengths, device=self.model.device) - 1
        return self.model(inputs_embeds=embeds, step=CacheStep(self.cache, slot=slot),
                          logits_at=last)[:, -1]

    def _grow(self) -> None:
        """Give each running sequence the page its pending token goes to; when none is free,
        preempt the newest sequence (its pages freed; `_next_prefill_group` resumes it)."""
        # Most steps no sequence crosses into a new page (one in 64 does): only those are sorted.
        growing = [s for s in self.running if not self.cache.holds(s.slot, s.length + 1)]
        for seq in sorted(growing, key=lambda s: s.admitted):
            while seq.slot >= 0 and not self.cache.reserve(seq.slot, seq.length + 1):
                victim = max(self.running, key=lambda s: s.admitted)
                self._leave(victim)
                self.preempted.appendleft(victim)
                self.preemptions += 1

    def _decode(self, active: list[_Sequence]) -> torch.Tensor:
        # Active sequences are exactly the running ones, in slot order 0..S-1.
        assert [s.slot for s in active] == list(range(len(active))), "slots must stay compact"
        self.cache.sync()
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run([s.pending for s in active], [s.length for s in active])
        else:
            device = self.model.device
            tokens = torch.tensor([[s.pending] for s in active], device=device)
            positions = torch.tensor([s.length for s in active], device=device)
            step = CacheStep(self.cache, positions=positions, kv_len=max(s.length for s in active) + 1)
            logits = self.model(input_ids=tokens, positions=positions[:, None], step=step)[:, -1]
        for s in active:
            s.length += 1
            s.pending = None
        return logits

    def _take(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[tuple[_Sequence, int, str | None]]:
        """Pick each live sequence's next token from its logits row (the step's one host sync);
        sequences done by EOS or max_tokens leave at once. -> (sequence, token, "eos" /
        "length" / None) for each."""
        live = [row for row, seq in enumerate(seqs) if not seq.done]
        if len(live) < len(seqs):
            seqs, logits = [seqs[row] for row in live], logits[live]
        if not seqs:
            return []
        picked = []
        for seq, token in zip(seqs, self._choose(seqs, logits)):
            seq.tokens.append(token)
            seq.pending = token
            reason = None
            if token == self.model.args.eos_id and not seq.request.params.ignore_eos:
                reason = "eos"
            elif len(seq.tokens) >= seq.max_tokens:
                reason = "length"
            if reason is not None:
                seq.done = True
                self._leave(seq)
            picked.append((seq, token, reason))
        return picked

    def _choose(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[int]:
        """The n-gram rule's bans written into `logits` (the caller's fresh tensor), then the
        pick: argmax, or seeded sampling for rows with a temperature."""
        # No float(): bf16 -> fp32 is exact, so argmax (ties included) is the same without the
        # 33 MB copy at 64 sequences. All sequences' banned tokens in one indexed write.
        rows, cols = [], []
        for i, seq in enumerate(seqs):
            if seq.ngram is not None:
                banned = seq.ngram.banned()
                rows += [i] * len(banned)
                cols += banned
        if rows:
            device = logits.device
            logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
        return self._pick(seqs, logits).tolist()

    def _report(self, picked: list[tuple[_Sequence, int, str | None]]) -> list[Delta]:
        """Per picked token: the n-gram state, the text, stop strings; one delta each. A stop
        string ends its sequence here (its row of the step in flight goes unused)."""
        deltas = []
        for seq, token, reason in picked:
            if seq.ngram is not None:
                seq.ngram.push(token)
            if reason != "eos" and not (seq.request.params.skip_special_tokens
                                        and token in self.special_ids):
                seq.text += seq.detok.push([token])
            stops = seq.request.params.stop
            cut = find_stop(seq.text, list(stops), seq.emitted) if stops else None
            if cut is not None:
                seq.text, reason = seq.text[:cut], "stop"
                if not seq.done:
                    self._retire(seq)
            if reason is not None:
                if reason != "stop":
                    seq.text += seq.detok.flush()
                deltas.append(self._delta(seq, [token], reason))
            else:
                deltas.append(self._delta(seq, [token], None))
        return deltas

    def _pick(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Greedy argmax when no sequence samples (the default path, as before sampling
        existed); otherwise `pick_tokens` per row, replayed from a graph when there are graphs."""
        params = [s.request.params for s in seqs]
        if all(p.temperature == 0 for p in params):
            return logits.argmax(dim=-1)
        device = logits.device
        rows = (torch.tensor([p.temperature for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([s.seed for s in seqs], device=device, dtype=torch.int64),
                torch.tensor([len(s.tokens) for s in seqs], device=device, dtype=torch.int64))
        if self.sampler_graphs is not None and self.sampler_graphs.fits(len(seqs)):
            return self.sampler_graphs.run(logits, *rows)
        return pick_tokens(logits, *rows)

    def _delta(self, seq: _Sequence, tokens: list[int], reason: str | None) -> Delta:
        # Hold back a tail that could still grow into a stop string.
        end = len(seq.text) if reason else len(seq.text) - holdback(seq.text, list(seq.request.params.stop))
        end = max(end, seq.emitted)
        text, seq.emitted = seq.text[seq.emitted:end], end
        return Delta(seq.request.request_id, text, tokens, reason is not None, reason,
                     len(seq.request.prompt_ids), len(seq.tokens))

    def _retire(self, seq: _Sequence) -> None:
        """End a sequence now (a stop string, an abort): a preempted one just goes; a running
        one leaves when the step in flight is done (`step` frees its row then)."""
        seq.done = True
        if seq.slot < 0:
            self.preempted.remove(seq)
        elif self._inflight is not None:
            self._leaving.append(seq)
        else:
            self._leave(seq)

    def _leave(self, seq: _Sequence) -> None:
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

    # -- offline helper ---------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest]) -> list[Delta]:
        """Run requests to completion; one Delta per request with all text and tokens."""
        ids = [self.add(r) for r in requests]
        results = {i: Delta(i, "", []) for i in ids}
        while self.has_work():
            for d in self.step():
                results[d.request_id].merge(d)
        return [results[i] for i in ids]


class AsyncEngine:
    """One background thread steps the engine; each request streams deltas to its event loop."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (its event loop, its queue, its merged delta when it is not streamed)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Delta | None]] = {}
        self._wake = threading.Event()
        self._prepared = threading.Event()
        self._prepare_error: BaseException | None = None
        self._progress = time.monotonic()  # when the engine thread last finished a step or idled
        self._thread = threading.Thread(target=self._loop, name="generation-engine", daemon=True)
        self._thread.start()
        # Graph capture happens on the engine thread; wait for it, so a replica is ready (and
        # its first request is not held up) only once the graphs exist.
        self._prepared.wait()
        if self._prepare_error is not None:
            raise RuntimeError(f"generation engine failed to start: {self._prepare_error}") \
                from self._prepare_error

    def stalled_for(self) -> float:
        """Seconds since the engine thread last finished a step while it had work (0 when idle)."""
        return time.monotonic() - self._progress if self.engine.has_work() else 0.0

    def probe(self) -> concurrent.futures.Future:
        """`GenerationEngine.probe` on the engine thread, between steps; its future."""
        done = concurrent.futures.Future()
        self._inbox.put(("probe", done, None, None))
        self._wake.set()
        return done

    @property
    def alive(self) -> bool:
        """False once the engine thread has died (the replica's health check reports it)."""
        return self._thread.is_alive()

    async def generate(self, request: GenerationRequest, stream: bool = True) -> AsyncIterator[Delta]:
        """The request's deltas as they are made; `stream=False`: one delta, the whole
        generation, merged on the engine thread (the caller's event loop then wakes once per
        request instead of once per token: at 256 sequences, ~17,000 wake-ups a second)."""
        loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
        self._inbox.put(("add", (request, stream), loop, deltas))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await deltas.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away: free the slot
                self._inbox.put(("abort", request.request_id, None, None))
                self._wake.set()

    def _publish(self, delta: Delta) -> None:
        loop, deltas, merged = self._streams[delta.request_id]
        if merged is not None:
            if merged.first_token_at is None:
                merged.first_token_at = time.monotonic()
            merged.merge(delta)
            delta = merged
        if merged is None or delta.finished:
            loop.call_soon_threadsafe(deltas.put_nowait, delta)
        if delta.finished:
            del self._streams[delta.request_id]

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, loop, deltas = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request, stream = payload
                try:
                    request_id = self.engine.add(request)
                    merged = None if stream else Delta(request_id, "", [])
                    self._streams[request_id] = (loop, deltas, merged)
                except Exception as e:  # bad request: tell its caller, keep serving
                    loop.call_soon_threadsafe(deltas.put_nowait, e)
            elif kind == "probe":
                if not payload.set_running_or_notify_cancel():
                    continue  # its health check gave up waiting
                try:
                    self.engine.probe()
                    payload.set_result(None)
                except Exception as e:  # noqa: BLE001 - the health check raises it
                    payload.set_exception(e)
            else:  # abort: its consumer is gone, nobody to tell
                self.engine.abort(payload)
                self._streams.pop(payload, None)

    def _loop(self) -> None:
        try:
            self.engine.prepare()
        except BaseException as e:  # noqa: BLE001 - reported to __init__, which raises it
            self._prepare_error = e
            return
        finally:
            self._prepared.set()
        while True:
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait()
                self._wake.clear()
                self._progress = time.monotonic()
                continue
            try:
                deltas = self.engine.step()
                self._progress = time.monotonic()
            except Exception as e:  # fail the requests in flight, keep the engine serving
                log.exception("generation step failed")
                self.engine.reset()
                for loop, q, _ in self._streams.values():
                    loop.call_soon_threadsafe(q.put_nowait, RuntimeError(f"generation failed: {e}"))
                self._streams.clear()
                continue
            for delta in deltas:
                if delta.request_id in self._streams:
                    self._publish(delta)
