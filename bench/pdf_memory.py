"""A long PDF through the running app: the Router's resident memory while it streams pages.

    python -m bench.pdf_memory                # 3,000 small pages, the tiny model on CPU
    python -m bench.pdf_memory --pages 200    # quicker
    python -m bench.pdf_memory --cache-mb 0 --name pdf-memory-nocache   # the feeder alone

Starts the app (tiny random model, default AppConfig, so `pages_in_flight` 16 and the 512 MB
encoder cache) on a local Ray cluster with HTTP on 127.0.0.1:8000, sends one PDF of small pages
(200 x 300 pt, each with its own page number, so no two are alike) as `stream=true`, mode tiny,
max_tokens 1, and samples the Router replica's RSS every second through its `stats()`. Writes
bench/results/pdf-memory-<date>.json. What is measured is the router's memory, which the page
feeder bounds; the numbers of the tiny model's text mean nothing.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # also `python bench/pdf_memory.py`
from bench.common import RESULTS, write_result  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from tests.pdfs import make_pdf  # noqa: E402

URL = "http://127.0.0.1:8000"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=3000)
    parser.add_argument("--cache-mb", type=int, default=AppConfig().encoder_cache_mb,
                        help="the router's encoder cache (0: off, to see the feeder alone)")
    parser.add_argument("--name", default="pdf-memory")
    parser.add_argument("--out", default=RESULTS)
    opts = parser.parse_args(argv)

    import ray
    from ray import serve

    from deployments.app import build
    ray.init(num_cpus=4, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(build(AppConfig(encoder_cache_mb=opts.cache_mb)), name="pdf-memory", route_prefix="/")
    router = serve.get_deployment_handle("Router", "pdf-memory")

    def stats():
        return router.stats.remote().result(timeout_s=60)

    pdf = make_pdf(opts.pages, size=(200, 300))
    before = stats()
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append((time.monotonic(), stats()["rss_mb"]))
            done.wait(1.0)
    sampler = threading.Thread(target=sample, daemon=True)
    body = {"document": base64.b64encode(pdf).decode(), "mode": "tiny", "max_tokens": 1,
            "stream": True, "timeout_s": 3600}
    start = time.monotonic()
    sampler.start()
    pages, failed = 0, 0
    with requests.post(f"{URL}/v1/ocr", json=body, stream=True, timeout=3700) as response:
        response.raise_for_status()
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("data: {"):
                entry = json.loads(line[6:])
                pages += 1
                failed += entry.get("error") is not None
                if pages in (100, opts.pages // 2):
                    samples.append((time.monotonic(), stats()["rss_mb"]))
    elapsed = time.monotonic() - start
    done.set()
    sampler.join()
    after = stats()
    serve.shutdown()
    ray.shutdown()
    rss = [mb for _, mb in samples]
    first_100 = [mb for t, mb in samples if t - start <= elapsed * 100 / max(pages, 1)]
    result = {
        "date": datetime.date.today().isoformat(),
        "setup": {"pages": opts.pages, "page_points": [200, 300], "dpi": 144, "mode": "tiny",
                  "max_tokens": 1, "pages_in_flight": AppConfig().pages_in_flight,
                  "encoder_cache_mb": opts.cache_mb, "pdf_mb": len(pdf) / 2**20,
                  "model": before["model"]},
        "summary": {"pages_done": pages, "failed_pages": failed, "seconds": round(elapsed, 1),
                    "pages_per_s": round(pages / elapsed, 2),
                    "router_rss_before_mb": round(before["rss_mb"], 1),
                    "router_rss_peak_sampled_mb": round(max(rss), 1),
                    "router_rss_after_first_100_pages_mb": round(max(first_100 or rss[:1]), 1),
                    "router_rss_end_mb": round(after["rss_mb"], 1),
                    "router_peak_rss_mb": round(after["peak_rss_mb"], 1),
                    "encoder_cache_mb_at_end": round((after["encoder_cache"] or {"bytes": 0})["bytes"] / 2**20, 1)},
        "rss_samples_mb": [[round(t - start, 1), round(mb, 1)] for t, mb in samples],
    }
    write_result(opts.out, opts.name, result)


if __name__ == "__main__":
    main()
