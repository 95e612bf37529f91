"""The tiling maths of the DeepSeek-OCR family: the view modes, the grid of crops an image is
cut into, and how many tokens an image's views hold, per family (`Tiling`: DEEPSEEK_OCR's 640x640
crops with newline tokens, DEEPSEEK_OCR_2's 768x768 crops without). No pixels here: this
reproduces the reference's HF ``dynamic_preprocess`` / ``find_closest_aspect_ratio`` and the view
modes of the vLLM / SGLang integrations, so that the grid and the token count are exactly the
model's."""

from __future__ import annotations

import math
from dataclasses import dataclass

CROP_SIZE = 640

# The vision encoder turns every 64x64 pixel block into one token
# (16x16 patches, then a 4x4 token compressor).
_PIXELS_PER_TOKEN_SIDE = 64

MIN_CROPS = 2
MAX_CROPS_LIMIT = 9  # DeepSeek's HF code allows up to 9; vLLM/SGLang use 6.
DEFAULT_MAX_CROPS = 6


class ImageError(ValueError):
    """Raised for every bad input image (undecodable, too large, wrong type...)."""


@dataclass(frozen=True)
class ViewMode:
    base_size: int  # side of the global view, in pixels
    crop: bool  # add 640x640 local crops for large images ("gundam")
    pad: bool  # keep aspect and pad with grey (True) or stretch (False)


MODES: dict[str, ViewMode] = {
    "tiny": ViewMode(base_size=512, crop=False, pad=False),
    "small": ViewMode(base_size=640, crop=False, pad=False),
    "base": ViewMode(base_size=1024, crop=False, pad=True),
    "large": ViewMode(base_size=1280, crop=False, pad=True),
    "gundam": ViewMode(base_size=1024, crop=True, pad=True),
}


class _Gridded:
    """`tiled` of an image measured into a grid of crops."""

    grid: tuple[int, int]

    @property
    def tiled(self) -> bool:
        return self.grid != (1, 1)


# ---------------------------------------------------------------------------
# Grid choice (DeepSeek's dynamic_preprocess / find_closest_aspect_ratio)
# ---------------------------------------------------------------------------


def _reference_candidates(max_crops: int, min_crops: int) -> list[tuple[int, int]]:
    """The reference expression, verbatim (order within a product = set order)."""
    return sorted(
        set(
            (i, j)
            for n in range(min_crops, max_crops + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if min_crops <= i * j <= max_crops
        ),
        key=lambda x: x[0] * x[1],
    )


# The reference builds a Python set of (i, j) and sorts it by i * j only, so
# the order of grids with the same product is whatever order CPython's set
# iteration happens to produce.  That order matters: on an exact tie of aspect
# difference, find_closest_aspect_ratio keeps the earlier candidate unless the
# image is large enough.  We pin the order the model was used with (computed
# with _reference_candidates on CPython 3.11; tuples of small ints hash
# deterministically, hash randomisation does not affect them) so that a
# different interpreter cannot silently change which grid is chosen.
# Keyed by (max_crops, min_crops).
_PINNED_CANDIDATES: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (2, 2): ((1, 2), (2, 1)),
    (3, 2): ((1, 2), (2, 1), (3, 1), (1, 3)),
    (4, 2): ((1, 2), (2, 1), (3, 1), (1, 3), (4, 1), (1, 4), (2, 2)),
    (5, 2): ((1, 2), (2, 1), (3, 1), (1, 3), (4, 1), (1, 4), (2, 2), (1, 5), (5, 1)),
    (6, 2): (
        (1, 2), (2, 1), (3, 1), (1, 3), (4, 1), (1, 4), (2, 2), (1, 5), (5, 1),
        (6, 1), (2, 3), (1, 6), (3, 2),
    ),
    (7, 2): (
        (1, 2), (2, 1), (3, 1), (1, 3), (4, 1), (1, 4), (2, 2), (1, 5), (5, 1),
        (6, 1), (2, 3), (1, 6), (3, 2), (7, 1), (1, 7),
    ),
    (8, 2): (
        (1, 2), (2, 1), (3, 1), (1, 3), (2, 2), (4, 1), (1, 4), (5, 1), (1, 5),
        (1, 6), (6, 1), (3, 2), (2, 3), (7, 1), (1, 7), (4, 2), (2, 4), (1, 8),
        (8, 1),
    ),
    (9, 2): (
        (1, 2), (2, 1), (3, 1), (1, 3), (2, 2), (4, 1), (1, 4), (5, 1), (1, 5),
        (1, 6), (6, 1), (3, 2), (2, 3), (7, 1), (1, 7), (4, 2), (2, 4), (1, 8),
        (8, 1), (1, 9), (3, 3), (9, 1),
    ),
}  # fmt: skip


