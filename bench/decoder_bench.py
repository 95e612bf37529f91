"""Decoder throughput on one GPU: continuous batching at 1 to 256 concurrent sequences.

    python bench/decoder_bench.py [--out bench/results] [--variants eager decode_graphs ...]
                                  [--code DIR] [--name decoder] [--repeats 3]

Real DeepSeek-3B-MoE dims, random weights, bf16. Each request: a 1,000-token prompt of which 903
are image placeholders (a 2x3 page; embeddings random) and exactly 512 generated tokens
(`ignore_eos`), greedy with the default no-repeat-n-gram rule. Reports generated tokens/s per
concurrency (all requests submitted together; prefills included; the median of --repeats runs),
the median decode step, the time spent while prompts wait to be prefilled, each variant's
prefill time of one prompt and peak memory, for the eager engine and with decode-step CUDA
graphs, side by side. Writes <name>-<date>.json with a top-level `summary` (the decode-graph
variant's). Variants: `eager`, `decode_graphs` (the default engine: paged-attention kernel),
`decode_graphs_gather` (its reference attention), `decode_graphs_separate` (the released q/k/v
and gate/up projections as separate matmuls: the packed ones' reference twin) and
`decode_graphs_grouped_mm` (the routed experts in grouped matmuls: the reference twin of
decoder/triton_moe.py's fused kernels, which the engine runs) and
`decode_graphs_prefill_grouped_mm` (fused kernels in decode steps only, prefills grouped);
`decode_graphs_torch_rope` (RoPE and the KV-cache writes as torch ops, the reference twin of
decoder/triton_rope.py). `--code DIR`
imports the decoder package from DIR instead (an older checkout, for an A/B in one run on one
machine).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import RESULTS, time_ms, write_result  # noqa: E402

PROMPT, IMAGE, GENERATED = 1000, 903, 512
CONCURRENCY = (1, 16, 64, 128, 256)
TARGETS = {"64": 12_000, "256": 25_000}  # tokens/s (issue 14)


def request(args, seed: int):
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 259, (PROMPT - IMAGE - 1,), generator=gen).tolist()
    ids = [0] + [IMAGE_TOKEN_ID] * IMAGE + text
    return GenerationRequest(ids, [0.02 * torch.randn(IMAGE, args.hidden, generator=gen)],
                             SamplingParams(max_tokens=GENERATED, ignore_eos=True))


def run(engine, args, n: int) -> dict:
    """n requests submitted together, stepped to completion; decode-only steps timed apart, and
    the wall time split into steps while prompts wait (prefills) and the rest."""
    ids = [engine.add(request(args, i)) for i in range(n)]
    generated = {i: 0 for i in ids}
    decode_steps, prefill_phase_s = [], 0.0
    preemptions = engine.preemptions
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    while engine.has_work():
        prefills = bool(engine.waiting)
        step_start = time.perf_counter()
        deltas = engine.step()  # ends in the argmax's host sync: wall time is GPU time
        if prefills:
            prefill_phase_s += time.perf_counter() - step_start
        else:
            decode_steps.append(time.perf_counter() - step_start)
        for d in deltas:
            generated[d.request_id] = d.completion_tokens
    seconds = time.perf_counter() - start
    total = sum(generated.values())
    assert total == n * GENERATED, total
    return {"seconds": seconds, "generated_tokens": total, "tokens_per_s": total / seconds,
            "decode_step_ms_p50": 1e3 * statistics.median(decode_steps),
            "decode_only_tokens_per_s": n / statistics.median(decode_steps),
            "prefill_phase_s": prefill_phase_s, "decode_phase_s": sum(decode_steps),
            "decode_steps": len(decode_steps), "preemptions": engine.preemptions - preemptions,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2 ** 30}


def repeated(engine, args, n: int, repeats: int) -> dict:
    """`run` `repeats` times: the median run by tokens/s, with every run's tokens/s beside it."""
    runs = sorted((run(engine, args, n) for _ in range(repeats)), key=lambda r: r["tokens_per_s"])
    return {**runs[len(runs) // 2], "repeats_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--name", default="decoder")
    parser.add_argument("--variants", nargs="+", default=["eager", "decode_graphs"],
                        choices=["eager", "decode_graphs", "decode_graphs_gather", "decode_graphs_separate",
                                 "decode_graphs_grouped_mm", "decode_graphs_prefill_grouped_mm",
                                 "decode_graphs_torch_rope"])
    parser.add_argument("--code", help="import the decoder package from this directory")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per concurrency (median)")
    opts = parser.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    if opts.code:
        sys.path.insert(0, os.path.abspath(opts.code))
    global random_decoder, DecoderArgs, GenerationEngine, GenerationRequest, SamplingParams
    global CacheStep, Experts, IMAGE_TOKEN_ID, ByteTokenizer
    from decoder.checkpoint import random_decoder
    from decoder.config import DecoderArgs
    from decoder.engine import GenerationEngine, GenerationRequest, SamplingParams
    from decoder.model import CacheStep, Experts
    from decoder.tokenizer import IMAGE_TOKEN_ID, ByteTokenizer
    print("decoder package:", os.path.dirname(sys.modules["decoder"].__file__), flush=True)
    args = DecoderArgs()
    model = random_decoder(args, device="cuda", dtype=torch.bfloat16)
    weights_gb = torch.cuda.memory_allocated() / 2 ** 30
    tokenizer = ByteTokenizer()
    max_len = PROMPT + GENERATED + 16

    embeds = torch.randn(1, PROMPT, args.hidden, device="cuda", dtype=torch.bfloat16)
    variants = {}
    for name in opts.variants:
        try:
            variants[name] = measure(model, tokenizer, args, embeds, max_len, name, opts.repeats)
        except Exception as e:  # noqa: BLE001 - a failed variant is recorded, the rest stand
            variants[name] = {"error": f"{type(e).__name__}: {e}"}
            print(name, "failed:", variants[name]["error"], flush=True)
        torch.cuda.empty_cache()
        write(opts, variants, weights_gb)  # after each variant: a cut-off run keeps what it has


def measure(model, tokenizer, args, embeds, max_len, variant, repeats) -> dict:
    graphs = variant != "eager"
    engine = GenerationEngine(model, tokenizer, max_batch=max(CONCURRENCY), max_len=max_len,
                              decode_graphs=graphs)
    if variant == "decode_graphs_gather":
        engine.cache.kernel = "gather"  # before the first step captures the graphs
    # Older code (--code) has no packed projections to unpack.
    if hasattr(model, "use_fused_projections"):
        model.use_fused_projections(variant != "decode_graphs_separate")
    if hasattr(model, "use_moe_kernel"):
        model.use_moe_kernel("grouped_mm" if variant == "decode_graphs_grouped_mm" else "auto")
        # Prefills (over 4,096 rows) on the grouped matmuls, decode steps fused: as before the
        # prefill tiles (bench/tune/tune_moe_kernel.py --prefill 1).
        Experts.TRITON_MAX_ROWS = 4096 if variant == "decode_graphs_prefill_grouped_mm" else None
    if hasattr(model, "use_rope_kernel"):
        model.use_rope_kernel("torch" if variant == "decode_graphs_torch_rope" else "auto")
    start = time.perf_counter()
    warm = GenerationRequest([0, 5, 6], params=SamplingParams(max_tokens=4, ignore_eos=True))
    engine.generate([warm])  # warm-up; with graphs, the first step captures them all
    rows = {"setup_s": time.perf_counter() - start}
    with torch.inference_mode():
        rows["prefill_ms"] = time_ms(lambda: model(
            inputs_embeds=embeds, step=CacheStep(engine.cache, slot=0), last_only=True), 10)
        batch = embeds.expand(16, -1, -1)  # the engine prefills waiting prompts together
        rows["prefill_16_per_prompt_ms"] = time_ms(lambda: model(
            inputs_embeds=batch, step=CacheStep(engine.cache, slot=0), last_only=True), 5) / 16
    for n in CONCURRENCY:
        rows[str(n)] = repeated(engine, args, n, repeats)
        print(f"{variant} c{n}: "
              f"{rows[str(n)]['tokens_per_s']:.0f} tokens/s, decode step "
              f"{rows[str(n)]['decode_step_ms_p50']:.2f} ms", flush=True)
    return rows


def write(opts, variants: dict, weights_gb: float) -> None:
    # The summary reports the engine's default (decode graphs on CUDA bf16), the rest beside it.
    if "1" not in variants.get("decode_graphs", {}):
        return
    best = variants["decode_graphs"]
    summary = {**{f"tokens_per_s_c{n}": best[str(n)]["tokens_per_s"] for n in CONCURRENCY},
               "prefill_ms": best["prefill_ms"],
               "prefill_16_per_prompt_ms": best["prefill_16_per_prompt_ms"],
               "decode_graphs": True,
               "targets_tokens_per_s": {f"c{n}": t for n, t in TARGETS.items()},
               "met": {f"c{n}": best[n]["tokens_per_s"] >= t for n, t in TARGETS.items()}}
    for name, other in variants.items():
        if name != "decode_graphs" and "1" in other:
            summary[f"{name}_tokens_per_s"] = {f"c{n}": other[str(n)]["tokens_per_s"] for n in CONCURRENCY}
            summary[f"speedup_over_{name}"] = {
                f"c{n}": best[str(n)]["tokens_per_s"] / other[str(n)]["tokens_per_s"] for n in CONCURRENCY}
    write_result(opts.out, opts.name, {
        "benchmark": "decoder continuous batching", "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
        "weights": "random, real DeepSeek-3B-MoE dims", "weights_gb": weights_gb,
        "workload": {"prompt_tokens": PROMPT, "image_tokens": IMAGE, "generated_tokens": GENERATED,
                     "ngram": "default (30/90)", "submission": "all n requests at once; "
                     "tokens/s counts prefills; decode_step_ms_p50 times steps without prefill"},
        "summary": summary, "variants": variants})

if __name__ == "__main__":
    main()
