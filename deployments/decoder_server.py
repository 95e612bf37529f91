"""The Decoder deployment: the continuous-batching engine behind a Serve handle.

Concurrent calls each submit one request to `AsyncEngine`, whose background thread steps all
running sequences together (and owns every GPU call, decode-graph capture included), so the
replica's event loop stays free; `generate` returns the finished text, `generate_stream`
yields deltas.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import torch
from ray import serve
from ray.serve.exceptions import BackPressureError

from decoder import (AsyncEngine, GenerationEngine, GenerationRequest, SamplingParams, load_decoder,
                     load_tokenizer)
from scheduler import DecoderAdmission

from .config import PROBE_EVERY_S, SHUTDOWN, STUCK_AFTER_S, AppConfig
from .metrics import decoder_metrics
from .model_source import (device_and_dtype, gpu_ids, gpu_memory_gb, is_tiny, prepare_replica_process,
                           replica_id, resolve_checkpoint, start_cuda, startup_phases)


# Admission is the replica's own (`DecoderAdmission`: a full batch plus `decoder_queue`
# waiting), so every request must reach it: max_ongoing_requests above any max_batch +
# decoder_queue a config sets. max_queued_requests bounds Serve's queue should one still form:
# past it, callers get BackPressureError at once, as from a full decoder.
@serve.deployment(max_ongoing_requests=4096, max_queued_requests=512,
                  ray_actor_options={"num_cpus": 0.25}, **SHUTDOWN)
class DecoderServer:
    def __init__(self, config: AppConfig):
        constructor_start = time.perf_counter()
        prepare_replica_process()
        cuda = start_cuda(config.gpu_memory_fraction("decoder"))
        device, dtype = device_and_dtype()
        directory, self.model_label = resolve_checkpoint(config.checkpoint)
        self.model_name = config.served_model_name or self.model_label  # its metrics' `model`
        start, reads = time.perf_counter(), {}
        model = load_decoder(directory, device=device, dtype=dtype, timings=reads)
        weights = time.perf_counter() - start
        tokenizer = load_tokenizer(None if is_tiny(config.checkpoint) else directory)
        loaded = time.perf_counter()
        # use_graphs None: decode-step CUDA graphs on a GPU, eager on CPU.
        self.engine = AsyncEngine(GenerationEngine(model, tokenizer, config.max_batch, config.max_len,
                                                   decode_graphs=config.use_graphs,
                                                   kv_cache_gb=config.kv_cache_gb,
                                                   kv_cache_dtype=config.kv_cache_dtype))
        # "graphs": the KV cache's allocation and the decode and sampler graphs' capture, of
        # which "graphs_compile_ahead" compiling their Triton kernels on threads first.
        self.startup_s = startup_phases(constructor_start, cuda=cuda, weights=weights,
                                        **{f"weights_{k}": v for k, v in reads.items() if k != "gb"},
                                        tokenizer=loaded - start - weights,
                                        graphs=time.perf_counter() - loaded,
                                        graphs_compile_ahead=self.engine.engine.compile_ahead_s)
        self.probed = time.monotonic()  # last real-path probe (none needed right after start-up)
        self.admission = DecoderAdmission(config.max_batch, config.decoder_queue)
        self.reported_tokens = 0  # of engine.tokens_generated, in the metrics so far
        self.reporter: asyncio.Task | None = None  # `_report_every_second`, from the first request

    def stats(self) -> dict:
        engine = self.engine.engine
        return {"model": self.model_label, "replica": replica_id(), "pid": os.getpid(),
                "gpu_ids": gpu_ids(),
                "decode_graphs": engine.decode_graphs is not None,
                "running": len(engine.running), "waiting": len(engine.waiting),
                "batch_running": engine.scheduler.batch_running,
                "batch_held": engine.scheduler.batch_held,
                "preempted": len(engine.preempted), "preemptions": engine.preemptions,
                "kv_cache_pages": engine.cache.num_pages, "kv_cache_pages_in_use": engine.cache.pages_in_use(),
                "admission": {"held": self.admission.held, "capacity": self.admission.capacity,
                              "refused": self.admission.refused}}

    async def check_health(self):
        """Fails when the engine thread died or has made no step for minutes; when idle, now and
        then runs the model's real code on one token on the engine thread."""
        if not self.engine.alive:
            raise RuntimeError("generation engine thread died")
        if self.engine.stalled_for() > STUCK_AFTER_S:
            raise RuntimeError(f"generation engine stuck: no step for over {STUCK_AFTER_S} s")
        if self.engine.engine.has_work() or time.monotonic() - self.probed < PROBE_EVERY_S:
            return  # working sequences exercise the model every step
        self.probed = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.probe()), timeout=20)
        except asyncio.TimeoutError:  # requests arrived first: not a fault
            return

    async def profile(self, seconds: float = 10.0) -> dict:
        """A profiler window of `seconds` on this replica's engine thread, under whatever load it
        has (`AsyncEngine.profile`: steps, sequences per step, prefills, KV-cache use, waits, and
        the thread's stack samples); benches open it on the running service."""
        if not 0 < seconds <= 300:
            raise ValueError(f"a profile window lasts (0, 300] seconds, got {seconds}")
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.profile, seconds)

    def ready(self) -> dict:
        """Answers once the constructor (weights, decode-graph capture) has finished."""
        engine = self.engine.engine
        return {"ready": self.engine.alive, "decode_graphs": engine.decode_graphs is not None,
                "max_batch": engine.max_batch, "max_len": engine.max_len,
                "kv_cache_tokens": engine.cache.capacity_tokens, "startup_s": self.startup_s,
                "gpu_memory_gb": gpu_memory_gb()}

    async def generate(self, prompt_ids: list[int], image_embeds: list[torch.Tensor],
                       params: SamplingParams) -> dict:
        """The whole generation in one answer (merged on the engine thread: no per-token work
        on this replica's event loop), with its time in this replica (`timings`)."""
        request = GenerationRequest(prompt_ids, image_embeds, params)
        arrived, last = time.monotonic(), None
        self._admit(params.priority)
        try:
            async for delta in self.engine.generate(request, stream=False):
                last = delta
        finally:
            self._leave(params.priority)
        timings = self._record_latency(request, last, arrived, last.first_token_at, time.monotonic())
        return {**self._as_dict(last), "timings": timings}

    async def generate_stream(self, prompt_ids: list[int], image_embeds: list[torch.Tensor],
                              params: SamplingParams) -> AsyncIterator[dict]:
        request = GenerationRequest(prompt_ids, image_embeds, params)
        arrived, first = time.monotonic(), None
        self._admit(params.priority)
        try:
            async for delta in self.engine.generate(request):
                first = first or time.monotonic()
                if delta.finished:
                    self._record_latency(request, delta, arrived, first, time.monotonic())
                yield self._as_dict(delta)
        finally:
            self._leave(params.priority)

    def _admit(self, priority: str) -> None:
        """Take the request, or refuse it at once when the replica holds a full batch and
        `decoder_queue` more of its class (the Router answers 503 with Retry-After, as for any
        full queue; a batch job's line is tried again)."""
        if not self.admission.take(priority):
            raise BackPressureError(num_queued_requests=self.admission.held[priority],
                                    max_queued_requests=self.admission.capacity)
        if self.reporter is None:  # the replica's event loop exists by now
            self.reporter = asyncio.get_running_loop().create_task(self._report_every_second())
        self._record_load()

    def _leave(self, priority: str) -> None:
        self.admission.release(priority)
        self._record_load()

    @staticmethod
    def _as_dict(delta) -> dict:
        out = {"text": delta.text, "finished": delta.finished, "finish_reason": delta.finish_reason,
               "prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens}
        if delta.repetition is not None:  # a loop ended it (decoder/repetition.py)
            out["repetition"] = delta.repetition
        return out

    def _record_latency(self, request, delta, arrived: float, first: float | None, done: float) -> dict:
        """Queue, prefill, time to first token and time per output token of a finished request
        into the metrics; returns its stages in ms: waiting for admission (`decoder_queue_ms`),
        prefill to first token (`prefill_ms`), first token to the last (`generate_ms`)."""
        metrics = decoder_metrics(self.model_name)
        if first is None:  # finished without a token (aborted)
            return {}
        stages = {"generate_ms": (done - first) * 1e3}
        metrics["ttft_ms"].observe((first - arrived) * 1e3)
        if request.prefilled_at is not None:
            stages["decoder_queue_ms"] = (request.prefilled_at - arrived) * 1e3
            stages["prefill_ms"] = (first - request.prefilled_at) * 1e3
            metrics["queue_ms"].observe(stages["decoder_queue_ms"])
            metrics["prefill_ms"].observe(stages["prefill_ms"])
        if delta.completion_tokens > 1:
            metrics["tpot_ms"].observe(stages["generate_ms"] / (delta.completion_tokens - 1))
        return stages

    async def _report_every_second(self) -> None:
        """The load gauges and the generated-token count, every second while the replica runs
        (between arrivals and finishes too: a long batch's gauges and tokens/s stay current)."""
        while True:
            self._record_load()
            await asyncio.sleep(1.0)

    def _record_load(self) -> None:
        """Running / waiting sequences, KV-cache use and tokens generated, read from the engine
        (its thread owns them; a slightly stale reading is fine for metrics)."""
        engine, metrics = self.engine.engine, decoder_metrics(self.model_name)
        generated = engine.tokens_generated
        if generated > self.reported_tokens:
            metrics["generated_tokens"].inc(generated - self.reported_tokens)
            self.reported_tokens = generated
        metrics["running"].set(len(engine.running))
        metrics["waiting"].set(len(engine.waiting))
        metrics["batch_held"].set(engine.scheduler.batch_held)
        metrics["batch_running"].set(engine.scheduler.batch_running)
        metrics["preempted"].set(len(engine.preempted))
        metrics["kv_cache_usage"].set(engine.cache.pages_in_use() / engine.cache.num_pages)
