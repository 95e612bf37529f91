"""The Serve encoder path against the in-process engine, on GPUs, for two placements.

    python bench/serve_bench.py [--out bench/results] [--reps 3]   # needs ray[serve] and >= 1 GPU
    python bench/serve_bench.py --smoke                            # CPU, tiny model: checks the script

Real vision dims, random weights (written once as a released-layout checkpoint), graphs on.
Pages: the e2e bench's A4 text pages (1191x1684, 2x3 crops) as PNG bytes, as users send them.
In-process: `DualPathEncoder.encode_images` of one page (p50 latency; decoding included, the
views made on the GPU as the app makes them) and of 64 pages (batched as the planner cuts
them); also encoding alone of pages preprocessed beforehand (the stricter baseline).
Through Serve (encode-only app: Router -> GlobalEncoder + LocalEncoder, no decoder): p50 of
`handle.encode.remote(page)` one at a time, and pages/s with 64 requests in flight: 320 calls,
64 outstanding at all times (`pages_per_s_c64`, the ratios' figure), and one burst of 64 calls
at once, waited for together (`pages_per_s_c64_burst`: the pipeline fills and drains in it).
Variants: "shared" (both encoders on one GPU at num_gpus 0.5 with memory caps), "separate"
(each encoder on its own GPU; needs 2), "shared-one-encoder" (one_encoder: both paths in one
Encoder process on the GPU, one call per page), "shared-encoder-in-router" (encoder_in_router:
that Encoder inside the one Router replica, which takes the GPU share: one Serve call per page)
and "shared-router-views" (views_on_encoder=false:
the routers make the views with PIL, the reference path and the design before); any of them
with "-decode<N>" after it: N decode threads per encoder
(`encoder_decode_threads`, 4 by default). 4 router replicas (2 CPUs each).
Each measurement is repeated `reps` times in this one run; each ratio is the median over the
repetitions of (Serve rep i) / (in-process rep i). This process takes the replicas' allocator
settings (`common.allocator`), so in-process and Serve decode alike. `hops_one_at_a_time`: a
page's time outside the replicas' own stages. `--py_spy DIR` samples the first variant's
encoders, one router and this driver under load (py-spy on PATH). Writes serve-<date>.json; its
summary holds the worst ratio over the view-on-encoder variants run, and each variant's.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import RESULTS, sync, wall_ms, write_result  # noqa: E402
from bench.workload import uniform_page  # noqa: E402
from common.allocator import keep_freed_memory  # noqa: E402
from encoder import EncoderArgs, load_encoder, preprocess, write_random_checkpoint  # noqa: E402
from encoder import DualPathEncoder  # noqa: E402

TARGETS = {"latency_ratio_p50": 1.25, "throughput_ratio_c64_vs_encode_only": 0.85}
# The run's sizes; --smoke shrinks them (tiny model on CPU, one small router).
PAGES, ROUTERS, ROUTER_CPUS, ENCODER_CPUS = 64, 4, 2, 2
ITERS, WARMUP = 30, 5  # p50 of 30 calls after 5 warm-ups, per repetition
SUSTAINED = 5  # pages/s at 64 in flight: over 5 x 64 calls, 64 outstanding at all times


def pages_per_s(fn) -> float:
    """`fn` encodes PAGES pages: one warm-up call, then one timed call (device synced)."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return PAGES / (time.perf_counter() - start)


def sustained_pages_per_s(handle, pages: list[bytes], in_flight: int, requests: int) -> float:
    """`requests` calls of `handle.encode` with `in_flight` of them outstanding at all times
    (each answer sends the next page): the rate a steady load of that many users sees."""
    import asyncio

    async def run() -> float:
        gate = asyncio.Semaphore(in_flight)

        async def one(i: int):
            async with gate:
                await handle.encode.remote(pages[i % len(pages)])
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return requests / (time.perf_counter() - start)
    return asyncio.run(run())


