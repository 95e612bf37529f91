"""Does torch.compile of the per-path forwards pay off under CUDA graphs? One page batch.

    python bench/compile_bench.py [--pages 32] [--all_budgets 1] [--out bench/results]

Builds two engines with one budget per path sized for exactly `pages` 2x3 pages (no padding),
or with --all_budgets 1 the default budgets of a replica (every graph the app captures):
plain forwards, and `torch.compile`d forwards (Inductor fuses LayerNorms, GELUs, residual adds
and layout copies; our Triton attention stays a custom op). Both capture CUDA graphs; reports
compile + capture time and pages/s for the same staged batch, and the output difference.
Writes compile-<date>.json (compile-budgets-<date>.json with --all_budgets). Run it twice with
one TORCHINDUCTOR_CACHE_DIR to see a later replica's start with Inductor's cache warm.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, rel_err, wall_ms, write_result  # noqa: E402
from bench.graph_bench import SIZES, image, on_gpu  # noqa: E402
from encoder import EncoderArgs, preprocess  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402
from encoder import DualPathEncoder  # noqa: E402
from scheduler import PathBudgets, default_budgets  # noqa: E402


def main(argv=None):
    opts = options(argv, pages=32, all_budgets=0)
    encoder = random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16)
    budgets = default_budgets(max_images=opts.pages) if opts.all_budgets else (
        PathBudgets.explicit("global", 272, [272 * opts.pages]),
        PathBudgets.explicit("local", 100, [600 * opts.pages]))
    pages = [on_gpu(preprocess(image(SIZES["page-1191x1684"], 2)))] * opts.pages
    rows, outputs = {}, {}
    for name, compile_ in [("plain", False), ("compiled", True)]:
        start = time.perf_counter()
        engine = DualPathEncoder(encoder, budgets, max_images=opts.pages, compile=compile_)
        setup_s = time.perf_counter() - start
        with torch.inference_mode():
            outputs[name] = engine.encode(pages)[0]
            ms = wall_ms(lambda: engine.encode(pages), 10)
        rows[name] = {"setup_s": setup_s, "ms": ms, "pages_per_s": opts.pages / ms * 1e3,
                      "graph_memory_gb": engine.graph_memory_bytes / 2 ** 30}
        print(f"{name}: setup {setup_s:.1f} s, {ms:.1f} ms per {opts.pages} pages, "
              f"{rows[name]['pages_per_s']:.1f} pages/s", flush=True)
        engine = None  # free this engine's graphs before building the next
        torch.cuda.empty_cache()
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "pages": opts.pages, "variants": rows,
              "budgets": "default (every graph a replica captures)" if opts.all_budgets else "one per path",
              "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default"),
              "speedup": rows["plain"]["ms"] / rows["compiled"]["ms"],
              "rel_err_compiled_vs_plain": rel_err(outputs["compiled"], outputs["plain"])}
    write_result(opts.out, "compile-budgets" if opts.all_budgets else "compile", result)
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}, indent=2))

if __name__ == "__main__":
    main()
