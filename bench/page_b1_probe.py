"""Where one 2x3 page's batch-1 time goes: the engine's call with the views on the host (as
graph_bench's page_b1_ms) and on the GPU (as the Encoder replica has them), both paths
overlapped or on one stream, each path alone; a kernel timeline per CUDA stream, and each
path's kernels by name and in the order they ran.
Two launch schemes the engine does not use, measured against its own: `threaded` (the local
graph launched from a second thread while this one launches the global graph: a graph's
launch holds its thread ~2 ms, which now sits before the global path starts) and `joint` (one
graph capturing both paths' forwards on two forked streams: one launch for the page; also with
each path's copy of its host views from a pinned buffer inside its own branch, `joint_staged`).
And two changes the engine could make, measured on its own call: `priority` (the call made on a
high-priority stream, so the local path, the longer one, takes the SMs first and the global
path, on the engine's side stream of default priority, fills what it leaves) and `pinned` (the
host views in page-locked memory: their copy is a DMA that does not hold the launching thread).
Last, the engine against its twin in the same run: an engine captured with the residual
epilogue and the patch kernel off (`_twin`, `_beside_twin` the engine re-measured beside it).

    python bench/page_b1_probe.py [--out bench/results] [--iters 30]

Writes page-b1-<date>.json (`summary`: the medians in ms).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, rel_err, wall_ms, write_result  # noqa: E402
from bench.e2e_bench import page_png  # noqa: E402
from bench.graph_bench import image  # noqa: E402
from common.cuda_graphs import capture_graph  # noqa: E402
from encoder import DualPathEncoder, EncoderArgs, decode, model, preprocess, views_of  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402
from encoder.graphs import PathTokens  # noqa: E402


def gpu_events(fn) -> list[dict]:
    """The kernels, copies and memsets of one call of `fn` (after one unprofiled call), as the
    profiler's chrome trace has them, in the order they started."""
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
    return sorted(events, key=lambda e: e["ts"])


def kernel_table(events: list[dict], top: int = 25) -> dict:
    """One call's GPU events (`gpu_events`) grouped by name (the first 60 characters): total ms
    and count, the `top` largest first."""
    table: dict = {}
    for e in events:
        row = table.setdefault(e["name"][:60], {"ms": 0.0, "n": 0})
        row["ms"] += e["dur"] / 1e3
        row["n"] += 1
    ranked = sorted(table.items(), key=lambda kv: -kv[1]["ms"])[:top]
    return {name: {"ms": round(row["ms"], 3), "n": row["n"]} for name, row in ranked}


def stream_timeline(fn) -> dict:
    """Per CUDA stream and kind (kernel, memcpy, memset): first start and last end in ms after
    the call's first GPU event, busy ms (the events' durations summed) and the event count."""
    events = gpu_events(fn)
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


def equal(a, b) -> bool:
    return torch.equal(a.global_tokens, b.global_tokens) and torch.equal(a.crop_tokens, b.crop_tokens)


def launch_local_on_a_thread(engine) -> None:
    """Shadow the engine's `_run_both` with one that stages and launches the local path on a
    worker thread (the current stream) while this thread does the global path (a side stream):
    CUDAGraph.replay releases the GIL, so the two launches can proceed at once. `del
    engine._run_both` restores the engine's own."""
    pool, side = ThreadPoolExecutor(1), torch.cuda.Stream()

    def run_both(global_views, global_plan, crops, local_plan):
        current = torch.cuda.current_stream()
        inputs_ready = current.record_event()

        def local():
            with torch.inference_mode(), torch.cuda.stream(current):
                return engine.local_path.run(crops, local_plan)
        local_tokens = pool.submit(local)
        side.wait_event(inputs_ready)
        with torch.cuda.stream(side):
            global_tokens = engine.global_path.run(global_views, global_plan)
        local_tokens = local_tokens.result()
        current.wait_stream(side)
        global_tokens.record_stream(current)
        return global_tokens, local_tokens
    engine._run_both = run_both


