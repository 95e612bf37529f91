"""Decoder throughput on one GPU: continuous batching at 1, 16 and 64 concurrent sequences.

    python bench/decoder_bench.py [--out bench/results]

Real DeepSeek-3B-MoE dims, random weights, bf16. Each request: a 1,000-token prompt of which 903
are image placeholders (a 2x3 page; embeddings random) and exactly 512 generated tokens
(`ignore_eos`), greedy with the default no-repeat-n-gram rule. Reports generated tokens/s per
concurrency (all requests submitted together; prefills included), the prefill time of one
prompt, and peak memory. Writes decoder-<date>.json with a top-level `summary`.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, time_ms, write_result  # noqa: E402
from decoder.checkpoint import random_decoder  # noqa: E402
from decoder.config import DecoderArgs  # noqa: E402
from decoder.engine import GenerationEngine, GenerationRequest, SamplingParams  # noqa: E402
from decoder.model import CacheStep  # noqa: E402
from decoder.tokenizer import IMAGE_TOKEN_ID, ByteTokenizer  # noqa: E402

PROMPT, IMAGE, GENERATED = 1000, 903, 512
CONCURRENCY = (1, 16, 64)
TARGET_C64 = 10_000


def request(args: DecoderArgs, seed: int) -> GenerationRequest:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 259, (PROMPT - IMAGE - 1,), generator=gen).tolist()
    ids = [0] + [IMAGE_TOKEN_ID] * IMAGE + text
    return GenerationRequest(ids, [0.02 * torch.randn(IMAGE, args.hidden, generator=gen)],
                             SamplingParams(max_tokens=GENERATED, ignore_eos=True))


def main(argv=None):
    opts = options(argv)
    args = DecoderArgs()
    model = random_decoder(args, device="cuda", dtype=torch.bfloat16)
    weights_gb = torch.cuda.memory_allocated() / 2 ** 30
    tokenizer = ByteTokenizer()
    engine = GenerationEngine(model, tokenizer, max_batch=max(CONCURRENCY), max_len=PROMPT + GENERATED + 16)

    embeds = torch.randn(1, PROMPT, args.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        prefill_ms = time_ms(lambda: model(inputs_embeds=embeds, step=CacheStep(engine.cache, slot=0),
                                           last_only=True), 10)
    rows = {}
    for n in CONCURRENCY:
        engine.generate([request(args, i) for i in range(min(n, 2))])  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        results = engine.generate([request(args, i) for i in range(n)])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        generated = sum(r.completion_tokens for r in results)
        assert generated == n * GENERATED, generated
        rows[n] = {"seconds": seconds, "generated_tokens": generated,
                   "tokens_per_s": generated / seconds,
                   "peak_memory_gb": torch.cuda.max_memory_allocated() / 2 ** 30}
        print(f"c{n}: {rows[n]['tokens_per_s']:.0f} tokens/s ({seconds:.1f} s)", flush=True)
    summary = {"tokens_per_s_c1": rows[1]["tokens_per_s"], "tokens_per_s_c16": rows[16]["tokens_per_s"],
               "tokens_per_s_c64": rows[64]["tokens_per_s"], "prefill_ms": prefill_ms,
               "target_tokens_per_s_c64": TARGET_C64,
               "met": rows[64]["tokens_per_s"] >= TARGET_C64}
    write_result(opts.out, "decoder", {
        "benchmark": "decoder continuous batching", "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
        "weights": "random, real DeepSeek-3B-MoE dims", "weights_gb": weights_gb,
        "workload": {"prompt_tokens": PROMPT, "image_tokens": IMAGE, "generated_tokens": GENERATED,
                     "ngram": "default (30/90)"},
        "summary": summary, "concurrency": {str(k): v for k, v in rows.items()}})


if __name__ == "__main__":
    main()
