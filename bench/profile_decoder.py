"""Where does a decode step's time go? Kernel table (torch.profiler) and graph-replay floor.

    python bench/profile_decoder.py [--batch 1 16 64] [--context 1024] [--kernel triton gather]
                                    [--moe_kernel grouped_mm triton] [--prefill 16]

Real DeepSeek-3B-MoE dims, random weights, bf16. For `batch` sequences at `context` cached
tokens: the eager model step (wall and summed kernel time), the same step replayed from a CUDA
graph, and the top CUDA kernels; with --compile, the graph replay of the torch.compile'd step;
--kernel: the paged decode attention's implementations to profile (decoder/kv_cache.py);
--moe_kernel: the routed experts' (decoder/model.py `Experts.kernel`); --prefill P: one
prefill forward of P prompts of `context` tokens, eager (the engine's prefills are not graphed).
Diagnostic only; writes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import compiled_replay_ms, print_profile, profile_step  # noqa: E402
from decoder.checkpoint import random_decoder  # noqa: E402
from decoder.config import DecoderArgs  # noqa: E402
from decoder.kv_cache import KVCache, pages_for  # noqa: E402
from decoder.model import CacheStep  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--kernel", nargs="+", default=["triton"], choices=["triton", "gather"])
    parser.add_argument("--moe_kernel", nargs="+", default=["auto"], choices=["auto", "grouped_mm", "triton"])
    parser.add_argument("--prefill", type=int, default=0, metavar="PROMPTS",
                        help="also profile one prefill forward of PROMPTS prompts of --context tokens "
                             "(as the engine batches waiting prompts; eager: no graph)")
    parser.add_argument("--compile", action="store_true",
                        help="also replay a graph of the torch.compile'd step (one static compile per batch)")
    opts = parser.parse_args(argv)
    args = DecoderArgs()
    model = random_decoder(args, device="cuda", dtype=torch.bfloat16)
    rows, kv_len = max(*opts.batch, opts.prefill), opts.context + 1
    cache = KVCache(args.n_layers, args.n_heads, args.head_dim, rows * pages_for(kv_len), rows,
                    kv_len, "cuda", torch.bfloat16)
    for row in range(rows):
        cache.reserve(row, kv_len)
    cache.sync()
    for batch, kernel, moe in ((b, k, m) for b in opts.batch for k in opts.kernel for m in opts.moe_kernel):
        cache.kernel = kernel
        model.use_moe_kernel(moe)
        tokens = torch.randint(3, 1000, (batch, 1), device="cuda")
        positions = torch.full((batch,), opts.context, device="cuda")
        step = CacheStep(cache, positions=positions, kv_len=kv_len)
        with torch.inference_mode():
            fn = lambda: model(input_ids=tokens, positions=positions[:, None], step=step)  # noqa: E731
            result = profile_step(fn, 20)
            if opts.compile:
                compiled = torch.compile(model)
                fn = lambda: compiled(input_ids=tokens, positions=positions[:, None], step=step)  # noqa: E731
                compile_s, replay_ms = compiled_replay_ms(fn, 20)
                print(f"batch {batch}: compiled step replay {replay_ms:.2f} ms "
                      f"(compile {compile_s:.0f} s)", flush=True)
        print_profile(f"batch {batch}, context {opts.context}, {kernel} attention, {moe} experts",
                      result, opts.rows)
    embeds = torch.randn(opts.prefill, opts.context, args.hidden, device="cuda", dtype=torch.bfloat16)
    for moe in opts.moe_kernel if opts.prefill else ():  # the prefill tiles (triton_moe.PREFILL_ROWS)
        model.use_moe_kernel(moe)
        with torch.inference_mode():
            result = profile_step(lambda: model(inputs_embeds=embeds, step=CacheStep(cache, slot=0),
                                                last_only=True), 5, replay=False)
        print_profile(f"prefill of {opts.prefill} prompts x {opts.context} tokens, {moe} experts",
                      result, opts.rows)


if __name__ == "__main__":
    main()
