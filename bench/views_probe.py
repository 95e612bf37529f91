"""How much GPU time a page's views take, apart from the copy of its pixels to the GPU.

    python bench/views_probe.py   # needs a CUDA GPU; prints, writes nothing

For the e2e bench's text page ("L" PNG, 2x3 crops) and a colour page: `views_of` from pixels
already on the GPU, wall clock with a sync (launches included), and the sum of its kernels'
GPU times (torch.profiler), with their count; each resize pass in torch's ops (the twin) and
as one Triton kernel (`triton_resize.py`), and whether the two made the same views. Under load
the encoders make views on a stream of their own, beside the batches: the kernels' GPU time is
what they take from the encoding.
"""
from __future__ import annotations

import dataclasses
import io
import os
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import wall_ms  # noqa: E402
from bench.e2e_bench import page_png  # noqa: E402
from encoder import decode, resize, views_of  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def colour_page() -> bytes:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (1684 // 8, 1191 // 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).resize((1191, 1684), Image.BILINEAR).save(buffer, "PNG")
    return buffer.getvalue()


def main():
    from torch.profiler import ProfilerActivity, profile
    for name, page in (("text_page_L", page_png(0)), ("colour_page_RGB", colour_page())):
        decoded = decode(page)
        on_gpu = dataclasses.replace(decoded, pixels=decoded.pixels.to(DEVICE))
        made = {}
        for fused in (False, True):  # torch's ops per pass (the twin), then one kernel per pass
            resize.FUSED_PASS = fused
            made[fused] = views_of(on_gpu)
            wall = wall_ms(lambda: views_of(on_gpu), 50, 5)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    views_of(on_gpu)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            gpu_ms = sum(e.device_time for e in kernels) / 1e3 / 10
            print(f"{name} {'fused pass' if fused else 'torch ops '}: pixels {tuple(decoded.pixels.shape)}, "
                  f"views from GPU pixels {wall:.3f} ms wall, kernels {gpu_ms:.3f} ms GPU "
                  f"({len(kernels) // 10} a page)", flush=True)
        same = all(torch.equal(getattr(made[True], v), getattr(made[False], v)) for v in ("global_view", "crops"))
        print(f"{name}: identical views {same}", flush=True)


if __name__ == "__main__":
    main()
