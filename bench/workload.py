"""A realistic OCR workload for the benchmarks: pages of six kinds, in A4, Letter, slide and odd
sizes, as PNG and JPEG, each asking for its own output length (`max_tokens`).

    items = make_workload(200, seed=0)   # the same pages, byte for byte, for the same seed
    describe(items)                      # the mix, for a result's JSON

The mix (shares of the pages, exact up to rounding; sizes in pixels, pages at about 150 dpi):

| kind | share | what | sizes | formats |
|---|---|---|---|---|
| grey_text | 30% | black text, headings and tables on white, one grey channel (the encoder's grey fast path) | A4 1240x1754 55%, Letter 1275x1650 30%, odd 15% | PNG 75%, JPEG 25% |
| colour_scan | 20% | the same on tinted paper, coloured headings, a stamp, scanner noise | as grey_text | JPEG 65%, PNG 35% |
| photo | 15% | a page photographed: skewed in perspective on a table, uneven light; a quarter stored rotated with an EXIF orientation, as phones do | 1080x1440 to 1536x2048, a fifth landscape | JPEG |
| slide | 15% | 16:9, a title bar, bullets and a chart, diagram or photo block, in colour | 1280x720 to 1920x1080 | PNG 65%, JPEG 35% |
| receipt | 10% | a narrow till receipt: items, prices, a barcode | 384-640 wide, 900-2600 tall | JPEG 55%, PNG 45% |
| strip | 10% | very wide and short: a line or two of text, or a table's header row | 1600-3200 x 96-360; a quarter a line cut out, 400-640 x 48-120 | PNG 70%, JPEG 30% |

Output lengths: `max_tokens` from a two-piece log-normal with median 700 tokens, 5% below 150 and
5% above 2,500 (log-space sigma ln(700/150)/1.645 below the median and ln(2500/700)/1.645 above),
clipped to 32-4,096 (about 1% of pages at 4,096), independent of the page's kind. A model with
random weights never stops early, so `max_tokens` is the length it generates.

The kinds are dealt by their shares and shuffled with `random.Random(seed)`, the lengths drawn
from `numpy.random.default_rng(seed)`; each page is drawn from a generator of its own, seeded
with (seed, index), so pages can be rendered in any order or on several processes and every
page differs from every other (an encoder cache never hits).
"""
from __future__ import annotations

import io
import math
import random
import statistics
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFont

from encoder.tiling import DEEPSEEK_OCR, DEFAULT_MAX_CROPS

KIND_SHARES = {"grey_text": 0.30, "colour_scan": 0.20, "photo": 0.15, "slide": 0.15,
               "receipt": 0.10, "strip": 0.10}
PNG_SHARE = {"grey_text": 0.75, "colour_scan": 0.35, "photo": 0.0, "slide": 0.65,
             "receipt": 0.45, "strip": 0.70}
A4, LETTER = (1240, 1754), (1275, 1650)
PHOTO_SIZES = [(1080, 1440), (1200, 1600), (1512, 2016), (1536, 2048)]
SLIDE_SIZES = [(1280, 720), (1366, 768), (1600, 900), (1920, 1080)]
# The stated length distribution: median, 5% and 95% quantiles, clip range.
LENGTH_MEDIAN, LENGTH_P5, LENGTH_P95 = 700, 150, 2500
LENGTH_CLIP = (32, 4096)
_Z95 = 1.6448536269514722  # the standard normal's 95% quantile


@dataclass(frozen=True)
class PageSpec:
    """What to draw: everything about a page but its pixels."""
    index: int
    seed: int  # the workload's
    kind: str
    size: tuple[int, int]  # width, height as displayed
    size_class: str  # a4, letter, odd, photo, 16:9, receipt, strip
    format: str  # png, jpeg
    max_tokens: int


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload: the image's bytes and what they are."""
    image: bytes = field(repr=False)
    kind: str
    size: tuple[int, int]  # width, height as displayed (EXIF orientation applied)
    size_class: str
    format: str
    max_tokens: int

    @property
    def image_tokens(self) -> int:
        """The page's image tokens in the app's default mode (gundam, up to 6 crops)."""
        return image_tokens(self.size)


