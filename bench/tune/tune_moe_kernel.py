"""Pick the fused MoE kernels' tiles on this GPU, for decode steps and for prefills.

    python bench/tune/tune_moe_kernel.py [--out bench/results] [--prefill 1 | --small 1]

One MoE layer at real DeepSeek-3B-MoE dims (64 experts, hidden 1,280, intermediate 896, top 6),
bf16, random weights and routing. Decode (the default): 1 to 682 tokens (682 x 6 rows stays
under `triton_moe.PREFILL_ROWS`); --prefill 1: 1,024 to 16,384 tokens (the engine's prefill
forwards: up to 16,384 tokens, 98,304 rows) over larger tiles, the down kernel with atomic adds
and with stores and one sum; --small 1: 1 to 8 tokens (up to `triton_moe.SMALL_ROWS` rows with
the shared experts: one page alone) over narrow tiles. Each kernel of decoder/triton_moe.py is timed over its grid of
tiles, ten launches in one CUDA graph (GPU time, no Python launch cost), checked against the
grouped-matmul reference. The pick: the tile with the least time summed over the mode's batches
(decode: 1 to 256 tokens), each kernel apart. Then the whole experts forward (sort, kernels)
with those tiles against the grouped-matmul path, at every batch (the tiles set on the imported
module for this process only). Prints the picked tiles as the two lines of decoder/triton_moe.py
a maintainer would copy them into (GATE_UP_TILE / DOWN_TILE; PREFILL_ or SMALL_ ones with
--prefill 1 or --small 1); this script never edits source. Writes
bench/results/tune-moe-kernel.json (tune-moe-kernel-prefill.json, tune-moe-kernel-small.json;
`--out DIR` or `--out FILE.json` to change).
"""
from __future__ import annotations

import datetime
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.common import graph_replay_ms, options, rel_err, write_tuning  # noqa: E402
from decoder.config import DecoderArgs  # noqa: E402
from decoder.model import Experts  # noqa: E402
from decoder import triton_moe  # noqa: E402
from decoder.triton_moe import Tile, down_combine, gate_up_silu  # noqa: E402

DECODE = {
    "tokens": (1, 16, 64, 128, 256, 384, 512, 682),
    "picked_over": (1, 16, 64, 128, 256),  # the decode batches the tiles are chosen for
    "gate_up": [Tile(*t) for t in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4))],
    "attributes": ("GATE_UP_TILE", "DOWN_TILE"),
}
DECODE["down"] = DECODE["gate_up"]
PREFILL = {
    "tokens": (1024, 4096, 16384),
    "picked_over": (1024, 4096, 16384),
    "gate_up": [Tile(*t) for t in itertools.product((64, 128), (64, 128), (32, 64), (4, 8), (3, 4))],
    "down": [Tile(m, n, k, w, s, atomic) for atomic in (True, False)
             for m, n, k, w, s in itertools.product((64, 128), (64, 128, 256), (64,), (4, 8), (3, 4))],
    "attributes": ("PREFILL_GATE_UP_TILE", "PREFILL_DOWN_TILE"),
}
# Up to triton_moe.SMALL_ROWS rows: one page alone decodes one token. Narrow column blocks and
# fewer warps put more programs on the SMs; an expert holds a few rows here, so one row block
# (16) does (36 tiles: each is a compile, and the grid must fit one device call).
SMALL = {
    "tokens": (1, 2, 4, 8),
    "picked_over": (1, 2, 4, 8),
    "gate_up": [Tile(*t) for t in itertools.product((16,), (16, 32, 64), (64, 128, 256), (2, 4), (2, 4))],
    "attributes": ("SMALL_GATE_UP_TILE", "SMALL_DOWN_TILE"),
}
SMALL["down"] = SMALL["gate_up"]
LAUNCHES = 10  # per graph: one replay's fixed cost spread thin
COPY_INTO = "decoder/triton_moe.py"  # the file whose tile constants a maintainer sets from the pick


def per_launch_us(fn) -> float:
    def ten():
        for _ in range(LAUNCHES):
            fn()
    return graph_replay_ms(ten, 20) * 1e3 / LAUNCHES


def tile_source(name: str, tile: Tile) -> str:
    """`NAME = Tile(...)` as decoder/triton_moe.py spells it, ready to paste over its line there."""
    fields = ", ".join(map(str, tile[:5])) + ("" if tile.atomic_add else ", atomic_add=False")
    return f"{name} = Tile({fields})"


