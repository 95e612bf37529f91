"""Pick tile configs for the Triton rel-pos attention kernel on this GPU.

    python bench/tune/tune_relpos_kernel.py [--out bench/results] [--jobs 16]

For the four attention shapes a page batch runs (global block on 1024² views, global block on
640² crops, SAM's 14x14 windows addressed in place on both grids; 12 heads x 64, bf16, 8 views
or 48 crops, a quarter of a 32-page batch), it times the whole op `triton_relpos.attention`
(the rel terms included) for every config in a small grid: key-block layouts (ROW_PAD columns
x ROWS rows, and for a 40-wide row a 32-column part plus an 8-column tail of TAIL_ROWS rows),
BLOCK_M, warps and stages. Each config is checked against the dense-bias reference (windows:
the tiles before, which the tests check against padded partitions with the dense bias).
The best config per window width (the sum over the shapes of that width) is printed as the
`TUNED` table of encoder/triton_relpos.py, for a maintainer to copy there; this script never
edits source. The configs compile first in --jobs processes at once (Triton's cache then serves
the timing process). Writes bench/results/tune-relpos-kernel.json (`--out DIR` or `--out
FILE.json` to change).
"""
from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import json
import multiprocessing
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.common import options, rel_err, time_ms, write_tuning  # noqa: E402
from encoder import triton_relpos  # noqa: E402
from encoder.relpos_attention import dense_relpos_attention, rel_table  # noqa: E402

# name: (batch, grid side, window side (0: global attention), table rows)
SHAPES = {"global-64x64": (8, 64, 0, 127), "crop-global-40x40": (48, 40, 0, 127),
          "global-windows-64x64": (8, 64, 14, 27), "crop-windows-40x40": (48, 40, 14, 27)}
# Key-block layouts per window width: (ROW_PAD, ROWS, TAIL_ROWS).
LAYOUTS = {64: [(64, 1, 0), (64, 2, 0)],
           40: [(64, 2, 0), (64, 1, 0), (32, 4, 8), (32, 4, 16), (32, 2, 16)],
           14: [(16, 4, 0), (16, 8, 0), (8, 16, 16)]}
GRID = list(itertools.product((64, 128), (4, 8), (2, 3)))  # BLOCK_M, warps, stages
COPY_INTO = "encoder/triton_relpos.py: TUNED"  # where a maintainer copies the pick


def width(shape: str) -> int:
    _, side, window, _ = SHAPES[shape]
    return window or side


def configs(shape: str) -> list[dict]:
    return [dict(BLOCK_M=block_m, ROWS=rows, ROW_PAD=row_pad, TAIL_ROWS=tail, num_warps=warps,
                 num_stages=stages)
            for (row_pad, rows, tail), (block_m, warps, stages) in itertools.product(LAYOUTS[width(shape)], GRID)]


