"""Where does encoder time go? Kernel families and table (torch.profiler), graph-replay floor.

    python bench/profile_encoder.py [--batch 1 8] [--crops 6] [--impl fused dense] [--compile]

Real dims, random weights, bf16. For `batch` global 1024² views (the global path's forward) and
`crops` 640² crops (the local path's), per attention impl: the eager forward (wall and summed
kernel time), the same forward replayed from a CUDA graph, kernel time per family (matmul,
attention, norms, copies, ...) and the top kernels; with --compile also the graph replay of the
torch.compile'd forward. Diagnostic only; writes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import compiled_replay_ms, print_profile, profile_step  # noqa: E402
from encoder import EncoderArgs  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="global views")
    parser.add_argument("--crops", type=int, nargs="*", default=[], help="640² crops")
    parser.add_argument("--impl", nargs="+", default=["fused", "dense"])
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--compile", action="store_true")
    opts = parser.parse_args(argv)
    encoder = random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16)
    runs = [("global", encoder.forward_global, n, 1024) for n in opts.batch]
    runs += [("local", encoder.forward_local, n, 640) for n in opts.crops]
    for path, forward, n, size in runs:
        views = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, device="cuda")
        for impl in opts.impl:
            encoder.set_attention(impl)
            with torch.inference_mode():
                result = profile_step(lambda: forward(views))
                if opts.compile:
                    compiled = torch.compile(forward)
                    compile_s, replay_ms = compiled_replay_ms(lambda: compiled(views), 10)
                    print(f"{path} x{n} {impl}: compiled graph replay {replay_ms:.2f} ms "
                          f"(compile {compile_s:.0f} s)", flush=True)
            print_profile(f"{path} path, {n} views of {size}², {impl} attention", result, opts.rows)


if __name__ == "__main__":
    main()
