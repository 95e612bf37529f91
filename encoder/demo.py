"""Encode images and print what the decoder would receive.

    python -m encoder.demo [IMAGE ...] [--checkpoint DIR] [--mode gundam] [--max-crops 6]

Without --checkpoint it runs the TINY RANDOMLY INITIALISED encoder on CPU: token counts and
layout are real, the feature values are meaningless. Without images it makes three test
pictures (an untiled photo, an A4 page at 144 dpi, a 1x6 strip).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from PIL import Image, ImageDraw

from . import EncoderArgs, load_encoder, preprocess, write_random_checkpoint


def sample_images() -> dict[str, Image.Image]:
    page = Image.new("RGB", (1191, 1684), "white")
    draw = ImageDraw.Draw(page)
    for y in range(120, 1600, 48):  # lines of "text"
        draw.rectangle((100, y, 1091 - (y * 7) % 300, y + 18), fill=(20, 20, 20))
    return {"photo-448x448": Image.new("RGB", (448, 448), (40, 120, 200)),
            "page-1191x1684": page,
            "strip-640x3840": Image.new("RGB", (640, 3840), (230, 230, 200))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="*")
    parser.add_argument("--checkpoint")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--max-crops", type=int, default=6)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            print("NOTE: no --checkpoint: using a TINY RANDOMLY INITIALISED encoder "
                  "(real token layout, meaningless features)")
            path = write_random_checkpoint(tmp, EncoderArgs.tiny(), dtype=torch.float32)
        encoder = load_encoder(path, device=args.device, dtype=dtype)
    images = {p: p for p in args.images} or sample_images()
    print(f"encoder {encoder.args.name} on {args.device} ({dtype}), mode {args.mode}")
    for name, image in images.items():
        item = preprocess(image, mode=args.mode, max_crops=args.max_crops)
        start = time.perf_counter()
        (seq,) = encoder.encode_images([image], mode=args.mode, max_crops=args.max_crops)
        ms = (time.perf_counter() - start) * 1e3
        print(f"{name}: {item.original_size[0]}x{item.original_size[1]} -> grid {item.grid}, "
              f"{len(item.crops)} crops, {item.num_tokens} tokens -> {tuple(seq.shape)} "
              f"in {ms:.0f} ms")


if __name__ == "__main__":
    main()
