"""Why a page's host views cost ~0.8 ms at batch 1 (graph_bench's page_b1_ms with views on the
host against the same call with them on the GPU): the crops' host-to-device copy from each
kind of host memory, and what each path's launch holds the launching thread.

Copies of a page's crops (uint8 [6, 3, 640, 640], 7.4 MB), each timed on the GPU (CUDA events
around the copy alone) and on the CPU (the call's return): from pageable memory; from a block
torch's caching host allocator pins for it (`pin_memory()`, the engine's way); from a kept
pinned buffer just written by torch's CPU threads (the default count, and one), or written and
then left 5 ms; from a kept pinned buffer not written since long ago. Then the CPU time of each
path's graph replay at batch 1 (the call returns before the GPU is done), and of the engine's
whole launch of a page (`run` without waiting for the device).

    python bench/staging_probe.py [--out bench/results] [--iters 50]

Writes staging-<date>.json (`summary`: medians in ms).
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, write_result  # noqa: E402
from bench.graph_bench import image  # noqa: E402
from encoder import DualPathEncoder, EncoderArgs, preprocess  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402
from scheduler import Item  # noqa: E402


def timed_copy(prepare, dst: torch.Tensor, iters: int) -> dict:
    """Median GPU ms of `dst.copy_(prepare(), non_blocking=True)` and CPU ms of that call,
    each rep after the device is idle (prepare runs before the timing starts)."""
    gpu, cpu = [], []
    for _ in range(iters + 3):
        torch.cuda.synchronize()
        src = prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        cpu.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return {"gpu_ms": statistics.median(gpu[3:]), "cpu_ms": statistics.median(cpu[3:])}


def launch_ms(fn, iters: int) -> float:
    """Median CPU ms until `fn` returns, the device idle before each call."""
    times = []
    for _ in range(iters + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times[3:])


def main(argv=None):
    opts = options(argv, iters=50)
    page = preprocess(image((1191, 1684), 1))
    crops = page.crops  # pageable, as preprocess returns them
    dst = torch.empty(crops.shape, dtype=torch.uint8, device="cuda")
    kept = torch.empty(crops.shape, dtype=torch.uint8, pin_memory=True)
    clean = torch.empty(crops.shape, dtype=torch.uint8, pin_memory=True)
    clean.copy_(crops)
    threads = torch.get_num_threads()

    def written(n_threads: int, rest_s: float = 0.0):
        def prepare():
            torch.set_num_threads(n_threads)
            kept.copy_(crops)
            torch.set_num_threads(threads)
            if rest_s:
                time.sleep(rest_s)
            return kept
        return prepare
    copies = {"pageable": timed_copy(lambda: crops, dst, opts.iters),
              "fresh_pin_memory": timed_copy(lambda: crops.pin_memory(), dst, opts.iters),
              f"kept_pinned_just_written_{threads}_threads": timed_copy(written(threads), dst, opts.iters),
              "kept_pinned_just_written_1_thread": timed_copy(written(1), dst, opts.iters),
              "kept_pinned_written_5ms_before": timed_copy(written(threads, 0.005), dst, opts.iters),
              "kept_pinned_clean": timed_copy(lambda: clean, dst, opts.iters)}
    for name, row in copies.items():
        print(f"copy {name:>40}: GPU {row['gpu_ms']:.3f} ms, call {row['cpu_ms']:.3f} ms "
              f"({crops.numel() / row['gpu_ms'] / 1e6:.1f} GB/s)", flush=True)

    encoder = random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16)
    engine = DualPathEncoder(encoder, max_images=1)
    plan = engine.planner.plan([Item(1, len(crops))]).batches[0]
    gpu_global, gpu_crops = page.global_view.cuda()[None], crops.cuda()
    launches = {}
    with torch.inference_mode():
        for name, path, views, path_plan in (("global", engine.global_path, gpu_global, plan.global_path),
                                             ("local", engine.local_path, gpu_crops, plan.local_path)):
            graph = path.graphs[path_plan.budget].graph
            launches[f"{name}_graph_replay"] = launch_ms(graph.replay, opts.iters)
            launches[f"{name}_path_run_gpu_views"] = launch_ms(lambda: path.run(views, path_plan), opts.iters)
        launches["page_run_gpu_views"] = launch_ms(lambda: engine.run([gpu_global[0]], [gpu_crops]), opts.iters)
        launches["page_run_host_views"] = launch_ms(lambda: engine.run([page.global_view], [crops]), opts.iters)
    for name, ms in launches.items():
        print(f"launch {name:>28}: {ms:.3f} ms", flush=True)
    write_result(opts.out, "staging", {
        "benchmark": "a page's crops copied to the GPU from each kind of host memory; launch CPU times",
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cpu_threads": threads, "crops_bytes": crops.numel(),
        "timing": f"median of {opts.iters}, the device idle before each",
        "summary": {**{f"copy_{k}_gpu_ms": v["gpu_ms"] for k, v in copies.items()},
                    **{f"copy_{k}_call_ms": v["cpu_ms"] for k, v in copies.items()},
                    **{f"launch_{k}_ms": v for k, v in launches.items()}}})


if __name__ == "__main__":
    main()
