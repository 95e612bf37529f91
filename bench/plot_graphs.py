"""Plot batch-1 latency per image size, eager vs CUDA graphs, from a graphs-<date>.json.

    python bench/plot_graphs.py bench/results/graphs-pinned-views-2026-12-04.json   # -> ...-latency.png
"""
from __future__ import annotations

import argparse
import json


def main(path: str) -> str:
    import matplotlib  # the bench extra (pyproject's `bench`), imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(path))
    rows = result["latency_b1"]
    names = list(rows)
    series = [("dense-bias eager (DeepSeek's attention)", "dense_eager_ms", "#bbbbbb"),
              ("fused eager", "eager_ms", "#6699cc"), ("fused + CUDA graphs", "graphs_ms", "#cc6633")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for k, (label, key, color) in enumerate(series):
        xs = [i + (k - 1) * width for i in range(len(names))]
        bars = ax.bar(xs, [rows[n][key] for n in names], width, label=label, color=color)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(names)),
                  [f"{n}\n{rows[n]['grid'][0]}x{rows[n]['grid'][1]} tiles, {rows[n]['tokens']} tok"
                   for n in names], fontsize=8)
    ax.set_ylabel("ms per image (batch 1, wall clock)")
    ax.set_title(f"Vision encoder latency, {result['device']}, bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.replace(".json", "-latency.png")
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a graphs-<date>.json that bench/graph_bench.py wrote")
    print(main(parser.parse_args().path))
