"""Decoding an image: bytes, a path or a PIL image into an EXIF-oriented RGB (or one-channel
grey) PIL image, every problem an `ImageError`; alpha composited on white, 16-bit greys scaled to
8 bits, decompression bombs refused from the header. `decode` measures the result (its grid and
token count: tiling.py) into a `DecodedImage` of uint8 pixels, before any resize."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageChops, ImageOps

from .tiling import DEEPSEEK_OCR, DEFAULT_MAX_CROPS, ImageError, Tiling, ViewMode, _Gridded

# Default decompression-bomb limit (width * height), configurable per call.
# Note: PIL refuses images above 2 * Image.MAX_IMAGE_PIXELS (~179 MP) in
# Image.open itself; such images are rejected whatever max_pixels says.
MAX_IMAGE_PIXELS = 64_000_000


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


def _decode(image, mode, max_crops, max_pixels, grey,
            tiling: Tiling) -> tuple[Image.Image, ViewMode, tuple[int, int], int]:
    """The decoded image ("L" when grey and `grey`, else "RGB"), its view mode, its grid and
    its token count, for the model family `tiling`."""
    view_mode = tiling.check(mode, max_crops)
    img = _load(image, max_pixels, keep_grey=grey)
    if grey and img.mode == "RGB":
        img = _grey_channel(img) or img
    return img, view_mode, *tiling.grid_and_tokens(img.width, img.height, view_mode, max_crops)


def page_locked(pixels: torch.Tensor) -> torch.Tensor:
    """`pixels` in page-locked memory where a CUDA device is present (else as they are), as a
    DataLoader's pin_memory: their copy to the GPU is then a DMA queued on the stream, which
    neither holds the launching thread nor needs the engine to pin them on the encode's path
    (on the H200 machine a page's host views cost the engine's call ~1 ms of CPU when it pins
    them itself, as a probe measured). Pinning copies them once; page-locked memory is
    the machine's RAM that cannot be swapped, so pin what is about to be encoded, not a corpus."""
    if pixels.is_pinned() or not torch.cuda.is_available():
        return pixels
    return pixels.pin_memory()


@dataclass(frozen=True, eq=False)
class DecodedImage(_Gridded):
    """An image decoded, oriented and measured, before any resize: what a router sends when
    the encoders make the views on their own device (`global_view_of`, `crops_of`)."""

    pixels: torch.Tensor  # uint8 [C, H, W]: C = 1 for a grey image, else 3
    grid: tuple[int, int]
    num_tokens: int
    mode: str
    original_size: tuple[int, int]
    tiling: Tiling = DEEPSEEK_OCR  # the model family it was measured for


def decode(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
    grey: bool = True,
    pin_memory: bool = False,
    tiling: Tiling = DEEPSEEK_OCR,
) -> DecodedImage:
    """Decode ``image`` (as `preprocess`, same errors) without building any view; `pin_memory`
    as `preprocess` (the pixels then reach the GPU for `views_of` by DMA); measured for the
    model family `tiling`."""
    img, _, grid, num_tokens = _decode(image, mode, max_crops, max_pixels, grey, tiling)
    if img.mode == "L":
        pixels = np.array(img, dtype=np.uint8)[None]  # np.array: a writable copy
    else:
        pixels = np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
    pixels = torch.from_numpy(pixels)
    return DecodedImage(page_locked(pixels) if pin_memory else pixels, grid, num_tokens, mode, img.size,
                        tiling)
