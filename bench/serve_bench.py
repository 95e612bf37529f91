"""The Serve encoder path against the in-process engine, on GPUs, for two placements.

    python bench/serve_bench.py [--out bench/results]        # needs ray[serve] and >= 1 GPU

Real vision dims, random weights (written once as a released-layout checkpoint), graphs on.
In-process: `DualPathEncoder.encode_images` of one 1191x1684 page (p50 latency; preprocessing
included, as in the router) and of 64 pages (batched as the planner cuts them); also encoding
alone of pages preprocessed beforehand (the stricter baseline, reported beside the first).
Through Serve (encode-only app: Router -> GlobalEncoder + LocalEncoder, no decoder): p50 of
`handle.encode.remote(page)` one at a time, and pages/s with 64 requests in flight. Placements:
"separate" (each encoder on its own GPU; needs 2) and "shared" (both encoders on one GPU at
num_gpus 0.5 with memory caps); 4 router replicas (2 CPUs each) preprocess in parallel. Writes
serve-<date>.json whose summary holds the worst ratio over the placements run.
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, write_result  # noqa: E402
from bench.graph_bench import SIZES, image, wall_ms  # noqa: E402
from encoder import EncoderArgs, load_encoder, preprocess, write_random_checkpoint  # noqa: E402
from encoder import DualPathEncoder  # noqa: E402

PAGES = 64
ROUTERS = 4
ITERS, WARMUP = 30, 5  # p50 of 30 calls after 5 warm-ups
TARGETS = {"latency_ratio_p50": 1.25, "throughput_ratio_c64": 0.85}


def pages_per_s(fn) -> float:
    """`fn` encodes PAGES pages: one warm-up call, then one timed call (CUDA synced)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return PAGES / (time.perf_counter() - start)


def in_process(checkpoint: str, page) -> dict:
    """The same work without Serve: `encode_images` (preprocessing included, as the router does
    it) for one page and for 64 pages; also encoding alone, of pages preprocessed beforehand."""
    encoder = load_encoder(checkpoint, device="cuda", dtype=torch.bfloat16)
    engine = DualPathEncoder(encoder, max_images=32)
    item = preprocess(page)
    return {"p50_ms": wall_ms(lambda: engine.encode_images(page), ITERS, WARMUP),
            "pages_per_s_c64": pages_per_s(lambda: engine.encode_images([page] * PAGES)),
            "encode_only_p50_ms": wall_ms(lambda: engine.encode([item]), ITERS, WARMUP),
            "encode_only_pages_per_s_c64": pages_per_s(lambda: engine.encode([item] * PAGES)),
            "preprocess_p50_ms": wall_ms(lambda: preprocess(page), ITERS, WARMUP)}


def through_serve(checkpoint: str, page, placement: str) -> dict:
    """The encode-only app with this placement (what a Serve config's ray_actor_options set)."""
    from ray import serve

    from deployments.config import AppConfig
    from deployments.encoders import PathEncoder
    from deployments.router import Router
    gpus = {"separate": (1.0, 1.0), "shared": (0.5, 0.5)}[placement]
    memory = {"separate": (None, None), "shared": (0.3, 0.6)}[placement]
    config = AppConfig(checkpoint=checkpoint, encode_only=True, gpu_memory_fraction_global=memory[0],
                       gpu_memory_fraction_local=memory[1])
    encoders = [PathEncoder.options(name=f"{path.capitalize()}Encoder",
                                    ray_actor_options={"num_cpus": 2, "num_gpus": g}).bind(path, config)
                for path, g in zip(("global", "local"), gpus)]
    # Preprocessing a page is ~70 ms of CPU: routers scale out for it (autoscaled in the configs).
    router = Router.options(num_replicas=ROUTERS, ray_actor_options={"num_cpus": 2}).bind(
        *encoders, None, config)
    handle = serve.run(router, name=f"bench-{placement}", route_prefix=f"/{placement}")
    latency = wall_ms(lambda: handle.encode.remote(page).result(), ITERS, WARMUP)
    stages = handle.timings.remote().result()  # one router's stage times, one page at a time
    throughput = pages_per_s(lambda: [r.result() for r in [handle.encode.remote(page)
                                                          for _ in range(PAGES)]])
    serve.delete(f"bench-{placement}")
    return {"p50_ms": latency, "pages_per_s_c64": throughput, "router_stages_p50_ms": stages}


def main(argv=None):
    opts = options(argv)
    import ray
    n_gpus = torch.cuda.device_count()
    checkpoint = write_random_checkpoint(tempfile.mkdtemp(), EncoderArgs())
    page = image(SIZES["page-1191x1684"], 2)
    baseline = in_process(checkpoint, page)
    torch.cuda.empty_cache()  # the in-process graphs are gone; return their memory
    print("in-process", baseline, flush=True)
    ray.init(num_gpus=n_gpus, include_dashboard=False)
    placements = {}
    for placement in (["separate"] if n_gpus >= 2 else []) + ["shared"]:
        row = through_serve(checkpoint, page, placement)
        row["latency_ratio_p50"] = row["p50_ms"] / baseline["p50_ms"]
        row["throughput_ratio_c64"] = row["pages_per_s_c64"] / baseline["pages_per_s_c64"]
        # Stricter: against encoding alone (the in-process side skips preprocessing entirely).
        row["latency_ratio_p50_vs_encode_only"] = row["p50_ms"] / baseline["encode_only_p50_ms"]
        row["throughput_ratio_c64_vs_encode_only"] = (row["pages_per_s_c64"]
                                                      / baseline["encode_only_pages_per_s_c64"])
        placements[placement] = row
        print(placement, row, flush=True)
    summary = {
        "latency_ratio_p50": max(r["latency_ratio_p50"] for r in placements.values()),
        "throughput_ratio_c64": min(r["throughput_ratio_c64"] for r in placements.values()),
        "latency_ratio_p50_vs_encode_only": max(r["latency_ratio_p50_vs_encode_only"]
                                                for r in placements.values()),
        "throughput_ratio_c64_vs_encode_only": min(r["throughput_ratio_c64_vs_encode_only"]
                                                   for r in placements.values()),
        "placements_run": sorted(placements), "targets": TARGETS}
    summary["met"] = {
        "latency_ratio_p50": summary["latency_ratio_p50"] <= TARGETS["latency_ratio_p50"],
        "throughput_ratio_c64": summary["throughput_ratio_c64"] >= TARGETS["throughput_ratio_c64"]}
    write_result(opts.out, "serve", {
        "benchmark": "Serve encode path vs in-process", "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(), "gpus": n_gpus, "torch": torch.__version__,
        "router_replicas": ROUTERS,
        "in_process": baseline, "placements": placements, "summary": summary})


if __name__ == "__main__":
    main()
