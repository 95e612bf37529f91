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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import print_profile, profile_step  # noqa: E402
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
                result = profile_step(lambda: encoder.forward_global(views))
            print_profile(f"batch {batch} {impl}", result, opts.rows)


if __name__ == "__main__":
    main()