def inputs(shape: str):
    """q, k, v (strided views of one qkv projection), the axes' tables, the window's grid and the
    windows (None: global attention)."""
    bsz, side, window, rows = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(side + window)
    qkv = torch.randn(bsz, side * side, 3, 12, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    hw = (window or side,) * 2
    axes = [rel_table(hw[0], 0.1 * torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16,
                                                generator=gen)).contiguous() for _ in range(2)]
    windows = None
    if window:
        bias = 0.1 * torch.randn(3, 12, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        windows = triton_relpos.Windows(window, (side, side), bias[1], bias[2])
    return q, k, v, axes, hw, windows


def run(tensors, cfg):
    q, k, v, axes, hw, windows = tensors
    return triton_relpos.attention(q, k, v, *axes, hw, windows, tiles=cfg)


def reference(tensors, before: dict):
    """Global attention: the dense bias (DeepSeek's way). Windows: the kernels with the
    tiles before (the GPU tests check it against padded partitions with the dense bias)."""
    q, k, v, axes, hw, windows = tensors
    if windows is None:
        return dense_relpos_attention(q, k, v, *triton_relpos.rel_pos_terms(q, *axes, hw))
    return run(tensors, before)


def _compile(shape: str, cfgs: list[dict]) -> int:
    """In a worker process: launch each config once, so Triton compiles it into the shared cache."""
    tensors = inputs(shape)
    for cfg in cfgs:
        try:
            run(tensors, cfg)
        except Exception:  # noqa: BLE001 - the timing pass records the error
            pass
    torch.cuda.synchronize()
    return len(cfgs)


def warm_cache(jobs: int) -> None:
    tasks = [(shape, configs(shape)[i::jobs]) for shape in SHAPES for i in range(jobs)]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = sum(pool.map(_compile, *zip(*tasks)))
    print(f"compiled {done} configs in {jobs} processes", flush=True)


def tuned_source(tuned: dict[int, dict]) -> str:
    """The pick as the `TUNED` table's source, ready to paste over the one in COPY_INTO."""
    lines = "".join(f"    {w}: dict({', '.join(f'{k}={v!r}' for k, v in cfg.items())}),\n"
                    for w, cfg in sorted(tuned.items(), reverse=True))
    return f"TUNED: dict[int, dict] = {{\n{lines}}}\n"


def main(argv=None):
    opts = options(argv, jobs=16)
    before = {w: dict(cfg) for w, cfg in triton_relpos.TUNED.items()}
    if opts.jobs > 1:
        warm_cache(opts.jobs)
    results, scores = {}, {}
    for shape in SHAPES:
        tensors = inputs(shape)
        q, k, v, axes, hw, windows = tensors
        old = {"TAIL_ROWS": 0, **before[width(shape)]}  # the tiles before
        ref = reference(tensors, old)
        trials = []
        for cfg in configs(shape):
            try:
                fn = lambda: run(tensors, cfg)  # noqa: E731
                err = rel_err(fn(), ref)
                ms = time_ms(fn, 20)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
                trials.append({**cfg, "error": repr(e)[:200]})
                continue
            trials.append({**cfg, "ms": ms, "rel_err_vs_reference": err})
            if err < 1e-2:
                key = (width(shape), json.dumps(cfg, sort_keys=True))
                scores.setdefault(key, []).append(ms)
        row = {"batch": SHAPES[shape][0], "trials": trials,
               "before_ms": time_ms(lambda: run(tensors, old), 20)}
        if windows is None:
            terms = triton_relpos.rel_pos_terms(q, *axes, hw)
            row["dense_bias_ms"] = time_ms(lambda: dense_relpos_attention(q, k, v, *terms), 20)
            row["sdpa_no_bias_ms"] = time_ms(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 20)
        results[shape] = row
        best = min((t for t in trials if t.get("rel_err_vs_reference", 1.0) < 1e-2), key=lambda t: t["ms"])
        row["best"] = best
        print(f"{shape}: best {best['ms']:.3f} ms {best} | tiles before {row['before_ms']:.3f} ms",
              flush=True)
    tuned = {}
    for w in sorted({width(s) for s in SHAPES}):
        n_shapes = sum(width(s) == w for s in SHAPES)
        # A config counts where it ran within tolerance on every shape of this width.
        complete = {k: sum(ms) for k, ms in scores.items() if k[0] == w and len(ms) == n_shapes}
        key = min(complete, key=complete.get)
        tuned[w] = json.loads(key[1])
        print(f"width {w}: {tuned[w]} ({complete[key]:.3f} ms over its {n_shapes} shape(s))", flush=True)
    source = tuned_source(tuned)
    print(f"\nbest configs; to adopt them, copy into {COPY_INTO}:\n{source}", flush=True)
    write_tuning(opts.out, "relpos-kernel",
                 {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "copy_into": COPY_INTO, "source": source,
                  "tuned_before": before, "tuned": tuned, "shapes": results})


if __name__ == "__main__":
    main()
