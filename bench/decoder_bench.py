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
decoder/triton_rope.py); `decode_graphs_unfused_routing`, `decode_graphs_torch_norm` (the
routing and the norms' reference twins); `decode_graphs_prefill_first` (the engine's former
order: a prefill first, then the decode step); `decode_graphs_eager_prefill` (every prefill
launched eagerly: DEEPSEEK_OCR_PREFILL_GRAPHS=0, the twin of the prefill graphs);
`decode_graphs_fp8_kv` (the KV cache in 8-bit floats, `kv_cache_dtype="fp8"`, with its logits'
error against the model dtype's cache; the bound stays the model dtype's bytes);
`decode_graphs_picks_first` (each decode step's picks read before the next is launched:
DEEPSEEK_OCR_OVERLAP_PICKS=0, the twin of the overlapped picks); `decode_graphs_no_repetition_guard`
(every request's loop detector off, `repetition_guard: {"enabled": false}`: the detector's cost
is the default's difference from it; random weights do not loop, so it only watches). `--code DIR`
imports the decoder package from DIR instead (an older checkout, for an A/B in one run on one
machine).

    python bench/decoder_bench.py --workload realistic [--levels 64,256] [--name decoder-realistic]
    python bench/decoder_bench.py --smoke          # CPU, tiny model: the realistic mode, checked
    python bench/decoder_bench.py --workload load  # the weights from disk: streamed vs mapped

`--workload load`: `load_decoder` of a real-dims checkpoint the bench writes (random bf16, two
shards) onto the GPU with each reader of DEEPSEEK_OCR_STREAM_WEIGHTS in turn, each from a cold
page cache and then a warm one, `--repeats` times (medians).

`--workload realistic`: the contexts pages really have, against the memory-bandwidth bound.
Requests are bench/workload.py's pages (`--seed`): the app's default prompt with each page's
image tokens (273-933, from its size) and its max_tokens (median 700, 5-95% 150-2,500), one
engine with `max_len` 8192. At each level n (`--levels`, default 64 and 256) 3n requests go
through the engine with n in flight (one submitted as each finishes); tokens/s is measured from
the first finish to the last submission (always n in flight; prefills included), and beside it
over the decode steps alone. The bound: each decode step must read the weights it touches (every
dense weight, the lm_head, one embedding row per sequence, and per MoE layer the experts a batch
of B sequences touches, E * (1 - (1 - k/E)^B) expected of E with top-k routing) and every live
sequence's KV cache (2 x layers x heads x head_dim x element bytes a token), at the HBM bandwidth
measured on the same device by a large tensor copy (bytes read + written / time). Each level
reports its tokens/s, the bound's tokens/s over the same steps and their ratio
(`fraction_of_bound`); `one_page` is one A4 page (903 image tokens) generating 700 tokens alone.
Writes <name>-<date>.json (top-level `summary`; the bound's inputs under `bound`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import RESULTS, evict_from_page_cache, sync, time_ms, wall_ms, write_result  # noqa: E402
from bench.workload import describe, draw_specs, image_tokens  # noqa: E402

PROMPT, IMAGE, GENERATED = 1000, 903, 512
CONCURRENCY = (1, 16, 64, 128, 256)
TARGETS = {"64": 12_000, "256": 25_000}  # tokens/s (issue 14)
# --workload realistic (issue 38): the decode rate against the memory-bandwidth bound, one page alone.
REALISTIC_LEVELS, REALISTIC_MAX_LEN, ROUNDS = (64, 256), 8192, 3
ONE_PAGE = {"image_tokens": 903, "generated_tokens": 700}  # an A4 page (2x3 crops)
REALISTIC_TARGETS = {"fraction_of_bound": 0.70, "one_page_s": 0.5}


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
    parser.add_argument("--name", default=None, help="default: decoder (decoder-realistic with "
                        "--workload realistic)")
    parser.add_argument("--variants", nargs="+", default=None, help="default: eager decode_graphs "
                        "(decode_graphs with --workload realistic)",
                        choices=["eager", "decode_graphs", "decode_graphs_gather", "decode_graphs_separate",
                                 "decode_graphs_grouped_mm", "decode_graphs_prefill_grouped_mm",
                                 "decode_graphs_torch_rope", "decode_graphs_unfused_routing",
                                 "decode_graphs_torch_norm", "decode_graphs_prefill_first",
                                 "decode_graphs_eager_prefill", "decode_graphs_picks_first",
                                 "decode_graphs_fp8_kv", "decode_graphs_no_repetition_guard"])
    parser.add_argument("--code", help="import the decoder package from this directory")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per concurrency "
                        "(median; default 3, --smoke 1)")
    parser.add_argument("--workload", default="fixed", choices=("fixed", "realistic", "load"),
                        help="fixed: 1,000-token prompts, 512 tokens each; realistic: bench/workload.py's "
                        "pages against the memory-bandwidth bound; load: the weights read from a "
                        "checkpoint on disk onto the GPU, streamed against safetensors' mapping")
    parser.add_argument("--levels", default=",".join(map(str, REALISTIC_LEVELS)),
                        help="realistic: sequences in flight, e.g. 64,256")
    parser.add_argument("--seed", type=int, default=0, help="realistic: the workload's seed")
    parser.add_argument("--profile", action="store_true", help="realistic: also profile one page's "
                        "prefill and 10 decode steps at batch 1 and at each level (the kernels' shares "
                        "of a step, in the JSON)")
    parser.add_argument("--window", type=float, default=0, metavar="SECONDS", help="realistic: also "
                        "run each level through AsyncEngine (the Decoder replica's loop) with a profile "
                        "window of SECONDS (the one DecoderServer.profile opens on the service)")
    parser.add_argument("--profile-only", action="store_true", help="realistic: only the profile (no "
                        "timed runs), written as <name>-profile")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32: the realistic "
                        "mode at 2 and 4 in flight, each request asking for 1/100 of its tokens (with "
                        "--workload load: the tiny checkpoint loaded on CPU)")
    opts = parser.parse_args(argv)
    realistic = opts.workload == "realistic" or (opts.smoke and opts.workload != "load")
    load = opts.workload == "load"
    opts.name = opts.name or ("decoder-load" if load else "decoder-realistic" if realistic else "decoder")
    opts.variants = opts.variants or (["decode_graphs"] if realistic else ["eager", "decode_graphs"])
    opts.repeats = opts.repeats or (1 if opts.smoke else 3)
    opts.profile = opts.profile or opts.profile_only
    assert opts.smoke or torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --smoke)"
    if opts.code:
        sys.path.insert(0, os.path.abspath(opts.code))
    global random_decoder, DecoderArgs, GenerationEngine, GenerationRequest, SamplingParams
    global CacheStep, Experts, IMAGE_TOKEN_ID, ByteTokenizer, KVCache, DEFAULT_PROMPT, build_prompt
    from decoder.checkpoint import random_decoder
    from decoder.config import DecoderArgs
    from decoder.engine import GenerationEngine, GenerationRequest, SamplingParams
    from decoder.kv_cache import KVCache
    from decoder.model import CacheStep, Experts
    from decoder.tokenizer import DEFAULT_PROMPT, IMAGE_TOKEN_ID, ByteTokenizer, build_prompt
    print("decoder package:", os.path.dirname(sys.modules["decoder"].__file__), flush=True)
    if load:
        return measure_load(opts)
    if realistic:
        return measure_realistic(opts)
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


