"""The model's views of an image: its global view (the mode's square, padded with grey or
stretched) and, when tiled, its 640x640 crops, as uint8 tensors; normalisation to [-1, 1]
happens later, on the encoder's device (`normalize`).

Two ways to the same pixels: `preprocess` / `start_preprocess` decode and resize with PIL on the
host (the crops on a helper thread while the global view is built), and `views_of`
(`global_view_of`, `crops_of`) resizes decoded pixels with tensor maths (resize.py) on their own
device."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from .decoding import MAX_IMAGE_PIXELS, DecodedImage, _decode, page_locked
from .resize import resize
from .resize import supported as resize_supported
from .tiling import CROP_SIZE, DEEPSEEK_OCR, DEFAULT_MAX_CROPS, MODES, Tiling, ViewMode, _Gridded

# Grey used by the reference to pad the global view (mean pixel, 0.5 * 255).
_PAD_COLOR = (127, 127, 127)


# eq=False: the fields are tensors, and a generated __eq__ comparing tensors
# would raise ("Boolean value of Tensor ... is ambiguous").
@dataclass(frozen=True, eq=False)
class PreprocessedImage(_Gridded):
    global_view: torch.Tensor  # uint8 [3, S, S], S = mode's base size
    crops: torch.Tensor  # uint8 [P, 3, C, C] (C: the family's crop side); P = 0 when not tiled
    grid: tuple[int, int]  # (width tiles, height tiles); (1, 1) when not tiled
    num_tokens: int  # length of this image's token sequence
    mode: str
    original_size: tuple[int, int]  # (width, height) after EXIF transpose
    tiling: Tiling = DEEPSEEK_OCR  # the model family its views were made for


# ---------------------------------------------------------------------------
# Views by PIL on the host
# ---------------------------------------------------------------------------


def preprocess(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
    grey: bool = True,
    pin_memory: bool = False,
    tiling: Tiling = DEEPSEEK_OCR,
) -> PreprocessedImage:
    """Decode ``image`` and build its global view (and, in gundam mode, local crops) for the
    model family `tiling`. `pin_memory`: the views in page-locked memory where a CUDA device
    is present (`page_locked`)."""
    item = start_preprocess(image, mode, max_crops, max_pixels, grey, tiling).result()
    if not pin_memory:
        return item
    return dataclasses.replace(item, global_view=page_locked(item.global_view), crops=page_locked(item.crops))


@dataclass(frozen=True, eq=False)
class PendingImage:
    """An image whose global view is ready while its crops may still be resizing on a helper
    thread: a caller can start encoding the global view before `result()` (the router does)."""

    global_view: torch.Tensor
    grid: tuple[int, int]
    num_tokens: int
    mode: str
    original_size: tuple[int, int]
    crops: Future | None  # the uint8 [P, 3, C, C] tiles; None when not tiled
    tiling: Tiling = DEEPSEEK_OCR

    def result(self) -> PreprocessedImage:
        side = self.tiling.crop_size
        crops = (self.crops.result() if self.crops is not None
                 else torch.empty((0, 3, side, side), dtype=torch.uint8))
        return PreprocessedImage(self.global_view, crops, self.grid, self.num_tokens, self.mode,
                                 self.original_size, self.tiling)


def start_preprocess(
    image,
    mode: str = "gundam",
    max_crops: int = DEFAULT_MAX_CROPS,
    max_pixels: int = MAX_IMAGE_PIXELS,
    grey: bool = True,
    tiling: Tiling = DEEPSEEK_OCR,
) -> PendingImage:
    """Like `preprocess`, but returns once the global view is built; the crops follow.
    `grey`: resize a grey image (R == G == B at every pixel: scans, rendered text) as one
    channel, the same pixels for about half the CPU; False: always three (the reference)."""
    img, view_mode, grid, num_tokens = _decode(image, mode, max_crops, max_pixels, grey, tiling)
    tiles = None
    if grid != (1, 1):
        # The two resizes of a page (~30 ms each) are independent and PIL releases the GIL
        # while resampling: tile on a helper thread while this one builds the global view.
        tiles = _resize_threads().submit(_tile, img, grid, tiling.crop_size)
    return PendingImage(
        global_view=_pil_global_view(img, view_mode),
        grid=grid,
        num_tokens=num_tokens,
        mode=mode,
        original_size=img.size,
        crops=tiles,
        tiling=tiling,
    )


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


def _pad_to_square(img: Image.Image, size: int) -> Image.Image:
    color = _PAD_COLOR if img.mode == "RGB" else _PAD_COLOR[0]  # a grey: one channel, "L"
    return ImageOps.pad(img, (size, size), method=Image.BICUBIC, color=color)


def _stretch_to_square(img: Image.Image, size: int) -> Image.Image:
    return img.resize((size, size), Image.BICUBIC)


def _pil_global_view(img: Image.Image, view_mode: ViewMode) -> torch.Tensor:
    """The global view [3, S, S] by PIL: padded (grey) or stretched to the mode's square."""
    size = view_mode.base_size
    return _to_chw_uint8(_pad_to_square(img, size) if view_mode.pad else _stretch_to_square(img, size))


