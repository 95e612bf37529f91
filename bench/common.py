"""Timing and result-writing helpers shared by the benchmark scripts and the tuners in
bench/tune/ (CUDA, except the wall clock helpers, which also time CPU smoke runs)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import time

import torch

from common import switches
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


def profile_kernels(fn, top: int = 20) -> dict:
    """`fn()` once under torch.profiler (after one call unprofiled): the GPU kernels it ran by
    total time, as ms, shares of the kernels' sum and calls, and the call's wall time."""
    fn()
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        sync()
        wall_s = time.perf_counter() - start
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels) or 1
    return {"wall_ms": 1e3 * wall_s, "kernel_ms": total / 1e3, "kernels": sum(e.count for e in kernels),
            "top": [{"name": e.key[:120], "ms": e.device_time_total / 1e3, "share": e.device_time_total / total,
                     "calls": e.count}
                    for e in sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:top]]}


def rel_err(a, b) -> float:
    """|a - b| / |b|, in float64 (the tests' error measure too)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def evict_from_page_cache(directory: str) -> None:
    """Drop the files' pages from the page cache (written back first: dirty pages stay)."""
    for path in (os.path.join(folder, name) for folder, _, names in os.walk(directory) for name in names):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_result(out_dir: str, stem: str, result: dict) -> str:
    """bench/results/<stem>-<date>.json; prints the summary (the reply's tail) and the path."""
    return _write_json(os.path.join(out_dir, f"{stem}-{result['date']}.json"), result)


def code_state() -> dict:
    """What ran: every switch's setting in this process (the replicas of an end-to-end run
    inherit them; the shipped YAMLs set none), the git commit where there is one, and a digest
    of the repository's Python sources, which names the code where the commit cannot (the GPU
    machine's copy reports an older commit with changes on top)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder in ("common", "decoder", "deployments", "documents", "encoder", "scheduler", "corpus", "bench"):
        for dirpath, dirnames, filenames in sorted(os.walk(os.path.join(root, folder))):
            dirnames.sort()
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"switches": {name: switches.value(name) for name in switches.SWITCHES},
            "commit": commit, "uncommitted_changes": dirty if commit else None,
            "python_sources_sha256": digest.hexdigest()}


def gpu_names() -> list[str]:
    """The machine's GPUs as nvidia-smi names them, [] where there is none. Asked of nvidia-smi,
    not torch: a CUDA context in the bench's own process would take memory the app's replicas
    size themselves from."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def _write_json(path: str, result: dict) -> str:
    if "code" not in result:
        result["code"] = code_state()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    if "summary" in result:
        print(json.dumps(result["summary"], indent=2))
    print("wrote", path)
    return path


def write_tuning(out: str, name: str, result: dict) -> str:
    """A tuner's findings as JSON: tune-<name>.json in the folder `out` (bench/results by
    default: the latest run only, git keeps history), or `out` itself where it ends in .json.
    Tuners never edit source: `result["copy_into"]` names the constant a maintainer copies the
    pick into."""
    return _write_json(out if out.endswith(".json") else os.path.join(out, f"tune-{name}.json"), result)
