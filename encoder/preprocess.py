"""DeepSeek-OCR image preprocessing: decode an image and cut it into model views.

This reproduces the reference preprocessing of DeepSeek-OCR (its HF
``dynamic_preprocess`` / ``find_closest_aspect_ratio`` and the view modes of
the vLLM / SGLang integrations) so that the encoder sees exactly the pixels the
model was trained on.  Outputs are uint8 tensors; normalisation to [-1, 1]
happens later, on the encoder's device (see :func:`normalize`).

Plain Python + PIL + numpy + torch on purpose: this runs in request handlers
and must not depend on Ray or on the model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import struct
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageChops, ImageOps

from .resize import resize
from .resize import supported as resize_supported

__all__ = [
    "CROP_SIZE",
    "DecodedImage",
    "MAX_IMAGE_PIXELS",
    "MODES",
    "ImageError",
    "PendingImage",
    "PreprocessedImage",
    "ViewMode",
    "candidate_grids",
    "check_view_options",
    "choose_grid",
    "count_tokens",
    "crops_of",
    "decode",
    "global_view_of",
    "load_image",
    "normalize",
    "page_locked",
    "preprocess",
    "start_preprocess",
    "views_of",
]

CROP_SIZE = 640
# Default decompression-bomb limit (width * height), configurable per call.
# Note: PIL refuses images above 2 * Image.MAX_IMAGE_PIXELS (~179 MP) in
# Image.open itself; such images are rejected whatever max_pixels says.
MAX_IMAGE_PIXELS = 64_000_000

# The vision encoder turns every 64x64 pixel block into one token
# (16x16 patches, then a 4x4 token compressor).
_PIXELS_PER_TOKEN_SIDE = 64
# Grey used by the reference to pad the global view (mean pixel, 0.5 * 255).
_PAD_COLOR = (127, 127, 127)

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


class _Tiling:
    """`tiled` of an image measured into a grid of crops."""

    grid: tuple[int, int]

    @property
    def tiled(self) -> bool:
        return self.grid != (1, 1)


# eq=False: the fields are tensors, and a generated __eq__ comparing tensors
# would raise ("Boolean value of Tensor ... is ambiguous").
@dataclass(frozen=True, eq=False)
class PreprocessedImage(_Tiling):
    global_view: torch.Tensor  # uint8 [3, S, S], S = mode's base size
    crops: torch.Tensor  # uint8 [P, 3, 640, 640]; P = 0 when not tiled
    grid: tuple[int, int]  # (width tiles, height tiles); (1, 1) when not tiled
    num_tokens: int  # length of this image's token sequence
    mode: str
    original_size: tuple[int, int]  # (width, height) after EXIF transpose


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
    width: int, height: int, max_crops: int = DEFAULT_MAX_CROPS, min_crops: int = MIN_CROPS
) -> tuple[int, int]:
    """Pick the tiling grid (width tiles, height tiles) whose aspect is closest to the image's.

    On an exact tie of aspect difference a later candidate (more tiles) wins
    only if the image has more than half the pixels of that grid at 640x640
    per tile -- the reference rule, kept as is.
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
        elif diff == best_diff and area > 0.5 * CROP_SIZE * CROP_SIZE * i * j:
            best = (i, j)
    return best


def count_tokens(grid: tuple[int, int], base_size: int = 1024, crop_size: int = CROP_SIZE) -> int:
    """Exact number of image tokens the model sequence holds for one image.

    Global view: n rows of n tokens, each row followed by a newline token,
    plus one view-separator token (n = ceil(base_size / 64)).  When tiled, the
    crops form one (m*h_t) x (m*w_t) token grid, again with a newline per row
    (m = ceil(crop_size / 64)).
    """
    w_tiles, h_tiles = grid
    n = math.ceil(base_size / _PIXELS_PER_TOKEN_SIDE)
    tokens = n * (n + 1) + 1
    if (w_tiles, h_tiles) != (1, 1):
        m = math.ceil(crop_size / _PIXELS_PER_TOKEN_SIDE)
        tokens += (m * h_tiles) * (m * w_tiles + 1)
    return tokens


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------

