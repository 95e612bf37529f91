"""Where does eager encoder time go? Kernel table (torch.profiler) and graph-replay floor.

    python bench/profile_encoder.py [--batch 8] [--impl fused]

Prints the top CUDA kernels for one encode of `batch` global 1024² views, the sum of kernel
time against the wall time (CPU-bound when wall >> kernels), and the time of the same forward
replayed from a CUDA graph (launch overhead removed). Diagnostic only; writes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import graph_replay_ms, time_ms  # noqa: E402
from encoder import EncoderArgs  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--impl", nargs="+", default=["fused", "dense"])
    parser.add_argument("--rows", type=int, default=25)
    opts = parser.parse_args(argv)
    encoder = random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16)
    for batch in opts.batch:
        views = torch.randint(0, 256, (batch, 3, 1024, 1024), dtype=torch.uint8, device="cuda")
        for impl in opts.impl:
            encoder.set_attention(impl)
            with torch.inference_mode():
                fn = lambda: encoder.forward_global(views)  # noqa: E731
                eager = time_ms(fn, 10)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                events = prof.key_averages()
                kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
                replay = graph_replay_ms(fn, 10)
            print(f"\n=== batch {batch} {impl}: eager {eager:.2f} ms, kernels {kernel_ms:.2f} ms, "
                  f"graph replay {replay:.2f} ms, launches {sum(e.count for e in events if e.device_type.name == 'CUDA')}")
            print(events.table(sort_by="self_device_time_total", row_limit=opts.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
