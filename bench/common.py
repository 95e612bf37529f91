"""Timing and result-writing helpers shared by the benchmark scripts (CUDA, except the wall
clock helpers, which also time CPU smoke runs)."""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import torch

from common.cuda_graphs import capture_graph


RESULTS = os.path.join(os.path.dirname(__file__), "results")


def options(argv=None, iters: int | None = None, **extra) -> argparse.Namespace:
    """--out (default bench/results), --iters when given a default, and `extra` int options
    (--name default); refuses to run without CUDA."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    if iters is not None:
        parser.add_argument("--iters", type=int, default=iters)
    for name, default in extra.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    opts = parser.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    return opts


def sync() -> None:
    """Wait for the GPU, where there is one (CPU smoke runs have none)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median wall-clock ms of `fn` (the device synced after each call) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median of `iters` CUDA-event timings after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_replay_ms(fn, iters: int) -> float:
    """The same work replayed from a CUDA graph: GPU time without Python launch overhead."""
    graph, _ = capture_graph(fn)
    ms = time_ms(graph.replay, iters)
    del graph
    torch.cuda.empty_cache()
    return ms


def compiled_replay_ms(call, iters: int) -> tuple[float, float]:
    """(seconds of the first call, which compiles; graph-replay ms) of a torch.compile'd call."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, graph_replay_ms(call, iters)


def profile_step(fn, iters: int = 10, replay: bool = True) -> dict:
    """Eager ms, summed kernel ms and launches (torch.profiler), graph-replay ms (None without
    `replay`), kernel table."""
    from torch.profiler import ProfilerActivity, profile
    eager = time_ms(fn, iters)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return {"eager_ms": eager, "kernel_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "launches": sum(e.count for e in events if e.device_type.name == "CUDA"),
            "replay_ms": graph_replay_ms(fn, iters) if replay else None, "events": events}


# Kernel families by name (first match wins), for the per-family totals of print_profile.
KERNEL_FAMILIES = (
    ("relpos attention (ours)", r"_relpos_attention_fwd"),
    ("paged attention (ours)", r"paged|_split_kernel|_combine_kernel"),
    ("moe experts (ours)", r"_gate_up_kernel|_down_kernel"),
    ("flash / sdpa attention", r"flash|fmha|attention|cutlass::Kernel"),
    ("matmul", r"gemm|nvjet|sm90_xmma|cublas|cutlass|matmul|splitK"),
    ("conv", r"conv|implicit|winograd"),
    ("layer norm", r"layer_norm|LayerNorm|norm_kernel"),
    ("copy / cat / pad", r"copy|Memcpy|Memset|cat|CatArray|pad|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_"),
    ("reduce / softmax", r"reduce|softmax|Reduce"),
)


def kernel_families(events) -> dict[str, float]:
    """CUDA self time (ms) per kernel family, largest first; names matching none: 'other'."""
    totals: dict[str, float] = {}
    for e in events:
        if e.device_type.name != "CUDA" or not e.self_device_time_total:
            continue
        family = next((f for f, pattern in KERNEL_FAMILIES if re.search(pattern, e.key)), "other")
        totals[family] = totals.get(family, 0.0) + e.self_device_time_total / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def print_profile(title: str, p: dict, rows: int) -> None:
    replay = "" if p["replay_ms"] is None else f", graph replay {p['replay_ms']:.2f} ms"
    print(f"\n=== {title}: eager {p['eager_ms']:.2f} ms, kernels {p['kernel_ms']:.2f} ms{replay}, "
          f"kernel launches {p['launches']}")
    for family, ms in kernel_families(p["events"]).items():
        print(f"  {family:>26}: {ms:8.2f} ms ({ms / p['kernel_ms']:.0%})")
    if rows:
        print(p["events"].table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def write_result(out_dir: str, stem: str, result: dict) -> str:
    """bench/results/<stem>-<date>.json; prints the summary (the reply's tail) and the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    if "summary" in result:
        print(json.dumps(result["summary"], indent=2))
    print("wrote", path)
    return path