_ALPHA_MODES = frozenset({"RGBA", "LA", "La", "RGBa", "PA"})
_INT16_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
_DIRECT_RGB_MODES = frozenset({"L", "1", "CMYK", "YCbCr", "HSV", "P"})


def load_image(image, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode ``image`` into a fully loaded, EXIF-oriented RGB PIL image.

    Accepts bytes / bytearray / memoryview (encoded file data), a path (str or
    os.PathLike) or a PIL image (never modified).  Every problem with the
    input is raised as :class:`ImageError`.
    """
    return _load(image, max_pixels, keep_grey=False)


def _load(image, max_pixels: int, keep_grey: bool) -> Image.Image:
    """`load_image`; with keep_grey, an image decoded as one grey channel ("L", "1") stays "L"
    (its RGB would be three copies of it: the grey fast path needs no check then)."""
    if isinstance(image, Image.Image):
        return _decode_pil_image(image, max_pixels, keep_grey)
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        if not data:
            raise ImageError("empty image data")
        return _open_and_decode(io.BytesIO(data), max_pixels, "image data", keep_grey)
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if os.path.isdir(path):
            raise ImageError(f"image path is a directory, not a file: {_short_repr(path)}")
        if not os.path.isfile(path):
            raise ImageError(f"image file not found: {_short_repr(path)}")
        return _open_and_decode(path, max_pixels, f"image file {_short_repr(path)}", keep_grey)
    raise ImageError(
        "unsupported image input type "
        f"{type(image).__name__!r}; expected bytes, bytearray, memoryview, "
        "a path (str or os.PathLike) or a PIL.Image.Image"
    )


def _open_and_decode(fp, max_pixels: int, source: str, keep_grey: bool) -> Image.Image:
    with _opened(fp, max_pixels, source) as img:
        img.load()  # decode now, so truncated/corrupt data fails here
        return _orient_and_convert(img, keep_grey)


@contextlib.contextmanager
def _opened(fp, max_pixels: int, source: str):
    """The image opened (its header read, its size checked: bombs are refused before any pixel
    is decoded); what PIL raises inside, on malformed input, becomes an ImageError."""
    # PIL warns (DecompressionBombWarning) above its own MAX_IMAGE_PIXELS and
    # raises above twice that.  We enforce our own limit instead, so silence
    # the warning locally rather than touching PIL's global setting.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(fp) as img:
                _check_size(img.size, max_pixels)
                yield img
        except (ImageError, MemoryError):
            raise
        except Image.DecompressionBombError as exc:
            raise ImageError(f"image too large: {exc} (limit is {max_pixels} pixels)") from exc
        except FileNotFoundError as exc:
            raise ImageError(f"image file not found: {exc.filename!r}") from exc
        except Image.UnidentifiedImageError as exc:
            raise ImageError(f"cannot decode image: unrecognised format in {source}") from exc
        except Exception as exc:  # PIL raises many types on malformed input
            raise ImageError(f"cannot decode image: {type(exc).__name__}: {exc}") from exc


def _decode_pil_image(img: Image.Image, max_pixels: int, keep_grey: bool) -> Image.Image:
    _check_size(img.size, max_pixels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img.load()  # may be a lazily opened file
            return _orient_and_convert(img, keep_grey)
        except (ImageError, MemoryError):
            raise
        except Exception as exc:
            raise ImageError(f"cannot decode image: {type(exc).__name__}: {exc}") from exc


def _check_size(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(
            f"image too large: {width}x{height} = {width * height} pixels "
            f"exceeds the limit of {max_pixels} pixels"
        )


def _orient_and_convert(img: Image.Image, keep_grey: bool = False) -> Image.Image:
    # EXIF orientation first: every later step (sizes, grid, crops) must see
    # the image the way a person looks at it.  Returns a new image, so the
    # caller's image is never modified.
    oriented = ImageOps.exif_transpose(img)
    if keep_grey and oriented.mode in ("L", "1"):
        return oriented.convert("L") if oriented.mode == "1" else oriented
    rgb = _to_rgb(oriented)
    rgb.load()
    return rgb


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in _ALPHA_MODES or (mode == "P" and "transparency" in img.info):
        return _composite_on_white(img)
    if mode in _INT16_MODES or mode in ("I", "F"):
        return _high_depth_grey_to_rgb(img)
    if mode in _DIRECT_RGB_MODES:
        return img.convert("RGB")
    try:
        return img.convert("RGB")
    except Exception as exc:
        raise ImageError(f"unsupported image colour mode {mode!r}: {exc}") from exc


def _composite_on_white(img: Image.Image) -> Image.Image:
    # A plain convert("RGB") drops the alpha channel and keeps whatever colour
    # sits under transparent pixels -- usually black, which turns the
    # transparent background of scanned/exported text black.  Composite over
    # white instead.  For fully opaque pixels this equals convert("RGB"), so
    # opaque images get exactly the reference's pixels.
    if img.mode == "La":
        img = img.convert("LA")  # PIL cannot go La -> RGBA directly
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _high_depth_grey_to_rgb(img: Image.Image) -> Image.Image:
    # PIL's own convert clips 16/32-bit values to 0..255 instead of scaling,
    # so a normal 16-bit scan (values in the thousands) comes out all white.
    # Scale to 8 bit by keeping the high byte.
    arr = np.asarray(img)
    if img.mode in _INT16_MODES:
        grey = (arr.astype(np.uint16) >> 8).astype(np.uint8)
    elif img.mode == "I":
        values = arr.astype(np.int64)
        if values.max(initial=0) > 255:  # holds 16-bit data
            values = values >> 8
        grey = np.clip(values, 0, 255).astype(np.uint8)
    else:  # "F": assume 0..255 floats
        grey = np.clip(np.nan_to_num(arr.astype(np.float64)), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def _short_repr(text: str, limit: int = 200) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


# ---------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------


def preprocess(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
    grey: bool = True,
    pin_memory: bool = False,
) -> PreprocessedImage:
    """Decode ``image`` and build its global view (and, in gundam mode, local crops).
    `pin_memory`: the views in page-locked memory where a CUDA device is present (`page_locked`)."""
    item = start_preprocess(image, mode, max_crops, max_pixels, grey).result()
    if not pin_memory:
        return item
    return dataclasses.replace(item, global_view=page_locked(item.global_view), crops=page_locked(item.crops))


def page_locked(pixels: torch.Tensor) -> torch.Tensor:
    """`pixels` in page-locked memory where a CUDA device is present (else as they are), as a
    DataLoader's pin_memory: their copy to the GPU is then a DMA queued on the stream, which
    neither holds the launching thread nor needs the engine to pin them on the encode's path
    (on the H200 machine a page's host views cost the engine's call ~1 ms of CPU when it pins
    them itself, `bench/staging_probe.py`). Pinning copies them once; page-locked memory is
    the machine's RAM that cannot be swapped, so pin what is about to be encoded, not a corpus."""
    if pixels.is_pinned() or not torch.cuda.is_available():
        return pixels
    return pixels.pin_memory()


@dataclass(frozen=True, eq=False)
class PendingImage:
    """An image whose global view is ready while its crops may still be resizing on a helper
    thread: a caller can start encoding the global view before `result()` (the router does)."""

    global_view: torch.Tensor
    grid: tuple[int, int]
    num_tokens: int
    mode: str
    original_size: tuple[int, int]
    crops: Future | None  # the uint8 [P, 3, 640, 640] tiles; None when not tiled

    def result(self) -> PreprocessedImage:
        crops = (self.crops.result() if self.crops is not None
                 else torch.empty((0, 3, CROP_SIZE, CROP_SIZE), dtype=torch.uint8))
        return PreprocessedImage(self.global_view, crops, self.grid, self.num_tokens, self.mode,
                                 self.original_size)


def start_preprocess(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
    grey: bool = True,
) -> PendingImage:
    """Like `preprocess`, but returns once the global view is built; the crops follow.
    `grey`: resize a grey image (R == G == B at every pixel: scans, rendered text) as one
    channel, the same pixels for about half the CPU; False: always three (the reference)."""
    img, view_mode, grid, num_tokens = _decode(image, mode, max_crops, max_pixels, grey)
    tiles = None
    if grid != (1, 1):
        # The two resizes of a page (~30 ms each) are independent and PIL releases the GIL
        # while resampling: tile on a helper thread while this one builds the global view.
        tiles = _resize_threads().submit(_tile, img, grid)
    return PendingImage(
        global_view=_pil_global_view(img, view_mode),
        grid=grid,
        num_tokens=num_tokens,
        mode=mode,
        original_size=img.size,
        crops=tiles,
    )


def _decode(image, mode, max_crops, max_pixels, grey) -> tuple[Image.Image, ViewMode, tuple[int, int], int]:
    """The decoded image ("L" when grey and `grey`, else "RGB"), its view mode, its grid and
    its token count."""
    view_mode = check_view_options(mode, max_crops)
    img = _load(image, max_pixels, keep_grey=grey)
    if grey and img.mode == "RGB":
        img = _grey_channel(img) or img
    return img, view_mode, *_grid_and_tokens(img.width, img.height, view_mode, max_crops)


def _grid_and_tokens(width: int, height: int, view_mode: ViewMode,
                     max_crops: int) -> tuple[tuple[int, int], int]:
    """The crop grid of an image this size (untiled where the mode does not crop or the image
    fits one crop) and its token count."""
    grid = (1, 1)
    if view_mode.crop and (width > CROP_SIZE or height > CROP_SIZE):
        grid = choose_grid(width, height, max_crops)
    return grid, count_tokens(grid, base_size=view_mode.base_size, crop_size=CROP_SIZE)


# ---------------------------------------------------------------------------
# Decoded pixels, and the same views made from them with tensor math (resize.py)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DecodedImage(_Tiling):
    """An image decoded, oriented and measured, before any resize: what a router sends when
    the encoders make the views on their own device (`global_view_of`, `crops_of`)."""

    pixels: torch.Tensor  # uint8 [C, H, W]: C = 1 for a grey image, else 3
    grid: tuple[int, int]
    num_tokens: int
    mode: str
    original_size: tuple[int, int]


def decode(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
    grey: bool = True,
    pin_memory: bool = False,
) -> DecodedImage:
    """Decode ``image`` (as `preprocess`, same errors) without building any view; `pin_memory`
    as `preprocess` (the pixels then reach the GPU for `views_of` by DMA)."""
    img, _, grid, num_tokens = _decode(image, mode, max_crops, max_pixels, grey)
    if img.mode == "L":
        pixels = np.array(img, dtype=np.uint8)[None]  # np.array: a writable copy
    else:
        pixels = np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
    pixels = torch.from_numpy(pixels)
    return DecodedImage(page_locked(pixels) if pin_memory else pixels, grid, num_tokens, mode, img.size)


@dataclass(frozen=True, eq=False)
class ImageHeader(_Tiling):
    """A PNG's or JPEG's bytes with what their header says (no pixel decoded): the image's size
    as a person sees it (EXIF orientation applied), its grid and token count. A router sends
    this, and the encoder decodes `data` (`decode_header`)."""

    data: bytes
    grid: tuple[int, int]
    num_tokens: int
    mode: str
    original_size: tuple[int, int]


# EXIF orientations that swap width and height (transposes and quarter turns).
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})


