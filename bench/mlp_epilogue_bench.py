"""SAM's MLP up-projection: nn.Linear + exact GELU (two kernels) against one cuBLASLt matmul
with a bias + GELU epilogue (`encoder.model.linear_gelu`, GELU's tanh form), on a GPU.

    python bench/mlp_epilogue_bench.py [--out bench/results]

Token counts of a 32-page batch and of one page (global views: 4,096 tokens each; crops: 1,600)
at SAM's width (768 -> 3072), bf16: CUDA-event median ms of each way and the relative error of
each to an fp32 run of the exact GELU. Writes mlp-epilogue-<date>.json.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import options, rel_err, time_ms, write_result  # noqa: E402
from encoder import model  # noqa: E402

TOKENS = {"global_b32": 32 * 4096, "crops_b32": 192 * 1600, "global_b1": 4096, "crops_b1": 6 * 1600}


def main(argv=None):
    opts = options(argv, iters=50)
    torch.manual_seed(0)
    lin = torch.nn.Linear(768, 3072).cuda()
    with torch.no_grad():
        lin.weight.normal_(0, 0.04), lin.bias.normal_(0, 0.04)
    fp32 = lin
    lin = torch.nn.Linear(768, 3072).cuda().to(torch.bfloat16)
    lin.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    rows = {}
    with torch.inference_mode():
        for name, tokens in TOKENS.items():
            x = torch.randn(tokens, 768, device="cuda", dtype=torch.bfloat16)
            exact = F.gelu(fp32(x.float()))
            ways = {"linear_then_gelu": lambda: F.gelu(lin(x)),
                    "linear_then_gelu_tanh": lambda: F.gelu(lin(x), approximate="tanh"),
                    "epilogue": lambda: model.linear_gelu(lin, x)}
            row = {"tokens": tokens}
            for way, fn in ways.items():
                row[f"{way}_ms"] = time_ms(fn, opts.iters)
                row[f"{way}_rel_err_vs_fp32"] = rel_err(fn(), exact)
            row["epilogue_vs_tanh_max_abs"] = (ways["epilogue"]().float()
                                               - ways["linear_then_gelu_tanh"]().float()).abs().max().item()
            row["speedup"] = row["linear_then_gelu_ms"] / row["epilogue_ms"]
            rows[name] = row
            print(f"{name:>10}: linear+gelu {row['linear_then_gelu_ms']:.3f} ms, epilogue "
                  f"{row['epilogue_ms']:.3f} ms ({row['speedup']:.2f}x); err vs fp32 "
                  f"{row['linear_then_gelu_rel_err_vs_fp32']:.2e} / {row['epilogue_rel_err_vs_fp32']:.2e}",
                  flush=True)
    write_result(opts.out, "mlp-epilogue", {
        "benchmark": "SAM lin1 + GELU: two kernels vs a cuBLASLt GELU epilogue",
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "dtype": "bfloat16", "shapes": rows,
        "summary": {name: row["speedup"] for name, row in rows.items()}})


if __name__ == "__main__":
    main()
