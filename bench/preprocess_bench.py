"""CPU time of the router's preprocessing per page: decoding only (the encoders make the views,
views_on_encoder), or the views made with PIL, grey pages resized as one channel or three.

    python bench/preprocess_bench.py [--out bench/results] [--reps 20]

Runs on any machine (no GPU). Pages as the router receives them (encoded bytes): the e2e
bench's A4 text page (1191x1684, an "L" PNG), the same page saved as RGB, and a colour page of
the same size (where the grey check must decline). `preprocess(page, grey=...)` end to end
(decode, EXIF, global view, 2x3 crops), and `decode(page)` (what a router does when the
encoders make the views), the median of `reps` runs each, the variants interleaved. Writes
preprocess-<date>.json with a top-level `summary`.
"""
from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import statistics
import sys
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import RESULTS, write_result  # noqa: E402
from bench.e2e_bench import page_png  # noqa: E402
from encoder.preprocess import decode, preprocess  # noqa: E402


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def colour_page(size=(1191, 1684)) -> bytes:
    """Smooth colour gradients with a grey text page on top (a colour scan, say)."""
    w, h = size
    x, y = np.meshgrid(np.linspace(0, 1, w), np.linspace(0, 1, h))
    rgb = np.stack([200 + 55 * x, 180 + 75 * y, 230 - 50 * x * y], -1).astype(np.uint8)
    text = np.asarray(Image.open(io.BytesIO(page_png(11))).convert("L"))
    return png(Image.fromarray(np.minimum(rgb, text[..., None])))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--reps", type=int, default=20)
    opts = parser.parse_args(argv)
    text = page_png(3)
    pages = {"grey_L_png": text, "grey_rgb_png": png(Image.open(io.BytesIO(text)).convert("RGB")),
             "colour_png": colour_page()}
    rows = {}
    for name, data in pages.items():
        variants = {"one_channel": lambda: preprocess(data), "three_channels":
                    lambda: preprocess(data, grey=False), "decode_only": lambda: decode(data)}
        times = {key: [] for key in variants}
        for fn in variants.values():
            fn()  # warm-up (thread pool, caches)
        for _ in range(opts.reps):
            for key, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[key].append((time.perf_counter() - start) * 1e3)
        row = {f"{key}_ms": statistics.median(t) for key, t in times.items()}
        row["speedup"] = row["three_channels_ms"] / row["one_channel_ms"]
        row["decode_only_speedup"] = row["one_channel_ms"] / row["decode_only_ms"]
        rows[name] = row
        print(f"{name}: {row['one_channel_ms']:.1f} ms one channel, {row['three_channels_ms']:.1f} ms "
              f"three ({row['speedup']:.2f}x); decode only {row['decode_only_ms']:.1f} ms", flush=True)
    write_result(opts.out, "preprocess", {
        "benchmark": "router preprocessing per page (CPU)", "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "reps": opts.reps, "pages": "1191x1684: text page (L), the same as RGB, a colour page",
        "summary": {f"{name}_speedup": row["speedup"] for name, row in rows.items()}
        | {f"{name}_ms": row["one_channel_ms"] for name, row in rows.items()}
        | {f"{name}_decode_only_ms": row["decode_only_ms"] for name, row in rows.items()},
        "rows": rows})


if __name__ == "__main__":
    main()
