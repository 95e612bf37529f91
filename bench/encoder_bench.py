"""Eager encoder speed and memory on one GPU: dense rel-pos bias (DeepSeek's way) vs our fused path.

    python bench/encoder_bench.py [--out bench/results] [--iters 20]

Real DeepSeek-OCR dims, random weights, bf16. For each image kind (224², 448², 896², 1024², a
1191x1684 page) at batch 1 and 8 it times the whole encode of staged pixels (global path, plus the
local path when the image is tiled; preprocessing excluded), counts TFLOP/s from the config
(encoder/flops.py) and measures peak memory above the weights. Both attention paths run side by
side in this one process on the same weights and inputs; the fused output's error against the
dense one is recorded next to its speed. Writes `encoder-<date>.json` with a top-level `summary`.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, graph_replay_ms, rel_err, time_ms, write_result  # noqa: E402
from encoder import EncoderArgs, preprocess  # noqa: E402
from encoder.checkpoint import random_encoder  # noqa: E402
from encoder.flops import view_flops  # noqa: E402
from encoder.relpos_attention import (augmented_relpos_attention,  # noqa: E402
                                      dense_relpos_attention, fused_relpos_attention,
                                      rel_pos_terms)

CASES = {"224x224": (224, 224), "448x448": (448, 448), "896x896": (896, 896),
         "1024x1024": (1024, 1024), "page-1191x1684": (1191, 1684)}
BATCHES = (1, 8)
IMPLS = ("dense", "augmented", "fused")  # fused = the Triton kernel on CUDA
SUMMARY_CASE = "448x448"  # untiled: batch b = b global views
TARGETS = {"speedup_b1": 1.3, "speedup_b8": 2.0, "activation_memory_ratio_b8": 0.3}
GB = 1024 ** 3


def peak_above_baseline(fn) -> tuple[int, int]:
    """(peak bytes allocated while running fn, bytes allocated before it)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, base


def staged(size: tuple[int, int], batch: int):
    from PIL import Image
    gen = torch.Generator().manual_seed(size[0])
    noise = torch.randint(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=torch.uint8, generator=gen)
    item = preprocess(Image.fromarray(noise.numpy()).resize(size))
    global_views = item.global_view[None].repeat(batch, 1, 1, 1).cuda()
    crops = item.crops.repeat(batch, 1, 1, 1).cuda()
    return item, global_views, crops


def encode(encoder, global_views, crops):
    out = [encoder.forward_global(global_views)]
    if len(crops):
        out.append(encoder.forward_local(crops).flatten(0, 1))
    return torch.cat([o.reshape(-1, o.shape[-1]) for o in out])


def bench_cases(encoder, args: EncoderArgs, iters: int) -> list[dict]:
    rows = []
    for name, size in CASES.items():
        for batch in BATCHES:
            item, global_views, crops = staged(size, batch)
            flops = batch * (view_flops(args, 1024) + len(item.crops) * view_flops(args, 640))
            row = {"case": name, "batch": batch, "grid": list(item.grid),
                   "global_views": batch, "crops": len(crops), "tflop": flops / 1e12}
            outputs = {}
            for impl in IMPLS:
                encoder.set_attention(impl)
                fn = lambda: encode(encoder, global_views, crops)  # noqa: E731
                with torch.inference_mode():
                    outputs[impl] = fn()
                    ms = time_ms(fn, iters)
                    act, base = peak_above_baseline(fn)
                    graph_ms = graph_replay_ms(fn, iters)
                row[impl] = {"ms": ms, "tflops": flops / ms / 1e9, "graph_replay_ms": graph_ms,
                             "activation_gb": act / GB, "peak_gb": (act + base) / GB}
                if impl != "dense":
                    row[impl]["rel_err_vs_dense"] = rel_err(outputs[impl], outputs["dense"])
            row["speedup"] = row["dense"]["ms"] / row["fused"]["ms"]
            row["graph_speedup"] = row["dense"]["graph_replay_ms"] / row["fused"]["graph_replay_ms"]
            row["activation_ratio"] = row["fused"]["activation_gb"] / row["dense"]["activation_gb"]
            rows.append(row)
            print(f"{name:>15} b{batch}: " + " | ".join(
                f"{i} {row[i]['ms']:6.2f} ms (graph {row[i]['graph_replay_ms']:6.2f}) "
                f"{row[i]['activation_gb']:5.2f} GB" for i in IMPLS)
                + f" | x{row['speedup']:.2f} err {row['fused']['rel_err_vs_dense']:.1e}", flush=True)
    encoder.set_attention("fused")
    return rows


