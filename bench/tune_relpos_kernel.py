"""Pick tile configs for the Triton rel-pos attention kernel on this GPU.

    python bench/tune_relpos_kernel.py [--out DIR]

For the three shapes the encoder runs (global block on a 1024 view, global block on a 640 crop,
14x14 windows; batch of 8 views / 48 crops / 200 windows, 12 heads x 64, bf16) it times every
config in a small grid, checks each against the dense-bias reference, and prints the best as the
`TUNED` table for encoder/triton_relpos.py. Writes relpos-kernel-tuning-<date>.json.
"""
from __future__ import annotations

import datetime
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, rel_err, time_ms, write_result  # noqa: E402
from encoder.relpos_attention import dense_relpos_attention, rel_pos_terms  # noqa: E402
from encoder.triton_relpos import _empty_output, launch  # noqa: E402

SHAPES = {"global-64x64": (8, 64, 127), "crop-global-40x40": (48, 40, 127), "window-14x14": (200, 14, 27)}


def main(argv=None):
    opts = options(argv)
    results, tuned = {}, {}
    for name, (bsz, side, rows) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(side)
        qkv = torch.randn(bsz, side * side, 3, 12, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        tables = [0.1 * torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(2)]
        rel_h, rel_w = rel_pos_terms(q, *tables, (side, side))
        ref = dense_relpos_attention(q, k, v, rel_h, rel_w)
        row_pad = 1 << (side - 1).bit_length()
        base_rows = max(1, 64 // row_pad)
        trials = []
        for block_m, rows_mult, warps, stages in itertools.product((64, 128), (1, 2), (4, 8), (2, 3, 4)):
            cfg = dict(BLOCK_M=block_m, ROWS=base_rows * rows_mult, ROW_PAD=row_pad,
                       num_warps=warps, num_stages=stages)
            try:
                fn = lambda: launch(q, k, v, rel_h, rel_w, _empty_output(q), **cfg)  # noqa: E731
                err = rel_err(fn(), ref)
                ms = time_ms(fn, 20)
            except Exception as e:  # e.g. out of shared memory for this tile
                trials.append({**cfg, "error": repr(e)[:200]})
                continue
            trials.append({**cfg, "ms": ms, "rel_err_vs_dense": err})
        ok = [t for t in trials if "ms" in t and t["rel_err_vs_dense"] < 1e-2]
        best = min(ok, key=lambda t: t["ms"])
        dense_ms = time_ms(lambda: dense_relpos_attention(q, k, v, rel_h, rel_w), 20)
        floor_ms = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 20)
        results[name] = {"batch": bsz, "best": best, "dense_bias_ms": dense_ms,
                         "sdpa_no_bias_ms": floor_ms, "trials": trials}
        tuned[side] = {k: best[k] for k in ("BLOCK_M", "ROWS", "ROW_PAD", "num_warps", "num_stages")}
        print(f"{name}: best {best['ms']:.3f} ms {tuned[side]} | dense {dense_ms:.3f} ms | "
              f"no-bias SDPA {floor_ms:.3f} ms", flush=True)
    print("TUNED =", json.dumps(tuned))
    write_result(opts.out, "relpos-kernel-tuning",
                 {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "tuned": tuned, "shapes": results})

if __name__ == "__main__":
    main()
