"""Scale-out: the whole OCR app spread over N GPUs against squeezed onto one, and autoscaling.

    python bench/scaleout_bench.py [--out bench/results]     # needs ray[serve] and 4 GPUs
    python bench/scaleout_bench.py --smoke                   # tiny random model on CPU

Real DeepSeek-OCR dims, random weights (written once as a released-layout checkpoint), graphs on.
A fixed mixed workload (448² photos, 1191x1684 pages cut 2x3, 640x3840 strips cut 1x6, in turn),
full OCR through `handle.ocr` with a fixed `max_tokens`, at rising concurrency, for:
  spread:   GlobalEncoder on one GPU, LocalEncoder on one, Decoder replicas on the rest;
  squeezed: the same app on one GPU (0.2 / 0.3 / 0.5 of it, each process capping its memory).
Records pages/s, p50/p99 latency and per-path GPU utilisation (NVML, sampled every 0.2 s).
Then, with autoscaling (LocalEncoder and Decoder max 2 replicas), a load step from 8 to 64
requests in flight: replica counts over time and when each scale-up was decided and ready.
Writes scaleout-<date>.json with a top-level `summary`. `--smoke` runs every phase on CPU with
the tiny model and small numbers, to check the script itself (its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import RESULTS, write_result  # noqa: E402

KINDS = [(448, 448), (1191, 1684), (640, 3840)]  # untiled photo, 2x3 page, 1x6 strip
TARGET_SCALING = 3.2


def image(i: int):
    from PIL import Image
    gen = torch.Generator().manual_seed(i)
    w, h = KINDS[i % len(KINDS)]
    noise = torch.randint(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=torch.uint8, generator=gen)
    return Image.fromarray(noise.numpy()).resize((w, h), Image.BILINEAR)


class GpuSampler:
    """Mean NVML utilisation per GPU between start() and stop() (empty without NVML)."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no NVML (CPU smoke run): no utilisation
            self.nvml, self.handles = None, []

    def start(self):
        self.samples, self.running = [], True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while self.running:
            self.samples.append([self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles])
            time.sleep(0.2)

    def stop(self) -> list[float]:
        self.running = False
        self.thread.join()
        if not self.samples or not self.handles:
            return []
        return [statistics.mean(s[i] for s in self.samples) / 100 for i in range(len(self.handles))]


def deploy(name: str, checkpoint, layout: dict, smoke: bool):
    """The full app with per-deployment placement / autoscaling from `layout`."""
    from ray import serve

    from deployments.config import AppConfig
    from deployments.decoder_server import DecoderServer
    from deployments.encoders import PathEncoder
    from deployments.placement import ModelTiers
    from deployments.router import Router

    def opts(key):
        spec = {k: v for k, v in layout[key].items() if k not in ("memory_fraction", "gpus")}
        spec["ray_actor_options"] = {"num_cpus": 0 if smoke else 2, "num_gpus": layout[key].get("gpus", 0)}
        return spec

    config = AppConfig(checkpoint=checkpoint, max_len=4096, **{
        f"gpu_memory_fraction_{key}": layout[key].get("memory_fraction")
        for key in ("global", "local", "decoder")})
    encoders = [PathEncoder.options(name=f"{path.capitalize()}Encoder", **opts(path)).bind(path, config)
                for path in ("global", "local")]
    decoder = DecoderServer.options(name="Decoder", **opts("decoder")).bind(config)
    router = Router.options(**opts("router")).bind(ModelTiers.of(config, *encoders, decoder), config)
    return serve.run(router, name=name, route_prefix=f"/{name}")