def read_header(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> ImageHeader | None:
    """`image`'s sizes from its header alone, as `decode` would find them: for JPEG bytes (their
    EXIF and XMP orientation are in the header) and PNG bytes with no chunk that can orient
    them (an eXIf or XMP chunk may follow the pixel data: None then, as for every other input).
    The same errors as `decode` for bytes it refuses from the header (an unknown format, too
    many pixels); pixel data it has not read can still fail to decode."""
    view_mode = check_view_options(mode, max_crops)
    if not isinstance(image, (bytes, bytearray, memoryview)):
        return None
    data = bytes(image)
    if not (data.startswith(b"\x89PNG\r\n\x1a\n") or data.startswith(b"\xff\xd8")):
        return None
    with _opened(io.BytesIO(data), max_pixels, "image data") as img:
        if img.format == "PNG" and not _png_may_orient(data):
            exif = {}
        elif img.format in ("JPEG", "MPO"):  # EXIF and XMP are in the header's APP segments
            exif = img.getexif()
        else:
            return None
        width, height = img.size
    if exif.get(0x0112, 1) in _SWAPPING_ORIENTATIONS:  # ExifTags.Base.Orientation
        width, height = height, width
    return ImageHeader(data, *_grid_and_tokens(width, height, view_mode, max_crops), mode, (width, height))


# PNG chunks from which Pillow may read an orientation (`Image.getexif`): EXIF, and XMP or raw
# EXIF profiles in text chunks, which may follow the pixel data.
_PNG_ORIENTING_TEXT = (b"XML:com.adobe.xmp\0", b"Raw profile type exif\0")


def _png_may_orient(data: bytes) -> bool:
    """Whether a PNG holds a chunk that can carry an orientation (chunk headers only: pixel
    data is skipped over)."""
    at = 8
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"eXIf" or (kind in (b"tEXt", b"zTXt", b"iTXt")
                               and data[at + 8:at + 8 + length].startswith(_PNG_ORIENTING_TEXT)):
            return True
        if kind == b"IEND":
            return False
        at += 12 + length  # length, type, data, CRC
    return False


def decode_header(header: ImageHeader, max_pixels: int = MAX_IMAGE_PIXELS, grey: bool = True) -> DecodedImage:
    """Decode the image a header was read from: `decode`'s pixels, with the header's grid; an
    ImageError if the decoded size is not the header's."""
    decoded = decode(header.data, header.mode, MAX_CROPS_LIMIT, max_pixels, grey)
    if decoded.original_size != header.original_size:
        raise ImageError(f"decoded image is {decoded.original_size[0]}x{decoded.original_size[1]}, "
                         f"its header said {header.original_size[0]}x{header.original_size[1]}")
    return dataclasses.replace(decoded, grid=header.grid, num_tokens=header.num_tokens)


def global_view_of(pixels: torch.Tensor, mode: str = "gundam", exact: bool | None = None) -> torch.Tensor:
    """The global view [3, S, S] of decoded pixels [C, H, W], on their device: the pixels of
    `preprocess(...).global_view`. exact: the tensor resize (resize.py; ImageOps.pad's
    arithmetic) or, False, PIL itself; None: the tensor resize on a GPU, PIL on a CPU (where
    PIL's C loops are the faster of the two)."""
    view_mode = MODES[mode]
    size = view_mode.base_size
    if not _use_exact(pixels, exact):
        return _pil_global_view(_pil_image(pixels), view_mode)
    if not view_mode.pad:
        return _three_channels(resize(pixels, (size, size)))
    width, height = pixels.shape[2], pixels.shape[1]
    fitted = _contained_size(width, height, size)
    if fitted == (size, size):
        return _three_channels(resize(pixels, fitted))
    view = torch.full((pixels.shape[0], size, size), _PAD_COLOR[0], dtype=torch.uint8,
                      device=pixels.device)
    if min(fitted) > 0:  # ImageOps.contain gives an empty image below one pixel: all padding
        resized = resize(pixels, fitted)
        if fitted[0] != size:
            x = round((size - fitted[0]) * 0.5)
            view[:, :, x:x + fitted[0]] = resized
        else:
            y = round((size - fitted[1]) * 0.5)
            view[:, y:y + fitted[1], :] = resized
    return _three_channels(view)


def _use_exact(pixels: torch.Tensor, exact: bool | None) -> bool:
    if exact is None:
        return pixels.device.type == "cuda" and resize_supported()
    return exact


def _pil_image(pixels: torch.Tensor) -> Image.Image:
    array = pixels.cpu().numpy()
    return Image.fromarray(array[0]) if array.shape[0] == 1 else Image.fromarray(array.transpose(1, 2, 0))


def _contained_size(width: int, height: int, size: int) -> tuple[int, int]:
    """ImageOps.contain's target size for a size x size box, the same expressions."""
    im_ratio, dest_ratio = width / height, 1.0
    if im_ratio > dest_ratio:
        return size, round(height / width * size)
    if im_ratio < dest_ratio:
        return round(width / height * size), size
    return size, size


def crops_of(pixels: torch.Tensor, grid: tuple[int, int], exact: bool | None = None) -> torch.Tensor:
    """The crops [P, 3, 640, 640] of decoded pixels [C, H, W], on their device: the pixels of
    `preprocess(...).crops` (resize to the grid, row-major tiles); `exact` as global_view_of."""
    if not _use_exact(pixels, exact):
        return _tile(_pil_image(pixels), grid).to(pixels.device)
    w_tiles, h_tiles = grid
    resized = resize(pixels, (CROP_SIZE * w_tiles, CROP_SIZE * h_tiles))
    c = resized.shape[0]
    tiles = resized.view(c, h_tiles, CROP_SIZE, w_tiles, CROP_SIZE).permute(1, 3, 0, 2, 4)
    tiles = tiles.reshape(w_tiles * h_tiles, c, CROP_SIZE, CROP_SIZE)
    return tiles.expand(-1, 3, -1, -1).contiguous() if c == 1 else tiles.contiguous()


def _three_channels(view: torch.Tensor) -> torch.Tensor:
    return view.expand(3, -1, -1).contiguous() if view.shape[0] == 1 else view


def views_of(decoded: DecodedImage, device=None, exact: bool | None = None) -> PreprocessedImage:
    """`preprocess`'s result from a decoded image, the views made on `device` (default: where
    the pixels are); `exact` as global_view_of."""
    pixels = decoded.pixels if device is None else decoded.pixels.to(device, non_blocking=True)
    crops = (crops_of(pixels, decoded.grid, exact) if decoded.tiled else
             torch.empty((0, 3, CROP_SIZE, CROP_SIZE), dtype=torch.uint8, device=pixels.device))
    return PreprocessedImage(global_view_of(pixels, decoded.mode, exact), crops, decoded.grid,
                             decoded.num_tokens, decoded.mode, decoded.original_size)


def _grey_channel(img: Image.Image) -> Image.Image | None:
    """The one-channel ("L") image of an RGB image whose three channels are equal, else None.
    PIL's bicubic resize treats each channel alike with the same fixed-point arithmetic, so
    resizing this and repeating the channel gives the RGB resize's pixels exactly (tested)."""
    # 16 rows first, each a small copy: most colour images fail here, before the full split.
    for y in range(0, img.height, max(1, img.height // 16)):
        row = np.asarray(img.crop((0, y, img.width, y + 1)))
        if not ((row[..., 0] == row[..., 1]).all() and (row[..., 1] == row[..., 2]).all()):
            return None
    red, green, blue = img.split()  # C loops: ~3x faster than comparing numpy views
    if ImageChops.difference(red, green).getbbox() or ImageChops.difference(red, blue).getbbox():
        return None
    return red


_RESIZE_THREADS: tuple[int, ThreadPoolExecutor] | None = None


def _resize_threads() -> ThreadPoolExecutor:
    """One pool per process, shared by every caller (router threads, encode_images), so it is
    bounded by the machine, not per call. Per process: a forked child (a DataLoader worker, say)
    inherits the parent's pool object but none of its threads, and would wait on it forever."""
    global _RESIZE_THREADS
    if _RESIZE_THREADS is None or _RESIZE_THREADS[0] != os.getpid():
        _RESIZE_THREADS = (os.getpid(), ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1),
                                                           thread_name_prefix="tile-resize"))
    return _RESIZE_THREADS[1]


def check_view_options(mode, max_crops) -> ViewMode:
    """The view mode named `mode`; ImageError naming the value when `mode` or `max_crops` is bad."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ImageError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    is_int = isinstance(max_crops, int) and not isinstance(max_crops, bool)
    if not is_int or not MIN_CROPS <= max_crops <= MAX_CROPS_LIMIT:
        raise ImageError(
            f"max_crops must be an int in {MIN_CROPS}..{MAX_CROPS_LIMIT}, got {max_crops!r}"
        )
    return MODES[mode]


def _pad_to_square(img: Image.Image, size: int) -> Image.Image:
    color = _PAD_COLOR if img.mode == "RGB" else _PAD_COLOR[0]  # a grey: one channel, "L"
    return ImageOps.pad(img, (size, size), method=Image.BICUBIC, color=color)


def _stretch_to_square(img: Image.Image, size: int) -> Image.Image:
    return img.resize((size, size), Image.BICUBIC)


def _pil_global_view(img: Image.Image, view_mode: ViewMode) -> torch.Tensor:
    """The global view [3, S, S] by PIL: padded (grey) or stretched to the mode's square."""
    size = view_mode.base_size
    return _to_chw_uint8(_pad_to_square(img, size) if view_mode.pad else _stretch_to_square(img, size))


def _tile(img: Image.Image, grid: tuple[int, int]) -> torch.Tensor:
    """Resize to the grid (aspect not kept, as in the reference) and cut row-major tiles."""
    w_tiles, h_tiles = grid
    resized = img.resize((CROP_SIZE * w_tiles, CROP_SIZE * h_tiles), Image.BICUBIC)
    tiles = []
    for k in range(w_tiles * h_tiles):
        col, row = k % w_tiles, k // w_tiles
        box = (col * CROP_SIZE, row * CROP_SIZE, (col + 1) * CROP_SIZE, (row + 1) * CROP_SIZE)
        tiles.append(_to_chw_uint8(resized.crop(box)))
    return torch.stack(tiles)


def _to_chw_uint8(img: Image.Image) -> torch.Tensor:
    # Same values as torch.from_numpy(np.asarray(img)).permute(2, 0, 1).contiguous(),
    # but np.asarray of a PIL image is read-only and torch.from_numpy warns
    # about that; transposing in numpy and copying once gives a writable,
    # contiguous CHW array without the warning or an extra copy.
    hwc = np.asarray(img, dtype=np.uint8)
    if hwc.ndim == 2:  # one grey channel ("L"): repeated into R, G and B
        return torch.from_numpy(np.ascontiguousarray(np.broadcast_to(hwc, (3, *hwc.shape))))
    return torch.from_numpy(np.ascontiguousarray(hwc.transpose(2, 0, 1)))


def normalize(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1], bit-identical to ToTensor + Normalize(0.5, 0.5).

    Normalisation happens on the encoder's device (the encoder calls this
    inside its forward), so images cross process boundaries as uint8: 4x less
    data than float32.
    """
    if pixels.dtype != torch.uint8:
        raise TypeError(f"normalize expects uint8 pixels, got {pixels.dtype}")
    return (pixels.float() / 255 - 0.5) / 0.5