def main(argv=None):
    opts = options(argv, prefill=0, small=0)
    mode = PREFILL if opts.prefill else SMALL if opts.small else DECODE
    args = DecoderArgs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = Experts(args).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.02)
    weight_gb = sum(p.numel() * p.element_size() for p in experts.parameters()) / 1e9
    rows, totals = {}, {"gate_up": {}, "down": {}}
    for tokens in mode["tokens"]:
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, args.n_experts, device="cuda", generator=gen)
        weights, ids = logits.softmax(-1).topk(args.top_k, dim=-1)
        order, ends = experts.sort_rows(ids)
        with torch.inference_mode():
            experts.kernel = "grouped_mm"
            reference = experts(x, weights, ids)
            act = gate_up_silu(x, order, ends, experts.gate_up_proj, args.top_k)
            kernels = {
                "gate_up": lambda tile: gate_up_silu(x, order, ends, experts.gate_up_proj, args.top_k, tile),
                "down": lambda tile: down_combine(act, order, ends, weights.flatten(), experts.down_proj,
                                                  tokens, args.top_k, tile)}
            trials = {}
            for name, launch in kernels.items():
                trials[name] = []
                for tile in mode[name]:
                    try:
                        out = (down_combine(launch(tile), order, ends, weights.flatten(), experts.down_proj,
                                            tokens, args.top_k) if name == "gate_up" else launch(tile))
                        err = rel_err(out.to(reference.dtype), reference)
                        us = per_launch_us(lambda: launch(tile))  # noqa: B023 - timed at once
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
                        trials[name].append({**tile._asdict(), "error": repr(e)[:200]})
                        continue
                    trials[name].append({**tile._asdict(), "us": us, "rel_err": err})
                    if err < 1e-2 and tokens in mode["picked_over"]:
                        totals[name].setdefault(tile, {})[tokens] = us
            best = {name: min((t for t in ts if "us" in t and t["rel_err"] < 1e-2), key=lambda t: t["us"])
                    for name, ts in trials.items()}
            rows[str(tokens)] = {"best": best, "trials": trials}
        print(f"{tokens} tokens: " + "; ".join(
            f"{name} best {b['us']:.1f} us {Tile(**{k: b[k] for k in Tile._fields})}" for name, b in best.items()),
            flush=True)
    chosen = {}
    for name, by_tile in totals.items():
        complete = {tile: sum(t.values()) for tile, t in by_tile.items() if len(t) == len(mode["picked_over"])}
        chosen[name] = min(complete, key=complete.get)
    names = mode["attributes"]
    print(f"picked: {names[0]} = {chosen['gate_up']}, {names[1]} = {chosen['down']} "
          f"(were {getattr(triton_moe, names[0])}, {getattr(triton_moe, names[1])})")
    copy_into = f"{COPY_INTO}: {names[0]}, {names[1]}"
    source = "\n".join([tile_source(names[0], chosen["gate_up"]), tile_source(names[1], chosen["down"])])
    print(f"to adopt them, copy into {copy_into}:\n{source}", flush=True)
    # The whole experts forward, as Experts.forward runs it, with the chosen tiles.
    setattr(triton_moe, names[0], chosen["gate_up"])
    setattr(triton_moe, names[1], chosen["down"])
    forward = {}
    for tokens in mode["tokens"]:
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        weights, ids = torch.randn(tokens, args.n_experts, device="cuda", generator=gen).softmax(-1).topk(args.top_k)
        times = {}
        with torch.inference_mode():
            for kernel in ("grouped_mm", "triton"):
                experts.kernel = kernel
                times[kernel] = per_launch_us(lambda: experts(x, weights, ids))  # noqa: B023
        forward[str(tokens)] = {"grouped_mm_us": times["grouped_mm"], "triton_us": times["triton"],
                                "speedup": times["grouped_mm"] / times["triton"],
                                # as if every expert's weights were read (they are from ~64 tokens on)
                                "all_weights_tb_per_s_triton": weight_gb * 1e3 / times["triton"],
                                "tflop_per_s_triton": 6 * tokens * args.top_k * args.hidden
                                * args.moe_intermediate / times["triton"] / 1e6}
        print(f"experts forward, {tokens} tokens: grouped_mm {times['grouped_mm']:.1f} us, "
              f"triton {times['triton']:.1f} us ({forward[str(tokens)]['speedup']:.2f}x)", flush=True)
    summary = {"gate_up_tile": chosen["gate_up"]._asdict(), "down_tile": chosen["down"]._asdict(),
               **{f"gate_up_us_{t}": totals["gate_up"][chosen["gate_up"]][t] for t in mode["picked_over"]},
               **{f"down_us_{t}": totals["down"][chosen["down"]][t] for t in mode["picked_over"]},
               **{f"forward_speedup_{t}": forward[str(t)]["speedup"] for t in mode["tokens"]}}
    kind = "prefill" if opts.prefill else "small" if opts.small else "decode"
    write_tuning(opts.out, "moe-kernel" if kind == "decode" else f"moe-kernel-{kind}",
                 {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "experts_weight_gb": weight_gb, "mode": kind,
                  "copy_into": copy_into, "source": source,
                  "note": "each kernel's grid ran beside the module's tile of the other; the "
                          "forward comparison runs the chosen tiles",
                  "summary": summary, "forward": forward, "tokens": rows})


if __name__ == "__main__":
    main()