def measure_load(opts) -> None:
    """`load_decoder` of a real-dims checkpoint (random bf16 weights, written here) onto the GPU,
    its files dropped from the page cache before each load (a cold start's read) and kept in it
    for one more (the copy alone), by each reader in turn (DEEPSEEK_OCR_STREAM_WEIGHTS; the
    switch is read at each load), `opts.repeats` times; medians. --smoke: the tiny model on CPU."""
    import tempfile

    from decoder.checkpoint import load_decoder, write_random_checkpoint
    readers = {"streamed": "1", "mapped": "0"}
    device, dtype = ("cpu", torch.float32) if opts.smoke else ("cuda", torch.bfloat16)
    setting_before = os.environ.get("DEEPSEEK_OCR_STREAM_WEIGHTS")
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        write_random_checkpoint(directory, DecoderArgs.tiny() if opts.smoke else DecoderArgs(), num_shards=2)
        written_s = time.perf_counter() - start
        runs = {f"{name}_{cache}": [] for name in readers for cache in ("cold", "warm")}
        for _ in range(opts.repeats):
            for name, setting in readers.items():
                os.environ["DEEPSEEK_OCR_STREAM_WEIGHTS"] = setting
                for cache in ("cold", "warm"):
                    if cache == "cold":
                        evict_from_page_cache(directory)
                    timings, start = {}, time.perf_counter()
                    model = load_decoder(directory, device=device, dtype=dtype, timings=timings)
                    runs[f"{name}_{cache}"].append({"seconds": time.perf_counter() - start, **timings})
                    del model
                    if device == "cuda":
                        torch.cuda.empty_cache()
    if setting_before is None:  # the JSON's `code` then names the caller's setting
        os.environ.pop("DEEPSEEK_OCR_STREAM_WEIGHTS")
    else:
        os.environ["DEEPSEEK_OCR_STREAM_WEIGHTS"] = setting_before
    median = {key: statistics.median(r["seconds"] for r in rows) for key, rows in runs.items()}
    gb = runs["streamed_cold"][0]["gb"]
    summary = {**{f"{key}_s": s for key, s in median.items()}, "gb": gb,
               "streamed_cold_gb_per_s": gb / median["streamed_cold"],
               "mapped_cold_gb_per_s": gb / median["mapped_cold"],
               "speedup_cold": median["mapped_cold"] / median["streamed_cold"],
               "speedup_warm": median["mapped_warm"] / median["streamed_warm"]}
    for key, s in median.items():
        print(f"{key}: {s:.2f} s ({gb / s:.2f} GB/s)", flush=True)
    write_result(opts.out, f"{opts.name}-smoke" if opts.smoke else opts.name, {
        "benchmark": "the decoder's weights from disk onto the GPU, streamed reads against safetensors' mapping",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "workload": {"checkpoint": f"DecoderArgs{'.tiny()' if opts.smoke else '()'} dims, random bf16, "
                     f"2 shards, written by the bench ({written_s:.1f} s)", "repetitions": opts.repeats,
                     "cold": "posix_fadvise DONTNEED on every file before the load",
                     "warm": "right after a cold load of the same reader"},
        "summary": summary, "runs": runs})


