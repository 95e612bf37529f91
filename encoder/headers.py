"""A PNG's or JPEG's sizes from its header alone (no pixel decoded), with its grid and token
count: what a router sends when the encoder decodes the image (`decode_header`)."""

from __future__ import annotations

import dataclasses
import io
import struct
from dataclasses import dataclass

from .decoding import MAX_IMAGE_PIXELS, DecodedImage, _opened, decode
from .tiling import DEEPSEEK_OCR, DEFAULT_MAX_CROPS, ImageError, Tiling, _Gridded


@dataclass(frozen=True, eq=False)
class ImageHeader(_Gridded):
    """A PNG's or JPEG's bytes with what their header says (no pixel decoded): the image's size
    as a person sees it (EXIF orientation applied), its grid and token count. A router sends
    this, and the encoder decodes `data` (`decode_header`)."""

    data: bytes
    grid: tuple[int, int]
    num_tokens: int
    mode: str
    original_size: tuple[int, int]
    tiling: Tiling = DEEPSEEK_OCR  # the model family it was measured for


# EXIF orientations that swap width and height (transposes and quarter turns).
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})


def read_header(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
    tiling: Tiling = DEEPSEEK_OCR,
) -> ImageHeader | None:
    """`image`'s sizes from its header alone, as `decode` would find them: for JPEG bytes (their
    EXIF and XMP orientation are in the header) and PNG bytes with no chunk that can orient
    them (an eXIf or XMP chunk may follow the pixel data: None then, as for every other input).
    The same errors as `decode` for bytes it refuses from the header (an unknown format, too
    many pixels); pixel data it has not read can still fail to decode."""
    view_mode = tiling.check(mode, max_crops)
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
    return ImageHeader(data, *tiling.grid_and_tokens(width, height, view_mode, max_crops), mode,
                       (width, height), tiling)


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
    decoded = decode(header.data, header.mode, header.tiling.max_crops_limit, max_pixels, grey,
                     tiling=header.tiling)
    if decoded.original_size != header.original_size:
        raise ImageError(f"decoded image is {decoded.original_size[0]}x{decoded.original_size[1]}, "
                         f"its header said {header.original_size[0]}x{header.original_size[1]}")
    return dataclasses.replace(decoded, grid=header.grid, num_tokens=header.num_tokens)
