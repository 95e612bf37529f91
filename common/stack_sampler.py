"""Where one thread's time goes: its Python stack sampled from another thread (`sys._current_frames`)
every few milliseconds for a window of seconds. The same sampler opens a window on the Decoder's
engine thread inside a running replica (`DecoderServer.profile`) and on the in-process engine of
`bench/decoder_bench.py`, so the two harnesses are read with one instrument.

A frame blocked in C with the GIL released (waiting for the GPU in a read-back, a lock, a queue)
still shows the Python line that called it, so waiting shows up as time in its caller. Sampling
takes the GIL `1 / interval_s` times a second: it costs the sampled thread a little; compare
windows taken the same way, not them with unsampled runs.
"""
from __future__ import annotations

import collections
import sys
import time


def _name(frame) -> str:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "?")
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"


def sample_thread(thread_id: int, seconds: float, interval_s: float = 0.005, top: int = 25) -> dict:
    """Sample thread `thread_id`'s stack for `seconds` (blocking the caller): each function's
    share of the samples while on the stack (`inclusive`) and at its top (`self`), the most
    frequent `top` of each, and the share of samples in which the thread was not seen (it had
    ended)."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    samples = missing = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        frame = sys._current_frames().get(thread_id)
        samples += 1
        if frame is None:
            missing += 1
        else:
            own[_name(frame)] += 1
            seen = set()
            while frame is not None:
                name = _name(frame)
                if name not in seen:  # recursion counts once per sample
                    seen.add(name)
                    inclusive[name] += 1
                frame = frame.f_back
        time.sleep(interval_s)
    present = max(samples - missing, 1)

    def shares(counter: collections.Counter) -> list[list]:
        return [[name, round(count / present, 4)] for name, count in counter.most_common(top)]
    return {"samples": samples, "interval_s": interval_s, "seconds": seconds,
            "missing_share": round(missing / max(samples, 1), 4),
            "inclusive": shares(inclusive), "self": shares(own)}

