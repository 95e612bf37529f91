"""Where one 2x3 page's batch-1 time goes: the engine's call with the views on the host (as
graph_bench's page_b1_ms) and on the GPU (as the Encoder replica has them), both paths
overlapped or on one stream, each path alone; and a kernel timeline per CUDA stream.

    python bench/page_b1_probe.py [--out bench/results] [--iters 30]

Writes page-b1-<date>.json (`summary`: the medians in ms).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, wall_ms, write_result  # noqa: E402
from bench.graph_bench import image  # noqa: E402
from encoder import DualPathEncoder, EncoderArgs, preprocess  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402


def stream_timeline(fn) -> dict:
    """Per CUDA stream and kind (kernel, memcpy, memset): first start and last end in ms after
    the call's first GPU event, busy ms (the events' durations summed) and the event count."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    events = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return {}
    t0 = min(e["ts"] for e in events)
    streams: dict = {}
    for e in events:
        key = f"stream {e.get('args', {}).get('stream', '?')} {e['cat']}"
        row = streams.setdefault(key, {"first_ms": 1e9, "last_ms": 0.0, "busy_ms": 0.0, "n": 0})
        row["first_ms"] = round(min(row["first_ms"], (e["ts"] - t0) / 1e3), 3)
        row["last_ms"] = round(max(row["last_ms"], (e["ts"] + e["dur"] - t0) / 1e3), 3)
        row["busy_ms"] = round(row["busy_ms"] + e["dur"] / 1e3, 3)
        row["n"] += 1
    return streams


def main(argv=None):
    opts = options(argv, iters=30)
    encoder = random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16)
    engine = DualPathEncoder(encoder, max_images=32)
    host = preprocess(image((1191, 1684), 1))
    gpu = dataclasses.replace(host, global_view=host.global_view.cuda(), crops=host.crops.cuda())

    def both(item):
        return lambda: engine.run([item.global_view], [item.crops])
    rows = {}
    with torch.inference_mode():
        for name, item in (("host_views", host), ("gpu_views", gpu)):
            rows[f"{name}_encode"] = wall_ms(lambda: engine.encode([item]), opts.iters)
            rows[f"{name}_both_paths"] = wall_ms(both(item), opts.iters)
            engine.overlap_paths = False
            rows[f"{name}_one_stream"] = wall_ms(both(item), opts.iters)
            engine.overlap_paths = True
            rows[f"{name}_global_only"] = wall_ms(lambda: engine.run([item.global_view], [None]), opts.iters)
            rows[f"{name}_local_only"] = wall_ms(lambda: engine.run([None], [item.crops]), opts.iters)
        timeline = {name: stream_timeline(both(item))
                    for name, item in (("host_views", host), ("gpu_views", gpu))}
    for k, v in rows.items():
        print(f"{k:>28}: {v:6.2f} ms", flush=True)
    for name, streams in timeline.items():
        for stream, row in streams.items():
            print(f"{name} {stream}: {row}", flush=True)
    write_result(opts.out, "page-b1", {
        "benchmark": "one 2x3 page at batch 1, where the time goes",
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "timing": f"wall clock per call with CUDA sync, median of {opts.iters}",
        "summary": rows, "stream_timeline_ms": timeline})


if __name__ == "__main__":
    main()
