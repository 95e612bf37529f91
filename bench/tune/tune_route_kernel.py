"""Time the decode step's route kernel over its launch knobs on this GPU.

    python bench/tune/tune_route_kernel.py [--out bench/results]

One MoE layer's gate at real DeepSeek-3B-MoE dims (64 experts, hidden 1,280, top 6, 2 shared
experts), bf16, random weights. `decoder/triton_route.py` runs the gate's matmul, softmax, top-k
and sort in one program; at one token it took ~9 us a layer on an H100 (10% of a batch-1 decode
step) where its 164 KB of gate take well under one. Each `RouteTile` (columns per step of the
gate's matmul, warps, pipelining stages) is timed at 1 to 64 tokens, ten launches in one CUDA
graph (GPU time, no Python launch cost), and checked against `route_reference` (order and ends
exact, weights close); tiles that do not compile on this GPU (shared memory) are listed as such.
The pick: the least time summed over 1, 2, 4 and 8 tokens (one page alone and small batches,
where the kernel's share of a step is largest), within 5% of the default's at 64. Prints the pick
as the line of decoder/triton_route.py a maintainer would copy it into (`TILE = ...`); never
edits source. Writes bench/results/tune-route-kernel.json (`--out DIR` or `--out FILE.json`).
"""
from __future__ import annotations

import datetime
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.common import graph_replay_ms, options, write_tuning  # noqa: E402
from decoder.config import DecoderArgs  # noqa: E402
from decoder.model import route_reference  # noqa: E402
from decoder import triton_route  # noqa: E402
from decoder.triton_route import RouteTile, route  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 64)
PICKED_OVER = (1, 2, 4, 8)
TILES = [RouteTile(*t) for t in itertools.product((128, 256, 512), (4, 8), (2, 3, 4))]
LAUNCHES = 10  # per graph: one replay's fixed cost spread thin


def per_launch_us(fn) -> float:
    def ten():
        for _ in range(LAUNCHES):
            fn()
    return graph_replay_ms(ten, 20) * 1e3 / LAUNCHES


def main(argv=None):
    opts = options(argv)
    args = DecoderArgs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(args.n_experts, args.hidden, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    n_shared, scaling = args.n_shared_experts, 1.0
    times = {tile: {} for tile in TILES}
    failed = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)
        rw, ro, ren = route_reference(x.float() @ gate.float().T, args.top_k, scaling, n_shared)
        for tile in TILES:
            if tile in failed:
                continue
            try:
                w, o, en = route(x, gate, args.top_k, scaling, n_shared, tile)
                torch.cuda.synchronize()
            except Exception as error:  # out of shared memory on this GPU, say
                failed[tile] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                continue
            if not (torch.equal(en.long(), ren.long()) and torch.equal(o.long(), ro.long())
                    and torch.allclose(w, rw, atol=1e-5, rtol=1e-4)):
                failed[tile] = f"differs from route_reference at {tokens} tokens"
                continue
            times[tile][tokens] = per_launch_us(lambda: route(x, gate, args.top_k, scaling, n_shared, tile))
    ran = {tile: t for tile, t in times.items() if tile not in failed}
    default = triton_route.TILE
    limit = ran[default][64] * 1.05
    eligible = [tile for tile, t in ran.items() if t[64] <= limit] or [default]
    pick = min(eligible, key=lambda tile: sum(ran[tile][n] for n in PICKED_OVER))
    for tile, t in sorted(ran.items(), key=lambda kv: sum(kv[1][n] for n in PICKED_OVER)):
        print(tile, " ".join(f"{n}:{t[n]:.2f}" for n in TOKENS), "us", flush=True)
    line = f"TILE = RouteTile({pick.block_h}, {pick.num_warps}, {pick.num_stages})"
    print(f"default {default}: {', '.join(f'{n}: {ran[default][n]:.2f}' for n in TOKENS)} us")
    print(f"pick {pick}: {', '.join(f'{n}: {ran[pick][n]:.2f}' for n in TOKENS)} us")
    print(f"copy into decoder/triton_route.py: {line}")
    result = {
        "benchmark": "route kernel launch knobs (decoder/triton_route.py)",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": {"experts": args.n_experts, "hidden": args.hidden, "top_k": args.top_k,
                   "n_shared": n_shared, "dtype": "bfloat16"},
        "method": f"{LAUNCHES} launches per CUDA graph, median of 20 replays, per launch",
        "summary": {"default": default._asdict(), "pick": pick._asdict(),
                    "default_us": ran[default], "pick_us": ran[pick],
                    "picked_over_tokens": list(PICKED_OVER), "copy_into": line},
        "tiles": [{**tile._asdict(), "us": t} for tile, t in ran.items()],
        "failed": [{**tile._asdict(), "error": error} for tile, error in failed.items()],
    }
    print("wrote", write_tuning(opts.out, "route-kernel", result))


if __name__ == "__main__":
    main()
