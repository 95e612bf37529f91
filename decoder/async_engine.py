"""`AsyncEngine` runs `GenerationEngine.step()` on one background thread (all GPU work on that
thread) and streams each request's deltas to an asyncio queue; the decoder deployment uses it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import astuple, dataclass, replace

from common.stack_sampler import sample_thread

from .engine import GenerationEngine
from .sequence import Delta, GenerationRequest

log = logging.getLogger(__name__)
HELD_POLL_S = 0.05  # how often held batch work looks whether it may run


@dataclass
class LoopCounters:
    """What the engine thread did since it started (its windows are differences of these)."""
    steps: int = 0
    step_s: float = 0.0  # inside `GenerationEngine.step`
    step_cpu_s: float = 0.0  # the engine thread's CPU time in them (the rest: waiting for the
    # GIL, the device, a lock; a device wait may spin and count as CPU)
    idle_s: float = 0.0  # waiting for work
    rows: int = 0  # running sequences after each step, summed
    kv_pages: int = 0  # KV-cache pages in use after each step, summed
    # read from the engine and its runner, which count them (`counters`):
    tokens: int = 0  # generated
    prefills: int = 0  # prefill forwards
    prefilled_tokens: int = 0
    device_wait_s: float = 0.0  # blocked on the device for picks (in steps)
    bans: int = 0  # (row, token) pairs the n-gram rule banned

    def minus(self, other: LoopCounters) -> LoopCounters:
        return LoopCounters(*(a - b for a, b in zip(astuple(self), astuple(other))))


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
        self._counters = LoopCounters()
        self._stopping = False
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

    def counters(self) -> LoopCounters:
        """Now's totals (read from another thread: a step may be half counted; fine for rates)."""
        runner = self.engine.runner
        return replace(self._counters, tokens=self.engine.tokens_generated, prefills=runner.prefills,
                       prefilled_tokens=runner.prefilled_tokens, device_wait_s=runner.device_wait_s,
                       bans=runner.bans)

    def profile(self, seconds: float, interval_s: float = 0.005) -> dict:
        """A window of `seconds` on the engine thread (blocks the caller, on another thread):
        what its steps did (time per step, sequences per step, prefills, the KV cache's use, the
        share of the time it waited for the device or for work) and where its time went
        (`common.stack_sampler`). The same window on the service's replica and on the in-process
        bench's engine compares the two harnesses."""
        before, start = self.counters(), time.perf_counter()
        stacks = sample_thread(self._thread.ident, seconds, interval_s)
        window, elapsed = self.counters().minus(before), time.perf_counter() - start
        return engine_window(window, elapsed, self.engine.cache.num_pages) | {"stacks": stacks}

    def stop(self) -> None:
        """End the engine thread once the requests in flight are done (their callers still get
        their answers); requests added after this are never taken. For in-process users that
        step the engine with something else afterwards (benchmarks); a replica never stops it."""
        self._inbox.put(("stop", None, None, None))
        self._wake.set()
        self._thread.join()

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
                # The request itself, not its id: the id is given where the engine thread adds
                # it, which a consumer cancelled at once may not have reached yet (the abort,
                # behind the add in the inbox, then read no id and the request ran to its end).
                self._inbox.put(("abort", request, None, None))
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
            elif kind == "stop":
                self._stopping = True
            elif kind == "probe":
                if not payload.set_running_or_notify_cancel():
                    continue  # its health check gave up waiting
                try:
                    self.engine.probe()
                    payload.set_result(None)
                except Exception as e:  # noqa: BLE001 - the health check raises it
                    payload.set_exception(e)
            else:  # abort: its consumer is gone, nobody to tell
                self.engine.abort(payload.request_id)
                self._streams.pop(payload.request_id, None)

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
            counters = self._counters
            if self._stopping and not self.engine.has_work():
                return
            if not self.engine.has_work():
                waited = time.perf_counter()
                self._wake.wait()
                self._wake.clear()
                counters.idle_s += time.perf_counter() - waited
                self._progress = time.monotonic()
                continue
            if self.engine.only_held_work():  # batch work: look again soon, not in a busy loop
                self._wake.wait(HELD_POLL_S)
                self._wake.clear()
            try:
                started, cpu = time.perf_counter(), time.thread_time()
                deltas = self.engine.step()
                counters.steps += 1
                counters.step_s += time.perf_counter() - started
                counters.step_cpu_s += time.thread_time() - cpu
                counters.rows += len(self.engine.running)
                counters.kv_pages += self.engine.cache.pages_in_use()
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


def engine_window(window: LoopCounters, seconds: float, kv_pages: int) -> dict:
    """A window's counters as rates and shares."""
    steps = max(window.steps, 1)
    return {"seconds": round(seconds, 3), "steps": window.steps,
            "ms_per_step": round(window.step_s / steps * 1e3, 3),
            "sequences_per_step": round(window.rows / steps, 2),
            "tokens_per_s": round(window.tokens / seconds, 1),
            "prefills_per_s": round(window.prefills / seconds, 2),
            "prefilled_tokens_per_s": round(window.prefilled_tokens / seconds, 1),
            "kv_cache_use": round(window.kv_pages / steps / kv_pages, 4),
            "bans_per_step": round(window.bans / steps, 1),
            "stepping_share": round(window.step_s / seconds, 4),
            "stepping_cpu_share": round(window.step_cpu_s / seconds, 4),
            "idle_share": round(window.idle_s / seconds, 4),
            "device_wait_share": round(window.device_wait_s / seconds, 4)}