def joint_graph(engine, item, staged: bool = False):
    """One CUDA graph of a batch-1 page: the local path's forward on the capture stream and the
    global path's on a forked side stream, joined at the end. Returns (call(item): stage the
    item's views into the graph's inputs and replay, the graph's outputs). `staged`: the graph
    also holds each path's copy of its views from a pinned host buffer, at the head of its own
    branch (the call copies host views into those buffers on torch's CPU threads), so the
    global path's copy and kernels need not wait for the crops' copy."""
    global_in = item.global_view[None].cuda().clone()
    crops_in = item.crops.cuda().clone()
    if staged:
        pinned_global = torch.empty(global_in.shape, dtype=torch.uint8, pin_memory=True)
        pinned_crops = torch.empty(crops_in.shape, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()

    def forward():
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        if staged:
            crops_in.copy_(pinned_crops, non_blocking=True)
        crop_tokens = engine.local_path.forward(crops_in)
        with torch.cuda.stream(side):
            if staged:
                global_in.copy_(pinned_global, non_blocking=True)
            global_tokens = engine.global_path.forward(global_in)
        current.wait_stream(side)
        return global_tokens, crop_tokens
    if staged:
        pinned_global.copy_(global_in)
        pinned_crops.copy_(crops_in)
    graph, outputs = capture_graph(forward, torch.cuda.graph_pool_handle(), device="cuda")

    def call(page):
        if staged:  # the replay before has finished (the caller syncs): its buffers are free
            pinned_global.copy_(page.global_view[None])
            pinned_crops.copy_(page.crops)
        else:
            global_in.copy_(page.global_view[None], non_blocking=True)
            crops_in.copy_(page.crops, non_blocking=True)
        graph.replay()
        return outputs
    return call, outputs


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
        events = {"local_only": gpu_events(lambda: engine.run([None], [gpu.crops])),
                  "global_only": gpu_events(lambda: engine.run([gpu.global_view], [None]))}
        kernels = {path: kernel_table(path_events) for path, path_events in events.items()}
        # Each path's GPU operations in the order they ran (name, µs): what a small kernel
        # belongs to shows by its neighbours.
        sequence = {path: [(e["name"][:60], round(e["dur"], 1)) for e in path_events]
                    for path, path_events in events.items()}
        timeline = {name: stream_timeline(both(item))
                    for name, item in (("host_views", host), ("gpu_views", gpu))}
        reference = both(gpu)()[0]
        launch_local_on_a_thread(engine)
        for name, item in (("host_views", host), ("gpu_views", gpu)):
            rows[f"{name}_threaded"] = wall_ms(both(item), opts.iters)
        timeline["gpu_views_threaded"] = stream_timeline(both(gpu))
        rows["threaded_equal"] = equal(both(gpu)()[0], reference)
        del engine._run_both
        high = torch.cuda.Stream(priority=-5)  # clamped to the device's highest priority

        def on_high(fn):
            def call():
                with torch.cuda.stream(high):
                    return fn()
            return call
        pinned = dataclasses.replace(host, global_view=host.global_view.pin_memory(),
                                     crops=host.crops.pin_memory())
        for name, item in (("host_views", host), ("gpu_views", gpu), ("pinned_views", pinned)):
            rows[f"{name}_priority"] = wall_ms(on_high(lambda: engine.encode([item])), opts.iters)
        rows["pinned_views_encode"] = wall_ms(lambda: engine.encode([pinned]), opts.iters)
        timeline["gpu_views_priority"] = stream_timeline(on_high(both(gpu)))
        timeline["pinned_views_priority"] = stream_timeline(on_high(both(pinned)))
        rows["priority_equal"] = equal(on_high(both(gpu))()[0], reference)
        rows["pinned_equal"] = equal(both(pinned)()[0], reference)
        # The replica's views: decoded pixels copied to the GPU and resized there (views_of).
        decoded = decode(page_png(3))
        decoded_pinned = dataclasses.replace(decoded, pixels=decoded.pixels.pin_memory())
        for name, item in (("decoded", decoded), ("decoded_pinned", decoded_pinned)):
            rows[f"views_of_{name}"] = wall_ms(lambda: views_of(item, "cuda", exact=True), opts.iters)
        joint, outputs = joint_graph(engine, gpu)
        for name, item in (("host_views", host), ("gpu_views", gpu)):
            rows[f"{name}_joint"] = wall_ms(lambda: joint(item), opts.iters)
        timeline["gpu_views_joint"] = stream_timeline(lambda: joint(gpu))
        joint(gpu)
        rows["joint_equal"] = equal(PathTokens(outputs[0][0], outputs[1]), reference)
        staged, staged_outputs = joint_graph(engine, host, staged=True)
        rows["host_views_joint_staged"] = wall_ms(lambda: staged(host), opts.iters)
        timeline["host_views_joint_staged"] = stream_timeline(lambda: staged(host))
        staged(host)
        rows["joint_staged_equal"] = equal(PathTokens(staged_outputs[0][0], staged_outputs[1]), reference)
        # What staging a page's crops through pinned memory costs the CPU: pinned whole by
        # torch's caching allocator (the engine's way), or copied into a kept pinned buffer
        # whole or a view at a time (so each view's DMA could start while the next is copied).
        kept = torch.empty(host.crops.shape, dtype=torch.uint8, pin_memory=True)
        rows["cpu_pin_crops"] = wall_ms(lambda: host.crops.pin_memory(), opts.iters)
        rows["cpu_copy_crops_to_kept_pinned"] = wall_ms(lambda: kept.copy_(host.crops), opts.iters)
        rows["cpu_copy_crops_to_kept_pinned_by_view"] = wall_ms(
            lambda: [kept[i].copy_(host.crops[i]) for i in range(len(kept))], opts.iters)
        # The engine's kernels beside their twins, in the same run: an engine captured with the
        # residual epilogue and the patch kernel switched off.
        flags = model.RESIDUAL_EPILOGUE, model.PATCH_KERNEL
        model.RESIDUAL_EPILOGUE = model.PATCH_KERNEL = False
        twin = DualPathEncoder(encoder, max_images=32)
        model.RESIDUAL_EPILOGUE, model.PATCH_KERNEL = flags
        for name, item in (("host_views", host), ("gpu_views", gpu)):
            rows[f"{name}_encode_twin"] = wall_ms(lambda: twin.encode([item]), opts.iters)
            rows[f"{name}_encode_beside_twin"] = wall_ms(lambda: engine.encode([item]), opts.iters)
        kernels["local_only_twin"] = kernel_table(gpu_events(lambda: twin.run([None], [gpu.crops])))
        kernels["global_only_twin"] = kernel_table(gpu_events(lambda: twin.run([gpu.global_view], [None])))
        twin_out = twin.run([gpu.global_view], [gpu.crops])[0]
        rows["twin_rel_diff_global"] = rel_err(twin_out.global_tokens, reference.global_tokens)
        rows["twin_rel_diff_crops"] = rel_err(twin_out.crop_tokens, reference.crop_tokens)
    for k, v in rows.items():
        shown = (f"{v:.2e}" if "rel_diff" in k else f"{v:6.2f} ms") if isinstance(v, float) else v
        print(f"{k:>28}: {shown}", flush=True)
    for path, table in kernels.items():
        for name, row in table.items():
            print(f"{path} {row['ms']:7.3f} ms {row['n']:4d}x {name}", flush=True)
    for name, streams in timeline.items():
        for stream, row in streams.items():
            print(f"{name} {stream}: {row}", flush=True)
    write_result(opts.out, "page-b1", {
        "benchmark": "one 2x3 page at batch 1, where the time goes",
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "timing": f"wall clock per call with CUDA sync, median of {opts.iters}",
        "summary": rows, "stream_timeline_ms": timeline, "kernels_ms": kernels,
        "kernel_sequence_us": sequence})


if __name__ == "__main__":
    main()
