"""Encoder work in a process of its own on a GPU, paced like the service's encoders: how much a
decoder on the same card loses to it (CUDA time-slices the card between processes).

    python bench/encoder_load.py --pages_per_s 15 &      # ~the shipped service's rate at 256 in flight
    python bench/decoder_bench.py --workload realistic --levels 256 --repeats 1 --window 10 --name decoder-beside-encoder

The encoder every replica runs (`DualPathEncoder`, graphs, real DeepSeek-OCR dims, random
weights, bf16), capped at a quarter of the card, encodes batches of 4 A4 pages (a global view and
2x3 crops each) every 4 / rate seconds; it prints the rate it keeps and its wall time per page,
and touches --ready once warm (start the decoder after it). Runs until killed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.graph_bench import image  # noqa: E402
from encoder import DualPathEncoder, EncoderArgs, preprocess  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402

BATCH = 4


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages_per_s", type=float, default=15.0)
    parser.add_argument("--ready", default="/tmp/encoder-load-ready", help="a file touched once warm")
    opts = parser.parse_args(argv)
    torch.cuda.set_per_process_memory_fraction(0.25)
    graphs = DualPathEncoder(random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16), max_images=32)
    pages = [preprocess(image((1191, 1684), seed), pin_memory=True) for seed in range(BATCH)]
    graphs.encode(pages)
    torch.cuda.synchronize()
    open(opts.ready, "w").close()
    done, busy, start = 0, 0.0, time.perf_counter()
    while True:
        began = time.perf_counter()
        graphs.encode(pages)
        torch.cuda.synchronize()
        busy += time.perf_counter() - began
        done += BATCH
        ahead = start + done / opts.pages_per_s - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
        if done % 200 == 0:
            print(f"{done / (time.perf_counter() - start):.1f} pages/s, encode wall "
                  f"{1000 * busy / done:.1f} ms/page", flush=True)


if __name__ == "__main__":
    main()