def _tile(img: Image.Image, grid: tuple[int, int], side: int = CROP_SIZE) -> torch.Tensor:
    """Resize to the grid of `side`² tiles (aspect not kept, as in the reference) and cut
    row-major tiles."""
    w_tiles, h_tiles = grid
    resized = img.resize((side * w_tiles, side * h_tiles), Image.BICUBIC)
    tiles = []
    for k in range(w_tiles * h_tiles):
        col, row = k % w_tiles, k // w_tiles
        box = (col * side, row * side, (col + 1) * side, (row + 1) * side)
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


# ---------------------------------------------------------------------------
# Decoded pixels, and the same views made from them with tensor math (resize.py)
# ---------------------------------------------------------------------------


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


def crops_of(pixels: torch.Tensor, grid: tuple[int, int], exact: bool | None = None,
             side: int = CROP_SIZE) -> torch.Tensor:
    """The crops [P, 3, side, side] of decoded pixels [C, H, W], on their device: the pixels of
    `preprocess(...).crops` (resize to the grid, row-major tiles); `exact` as global_view_of;
    `side`: the family's crop side (`Tiling.crop_size`)."""
    if not _use_exact(pixels, exact):
        return _tile(_pil_image(pixels), grid, side).to(pixels.device)
    w_tiles, h_tiles = grid
    resized = resize(pixels, (side * w_tiles, side * h_tiles))
    c = resized.shape[0]
    tiles = resized.view(c, h_tiles, side, w_tiles, side).permute(1, 3, 0, 2, 4)
    tiles = tiles.reshape(w_tiles * h_tiles, c, side, side)
    return tiles.expand(-1, 3, -1, -1).contiguous() if c == 1 else tiles.contiguous()


def _three_channels(view: torch.Tensor) -> torch.Tensor:
    return view.expand(3, -1, -1).contiguous() if view.shape[0] == 1 else view


def views_of(decoded: DecodedImage, device=None, exact: bool | None = None) -> PreprocessedImage:
    """`preprocess`'s result from a decoded image, the views made on `device` (default: where
    the pixels are); `exact` as global_view_of."""
    pixels = decoded.pixels if device is None else decoded.pixels.to(device, non_blocking=True)
    side = decoded.tiling.crop_size
    crops = (crops_of(pixels, decoded.grid, exact, side) if decoded.tiled else
             torch.empty((0, 3, side, side), dtype=torch.uint8, device=pixels.device))
    return PreprocessedImage(global_view_of(pixels, decoded.mode, exact), crops, decoded.grid,
                             decoded.num_tokens, decoded.mode, decoded.original_size, decoded.tiling)


def normalize(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1], bit-identical to ToTensor + Normalize(0.5, 0.5).

    Normalisation happens on the encoder's device (the encoder calls this
    inside its forward), so images cross process boundaries as uint8: 4x less
    data than float32.
    """
    if pixels.dtype != torch.uint8:
        raise TypeError(f"normalize expects uint8 pixels, got {pixels.dtype}")
    return (pixels.float() / 255 - 0.5) / 0.5