def image_tokens(size: tuple[int, int]) -> int:
    """DeepSeek-OCR's image tokens for an image of this size in the default mode (273-933)."""
    view_mode = DEEPSEEK_OCR.check("gundam", DEFAULT_MAX_CROPS)
    return DEEPSEEK_OCR.grid_and_tokens(*size, view_mode, DEFAULT_MAX_CROPS)[1]


def draw_lengths(n: int, seed: int) -> list[int]:
    """n output lengths (`max_tokens`) from the stated distribution."""
    z = np.random.default_rng(seed).standard_normal(n)
    sigma = np.where(z < 0, math.log(LENGTH_MEDIAN / LENGTH_P5), math.log(LENGTH_P95 / LENGTH_MEDIAN)) / _Z95
    lengths = np.clip(np.round(LENGTH_MEDIAN * np.exp(sigma * z)), *LENGTH_CLIP)
    return [int(t) for t in lengths]


def draw_specs(n: int, seed: int) -> list[PageSpec]:
    """The mix without pixels: each page's kind (dealt by KIND_SHARES), size, format and length."""
    quotas = {kind: n * share for kind, share in KIND_SHARES.items()}
    counts = {kind: int(q) for kind, q in quotas.items()}
    by_remainder = sorted(quotas, key=lambda kind: quotas[kind] - counts[kind], reverse=True)
    for kind in by_remainder[:n - sum(counts.values())]:  # largest remainders round up
        counts[kind] += 1
    kinds = [kind for kind, count in counts.items() for _ in range(count)]
    random.Random(seed).shuffle(kinds)
    specs = []
    for index, (kind, length) in enumerate(zip(kinds, draw_lengths(n, seed))):
        rng = random.Random(f"{seed}:{index}")  # str seeds hash with SHA-512: stable
        size, size_class = SIZES[kind](rng)
        fmt = "png" if rng.random() < PNG_SHARE[kind] else "jpeg"
        specs.append(PageSpec(index, seed, kind, size, size_class, fmt, length))
    return specs


def make_workload(n: int, seed: int, workers: int = 1) -> list[WorkItem]:
    """n pages of the mix, rendered (on `workers` processes; the same bytes however many)."""
    specs = draw_specs(n, seed)
    if workers <= 1:
        return [render(spec) for spec in specs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(render, specs, chunksize=8))