def in_process(checkpoint: str, pages: list[bytes], reps: int) -> dict:
    """The same work without Serve, `reps` times each: `encode_images` (decoding included, as
    the router does it) for one page and for 64 pages; also encoding alone, of pages
    preprocessed beforehand."""
    cuda = torch.cuda.is_available()
    encoder = load_encoder(checkpoint, device="cuda" if cuda else "cpu",
                           dtype=torch.bfloat16 if cuda else torch.float32)
    engine = DualPathEncoder(encoder, max_images=32)
    items = [preprocess(p) for p in pages]
    batch = [pages[i % len(pages)] for i in range(PAGES)]
    rows = [{"p50_ms": wall_ms(lambda: engine.encode_images(pages[0]), ITERS, WARMUP),
             "pages_per_s_c64": pages_per_s(lambda: engine.encode_images(batch)),
             "encode_only_p50_ms": wall_ms(lambda: engine.encode([items[0]]), ITERS, WARMUP),
             "encode_only_pages_per_s_c64": pages_per_s(
                 lambda: engine.encode([items[i % len(items)] for i in range(PAGES)]))}
            for _ in range(reps)]
    return {"reps": rows, "views_on_device": engine.views_on_device,
            "preprocess_p50_ms": wall_ms(lambda: preprocess(pages[0]), ITERS, WARMUP)}