def bench_attention_block(iters: int) -> list[dict]:
    """One global SAM block's attention (64x64 grid, 12 heads x 64), as in dual-path-graphs.md."""
    rows = []
    for batch in BATCHES:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        q, k, v = (torch.randn(batch, 12, 4096, 64, device="cuda", dtype=torch.bfloat16,
                               generator=gen) for _ in range(3))
        rph, rpw = (0.1 * torch.randn(127, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
        rel_h, rel_w = rel_pos_terms(q, rph, rpw, (64, 64))
        variants = {
            "dense_bias_sdpa": lambda: dense_relpos_attention(q, k, v, rel_h, rel_w),
            "augmented_sdpa": lambda: augmented_relpos_attention(q, k, v, rel_h, rel_w),
            "fused_triton": lambda: fused_relpos_attention(q, k, v, rel_h, rel_w),
            "sdpa_no_bias_floor": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
        }
        for name, fn in variants.items():
            with torch.inference_mode():
                ms = time_ms(fn, iters)
                act, _ = peak_above_baseline(fn)
            rows.append({"variant": name, "batch": batch, "ms": ms, "activation_gb": act / GB})
            print(f"attention block b{batch} {name:>22}: {ms:6.3f} ms {act / GB:5.2f} GB", flush=True)
    return rows


def main(argv=None):
    opts = options(argv, iters=20)

    args = EncoderArgs()
    encoder = random_encoder(args, device="cuda", dtype=torch.bfloat16)
    weights_gb = torch.cuda.memory_allocated() / GB
    attention = bench_attention_block(opts.iters)
    cases = bench_cases(encoder, args, opts.iters)

    pick = {r["batch"]: r for r in cases if r["case"] == SUMMARY_CASE}
    summary = {
        "speedup_b1": pick[1]["speedup"],
        "speedup_b8": pick[8]["speedup"],
        "activation_memory_ratio_b8": pick[8]["activation_ratio"],
        "summary_case": f"{SUMMARY_CASE}: untiled, so batch b = b global 1024² views",
        "fused_ms_b1": pick[1]["fused"]["ms"], "dense_ms_b1": pick[1]["dense"]["ms"],
        "fused_ms_b8": pick[8]["fused"]["ms"], "dense_ms_b8": pick[8]["dense"]["ms"],
        "graph_speedup_b1": pick[1]["graph_speedup"], "graph_speedup_b8": pick[8]["graph_speedup"],
        "targets": TARGETS,
    }
    summary["met"] = {
        "speedup_b1": summary["speedup_b1"] >= TARGETS["speedup_b1"],
        "speedup_b8": summary["speedup_b8"] >= TARGETS["speedup_b8"],
        "activation_memory_ratio_b8":
            summary["activation_memory_ratio_b8"] <= TARGETS["activation_memory_ratio_b8"],
    }
    result = {
        "benchmark": "encoder eager: dense rel-pos bias vs fused attention (Triton) vs augmented SDPA",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
        "weights": "random, real DeepSeek-OCR vision dims", "weights_gb": weights_gb,
        "iters": opts.iters, "timing": "median of CUDA-event timings after 3 warm-ups",
        "tflop_per_view": {"global_1024": view_flops(args, 1024) / 1e12,
                           "crop_640": view_flops(args, 640) / 1e12},
        "summary": summary, "cases": cases, "attention_block": attention,
    }
    write_result(opts.out, "encoder", result)

if __name__ == "__main__":
    main()