def smoke_lengths(items: list[WorkItem], divide: int = 100) -> list[WorkItem]:
    """The benches' CPU smoke runs (the tiny model on 2 cores): a hundredth of each page's
    tokens (`divide`: another share)."""
    return [replace(item, max_tokens=max(2, item.max_tokens // divide)) for item in items]


def uniform_workload(n: int, seed: int, max_tokens: int = 700) -> list[WorkItem]:
    """The benchmarks' former workload, for comparison: n grey text pages, 1191x1684 PNG, each
    with different random words, all of one length."""
    return [WorkItem(uniform_page(seed * 1_000_003 + i), "grey_text", (1191, 1684), "a4", "png", max_tokens)
            for i in range(n)]


def uniform_page(seed: int | str, size=(1191, 1684)) -> bytes:
    """A white page of text-like lines (random words, PIL's small bitmap font), as PNG."""
    rng = random.Random(seed)
    page = Image.new("L", size, 255)
    draw = ImageDraw.Draw(page)
    for y in range(80, size[1] - 80, 28):
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                         for _ in range(rng.randint(6, 14)))
        draw.text((70, y), words, fill=0)
    buffer = io.BytesIO()
    page.save(buffer, "PNG")
    return buffer.getvalue()


def describe(items: list[WorkItem] | list[PageSpec]) -> dict:
    """The mix in numbers: pages per kind, format and size class; max_tokens' and image tokens'
    quantiles; image bytes (of rendered items)."""
    def quantiles(values):
        ordered = sorted(values)
        at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return {"min": ordered[0], "p5": at(0.05), "p50": statistics.median(ordered), "p95": at(0.95),
                "max": ordered[-1], "mean": statistics.fmean(ordered)}
    described = {"pages": len(items),
                 "kinds": dict(Counter(item.kind for item in items)),
                 "formats": dict(Counter(item.format for item in items)),
                 "size_classes": dict(Counter(item.size_class for item in items)),
                 "max_tokens": quantiles([item.max_tokens for item in items]),
                 "generated_tokens_total": sum(item.max_tokens for item in items),
                 "image_tokens": quantiles([image_tokens(item.size) for item in items]),
                 "length_distribution": f"two-piece log-normal: median {LENGTH_MEDIAN}, 5% {LENGTH_P5}, "
                                        f"95% {LENGTH_P95}, clipped to {LENGTH_CLIP[0]}-{LENGTH_CLIP[1]}"}
    if all(isinstance(item, WorkItem) for item in items):
        described["image_bytes"] = quantiles([len(item.image) for item in items])
    return described


# --- sizes: (width, height), size class ----------------------------------------------------------
def page_size(rng: random.Random) -> tuple[tuple[int, int], str]:
    draw = rng.random()
    if draw < 0.55:
        return A4, "a4"
    if draw < 0.85:
        return LETTER, "letter"
    width = rng.randint(850, 2000)
    return (width, round(width * rng.uniform(1.15, 1.55))), "odd"


def photo_size(rng: random.Random) -> tuple[tuple[int, int], str]:
    size = rng.choice(PHOTO_SIZES)
    return (size[::-1] if rng.random() < 0.2 else size), "photo"


def slide_size(rng: random.Random) -> tuple[tuple[int, int], str]:
    return rng.choice(SLIDE_SIZES), "16:9"


def receipt_size(rng: random.Random) -> tuple[tuple[int, int], str]:
    return (rng.choice((384, 512, 576, 640)), rng.randint(900, 2600)), "receipt"


def strip_size(rng: random.Random) -> tuple[tuple[int, int], str]:
    # Most span a page or a screen; a quarter are a line cut from one (small: untiled, 273 tokens).
    if rng.random() < 0.25:
        return (rng.randint(400, 640), rng.randint(48, 120)), "strip"
    return (rng.randint(1600, 3200), rng.randint(96, 360)), "strip"


SIZES = {"grey_text": page_size, "colour_scan": page_size, "photo": photo_size, "slide": slide_size,
         "receipt": receipt_size, "strip": strip_size}


# --- rendering -----------------------------------------------------------------------------------
def render(spec: PageSpec) -> WorkItem:
    """The page `spec` describes, encoded."""
    rng = random.Random(f"{spec.seed}:{spec.index}:pixels")
    noise = np.random.default_rng(rng.getrandbits(64))
    image = RENDERERS[spec.kind](rng, noise, spec.size)
    orientation = 6 if spec.kind == "photo" and rng.random() < 0.25 else 1
    return WorkItem(encode(image, spec.format, rng, orientation), spec.kind, spec.size, spec.size_class,
                    spec.format, spec.max_tokens)


def encode(image: Image.Image, fmt: str, rng: random.Random, orientation: int = 1) -> bytes:
    """PNG, or JPEG at quality 75-92; orientation 6: stored turned a quarter, EXIF saying so."""
    buffer = io.BytesIO()
    if fmt == "png":
        image.save(buffer, "PNG")
    else:
        exif = Image.Exif()
        if orientation == 6:  # a viewer turns it 90 degrees clockwise back
            image = image.transpose(Image.Transpose.ROTATE_90)
            exif[0x0112] = 6
        image.save(buffer, "JPEG", quality=rng.randint(75, 92), exif=exif)
    return buffer.getvalue()


@cache
def font(px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=px)


def words(rng: random.Random, n: int) -> str:
    """n text-like words: lower case, some capitalised, numbers and punctuation now and then."""
    out = []
    for _ in range(n):
        word = "".join(rng.choice("etaoinshrdlcumwfgypbvkjxqz"[:rng.choice((12, 20, 26))])
                       for _ in range(rng.randint(1, 10)))
        draw = rng.random()
        if draw < 0.08:
            word = word.capitalize()
        elif draw < 0.12:
            word = str(rng.randint(0, 9999))
        out.append(word + (rng.choice(".,;:") if rng.random() < 0.08 else ""))
    return " ".join(out)


def text_block(draw, rng, left: int, top: int, right: int, bottom: int, px: int, ink,
               heading_ink=None) -> None:
    """A document's body between the margins: headings, paragraphs and now and then a table."""
    body, heading = font(px), font(round(px * rng.uniform(1.3, 1.8)))
    per_line = max(4, int((right - left) / (0.52 * px)))
    line = round(px * rng.uniform(1.3, 1.6))
    y = top
    while y < bottom - line:
        draw_kind = rng.random()
        if draw_kind < 0.15:  # a heading
            draw.text((left, y), words(rng, rng.randint(2, 6)).title(), fill=heading_ink or ink, font=heading)
            y += round(heading.size * 1.8)
        elif draw_kind < 0.25:  # a table: ruled cells of short entries
            rows, cols = rng.randint(3, 8), rng.randint(2, 6)
            height = min(rows * line, bottom - y)
            cell_w = (right - left) // cols
            for r in range(rows + 1):
                if r * line <= height:
                    draw.line([(left, y + r * line), (left + cols * cell_w, y + r * line)], fill=ink, width=1)
            for c in range(cols + 1):
                draw.line([(left + c * cell_w, y), (left + c * cell_w, y + min(rows * line, height))], fill=ink, width=1)
            for r in range(rows):
                for c in range(cols):
                    if (r + 1) * line <= height:
                        draw.text((left + c * cell_w + 6, y + r * line + 3),
                                  words(rng, rng.randint(1, 2))[:int(cell_w / (0.55 * px))], fill=ink, font=body)
            y += height + line
        else:  # a paragraph, its last line short
            lines = rng.randint(2, 9)
            for k in range(lines):
                if y >= bottom - line:
                    break
                text = words(rng, per_line // 5)[:per_line]
                draw.text((left, y), text[:rng.randint(per_line // 4, per_line)] if k == lines - 1 else text,
                          fill=ink, font=body)
                y += line
            y += line // 2


def document(rng: random.Random, size, mode: str, paper, ink, heading_ink=None) -> Image.Image:
    page = Image.new(mode, size, paper)
    draw = ImageDraw.Draw(page)
    margin = round(size[0] * rng.uniform(0.05, 0.09))
    px = max(10, round(size[0] / 1240 * rng.choice((19, 21, 23, 25))))
    text_block(draw, rng, margin, margin, size[0] - margin, size[1] - margin - 2 * px, px, ink, heading_ink)
    draw.text((size[0] // 2, size[1] - margin), str(rng.randint(1, 300)), fill=ink, font=font(px), anchor="mm")
    return page


def grey_text(rng, noise, size):
    return document(rng, size, "L", rng.randint(246, 255), rng.randint(0, 40))


def add_noise(image: Image.Image, noise: np.random.Generator, amplitude: int) -> Image.Image:
    """Scanner noise: the same random offset, -amplitude..amplitude, on every channel of a pixel."""
    grain = noise.integers(0, 2 * amplitude + 1, size=(image.height, image.width), dtype=np.uint8)
    return ImageChops.add(image, Image.fromarray(grain, "L").convert(image.mode), 1.0, -amplitude)


def colour_scan(rng, noise, size):
    paper = tuple(rng.randint(lo, 255) for lo in (232, 222, 195))
    heading = rng.choice([(20, 50, 140), (150, 20, 30), (20, 110, 60), (120, 40, 130)])
    page = document(rng, size, "RGB", paper, (rng.randint(10, 60),) * 3, heading)
    stamp(page, rng)
    return add_noise(page, noise, rng.randint(3, 8))


def stamp(page: Image.Image, rng: random.Random) -> None:
    """A round office stamp in red or blue, slightly turned, pressed on part of the page."""
    side = round(page.width * rng.uniform(0.15, 0.25))
    ink = rng.choice([(190, 30, 40, 200), (30, 60, 170, 200)])
    mark = Image.new("RGBA", (side, side), (0, 0, 0, 0))
    draw = ImageDraw.Draw(mark)
    draw.ellipse([4, 4, side - 5, side - 5], outline=ink, width=max(3, side // 40))
    draw.ellipse([side // 6, side // 6, side - side // 6, side - side // 6], outline=ink, width=2)
    draw.text((side // 2, side // 2), words(rng, 1)[:8].upper(), fill=ink, font=font(max(10, side // 7)), anchor="mm")
    mark = mark.rotate(rng.uniform(-25, 25), resample=Image.Resampling.BILINEAR)
    page.paste(mark, (rng.randint(0, page.width - side), rng.randint(page.height // 2, page.height - side)), mark)


def perspective_coefficients(page_corners, photo_corners) -> list[float]:
    """PIL's PERSPECTIVE data mapping each photo corner back to its page corner."""
    rows, rhs = [], []
    for (x, y), (u, v) in zip(photo_corners, page_corners):
        rows += [[x, y, 1, 0, 0, 0, -u * x, -u * y], [0, 0, 0, x, y, 1, -v * x, -v * y]]
        rhs += [u, v]
    return np.linalg.solve(np.array(rows, float), np.array(rhs, float)).tolist()


def photo(rng, noise, size):
    inner = (round(size[0] * 0.8), round(size[0] * 0.8 * 1.414))
    if rng.random() < 0.5:
        page = document(rng, inner, "RGB", (250, 250, 248), (20, 20, 20))
    else:
        page = document(rng, inner, "RGB", (245, 238, 222), (30, 30, 40), (20, 50, 140))
    # The page's corners land in the frame, each pushed in at random: perspective and a turn.
    w, h = size
    scale = min(w / inner[0], h / inner[1]) * rng.uniform(0.8, 0.95)
    x0, y0 = (w - inner[0] * scale) / 2, (h - inner[1] * scale) / 2
    x1, y1 = x0 + inner[0] * scale, y0 + inner[1] * scale
    jitter = lambda: rng.uniform(-0.06, 0.06) * w  # noqa: E731
    corners = [(x0 + jitter(), y0 + jitter()), (x1 + jitter(), y0 + jitter()),
               (x1 + jitter(), y1 + jitter()), (x0 + jitter(), y1 + jitter())]
    table = tuple(rng.randint(lo, hi) for lo, hi in ((60, 140), (45, 110), (30, 80)))
    shot = page.transform(size, Image.Transform.PERSPECTIVE,
                          perspective_coefficients([(0, 0), (inner[0], 0), inner, (0, inner[1])], corners),
                          Image.Resampling.BILINEAR, fillcolor=table)
    # Uneven light: a smooth random field from a few bright and dark spots, warm or cool.
    spots = Image.fromarray(noise.integers(150, 256, size=(3, 3), dtype=np.uint8), "L").resize(
        size, Image.Resampling.BICUBIC)
    tint = rng.choice([(255, 240, 215), (235, 242, 255), (255, 255, 255)])
    light = Image.merge("RGB", [spots.point(lambda v, t=t: v * t // 255) for t in tint])
    return add_noise(ImageChops.multiply(shot, light), noise, 4)


def slide(rng, noise, size):
    w, h = size
    dark = rng.random() < 0.25
    background = (rng.randint(10, 40), rng.randint(20, 50), rng.randint(50, 90)) if dark else \
        tuple(rng.randint(235, 255) for _ in range(3))
    ink = (235, 235, 235) if dark else (30, 30, 30)
    accent = rng.choice([(0, 90, 170), (200, 60, 30), (30, 140, 90), (120, 60, 160), (230, 160, 0)])
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    bar = round(h * 0.16)
    draw.rectangle([0, 0, w, bar], fill=accent)
    draw.text((round(w * 0.04), bar // 2), words(rng, rng.randint(3, 7)).title(), fill=(255, 255, 255),
              font=font(round(bar * 0.42)), anchor="lm")
    px = round(h * rng.uniform(0.032, 0.045))
    y = bar + round(h * 0.06)
    for _ in range(rng.randint(3, 6)):  # bullets on the left
        draw.ellipse([round(w * 0.04), y + px // 3, round(w * 0.04) + px // 2, y + px // 3 + px // 2], fill=accent)
        draw.text((round(w * 0.07), y), words(rng, rng.randint(3, 8))[:int(0.4 * w / (0.55 * px))], fill=ink, font=font(px))
        y += round(px * 2.0)
    figure(draw, image, rng, noise, (round(w * 0.52), bar + round(h * 0.08), round(w * 0.95), round(h * 0.88)),
           accent, ink)
    draw.text((w - round(w * 0.03), h - round(h * 0.04)), str(rng.randint(1, 60)), fill=ink, font=font(px), anchor="rm")
    return image


def figure(draw, image, rng, noise, box, accent, ink) -> None:
    """A slide's figure in `box`: a bar, pie or line chart, a box diagram or a photo."""
    left, top, right, bottom = box
    palette = [accent, (90, 160, 220), (240, 140, 60), (120, 190, 100), (200, 90, 140), (150, 150, 150)]
    chart = rng.choice(["bars", "pie", "line", "diagram", "picture"])
    if chart == "bars":
        draw.line([(left, bottom), (right, bottom)], fill=ink, width=2)
        draw.line([(left, top), (left, bottom)], fill=ink, width=2)
        n = rng.randint(3, 9)
        width = (right - left) / (n * 1.5)
        for i in range(n):
            x = left + width * (0.5 + 1.5 * i)
            draw.rectangle([x, bottom - rng.uniform(0.1, 0.95) * (bottom - top), x + width, bottom - 1],
                           fill=palette[i % len(palette)])
    elif chart == "pie":
        side = min(right - left, bottom - top)
        start, shares = 0.0, [rng.random() + 0.2 for _ in range(rng.randint(3, 6))]
        for i, share in enumerate(shares):
            end = start + 360 * share / sum(shares)
            draw.pieslice([left, top, left + side, top + side], start, end, fill=palette[i % len(palette)])
            start = end
    elif chart == "line":
        draw.line([(left, bottom), (right, bottom)], fill=ink, width=2)
        for series in range(rng.randint(1, 3)):
            points = [(left + (right - left) * i / 9, bottom - rng.uniform(0.1, 0.9) * (bottom - top)) for i in range(10)]
            draw.line(points, fill=palette[series], width=4)
            for x, y in points:
                draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill=palette[series])
    elif chart == "diagram":
        boxes = []
        for i in range(rng.randint(3, 5)):
            x = left + rng.uniform(0, 0.6) * (right - left)
            y = top + i * (bottom - top) / 5
            boxes.append((x, y, x + 0.38 * (right - left), y + 0.13 * (bottom - top)))
            draw.rounded_rectangle(boxes[-1], radius=12, fill=palette[i % len(palette)])
            draw.text((x + 10, y + 8), words(rng, 2), fill=(255, 255, 255), font=font(max(10, round((bottom - top) / 22))))
        for a, b in zip(boxes, boxes[1:]):
            draw.line([((a[0] + a[2]) / 2, a[3]), ((b[0] + b[2]) / 2, b[1])], fill=ink, width=3)
    else:  # a photograph: a smooth random colour field
        picture = Image.fromarray(noise.integers(0, 256, size=(6, 8, 3), dtype=np.uint8), "RGB").resize(
            (right - left, bottom - top), Image.Resampling.BICUBIC)
        image.paste(picture, (left, top))


def receipt(rng, noise, size):
    width = size[0]
    grey = rng.random() < 0.5
    paper = rng.randint(225, 250) if grey else (rng.randint(238, 252), rng.randint(236, 250), rng.randint(225, 242))
    image = Image.new("L" if grey else "RGB", size, paper)
    draw = ImageDraw.Draw(image)
    px = round(width / rng.uniform(24, 30))
    body, ink = font(px), 30 if grey else (40, 40, 50)
    margin, line = round(width * 0.05), round(px * 1.35)
    y = margin
    draw.text((width // 2, y), words(rng, 2).upper(), fill=ink, font=font(round(px * 1.6)), anchor="mt")
    y += round(px * 2.6)
    for _ in range(rng.randint(2, 3)):
        draw.text((width // 2, y), words(rng, 4)[:30], fill=ink, font=body, anchor="mt")
        y += line
    draw.text((margin, y), "-" * 60, fill=ink, font=body)
    y += line
    while y < size[1] - 7 * line - width // 4:  # items: a name, a price on the right
        draw.text((margin, y), words(rng, rng.randint(1, 3))[:22].upper(), fill=ink, font=body)
        draw.text((width - margin, y), f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}", fill=ink, font=body, anchor="ra")
        y += line
    draw.text((margin, y), "-" * 60, fill=ink, font=body)
    draw.text((margin, y + line), "TOTAL", fill=ink, font=font(round(px * 1.3)))
    draw.text((width - margin, y + line), f"{rng.randint(10, 999)}.{rng.randint(0, 99):02d}", fill=ink,
              font=font(round(px * 1.3)), anchor="ra")
    x, bars_top = margin, size[1] - margin - width // 4
    while x < width - margin - 4:  # a barcode
        bar = rng.randint(1, 4) * 2
        if rng.random() < 0.55:
            draw.rectangle([x, bars_top, x + bar - 1, size[1] - margin], fill=ink)
        x += bar
    return image


def strip(rng, noise, size):
    w, h = size
    coloured = rng.random() < 0.4
    band = rng.choice([(225, 235, 250), (250, 235, 220), (230, 245, 230)]) if coloured else (255, 255, 255)
    image = Image.new("RGB" if coloured else "L", size, band if coloured else 255)
    draw = ImageDraw.Draw(image)
    ink = (20, 20, 30) if coloured else 0
    if rng.random() < 0.5:  # one to three lines of text
        lines = rng.randint(1, 3)
        px = max(10, round(h / (lines * 1.6)))
        for k in range(lines):
            draw.text((round(px * 0.8), round(h * (k + 0.5) / lines)), words(rng, int(w / (0.52 * px)) // 5),
                      fill=ink, font=font(px), anchor="lm")
    else:  # a table's header row: ruled cells
        cols = rng.randint(4, 12)
        px = max(10, round(h * 0.3))
        cell = w / cols
        draw.rectangle([0, 0, w - 1, h - 1], outline=ink, width=2)
        for c in range(cols):
            draw.line([(c * cell, 0), (c * cell, h)], fill=ink, width=2)
            draw.text((c * cell + cell / 2, h / 2), words(rng, 1)[:int(cell / (0.6 * px))].title(),
                      fill=ink, font=font(px), anchor="mm")
    return image


RENDERERS = {"grey_text": grey_text, "colour_scan": colour_scan, "photo": photo, "slide": slide,
             "receipt": receipt, "strip": strip}