def py_spy(pids: dict[str, int], seconds: int, out_dir: str) -> list:
    """Sample these processes' Python stacks for `seconds` (py-spy, which must be on PATH),
    without pausing them: collapsed stacks per thread, <out_dir>/py-spy-<name>.txt."""
    import subprocess
    os.makedirs(out_dir, exist_ok=True)
    return [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(seconds),
                              "--rate", "200", "--format", "raw", "--threads", "--nonblocking",
                              "--output", os.path.join(out_dir, f"py-spy-{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            for name, pid in pids.items()]


def through_serve(checkpoint: str, pages: list[bytes], variant: str, reps: int,
                  profile_dir: str | None = None) -> dict:
    """The encode-only app with this variant's placement and views_on_encoder."""
    from ray import serve

    from deployments.config import AppConfig
    from deployments.encoders import PathEncoder
    from deployments.placement import ModelTiers
    from deployments.router import Router
    decode = re.search(r"-decode(\d+)$", variant)
    base = variant.removesuffix(decode.group(0) if decode else "")
    placement = (base.removesuffix("-router-views").removesuffix("-one-encoder")
                 .removesuffix("-encoder-in-router"))
    gpus = {"separate": (1.0, 1.0), "shared": (0.5, 0.5)}[placement]
    if not torch.cuda.is_available():  # smoke: the same app on CPU
        gpus = (0, 0)
    memory = {"separate": (None, None), "shared": (0.3, 0.6)}[placement]
    config = AppConfig(checkpoint=checkpoint, encode_only=True, gpu_memory_fraction_global=memory[0],
                       gpu_memory_fraction_local=memory[1], encoder_cache_mb=0,  # every page encoded
                       views_on_encoder=not base.endswith("-router-views"),
                       one_encoder=base.endswith("-one-encoder"),
                       encoder_in_router=base.endswith("-encoder-in-router"),
                       **({"encoder_decode_threads": int(decode.group(1))} if decode else {}))
    routers = {"num_replicas": ROUTERS, "ray_actor_options": {"num_cpus": ROUTER_CPUS}}
    if config.encoder_in_router:  # one Router with the Encoder's share and torch threads
        encoders = [None, None]
        routers = {"num_replicas": 1, "ray_actor_options": {"num_cpus": ENCODER_CPUS,
                                                             "num_gpus": sum(gpus)}}
    elif config.one_encoder:  # both paths in one process: the two GPU shares and memory caps
        encoders = [PathEncoder.options(name="Encoder", ray_actor_options={
            "num_cpus": ENCODER_CPUS, "num_gpus": sum(gpus)}).bind("both", config), None]
    else:
        encoders = [PathEncoder.options(name=f"{path.capitalize()}Encoder",
                                        ray_actor_options={"num_cpus": ENCODER_CPUS, "num_gpus": g}
                                        ).bind(path, config)
                    for path, g in zip(("global", "local"), gpus)]
    router = Router.options(**routers).bind(ModelTiers.of(config, *encoders, None), config)
    handle = serve.run(router, name=f"bench-{variant}", route_prefix=f"/{variant}")
    rows, stages, encoder_stages = [], None, None

    def encoder_stats() -> dict:
        if config.encoder_in_router:
            return {"Encoder": handle.stats.remote().result()["encoder"]}
        names = ["Encoder"] if config.one_encoder else ["GlobalEncoder", "LocalEncoder"]
        return {name: serve.get_deployment_handle(name, f"bench-{variant}").stats.remote().result()
                for name in names}
    for _ in range(reps):
        latency = wall_ms(lambda: handle.encode.remote(pages[0]).result(), ITERS, WARMUP)
        # One router's and each encoder's stage medians over one-page-at-a-time requests only
        # (taken before any load: under 64 in flight the stages are mostly queueing): where a
        # page's time goes.
        stages = stages or handle.timings.remote().result()
        encoder_stages = encoder_stages or {name: stats["stages_p50_ms"]
                                            for name, stats in encoder_stats().items()}
        burst = pages_per_s(lambda: [r.result() for r in [
            handle.encode.remote(pages[i % len(pages)]) for i in range(PAGES)]])
        sustained_pages_per_s(handle, pages, PAGES, PAGES)  # warm-up
        sustained = sustained_pages_per_s(handle, pages, PAGES, SUSTAINED * PAGES)
        rows.append({"p50_ms": latency, "pages_per_s_c64_burst": burst, "pages_per_s_c64": sustained})
    # The encoders under load (the last repetition's 64-in-flight runs weigh most in their last
    # 1,000 batches): how many requests a batch held, and the stages' medians.
    under_load = {name: {k: v for k, v in stats.items() if k in ("requests_per_batch", "stages_p50_ms")}
                  for name, stats in encoder_stats().items()}
    if profile_dir:  # where the CPU time goes under load: 64 in flight, again and again
        pids = {name: stats["pid"] for name, stats in encoder_stats().items()}
        router_pid = handle.stats.remote().result()["pid"]
        pids |= {"driver": os.getpid(), **({} if router_pid in pids.values() else {"Router": router_pid})}
        samplers = py_spy(pids, 4, profile_dir)
        deadline = time.perf_counter() + 5
        while time.perf_counter() < deadline:
            [r.result() for r in [handle.encode.remote(pages[i % len(pages)]) for i in range(PAGES)]]
        for sampler in samplers:
            sampler.wait(timeout=30)
    serve.delete(f"bench-{variant}")
    return {"reps": rows, "router_stages_p50_ms_one_at_a_time": stages,
            "encoder_stages_p50_ms_one_at_a_time": encoder_stages, "encoders_under_load": under_load,
            "views_on_encoder": config.views_on_encoder}


def hops(row: dict) -> dict:
    """One page's time outside the stages the replicas time (one page at a time): between this
    driver and the router (p50 less the router's own stages), and between the router and the
    encoders (the router's encode stage less the slower encoder's own stages). Split further
    by each handler's whole time (entry to return): Serve's two calls (`serve_call_*`: p50
    less the router's handler; the router's encode stage less the slower encoder's handler),
    and inside each handler the time outside its stages (`*_unstaged_ms`: option parsing,
    hand-offs between the event loop and its threads)."""
    router = row["router_stages_p50_ms_one_at_a_time"]
    encoders = row["encoder_stages_p50_ms_one_at_a_time"]
    inside = {name: sum(st.get(k) or 0.0 for k in ("decode_ms", "wait_ms", "batch_views_ms", "run_ms",
                                                   "results_ms"))
              for name, st in encoders.items()}
    handler = {name: st.get("handler_ms") or 0.0 for name, st in encoders.items()}
    slowest = max(encoders, key=lambda name: handler[name])
    p50 = statistics.median(r["p50_ms"] for r in row["reps"])
    return {"driver_router_ms": p50 - router["preprocess_ms"] - router["encoding_ms"],
            "router_encoder_ms": router["encode_ms"] - max(inside.values()),
            "encoder_inside_ms": inside,
            "serve_call_router_ms": p50 - router["handler_ms"],
            "router_unstaged_ms": router["handler_ms"] - router["preprocess_ms"] - router["encoding_ms"],
            "serve_call_encoder_ms": router["encode_ms"] - handler[slowest],
            "encoder_handler_ms": handler,
            "encoder_unstaged_ms": {name: handler[name] - inside[name] for name in encoders}}


def ratios(serve_reps: list[dict], local_reps: list[dict]) -> dict:
    """Median over repetitions of Serve / in-process, for each ratio the issue names."""
    def median(num: str, den: str) -> float:
        return statistics.median(s[num] / b[den] for s, b in zip(serve_reps, local_reps))
    return {"latency_ratio_p50": median("p50_ms", "p50_ms"),
            "throughput_ratio_c64": median("pages_per_s_c64", "pages_per_s_c64"),
            "latency_ratio_p50_vs_encode_only": median("p50_ms", "encode_only_p50_ms"),
            "burst_throughput_ratio_c64_vs_encode_only": median("pages_per_s_c64_burst",
                                                                "encode_only_pages_per_s_c64"),
            "throughput_ratio_c64_vs_encode_only": median("pages_per_s_c64",
                                                          "encode_only_pages_per_s_c64")}


def main(argv=None):
    global PAGES, ROUTERS, ROUTER_CPUS, ENCODER_CPUS, ITERS, WARMUP, SUSTAINED
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--reps", type=int, default=None, help="repetitions (3; --smoke: 1)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few pages")
    parser.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1")
    parser.add_argument("--py_spy", metavar="DIR", help="sample the first variant's encoder(s), "
                        "one router and this driver under load with py-spy, into DIR")
    parser.add_argument("--variants", nargs="+", default=["shared", "shared-one-encoder",
                                                          "shared-encoder-in-router",
                                                          "shared-router-views"],
                        help="besides 'separate' (run when there are 2 GPUs)")
    opts = parser.parse_args(argv)
    # The smoke run is sized for 2 CPU cores (about a minute there): every variant and phase,
    # once, few and small pages.
    opts.reps = opts.reps or (1 if opts.smoke else 3)
    page_size = (800, 1100) if opts.smoke else (1191, 1684)
    if opts.smoke:
        PAGES, ROUTERS, ROUTER_CPUS, ENCODER_CPUS, ITERS, WARMUP, SUSTAINED = 4, 1, 0.25, 0.25, 2, 1, 1
    else:
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --smoke)"
    import ray
    n_gpus = torch.cuda.device_count()
    # The replicas keep freed buffers for the next request (their start does this); the
    # in-process baseline gets the same allocator settings, so the ratios compare like with like.
    keep_freed_memory()
    args = EncoderArgs.tiny() if opts.smoke else EncoderArgs()
    checkpoint = write_random_checkpoint(tempfile.mkdtemp(), args)
    pages = [uniform_page(seed, page_size) for seed in range(8)]
    baseline = in_process(checkpoint, pages, opts.reps)
    if n_gpus:
        torch.cuda.empty_cache()  # the in-process graphs are gone; return their memory
    print("in-process", baseline, flush=True)
    ray.init(num_gpus=n_gpus, num_cpus=2 if opts.smoke else None, include_dashboard=False)
    from ray import serve
    serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
    variants = {}
    for i, variant in enumerate((["separate"] if n_gpus >= 2 else []) + opts.variants):
        row = through_serve(checkpoint, pages, variant, opts.reps, opts.py_spy if i == 0 else None)
        row |= ratios(row["reps"], baseline["reps"]) | {"hops_one_at_a_time": hops(row)}
        variants[variant] = row
        print(variant, row, flush=True)
    measured = [r for r in variants.values() if r["views_on_encoder"]]
    summary = {
        "latency_ratio_p50": max(r["latency_ratio_p50"] for r in measured),
        "throughput_ratio_c64": min(r["throughput_ratio_c64"] for r in measured),
        "latency_ratio_p50_vs_encode_only": max(r["latency_ratio_p50_vs_encode_only"] for r in measured),
        "throughput_ratio_c64_vs_encode_only": min(r["throughput_ratio_c64_vs_encode_only"]
                                                   for r in measured),
        "burst_throughput_ratio_c64_vs_encode_only": min(
            r["burst_throughput_ratio_c64_vs_encode_only"] for r in measured),
        "router_views_throughput_ratio_c64_vs_encode_only":
            variants["shared-router-views"]["throughput_ratio_c64_vs_encode_only"]
            if "shared-router-views" in variants else None,
        "by_variant": {name: {key: r[key] for key in TARGETS} for name, r in variants.items()},
        "variants_run": sorted(variants), "reps": opts.reps, "targets": TARGETS}
    summary["met"] = {
        "latency_ratio_p50": summary["latency_ratio_p50"] <= TARGETS["latency_ratio_p50"],
        "throughput_ratio_c64_vs_encode_only": summary["throughput_ratio_c64_vs_encode_only"]
        >= TARGETS["throughput_ratio_c64_vs_encode_only"]}
    summary["smoke"] = opts.smoke
    write_result(opts.out, "serve-smoke" if opts.smoke else "serve", {
        "benchmark": "Serve encode path vs in-process", "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if n_gpus else "cpu", "gpus": n_gpus,
        "torch": torch.__version__,
        "router_replicas": ROUTERS, "pages": f"e2e bench text pages ({page_size[0]}x{page_size[1]} PNG)",
        "in_process": baseline, "variants": variants, "summary": summary})


if __name__ == "__main__":
    main()