def measure(model, tokenizer, args, embeds, max_len, variant, repeats) -> dict:
    engine, setup_s = make_engine(model, tokenizer, variant, max(CONCURRENCY), max_len)
    rows = {"setup_s": setup_s}
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


def make_engine(model, tokenizer, variant: str, max_batch: int, max_len: int):
    """The engine of `variant`, warmed up, and the warm-up's seconds (with graphs, the first
    step captures them all). Decode graphs only on CUDA (CPU smoke runs: eager)."""
    graphs = variant != "eager" and torch.cuda.is_available()
    fp8 = {"kv_cache_dtype": "fp8"} if variant == "decode_graphs_fp8_kv" else {}  # the option's path
    engine = GenerationEngine(model, tokenizer, max_batch=max_batch, max_len=max_len,
                              decode_graphs=graphs, **fp8)
    if variant == "decode_graphs_gather":
        engine.cache.kernel = "gather"  # before the first step captures the graphs
    if hasattr(engine, "prefill_behind_decode"):  # the old order: prefill, pick, then decode
        engine.prefill_behind_decode = variant != "decode_graphs_prefill_first"
    if variant == "decode_graphs_eager_prefill":  # DEEPSEEK_OCR_PREFILL_GRAPHS=0's path
        engine.runner.prefill_graphs_on = False  # before prepare() captures them
    if hasattr(engine, "overlap_picks"):  # DEEPSEEK_OCR_OVERLAP_PICKS=0's path: picks read first
        engine.overlap_picks = variant != "decode_graphs_picks_first"
    # Older code (--code) has no packed projections to unpack.
    if hasattr(model, "use_fused_projections"):
        model.use_fused_projections(variant != "decode_graphs_separate")
    if hasattr(model, "use_moe_kernel"):
        model.use_moe_kernel("grouped_mm" if variant == "decode_graphs_grouped_mm" else "auto")
        # Prefills (over 4,096 rows) on the grouped matmuls, decode steps fused: as before the
        # prefill tiles (bench/tune/tune_moe_kernel.py --prefill 1).
        Experts.TRITON_MAX_ROWS = 4096 if variant == "decode_graphs_prefill_grouped_mm" else None
    if hasattr(model, "use_fused_routing"):
        model.use_fused_routing(variant != "decode_graphs_unfused_routing")
    if hasattr(model, "use_norm_kernel"):
        model.use_norm_kernel("torch" if variant == "decode_graphs_torch_norm" else "auto")
    if hasattr(model, "use_rope_kernel"):
        model.use_rope_kernel("torch" if variant == "decode_graphs_torch_rope" else "auto")
    if variant == "decode_graphs_no_repetition_guard":  # every request's loop detector off
        add = engine.add
        engine.add = lambda request: add(dataclasses.replace(request, params=dataclasses.replace(
            request.params, repetition=dataclasses.replace(request.params.repetition, enabled=False))))
    start = time.perf_counter()
    warm = GenerationRequest([0, 5, 6], params=SamplingParams(max_tokens=4, ignore_eos=True))
    engine.generate([warm])
    return engine, time.perf_counter() - start


def fp8_kv_logit_error(model, prompt_embeds: torch.Tensor, steps: int = 64) -> dict:
    """What an fp8 KV cache (kv_cache_dtype "fp8") changes in the logits: a page's embeddings
    prefilled, then `steps` decode steps fed the model-dtype cache's greedy tokens, in a cache of
    each type; per step, the logits' relative error against the model dtype's (median, max),
    and how often the greedy token agrees."""
    from decoder.kv_cache import PAGE_TOKENS, kv_dtype, pages_for
    args, n, device = model.args, prompt_embeds.shape[0], model.device
    kv_len = pages_for(n + steps) * PAGE_TOKENS
    logits, greedy = {}, None
    for name in ("auto", "fp8"):
        cache = KVCache(args.n_layers, args.n_heads, args.head_dim, pages_for(kv_len), 1, kv_len, device,
                        kv_dtype(name, model.dtype))
        cache.reserve(0, kv_len)
        cache.sync()
        tokens = []
        with torch.inference_mode():
            out = [model(inputs_embeds=prompt_embeds[None].to(device), step=CacheStep(cache, slot=0),
                         logits_at=torch.tensor([n - 1], device=device)).float().flatten()]
            for i in range(steps):
                tokens.append(greedy[i] if greedy else int(out[-1].argmax()))
                position = torch.tensor([n + i], device=device)
                out.append(model(input_ids=torch.tensor([[tokens[-1]]], device=device), positions=position[:, None],
                                 step=CacheStep(cache, positions=position, kv_len=kv_len)).float().flatten())
        greedy, logits[name] = greedy or tokens, out
    errors = [float((f - a).norm() / a.norm()) for a, f in zip(logits["auto"], logits["fp8"])]
    agree = [int(a.argmax()) == int(f.argmax()) for a, f in zip(logits["auto"], logits["fp8"])]
    return {"steps": steps, "prompt_tokens": n, "rel_err_median": statistics.median(errors),
            "rel_err_max": max(errors), "greedy_agreement": sum(agree) / len(agree),
            "agreed": sum(agree), "compared": len(agree)}


