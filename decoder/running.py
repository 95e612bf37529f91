"""The model runner: the decoder's forwards over the KV cache, and the CUDA graphs that replay them.

Given the rows the scheduler decided (scheduling.py), it builds the inputs and runs the model: a
prefill of right-padded contexts with image embeddings merged at their placeholders, and one
decode step of every running sequence (eager, or replayed from the decode graphs of
decode_graphs.py). It also picks each row's next token from its logits (the n-gram rule's bans,
then argmax or seeded sampling: sampling.py, replayed from the sampler graphs captured with the
decode graphs). `prepare` captures the graphs and compiles the Triton kernels ahead of the first
request.
"""
from __future__ import annotations

import time

import torch

from common import switches
from common.triton_compile import compile_ahead

from .kv_cache import KVCache
from .model import CacheStep, Decoder
from .sampling import SamplerGraphs, argmax_rows, pick_tokens
from .sequence import Sequence
from .staging import StagedCopies, to_device
from .tokenizer import IMAGE_TOKEN_ID


class ModelRunner:
    # CUDA graphs of a one-sequence prefill at token buckets (decoder/prefill_graphs.py), captured
    # after the decode graphs: the eager prefill of a page is bound by its ~560 launches (H100,
    # realistic mix: 12,211 against 10,660 tokens/s at 64 sequences, 19,107 against 15,954 at
    # 256). DEEPSEEK_OCR_PREFILL_GRAPHS=0: every prefill runs eagerly (the reference twin).
    prefill_graphs_on = switches.on("DEEPSEEK_OCR_PREFILL_GRAPHS")

    def __init__(self, model: Decoder, cache: KVCache, max_batch: int, max_len: int,
                 decode_graphs: bool | None = None):
        self.model, self.cache, self.max_batch, self.max_len = model, cache, max_batch, max_len
        # CUDA graphs of the decode step (decoder/decode_graphs.py), captured by `prepare()` (on
        # the thread that steps the engine, before any prefill). Default: on for a bf16 model on
        # CUDA, where they measured faster at every concurrency (bench/results/decoder-*.json).
        graphable = model.device.type == "cuda" and model.dtype == torch.bfloat16
        if decode_graphs and not graphable:
            raise ValueError(f"decode graphs need a bf16 model on CUDA, got {model.dtype} on "
                             f"{model.device}")
        self.use_decode_graphs = graphable if decode_graphs is None else decode_graphs
        self.decode_graphs = None
        self.prefill_graphs = None  # PrefillGraphs, where `prefill_graphs_on` (prepare() captures them)
        self._prefill_graphable = graphable and model.args.sliding_window is None
        self.sampler_graphs = None  # pick_tokens per batch bucket, captured with the decode graphs
        self._picks_host = None  # pinned: a step's picks read back while the next step runs
        self._warmed_prefill = False
        self.compile_ahead_s = 0.0  # the Triton kernels compiled on threads before capture
        # Since the start, for profiles (AsyncEngine.profile): prefill forwards, the tokens
        # they ran, and the host's time blocked waiting for the device to hand picks back.
        self.prefills = self.prefilled_tokens = 0
        self.device_wait_s = 0.0
        self.bans = 0  # (row, token) pairs the n-gram rule banned
        self.staged = StagedCopies(model.device)  # each step's small host lists to the device

    @torch.inference_mode()
    def probe(self) -> None:
        """A cheap run of the real model on one token, outside the cache (health checks); on a
        GPU it waits for the device, so a broken CUDA context raises here."""
        self.model(input_ids=torch.tensor([[self.model.args.bos_id]], device=self.model.device))
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def prepare(self, idle: bool) -> None:
        """Capture the decode graphs if they are on (the first `step` does it otherwise), and on
        CUDA run one page-sized prefill: the prefill kernels' first launch compiles them (Triton:
        ~2 s on a fresh node, which the first request would otherwise wait). Before either, the
        Triton kernels both meet are compiled on threads at once (common/triton_compile.py).
        `idle`: no sequence holds a row of the cache yet."""
        capture = self.use_decode_graphs and self.decode_graphs is None
        warm_prefill = self.model.device.type == "cuda" and not self._warmed_prefill
        if capture or warm_prefill:
            # Capture and warm-up write into the cache: before any request holds a slot.
            assert idle, "decode graphs and the warm-up prefill come before the first request"
            self.compile_ahead_s = compile_ahead(lambda: self._first_forwards(capture, warm_prefill))
        if capture:
            from .decode_graphs import DecodeGraphs
            self.decode_graphs = DecodeGraphs(self.model, self.cache, self.max_batch, self.max_len)
            self.sampler_graphs = SamplerGraphs(self.decode_graphs.batches,
                                                self.model.args.vocab_size, self.model.device)
        if warm_prefill:
            self._first_forwards(capture=False, warm_prefill=True)
            self._warmed_prefill = True
        if self.prefill_graphs_on and self._prefill_graphable and self.prefill_graphs is None:
            # Their capture writes the scratch page only (a zero table row): any time will do.
            from .prefill_graphs import PrefillGraphs
            self.prefill_graphs = PrefillGraphs(self.model, self.cache, self.max_len)

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

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Contexts right-padded into one batch (causal rows never attend to their padding, and
        the padded cache positions are masked until decoding overwrites them), image
        embeddings merged at the prompts' placeholders, written into the pages of their rows
        (consecutive: `Scheduler.place`); the last real position's logits of each row [B, vocab]."""
        contexts = [seq.context() for seq in seqs]
        lengths = [len(c) for c in contexts]
        self.prefills += 1
        self.prefilled_tokens += sum(lengths)
        slot = seqs[0].slot
        self.cache.sync()
        ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        prompt = torch.zeros(ids.shape, dtype=torch.bool)  # generated tokens are never image slots
        for row, context in enumerate(contexts):
            ids[row, :lengths[row]] = torch.tensor(context)
            prompt[row, :len(seqs[row].request.prompt_ids)] = True
        # Every input reaches the GPU by an asynchronous copy and no step waits on the device
        # (a blocking copy or a boolean-mask write would wait for a decode step launched before
        # this prefill: `GenerationEngine.prefill_behind_decode`). Placeholders are found on the
        # host, in row-major order, as the images are concatenated.
        device = self.model.device
        embeds = self.model.embed(to_device(ids, device))
        images = [e for seq in seqs for e in seq.request.image_embeds]
        if images:
            placeholders = ((ids == IMAGE_TOKEN_ID) & prompt).flatten().nonzero()[:, 0]
            images = torch.cat([to_device(e, device) for e in images]).to(embeds.dtype)
            embeds.view(-1, embeds.shape[-1]).index_copy_(0, to_device(placeholders, device), images)
        if self.prefill_graphs is not None and len(seqs) == 1 and self.prefill_graphs.fits(lengths[0]):
            return self.prefill_graphs.run(embeds, slot)
        last = to_device(torch.tensor(lengths) - 1, device)
        # R-SWA: a resumed sequence's context holds generated tokens, which see only the prompt
        # and their last `window` (a fresh prompt's pass is plain causal: no mask is built).
        return self.model(inputs_embeds=embeds, step=CacheStep(self.cache, slot=slot), logits_at=last,
                          prompt_lens=[len(seq.request.prompt_ids) for seq in seqs])[:, -1]

    def empty_cache(self) -> None:
        """After a prefill ran out of GPU memory: the allocator's cached blocks go back to the
        device before the smaller retries (`Scheduler.unadmit`)."""
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def decode(self, active: list[Sequence], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of the running sequences, launched: their logits [S, vocab]. Each
        feeds its pending token, or row i of `tokens` (on the device: the last step's picks,
        not read back yet; `GenerationEngine.overlap_picks`)."""
        # Active sequences are exactly the running ones, in slot order 0..S-1.
        assert [s.slot for s in active] == list(range(len(active))), "slots must stay compact"
        self.cache.sync()
        # R-SWA models (Unlimited-OCR): each row's prompt length, where its window's gap begins
        prompt_lens = ([len(s.request.prompt_ids) for s in active]
                       if self.model.args.sliding_window is not None else None)
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run([s.pending for s in active] if tokens is None else tokens,
                                            [s.length for s in active], prompt_lens)
        else:
            device = self.model.device
            tokens = (torch.tensor([[s.pending] for s in active], device=device) if tokens is None
                      else tokens.view(-1, 1))
            positions = torch.tensor([s.length for s in active], device=device)
            step = CacheStep(self.cache, positions=positions, kv_len=max(s.length for s in active) + 1)
            if prompt_lens is not None:
                step.prompt_lens = torch.tensor(prompt_lens, device=device)
            logits = self.model(input_ids=tokens, positions=positions[:, None], step=step)[:, -1]
        for s in active:
            s.length += 1
            s.pending = None
        return logits

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Each row's next token (waits for the device)."""
        picked = self.pick_on_device(seqs, logits)
        start = time.perf_counter()
        tokens = picked.tolist()
        self.device_wait_s += time.perf_counter() - start
        return tokens

    def read_back(self, picked: torch.Tensor):
        """Start copying `picked` (a step's tokens on the device) to the host; returns a function
        that waits for them and gives them as a list. On a GPU the copy goes through a pinned
        buffer behind the work queued so far, so what is launched after it runs on."""
        if picked.device.type != "cuda":
            return picked.tolist
        if self._picks_host is None:
            self._picks_host = torch.zeros(self.max_batch, dtype=torch.long, pin_memory=True)
        host = self._picks_host[:picked.shape[0]]
        host.copy_(picked, non_blocking=True)
        copied = torch.cuda.current_stream(picked.device).record_event()

        def tokens() -> list[int]:
            start = time.perf_counter()
            copied.synchronize()
            self.device_wait_s += time.perf_counter() - start
            return host.tolist()
        return tokens

    def pick_on_device(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The n-gram rule's bans written into `logits` (the caller's fresh tensor), then the
        pick: argmax, or seeded sampling for rows with a temperature -> [S] on the device."""
        # No float(): bf16 -> fp32 is exact, so argmax (ties included) is the same without the
        # 33 MB copy at 64 sequences. All sequences' banned tokens in one indexed write.
        rows, cols = [], []
        for i, seq in enumerate(seqs):
            if seq.ngram is not None:
                banned = seq.ngram.banned()
                rows += [i] * len(banned)
                cols += banned
        if rows:
            self.bans += len(rows)
            where = self.staged(rows + cols).view(2, len(rows))  # one copy for both
            logits[where[0], where[1]] = float("-inf")
        return self.pick(seqs, logits)

    def pick(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Greedy argmax when no sequence samples (the default path, as before sampling
        existed); otherwise `pick_tokens` per row, replayed from a graph when there are graphs."""
        params = [s.request.params for s in seqs]
        if all(p.temperature == 0 for p in params):
            return argmax_rows(logits)
        device = logits.device  # copies that do not wait for the device (a decode step may run)
        rows = (to_device(torch.tensor([p.temperature for p in params]), device),
                to_device(torch.tensor([p.top_p for p in params]), device),
                to_device(torch.tensor([s.seed for s in seqs], dtype=torch.int64), device),
                to_device(torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64), device))
        if self.sampler_graphs is not None and self.sampler_graphs.fits(len(seqs)):
            return self.sampler_graphs.run(logits, *rows)
        return pick_tokens(logits, *rows)
