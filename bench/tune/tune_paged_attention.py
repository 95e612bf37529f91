"""Pick the paged decode-attention kernel's knobs on this GPU, against the unpaged attention.

    python bench/tune/tune_paged_attention.py [--out bench/results]

One layer at real dims (10 heads x 128, bf16), rows at positions spread over the upper half of a
1,280-token context bucket (as running pages are), for 1, 16, 64 and 256 rows. Times every config
of a small grid (tokens per loop step, tokens per split, warps, stages), checks each against the
gathered reference, and times the attention the engine ran before paging (SDPA over a contiguous
[S, H, 1280, d] cache with a mask) beside it. Prints the best config per batch and the one best
summed over the batches (the module defaults), as the line of decoder/triton_paged_attention.py
a maintainer would copy it into (BLOCK_T, SPLIT_TOKENS, NUM_WARPS, NUM_STAGES); this script never
edits source. Writes bench/results/tune-paged-attention.json (`--out DIR` or `--out FILE.json`
to change).
"""
from __future__ import annotations

import datetime
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.common import options, rel_err, time_ms, write_tuning  # noqa: E402
from decoder.kv_cache import PAGE_TOKENS, gathered_decode_attention, pages_for  # noqa: E402
from decoder.triton_paged_attention import paged_decode_attention  # noqa: E402

HEADS, HEAD_DIM, CONTEXT = 10, 128, 1280
ROWS = (1, 16, 64, 256)
KNOBS = ("block_t", "split_tokens", "num_warps", "num_stages")
GRID = list(itertools.product((32, 64, 128), (128, 256, 512, 1024), (2, 4, 8), (1, 2, 3)))
# Where a maintainer copies the pick: the module's defaults, one line, in KNOBS' order.
COPY_INTO = "decoder/triton_paged_attention.py: BLOCK_T, SPLIT_TOKENS, NUM_WARPS, NUM_STAGES"


def main(argv=None):
    opts = options(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, totals = {}, {}
    for rows in ROWS:
        pages = rows * pages_for(CONTEXT)
        k = torch.randn(pages + 1, HEADS, PAGE_TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        table = (torch.randperm(pages, device="cuda", generator=gen) + 1).view(rows, -1).int()
        positions = torch.randint(CONTEXT // 2, CONTEXT, (rows,), device="cuda", generator=gen)
        q = torch.randn(rows, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = gathered_decode_attention(q, k, v, table, positions, CONTEXT)
        read_gb = 2 * HEADS * HEAD_DIM * 2 * int((positions + 1).sum()) / 1e9  # keys + values held
        # Before paging: one contiguous cache block per row, the whole bucket read, masked.
        keys, values = (x[table.long()].transpose(1, 2).reshape(rows, HEADS, -1, HEAD_DIM)[:, :, :CONTEXT]
                        .contiguous() for x in (k, v))
        visible = (torch.arange(CONTEXT, device="cuda")[None] <= positions[:, None])[:, None, None]
        unpaged_ms = time_ms(lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=visible), 20)
        del keys, values
        trials = []
        for block_t, split, warps, stages in GRID:
            if split % block_t:
                continue
            cfg = dict(zip(KNOBS, (block_t, split, warps, stages)))
            try:
                fn = lambda: paged_decode_attention(q[:, :, 0], k, v, table, positions, CONTEXT, **cfg)  # noqa: E731
                err = rel_err(fn().view(rows, 1, -1), ref)
                ms = time_ms(fn, 20)
            except Exception as e:  # noqa: BLE001 - e.g. out of registers for this tile
                trials.append({**cfg, "error": repr(e)[:200]})
                continue
            trials.append({**cfg, "ms": ms, "tb_per_s": read_gb / ms, "rel_err": err})
            if err < 1e-2:
                totals.setdefault(tuple(cfg.values()), {})[rows] = ms
        ok = [t for t in trials if "ms" in t and t["rel_err"] < 1e-2]
        best = min(ok, key=lambda t: t["ms"])
        results[str(rows)] = {"best": best, "unpaged_sdpa_ms": unpaged_ms, "valid_kv_gb": read_gb,
                              "unpaged_tb_per_s": 2 * rows * HEADS * HEAD_DIM * 2 * CONTEXT / 1e9 / unpaged_ms,
                              "trials": trials}
        print(f"rows {rows}: best {best['ms'] * 1e3:.1f} us ({best['tb_per_s']:.2f} TB/s of valid KV) "
              f"{ {k: best[k] for k in KNOBS} } | "
              f"unpaged SDPA {unpaged_ms * 1e3:.1f} us", flush=True)
    # The defaults: the config with the least time summed over every batch it ran correctly at.
    complete = {key: sum(times.values()) for key, times in totals.items() if len(times) == len(ROWS)}
    best_key = min(complete, key=complete.get)
    overall = dict(zip(KNOBS, best_key))
    summary = {"best_overall": overall,
               **{f"paged_us_rows{r}": totals[best_key][r] * 1e3 for r in ROWS},
               **{f"unpaged_sdpa_us_rows{r}": results[str(r)]["unpaged_sdpa_ms"] * 1e3 for r in ROWS}}
    source = f"BLOCK_T, SPLIT_TOKENS, NUM_WARPS, NUM_STAGES = {', '.join(map(str, best_key))}"
    print("defaults:", overall)
    print(f"to adopt them, copy into {COPY_INTO}:\n{source}", flush=True)
    write_tuning(opts.out, "paged-attention",
                 {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "context": CONTEXT, "heads": HEADS, "head_dim": HEAD_DIM,
                  "copy_into": COPY_INTO, "source": source,
                  "summary": summary, "rows": results})


if __name__ == "__main__":
    main()
