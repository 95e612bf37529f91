"""Where does a GPU replica's start-up go? One tier's constructor work, stage by stage.

    python bench/startup_profile.py --tier local [--cprofile 30]

Run in a fresh process (and with an empty TRITON_CACHE_DIR for a fresh node's kernel compiles);
start several at once, one per tier, to see them contend as a shared GPU's replicas do. Each
stage's seconds and the Triton kernels compiled during it (files in the Triton cache) are
printed as one JSON line. Random weights made on the GPU (a checkpoint's read is timed by the
replicas themselves, `startup_s`). Diagnostic only; writes nothing.
"""
from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def compiled_kernels() -> int:
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    return len(glob.glob(os.path.join(cache, "*", "*.cubin")))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tier", choices=["global", "local", "decoder"], required=True)
    parser.add_argument("--cprofile", type=int, default=0, help="print this many functions by cumulative time")
    opts = parser.parse_args(argv)
    stages: dict[str, dict] = {"import_torch": {"s": round(time.perf_counter() - PROCESS_START, 2)}}
    profiler = cProfile.Profile() if opts.cprofile else None

    def stage(name, fn):
        kernels, start = compiled_kernels(), time.perf_counter()
        if profiler:
            profiler.enable()
        result = fn()
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        stages[name] = {"s": round(time.perf_counter() - start, 2), "kernels": compiled_kernels() - kernels}
        return result

    stage("cuda", lambda: torch.zeros(1, device="cuda"))
    if opts.tier == "decoder":
        from decoder.checkpoint import random_decoder
        from decoder.config import DecoderArgs
        from decoder.engine import GenerationEngine
        from decoder.tokenizer import ByteTokenizer
        model = stage("weights", lambda: random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16))
        engine = stage("engine", lambda: GenerationEngine(model, ByteTokenizer(), 256, 8192, kv_cache_gb=40))
        engine._warmed_prefill = True  # the decode graphs alone first
        stage("decode_graphs", engine.prepare)
        engine._warmed_prefill = False
        stage("warmup_prefill", engine.prepare)
        details = {"decode_graphs": len(engine.decode_graphs.graphs)}
    else:
        from encoder import DualPathEncoder, EncoderArgs
        from encoder.checkpoint import random_encoder
        encoder = stage("weights", lambda: random_encoder(EncoderArgs(), device="cuda", dtype=torch.bfloat16))
        engine = stage("graphs", lambda: DualPathEncoder(encoder, max_images=32, paths=(opts.tier,)))
        details = engine.paths[0].report.as_dict()
    stages["total"] = {"s": round(time.perf_counter() - PROCESS_START, 2)}
    print(json.dumps({"tier": opts.tier, "stages": stages, "details": details}), flush=True)
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(opts.cprofile)


if __name__ == "__main__":
    main()