async def drive(handle, requests: int, concurrency: int, max_tokens: int, start_index: int = 0) -> dict:
    """`requests` OCR calls with `concurrency` in flight: latencies and completion tokens."""
    gate, latencies, tokens = asyncio.Semaphore(concurrency), [], []
    images = [image(start_index + i) for i in range(requests)]

    async def one(img):
        async with gate:
            start = time.perf_counter()
            result = await handle.ocr.remote(img, max_tokens=max_tokens)
            latencies.append(time.perf_counter() - start)
            tokens.append(result["usage"]["completion_tokens"])

    start = time.perf_counter()
    await asyncio.gather(*(one(img) for img in images))
    seconds = time.perf_counter() - start
    latencies.sort()
    return {"concurrency": concurrency, "requests": requests, "seconds": seconds,
            "pages_per_s": requests / seconds, "tokens_per_s": sum(tokens) / seconds,
            "p50_s": latencies[len(latencies) // 2],
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def gpus_of(name: str) -> dict[str, list[int]]:
    """Physical GPU ids per deployment (asked of each replica; decoders answer in turn)."""
    from ray import serve
    out = {}
    for deployment in ("GlobalEncoder", "LocalEncoder", "Decoder"):
        h = serve.get_deployment_handle(deployment, name)
        out[deployment] = sorted({g for _ in range(8) for g in h.stats.remote().result()["gpu_ids"]})
    return out


def sweep(name, checkpoint, layout, levels, max_tokens, smoke, sampler) -> dict:
    from ray import serve
    handle = deploy(name, checkpoint, layout, smoke)
    asyncio.run(drive(handle, 4, 4, max_tokens))  # warm-up
    placement = gpus_of(name)
    rows = []
    for concurrency in levels:
        sampler.start()
        requests = 2 * concurrency if smoke else max(2 * concurrency, 8)  # smoke: a page's seconds at 1
        row = asyncio.run(drive(handle, requests, concurrency, max_tokens, 1000))
        utilisation = sampler.stop()
        row["gpu_utilisation"] = {d: statistics.mean(utilisation[g] for g in ids) if utilisation and ids else None
                                  for d, ids in placement.items()}
        rows.append(row)
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    serve.delete(name)
    return {"layout": layout, "gpu_ids": placement, "levels": rows}


def autoscale(checkpoint, layout, low, high, low_s, high_s, max_tokens, smoke) -> dict:
    """A load step from `low` to `high` requests in flight; replica states polled every second."""
    from ray import serve
    name = "autoscale"
    handle = deploy(name, checkpoint, layout, smoke)
    timeline, stop = [], threading.Event()
    t0 = time.perf_counter()

    def poll():
        while not stop.is_set():
            deployments = serve.status().applications[name].deployments
            timeline.append({"t": round(time.perf_counter() - t0, 2), **{
                d: {getattr(state, "value", state): n for state, n in deployments[d].replica_states.items()}
                for d in ("LocalEncoder", "Decoder")}})
            stop.wait(1.0)

    async def load(concurrency: int, seconds: float, offset: int):
        deadline, done, i = time.perf_counter() + seconds, [], offset

        async def worker():
            nonlocal i
            while time.perf_counter() < deadline:
                i += 1
                await handle.ocr.remote(image(i), max_tokens=max_tokens)
                done.append(1)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(done)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    low_done = asyncio.run(load(low, low_s, 0))
    step_at = time.perf_counter() - t0
    high_done = asyncio.run(load(high, high_s, 10_000))
    stop.set()
    poller.join()
    serve.delete(name)

    def first(deployment, test):
        return next((p["t"] - step_at for p in timeline if p["t"] >= step_at and test(p[deployment])), None)

    scale_up = {d: {"decided_s": first(d, lambda s: sum(s.values()) > 1),
                    "ready_s": first(d, lambda s: s.get("RUNNING", 0) > 1)}
                for d in ("LocalEncoder", "Decoder")}
    return {"layout": layout, "low": low, "high": high, "step_at_s": step_at,
            "pages_per_s_low": low_done / low_s, "pages_per_s_high": high_done / high_s,
            "scale_up": scale_up, "timeline": timeline}


def layouts(gpus: int, smoke: bool) -> dict:
    def g(n):
        return 0 if smoke else n
    target = (1, 2) if smoke else (16, 48)  # ongoing requests per replica (configs' reasoning)
    router = {"num_replicas": 1 if smoke else 4}  # smoke: one Router, three replica starts fewer
    spread = {"router": router, "global": {"gpus": g(1)}, "local": {"gpus": g(1)},
              "decoder": {"gpus": g(1), "num_replicas": max(1, gpus - 2)}}
    squeezed = {"router": router,
                "global": {"gpus": g(0.2), "memory_fraction": None if smoke else 0.15},
                "local": {"gpus": g(0.3), "memory_fraction": None if smoke else 0.25},
                "decoder": {"gpus": g(0.5), "memory_fraction": None if smoke else 0.55}}

    def scaled(max_replicas, target_requests):
        return {"autoscaling_config": {"min_replicas": 1, "max_replicas": max_replicas,
                                       "target_ongoing_requests": target_requests,
                                       "upscale_delay_s": 5, "downscale_delay_s": 600}}
    autoscaled = {"router": router, "global": {"gpus": g(0.5)},
                  "local": {"gpus": g(0.5), **scaled(2, target[0])},
                  "decoder": {"gpus": g(1), **scaled(2, target[1])}}
    return {"spread": spread, "squeezed": squeezed, "autoscaled": autoscaled}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script")
    parser.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1")
    parser.add_argument("--max-tokens", type=int, default=256)
    opts = parser.parse_args(argv)
    import ray
    gpus = 0 if opts.smoke else torch.cuda.device_count()
    if not opts.smoke and gpus < 4:  # spread: 1 + 1 + 2 decoders; autoscaled: up to 3.5 GPUs
        raise SystemExit(f"needs 4 GPUs, found {gpus} (--smoke checks the script on CPU)")
    checkpoint = None
    if not opts.smoke:
        from deployments.model_source import write_random_model
        checkpoint = write_random_model(tempfile.mkdtemp(), seed=0, dtype=torch.bfloat16)
    max_tokens = 4 if opts.smoke else opts.max_tokens
    levels = (1, 4) if opts.smoke else (1, 8, 32, 64)
    ray.init(num_cpus=4 if opts.smoke else None, num_gpus=gpus, include_dashboard=False)
    from ray import serve
    serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
    plans, sampler = layouts(gpus, opts.smoke), GpuSampler()
    squeezed = sweep("squeezed", checkpoint, plans["squeezed"], levels, max_tokens, opts.smoke, sampler)
    # On CPU the two layouts are one app (no GPU to spread over, one Decoder): swept once.
    spread = squeezed if opts.smoke else sweep("spread", checkpoint, plans["spread"], levels, max_tokens,
                                               opts.smoke, sampler)
    step = autoscale(checkpoint, plans["autoscaled"], *((2, 8, 3, 12) if opts.smoke else (8, 64, 30, 150)),
                     max_tokens, opts.smoke)
    best = {k: max(r["pages_per_s"] for r in v["levels"]) for k, v in (("spread", spread), ("squeezed", squeezed))}
    top = {k: v["levels"][-1] for k, v in (("spread", spread), ("squeezed", squeezed))}
    summary = {"gpus": gpus, "pages_per_s_1gpu": best["squeezed"], f"pages_per_s_{gpus}gpu": best["spread"],
               "scaling": best["spread"] / best["squeezed"], "target_scaling": TARGET_SCALING,
               "p50_s": {k: r["p50_s"] for k, r in top.items()}, "p99_s": {k: r["p99_s"] for k, r in top.items()},
               "gpu_utilisation_spread": top["spread"]["gpu_utilisation"],
               "time_to_scale_up_s": {d: v["ready_s"] for d, v in step["scale_up"].items()},
               "smoke": opts.smoke}
    summary["met"] = summary["scaling"] >= TARGET_SCALING
    write_result(opts.out, "scaleout-smoke" if opts.smoke else "scaleout", {
        "benchmark": "scale-out and autoscaling of the whole OCR app",
        "date": datetime.date.today().isoformat(),
        "device": "cpu (smoke)" if opts.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
        "workload": {"kinds": [f"{w}x{h}" for w, h in KINDS], "max_tokens": max_tokens,
                     "concurrency": list(levels)},
        "summary": summary, "spread": spread, "squeezed": squeezed, "autoscale": step})


if __name__ == "__main__":
    main()