def candidate_grids(max_crops: int, min_crops: int = MIN_CROPS) -> list[tuple[int, int]]:
    """All (width tiles, height tiles) with min_crops <= i*j <= max_crops, in reference order.

    Pinned for min_crops=2 and max_crops 2..9; other combinations fall back to
    the reference expression on the running interpreter.
    """
    pinned = _PINNED_CANDIDATES.get((max_crops, min_crops))
    if pinned is not None:
        return list(pinned)
    return _reference_candidates(max_crops, min_crops)


def choose_grid(
    width: int, height: int, max_crops: int = DEFAULT_MAX_CROPS, min_crops: int = MIN_CROPS,
    crop_size: int = CROP_SIZE,
) -> tuple[int, int]:
    """Pick the tiling grid (width tiles, height tiles) whose aspect is closest to the image's.

    On an exact tie of aspect difference a later candidate (more tiles) wins
    only if the image has more than half the pixels of that grid at
    crop_size x crop_size per tile (640 for DeepSeek-OCR, 768 for
    DeepSeek-OCR-2) -- the reference rule, kept as is.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for i, j in candidate_grids(max_crops, min_crops):
        diff = abs(aspect - i / j)
        if diff < best_diff:
            best_diff, best = diff, (i, j)
        elif diff == best_diff and area > 0.5 * crop_size * crop_size * i * j:
            best = (i, j)
    return best


@dataclass(frozen=True)
class Tiling:
    """One model family's views: the modes it was trained with, its crops' side and count, and
    how its sequence lays out tokens. The encoder knows its own (`DeepEncoder.tiling`,
    `DeepEncoderV2.tiling`); the images made for it carry it, so an encoder can refuse an image
    tiled for another family.

    Both families choose the grid by the same rule (`choose_grid`) with their own crop side;
    an image whose sides both fit one crop is not tiled."""

    name: str
    crop_size: int  # side of a crop, in pixels
    max_crops_limit: int  # the most crops a request may ask for
    default_max_crops: int
    modes: tuple[str, ...]  # of MODES
    newlines: bool  # a newline token after each row of tokens (DeepSeek-OCR), or none

    @property
    def crop_tokens(self) -> int:
        """Tokens one crop's view becomes (before newlines)."""
        return (self.crop_size // _PIXELS_PER_TOKEN_SIDE) ** 2

    def view_tokens(self, base_size: int) -> int:
        """Tokens a global view of this side becomes, its newlines included."""
        n = math.ceil(base_size / _PIXELS_PER_TOKEN_SIDE)
        return n * (n + 1) if self.newlines else n * n

    def check(self, mode, max_crops) -> ViewMode:
        """The view mode named `mode`; ImageError naming the value when `mode` or `max_crops`
        is not one this family takes."""
        if not isinstance(mode, str) or mode not in self.modes:
            raise ImageError(f"unknown mode {mode!r}; valid modes: {', '.join(self.modes)}"
                             + ("" if self is DEEPSEEK_OCR else f" ({self.name})"))
        is_int = isinstance(max_crops, int) and not isinstance(max_crops, bool)
        if not is_int or not MIN_CROPS <= max_crops <= self.max_crops_limit:
            raise ImageError(f"max_crops must be an int in {MIN_CROPS}..{self.max_crops_limit}"
                             + ("" if self is DEEPSEEK_OCR else f" for {self.name}")
                             + f", got {max_crops!r}")
        return MODES[mode]

    def grid(self, width: int, height: int, view_mode: ViewMode, max_crops: int) -> tuple[int, int]:
        """The crop grid of an image this size: untiled where the mode does not crop or the
        image fits one crop."""
        if view_mode.crop and (width > self.crop_size or height > self.crop_size):
            return choose_grid(width, height, max_crops, crop_size=self.crop_size)
        return (1, 1)

    def count_tokens(self, grid: tuple[int, int], base_size: int = 1024) -> int:
        """Exact number of image tokens the model's sequence holds for one image: its global
        view's, one view separator, and when tiled its crops' (DeepSeek-OCR: stitched into one
        token grid with a newline after each row; DeepSeek-OCR-2: each crop's as they are)."""
        w_tiles, h_tiles = grid
        tokens = self.view_tokens(base_size) + 1
        if (w_tiles, h_tiles) != (1, 1):
            m = math.ceil(self.crop_size / _PIXELS_PER_TOKEN_SIDE)
            tokens += (m * h_tiles) * (m * w_tiles + 1) if self.newlines else m * m * w_tiles * h_tiles
        return tokens

    def grid_and_tokens(self, width: int, height: int, view_mode: ViewMode,
                        max_crops: int) -> tuple[tuple[int, int], int]:
        grid = self.grid(width, height, view_mode, max_crops)
        return grid, self.count_tokens(grid, view_mode.base_size)


# DeepSeek-OCR: five modes, 640² crops, 2-9 of them (DeepSeek's HF code allows up to 9;
# vLLM/SGLang use 6), newline tokens.
DEEPSEEK_OCR = Tiling("deepseek-ocr", CROP_SIZE, MAX_CROPS_LIMIT, DEFAULT_MAX_CROPS, tuple(MODES), True)


def count_tokens(grid: tuple[int, int], base_size: int = 1024, crop_size: int = CROP_SIZE) -> int:
    """DeepSeek-OCR's image tokens for one image (`Tiling.count_tokens`): the global view, n
    rows of n tokens each followed by a newline token, plus one view-separator token (n =
    ceil(base_size / 64)); when tiled, the crops' one (m*h_t) x (m*w_t) token grid, again with
    a newline per row (m = ceil(crop_size / 64))."""
    tiling = DEEPSEEK_OCR if crop_size == CROP_SIZE else Tiling(
        "deepseek-ocr", crop_size, MAX_CROPS_LIMIT, DEFAULT_MAX_CROPS, tuple(MODES), True)
    return tiling.count_tokens(grid, base_size)


def check_view_options(mode, max_crops, tiling: Tiling | None = None) -> ViewMode:
    """The view mode named `mode`; ImageError naming the value when `mode` or `max_crops` is
    bad for `tiling` (default: DeepSeek-OCR's)."""
    return (tiling or DEEPSEEK_OCR).check(mode, max_crops)


# ---------------------------------------------------------------------------
# DeepSeek-OCR-2 (DeepEncoder V2): 1024² global view, 768² crops, no newlines
# ---------------------------------------------------------------------------
# Its `process/image_process.py` and `config.py`: the same candidate grids and
# tie rule as above with 768 as the tile size (the tie threshold included:
# a 1400x1120 page is (2, 2) here and (3, 2) with 640 tiles), MIN_CROPS 2,
# MAX_CROPS 6 ("max:6": what it was trained with), and no crops when both
# sides are <= 768. Every view becomes as many tokens as its learned queries:
# (side / 64)² -- 256 for the global view, 144 per crop. Its one view layout is
# gundam's (crops) or, without crops, base's (its CROP_MODE false).

OCR2_BASE_SIZE = 1024
OCR2_CROP_SIZE = 768
OCR2_MIN_CROPS = 2
OCR2_MAX_CROPS = 6
OCR2_GLOBAL_TOKENS = (OCR2_BASE_SIZE // _PIXELS_PER_TOKEN_SIDE) ** 2  # query_1024: 256
OCR2_CROP_TOKENS = (OCR2_CROP_SIZE // _PIXELS_PER_TOKEN_SIDE) ** 2  # query_768: 144
DEEPSEEK_OCR_2 = Tiling("deepseek-ocr-2", OCR2_CROP_SIZE, OCR2_MAX_CROPS, OCR2_MAX_CROPS,
                        ("gundam", "base"), False)


def ocr2_grid(width: int, height: int, max_crops: int = OCR2_MAX_CROPS) -> tuple[int, int]:
    """DeepSeek-OCR-2's crop grid (width tiles, height tiles) for an image this size; (1, 1)
    (untiled) when both sides are <= 768."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if not OCR2_MIN_CROPS <= max_crops <= OCR2_MAX_CROPS:
        raise ValueError(f"max_crops must be in {OCR2_MIN_CROPS}..{OCR2_MAX_CROPS} for "
                         f"DeepSeek-OCR-2, got {max_crops!r}")
    return DEEPSEEK_OCR_2.grid(width, height, MODES["gundam"], max_crops)


def ocr2_count_tokens(grid: tuple[int, int]) -> int:
    """DeepSeek-OCR-2's image tokens for one image: 144 per crop (when tiled), 256 for the
    global view, one view separator."""
    return DEEPSEEK_OCR_2.count_tokens(grid)