FP8_AGREEMENT_TOKENS = 2000  # issue 54: fp8 becomes a default only at >= 99.5% over this many


def fp8_kv_agreement(model, contexts: list[torch.Tensor], tokens: int = FP8_AGREEMENT_TOKENS) -> dict:
    """`fp8_kv_logit_error` over several contexts (the workload's image sizes), `tokens` decode
    steps shared among them: the greedy agreement pooled over every compared pick, each
    context's own figures beside it."""
    steps = -(-tokens // len(contexts))
    runs = [fp8_kv_logit_error(model, context, steps) for context in contexts]
    agreed, compared = sum(r["agreed"] for r in runs), sum(r["compared"] for r in runs)
    return {"contexts": len(runs), "generated_tokens": steps * len(runs), "greedy_agreement": agreed / compared,
            "rel_err_median": statistics.median(r["rel_err_median"] for r in runs),
            "rel_err_max": max(r["rel_err_max"] for r in runs), "per_context": runs}


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


# --- --workload realistic: pages' contexts against the memory-bandwidth bound ------------------------
def copy_bandwidth(device: str) -> dict:
    """The device's memory bandwidth as a large tensor copy moves it: bytes read + written per
    second (CUDA: 2 x 1 GiB, CUDA-event timed; CPU smoke runs: 2 x 64 MiB, wall clock)."""
    nbytes = 2 ** 30 if device == "cuda" else 2 ** 26
    source = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    ms = (time_ms if device == "cuda" else wall_ms)(lambda: target.copy_(source), 20)
    return {"bytes_per_s": 2 * nbytes / (ms / 1e3), "copy_bytes": nbytes, "copy_ms": ms,
            "how": "torch tensor copy on the device, bytes read + written / median time of 20"}


def weight_bytes(model) -> dict:
    """The model's weights by how a decode step reads them: `every_step` (attention, dense MLPs,
    shared experts, gates, norms, lm_head), `per_expert` (one routed expert of one MoE layer),
    `embedding_row` (one row per sequence; the rest of the table is not read)."""
    def size(params):
        return sum(p.numel() * p.element_size() for p in params)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    embedding = model.model.embed_tokens.weight
    expert_bytes = size(p for m in experts for p in m.parameters())
    total = size(model.parameters())
    args = model.args
    return {"total": total, "every_step": total - expert_bytes - size([embedding]),
            "per_expert": expert_bytes / (len(experts) * args.n_experts), "moe_layers": len(experts),
            "n_experts": args.n_experts, "top_k": args.top_k,
            "embedding_row": embedding.shape[1] * embedding.element_size()}


def step_bytes(weights: dict, batch: int, live_tokens: int, kv_bytes_per_token: int) -> dict:
    """Bytes one decode step of `batch` sequences holding `live_tokens` in the KV cache must
    read: the weights it touches (per MoE layer E * (1 - (1 - k/E)^B) experts expected, routing
    spread evenly) and the live KV cache."""
    experts = weights["n_experts"] * (1 - (1 - weights["top_k"] / weights["n_experts"]) ** batch)
    touched = (weights["every_step"] + weights["moe_layers"] * experts * weights["per_expert"]
               + batch * weights["embedding_row"])
    return {"weights": touched, "kv": kv_bytes_per_token * live_tokens}


def page_requests(specs, tokenizer, embeds: dict, token_scale: int) -> list:
    """One request per page: the default prompt around its image tokens (embeddings shared by
    pages of one token count: their values do not change the work), its max_tokens / token_scale."""
    requests = []
    for spec in specs:
        count = image_tokens(spec.size)
        ids = build_prompt(tokenizer, DEFAULT_PROMPT, [count])
        params = SamplingParams(max_tokens=max(2, spec.max_tokens // token_scale), ignore_eos=True)
        requests.append(GenerationRequest(ids, [embeds[count]], params))
    return requests


class StepCost:
    """A decode step's bytes (`step_bytes`) for this model and cache, and the bandwidth they
    move at."""
    def __init__(self, weights: dict, kv_bytes_per_token: int, bandwidth: float):
        self.weights, self.kv_bytes_per_token, self.bandwidth = weights, kv_bytes_per_token, bandwidth

    def __call__(self, batch: int, live_tokens: int) -> dict:
        return step_bytes(self.weights, batch, live_tokens, self.kv_bytes_per_token)


@dataclasses.dataclass
class Step:
    seconds: float
    batch: int  # sequences in the decode step it launched
    weights_bytes: float  # what that decode step must read
    kv_bytes: float
    live_tokens: int
    prefills: bool  # it prefilled waiting prompts too
    new_tokens: int  # tokens it picked (first tokens of prefilled prompts included)


def closed_loop(engine, requests: list, n: int, cost: StepCost) -> dict:
    """`requests` through the engine, n in flight (the next submitted as one finishes). The
    figures are over the steps from the first finish to the last submission (n in flight
    throughout; prefills included), and over the decode-only steps among them:
    `fraction_of_bound` = the time the steps' bytes take at the measured bandwidth / their wall
    time. With the engine's `prefill_behind_decode` a prefill's device time is waited for at
    the start of the next step, which may be a decode-only one: the window's figures are the
    comparable ones across the two orders."""
    pending = list(reversed(requests))
    for _ in range(min(n, len(pending))):
        engine.add(pending.pop())
    produced, steps, first_finish, last_submit = {}, [], None, None
    preemptions = engine.preemptions
    sync()
    start = time.perf_counter()
    while engine.has_work():
        prefills = bool(engine.waiting or engine.preempted)
        step_start = time.perf_counter()
        deltas = engine.step()  # ends in the sampled tokens' host sync: wall time is device time
        seconds = time.perf_counter() - step_start
        new_tokens = sum(d.completion_tokens - produced.get(d.request_id, 0) for d in deltas)
        produced.update((d.request_id, d.completion_tokens) for d in deltas)
        running = engine.running  # the rows of the decode step just launched
        live = sum(seq.length for seq in running)
        read = cost(len(running), live)
        steps.append(Step(seconds, len(running), read["weights"], read["kv"], live, prefills, new_tokens))
        finished = sum(d.finished for d in deltas)
        if finished and first_finish is None:
            first_finish = len(steps)
        for _ in range(min(finished, len(pending))):
            engine.add(pending.pop())
            if not pending:
                last_submit = len(steps)
    seconds = time.perf_counter() - start
    window = steps[first_finish:last_submit]
    assert window, "too few requests for a span with n in flight"
    decode_only = [step for step in window if not step.prefills]

    def over(chosen):
        """(decoded tokens/s, the bound's tokens/s, bound time / wall time) over these steps."""
        decoded, wall = sum(s.batch for s in chosen), sum(s.seconds for s in chosen)
        bound_s = sum(s.weights_bytes + s.kv_bytes for s in chosen) / cost.bandwidth
        return decoded / wall, decoded / bound_s, bound_s / wall
    _, bound_tokens_per_s, fraction = over(window)
    decode_tokens_per_s, _, decode_fraction = over(decode_only) if decode_only else (None, None, None)
    window_s = sum(s.seconds for s in window)
    return {"tokens_per_s": sum(s.new_tokens for s in window) / window_s,
            "bound_tokens_per_s": bound_tokens_per_s, "fraction_of_bound": fraction,
            "decode_only_tokens_per_s": decode_tokens_per_s, "decode_only_fraction_of_bound": decode_fraction,
            "decode_step_ms_p50": 1e3 * statistics.median(s.seconds for s in decode_only) if decode_only else None,
            "whole_run_tokens_per_s": sum(produced.values()) / seconds, "seconds": seconds,
            "requests": len(requests), "generated_tokens": sum(produced.values()),
            "window_steps": len(window), "window_s": window_s,
            "prefill_share_of_window": sum(s.seconds for s in window if s.prefills) / window_s,
            "mean_batch": statistics.fmean(s.batch for s in window),
            "mean_context_tokens": sum(s.live_tokens for s in window) / sum(s.batch for s in window),
            "weights_read_gb_per_step": statistics.fmean(s.weights_bytes for s in window) / 1e9,
            "kv_read_gb_per_step": statistics.fmean(s.kv_bytes for s in window) / 1e9,
            "preemptions": engine.preemptions - preemptions}


def through_async_engine(engine, requests: list, n: int, window_s: float) -> dict:
    """`requests` through `AsyncEngine`, the Decoder replica's loop (the engine stepped on its
    own thread, requests submitted from an asyncio loop, whole answers merged on that thread),
    n in flight, and a profile window of `window_s` (`AsyncEngine.profile`, the one
    `DecoderServer.profile` opens on the running service) from the first finish on. The same
    engine and instrument as the service, without Serve: what the replica's process adds shows
    against the service's window at the same n."""
    import asyncio

    from decoder.async_engine import AsyncEngine
    loop_engine, pending = AsyncEngine(engine), list(reversed(requests))

    async def main():
        first_finish = asyncio.Event()

        async def worker() -> int:
            produced = 0
            while pending:
                async for delta in loop_engine.generate(pending.pop(), stream=False):
                    produced += delta.completion_tokens
                first_finish.set()
            return produced
        start = time.perf_counter()
        workers = [asyncio.create_task(worker()) for _ in range(n)]
        await first_finish.wait()
        profile = await asyncio.get_running_loop().run_in_executor(None, loop_engine.profile, window_s)
        produced = sum(await asyncio.gather(*workers))
        return {"whole_run_tokens_per_s": produced / (time.perf_counter() - start),
                "generated_tokens": produced, "window": profile}
    try:
        return asyncio.run(main())
    finally:
        loop_engine.stop()


def one_page(engine, tokenizer, embeds: dict, token_scale: int, cost) -> dict:
    """One A4 page alone: its prefill to the first token and the whole generation (seconds),
    against the bound of its decode steps (batch 1: the experts its tokens route to and its own
    KV cache)."""
    count, generated = ONE_PAGE["image_tokens"], max(2, ONE_PAGE["generated_tokens"] // token_scale)
    ids = build_prompt(tokenizer, DEFAULT_PROMPT, [count])
    engine.add(GenerationRequest(ids, [embeds[count]], SamplingParams(max_tokens=generated, ignore_eos=True)))
    sync()
    start = time.perf_counter()
    first = None
    while engine.has_work():
        engine.step()
        first = first or time.perf_counter() - start
    seconds = time.perf_counter() - start
    bound_s = sum(sum(cost(1, len(ids) + i).values()) for i in range(generated - 1)) / cost.bandwidth
    return {"seconds": seconds, "first_token_s": first, "generated_tokens": generated,
            "prompt_tokens": len(ids), "decode_bound_s": bound_s,
            "decode_fraction_of_bound": bound_s / (seconds - first)}


def profile_decode(engine, requests: list, n: int, steps: int = 10, top: int = 15) -> dict:
    """Where a decode step's time goes: n requests prefilled (unprofiled), then `steps` decode
    steps under torch.profiler, then the requests aborted; the device kernels the profiler saw
    (with decode graphs: those their replays ran) by total time, as shares of the kernels' sum,
    and the steps' wall time. The contexts are the
    prompts' (a few tokens more): shorter than mid-generation, so attention's share is low."""
    ids = [engine.add(request) for request in requests[:n]]
    while engine.waiting:
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    device = torch.cuda.is_available()
    if device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall_s = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    time_of = (lambda e: e.device_time_total) if device else (lambda e: e.self_cpu_time_total)
    events = [e for e in prof.key_averages() if time_of(e) > 0
              and (not device or e.device_type == torch.autograd.DeviceType.CUDA)]
    total = sum(time_of(e) for e in events) or 1
    kernels = sorted(events, key=time_of, reverse=True)[:top]
    return {"steps": steps, "batch": n, "kernel_ms_per_step": total / 1e3 / steps,
            "kernels_per_step": sum(e.count for e in events) / steps,
            "wall_ms_per_step": 1e3 * wall_s / steps,  # profiled: the host's share is inflated
            "top": [{"name": e.key[:120], "ms_per_step": time_of(e) / 1e3 / steps,
                     "share": time_of(e) / total, "calls_per_step": e.count / steps} for e in kernels]}


def profile_prefill(engine, request, top: int = 15) -> dict:
    """Where one page's prefill goes (the engine otherwise idle): the step that prefills it
    under torch.profiler, its wall time against its kernels' sum (the rest is the host's:
    launches and waits), the top kernels and the host's top ops by their own time; then the
    request is aborted."""
    request_id = engine.add(request)
    device = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device else [])
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.step()  # the prefill, its first token, the first decode step launched
        sync()
        wall_s = time.perf_counter() - start
    engine.abort(request_id)
    while engine.has_work():
        engine.step()
    events = prof.key_averages()
    kernels = [e for e in events if device and e.device_type == torch.autograd.DeviceType.CUDA
               and e.device_time_total > 0]
    host = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total,
                  reverse=True)
    return {"prompt_tokens": len(request.prompt_ids), "wall_ms": 1e3 * wall_s,
            "kernel_ms": sum(e.device_time_total for e in kernels) / 1e3,
            "kernels": sum(e.count for e in kernels),
            "top_kernels": [{"name": e.key[:120], "ms": e.device_time_total / 1e3, "calls": e.count}
                            for e in sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:top]],
            "top_host_ops": [{"name": e.key[:120], "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                             for e in host[:top]]}


def measure_realistic(opts) -> None:
    if opts.smoke:
        args, device, dtype, token_scale, levels = DecoderArgs.tiny(), "cpu", torch.float32, 100, (2, 4)
    else:
        args, device, dtype, token_scale = DecoderArgs(), "cuda", torch.bfloat16, 1
        levels = tuple(int(n) for n in opts.levels.split(","))
    bandwidth = copy_bandwidth(device)  # before the model and cache take the memory
    if device == "cuda":
        torch.cuda.empty_cache()  # the copy's buffers, back to the driver
    print(f"copy bandwidth {bandwidth['bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
    model = random_decoder(args, device=device, dtype=dtype)
    tokenizer = ByteTokenizer()
    max_len = min(REALISTIC_MAX_LEN, args.max_positions)
    weights = weight_bytes(model)
    kv_bytes_per_token = KVCache.bytes_per_token(args.n_layers, args.n_heads, args.head_dim, dtype)
    cost = StepCost(weights, kv_bytes_per_token, bandwidth["bytes_per_s"])
    gen = torch.Generator().manual_seed(opts.seed)
    specs = {n: draw_specs(ROUNDS * n, opts.seed + n) for n in levels}
    counts = sorted({image_tokens(spec.size) for n in levels for spec in specs[n]} | {ONE_PAGE["image_tokens"]})
    embeds = {count: 0.02 * torch.randn(count, args.hidden, generator=gen) for count in counts}
    setting = {"levels": levels, "specs": specs, "bandwidth": bandwidth, "weights": weights, "dtype": dtype,
               "kv_bytes_per_token": kv_bytes_per_token, "max_len": max_len, "device": device,
               "token_scale": token_scale}
    variants = {}
    for variant in opts.variants:
        engine, setup_s = make_engine(model, tokenizer, variant, max(levels), max_len)
        rows = {"setup_s": setup_s, "decode_graphs": engine.decode_graphs is not None,
                "kv_cache_tokens": engine.cache.capacity_tokens}
        variants[variant] = rows
        if variant == "decode_graphs_fp8_kv":  # against the model dtype's cache; bound: bf16's bytes
            # Teacher-forced over the workload's contexts: one per image size it draws, 8 at most.
            contexts = [embeds[count] for count in counts[:: max(1, len(counts) // 8)][:8]]
            rows["logit_error_vs_model_dtype"] = error = fp8_kv_agreement(model, contexts)
            print(f"{variant} logits vs the model dtype's cache over {error['generated_tokens']} tokens of "
                  f"{error['contexts']} contexts: rel err median {error['rel_err_median']:.2e}, max "
                  f"{error['rel_err_max']:.2e}, greedy agreement {error['greedy_agreement']:.4f}", flush=True)
        write = write_profile if opts.profile_only else write_realistic
        for n in () if opts.profile_only else levels:
            runs = sorted((closed_loop(engine, page_requests(specs[n], tokenizer, embeds, token_scale), n, cost)
                           for _ in range(opts.repeats)), key=lambda r: r["tokens_per_s"])
            rows[str(n)] = {**runs[len(runs) // 2], "repeats_tokens_per_s": [r["tokens_per_s"] for r in runs]}
            row = rows[str(n)]
            print(f"{variant} c{n}: {row['tokens_per_s']:.0f} tokens/s, bound {row['bound_tokens_per_s']:.0f}: "
                  f"{row['fraction_of_bound']:.2f}; decode-only steps {row['decode_only_fraction_of_bound'] or 0:.2f} "
                  f"(p50 {row['decode_step_ms_p50'] or 0:.2f} ms), prefill share {row['prefill_share_of_window']:.2f}, "
                  f"mean batch {row['mean_batch']:.0f}, context {row['mean_context_tokens']:.0f}", flush=True)
        for n in () if opts.profile_only or not opts.window else levels:
            rows.setdefault("async_engine", {})[str(n)] = row = through_async_engine(
                engine, page_requests(specs[n], tokenizer, embeds, token_scale), n, opts.window)
            window = row["window"]
            print(f"{variant} c{n} through AsyncEngine: window {window['tokens_per_s']:.0f} tokens/s, "
                  f"{window['ms_per_step']:.2f} ms a step of {window['sequences_per_step']:.0f} sequences, "
                  f"device wait {window['device_wait_share']:.2f}, idle {window['idle_share']:.2f}", flush=True)
        if not opts.profile_only:
            pages = sorted((one_page(engine, tokenizer, embeds, token_scale, cost) for _ in range(opts.repeats)),
                           key=lambda r: r["seconds"])
            rows["one_page"] = {**pages[len(pages) // 2], "repeats_s": [r["seconds"] for r in pages]}
            print(f"{variant} one page: {rows['one_page']['seconds']:.3f} s", flush=True)
            write_realistic(opts, variants, setting)
        if opts.profile:  # last, each batch written as it is done: a run cut off keeps what it has
            rows["profile"] = {}
            page = GenerationRequest(build_prompt(tokenizer, DEFAULT_PROMPT, [ONE_PAGE["image_tokens"]]),
                                     [embeds[ONE_PAGE["image_tokens"]]], SamplingParams(max_tokens=8, ignore_eos=True))
            rows["profile_prefill"] = prefill = profile_prefill(engine, page)
            write(opts, variants, setting)
            print(f"{variant} profile prefill of {prefill['prompt_tokens']} tokens: wall {prefill['wall_ms']:.1f} ms, "
                  f"kernels {prefill['kernel_ms']:.1f} ms in {prefill['kernels']}", flush=True)
            for op in prefill["top_host_ops"][:8]:
                print(f"  host {op['self_ms']:7.3f} ms x{op['calls']:4d} {op['name']}", flush=True)
            for n in (1, *levels):  # batch 1: one page alone
                profile = profile_decode(engine, page_requests(specs[max(levels)][:n], tokenizer, embeds,
                                                               token_scale), n)
                rows["profile"][str(n)] = profile
                write(opts, variants, setting)
                print(f"{variant} profile b{n}: wall {profile['wall_ms_per_step']:.2f} ms/step, kernels "
                      f"{profile['kernel_ms_per_step']:.2f} ms in {profile['kernels_per_step']:.0f}", flush=True)
                for kernel in profile["top"]:
                    print(f"  {kernel['ms_per_step']:7.3f} ms {kernel['share']:5.1%} x{kernel['calls_per_step']:4.0f} "
                          f"{kernel['name']}", flush=True)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()


def write_profile(opts, variants: dict, setting: dict) -> None:
    """--profile-only: each variant's decode-step profiles, at batch 1 and at each level."""
    summary = {f"{variant}_b{n}": {key: profile[key] for key in ("wall_ms_per_step", "kernel_ms_per_step",
                                                                 "kernels_per_step")}
               for variant, rows in variants.items() for n, profile in rows.get("profile", {}).items()}
    write_result(opts.out, f"{opts.name}-profile", {
        "benchmark": "where a decode step's time goes (torch.profiler; no timed runs)",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if setting["device"] == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(setting["dtype"]).removeprefix("torch."),
        "weights": "tiny random" if opts.smoke else "random, real DeepSeek-3B-MoE dims",
        "workload": {"pages": {str(n): describe(setting["specs"][n]) for n in setting["levels"]},
                     "max_len": setting["max_len"], "seed": opts.seed},
        "summary": summary, "variants": variants})


def guard_cost(variants: dict, levels) -> dict:
    """The loop detector's cost (issue 57, target <= 2% at 256): the default engine's median
    decode step over the same engine's with every request's detector off, less 1, per level;
    {} unless both ran."""
    on, off = variants.get("decode_graphs"), variants.get("decode_graphs_no_repetition_guard")
    if not on or not off or any(str(n) not in on or str(n) not in off for n in levels):
        return {}
    return {"repetition_guard_step_cost": {f"c{n}": on[str(n)]["decode_step_ms_p50"] / off[str(n)]["decode_step_ms_p50"] - 1
                                           for n in levels}}


def write_realistic(opts, variants: dict, setting: dict) -> None:
    """The JSON of the variants measured so far (`setting`: what measure_realistic measured them in)."""
    levels, specs, bandwidth, weights, kv_bytes_per_token, dtype, max_len, device, token_scale = (
        setting[key] for key in ("levels", "specs", "bandwidth", "weights", "kv_bytes_per_token", "dtype",
                                 "max_len", "device", "token_scale"))
    first = variants[opts.variants[0]]
    summary = {"variant": opts.variants[0], "decode_graphs": first["decode_graphs"],
               **{f"{key}_c{n}": first[str(n)][key] for n in levels
                  for key in ("tokens_per_s", "bound_tokens_per_s", "fraction_of_bound",
                              "decode_only_fraction_of_bound")},
               **{f"async_engine_window_tokens_per_s_c{n}": first["async_engine"][str(n)]["window"]["tokens_per_s"]
                  for n in levels if str(n) in first.get("async_engine", {})},
               "one_page_s": first["one_page"]["seconds"],
               "hbm_bandwidth_gb_s": bandwidth["bytes_per_s"] / 1e9, "targets": REALISTIC_TARGETS,
               "met": {**{f"fraction_of_bound_c{n}": first[str(n)]["fraction_of_bound"]
                          >= REALISTIC_TARGETS["fraction_of_bound"] for n in levels},
                       "one_page_s": first["one_page"]["seconds"] <= REALISTIC_TARGETS["one_page_s"]}}
    summary.update(guard_cost(variants, levels))
    write_result(opts.out, f"{opts.name}-smoke" if opts.smoke else opts.name, {
        "benchmark": "decoder at pages' contexts against the memory-bandwidth bound",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "weights": "tiny random" if opts.smoke else "random, real DeepSeek-3B-MoE dims",
        "workload": {"pages": {str(n): describe(specs[n]) for n in levels},
                     "prompt": DEFAULT_PROMPT, "max_len": max_len, "seed": opts.seed,
                     "max_tokens": "each page's own" + (f" / {token_scale} (smoke)" if token_scale > 1 else ""),
                     "submission": f"{ROUNDS}n requests, n in flight (one submitted as one finishes); "
                     "figures from the first finish to the last submission", "ngram": "default (30/90)",
                     "one_page": ONE_PAGE},
        "bound": {"bandwidth": bandwidth, "weights_bytes": weights, "kv_bytes_per_token": kv_bytes_per_token,
                  "bytes_per_decode_step": "weights touched (every_step + moe_layers * E * (1 - (1 - k/E)^B) "
                  "* per_expert + B * embedding_row) + kv_bytes_per_token * live tokens",
                  "bound_tokens_per_s": "decoded tokens / sum over the steps of bytes_per_decode_step / "
                  "bandwidth"},
        "summary": summary, "variants": variants})


if __name__ == "__main__":
    main()
