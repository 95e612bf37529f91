"""DeepSeek-OCR-2's views of an image, by PIL on the host: pixel for pixel its
`process/image_process.py` (`tokenize_with_images`, `dynamic_preprocess`).

- Global view: `ImageOps.pad` to 1024x1024, bicubic, grey (127, 127, 127): the same view as
  DeepSeek-OCR's gundam mode (`views._pad_to_square`).
- Crops, unless both sides are <= 768: the whole image resized to (768 w_t, 768 h_t) with PIL's
  default filter (bicubic), aspect not kept, cut into 768x768 tiles row-major (tile k is column
  k % w_t, row k // w_t); the grid is `tiling.ocr2_grid`.
- uint8 out, normalised on the encoder's device (`views.normalize`, bit for bit ToTensor +
  Normalize(0.5, 0.5) as its ImageTransform).

The result is a `views.PreprocessedImage` (its `mode` "gundam", the one mode DeepSeek-OCR-2
has, with 768² crops); decoding is `decoding.py`'s (EXIF orientation, RGB, the grey fast path).
"""
from __future__ import annotations

import torch
from PIL import Image

from .decoding import MAX_IMAGE_PIXELS, _grey_channel, _load
from .tiling import OCR2_BASE_SIZE, OCR2_CROP_SIZE, OCR2_MAX_CROPS, ocr2_count_tokens, ocr2_grid
from .views import PreprocessedImage, _pad_to_square, _to_chw_uint8

OCR2_MODE = "gundam"


def preprocess_ocr2(image, max_crops: int = OCR2_MAX_CROPS, max_pixels: int = MAX_IMAGE_PIXELS,
                    grey: bool = True) -> PreprocessedImage:
    """Decode `image` (bytes, a path or a PIL image; errors as `preprocess`) into DeepSeek-OCR-2's
    global view [3, 1024, 1024] and crops [P, 3, 768, 768] (P = 0 when untiled), uint8.
    `grey`: a grey image (R == G == B) is resized as one channel, the same pixels (`preprocess`)."""
    img = _load(image, max_pixels, keep_grey=grey)
    if grey and img.mode == "RGB":
        img = _grey_channel(img) or img
    grid = ocr2_grid(img.width, img.height, max_crops)
    crops = (tile(img, grid, OCR2_CROP_SIZE) if grid != (1, 1) else
             torch.empty((0, 3, OCR2_CROP_SIZE, OCR2_CROP_SIZE), dtype=torch.uint8))
    return PreprocessedImage(
        global_view=_to_chw_uint8(_pad_to_square(img, OCR2_BASE_SIZE)),
        crops=crops,
        grid=grid,
        num_tokens=ocr2_count_tokens(grid),
        mode=OCR2_MODE,
        original_size=img.size,
    )


def tile(img: Image.Image, grid: tuple[int, int], crop_size: int) -> torch.Tensor:
    """Resize to the grid (aspect not kept, as the reference) and cut row-major tiles:
    uint8 [w_t * h_t, 3, crop_size, crop_size]."""
    w_tiles, h_tiles = grid
    resized = img.resize((crop_size * w_tiles, crop_size * h_tiles), Image.BICUBIC)
    tiles = []
    for k in range(w_tiles * h_tiles):
        col, row = k % w_tiles, k // w_tiles
        box = (col * crop_size, row * crop_size, (col + 1) * crop_size, (row + 1) * crop_size)
        tiles.append(_to_chw_uint8(resized.crop(box)))
    return torch.stack(tiles)
