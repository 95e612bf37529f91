"""Tests for encoder.preprocess (DeepSeek-OCR image preprocessing)."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from encoder.preprocess import (
    _reference_candidates,  # the reference expression, verbatim
    CROP_SIZE,
    MAX_IMAGE_PIXELS,
    MODES,
    ImageError,
    PreprocessedImage,
    candidate_grids,
    choose_grid,
    count_tokens,
    load_image,
    normalize,
    preprocess,
)

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def reference_choose_grid(width: int, height: int, max_num: int, image_size: int = 640):
    """Straight re-implementation of find_closest_aspect_ratio."""
    aspect_ratio = width / height
    best_ratio_diff = float("inf")
    best_ratio = (1, 1)
    area = width * height
    for ratio in _reference_candidates(max_num, 2):
        target_aspect_ratio = ratio[0] / ratio[1]
        ratio_diff = abs(aspect_ratio - target_aspect_ratio)
        if ratio_diff < best_ratio_diff:
            best_ratio_diff = ratio_diff
            best_ratio = ratio
        elif ratio_diff == best_ratio_diff:
            if area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
                best_ratio = ratio
    return best_ratio


def encode(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    arr = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(arr, mode) if channels > 1 else Image.fromarray(arr[..., 0])


def pixel(view: torch.Tensor, x: int, y: int) -> tuple[int, ...]:
    """RGB at (x, y) of a uint8 CHW tensor."""
    return tuple(int(v) for v in view[:, y, x])


def to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but which holds no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


GRIDS_6 = {
    (2, 1): 483,
    (1, 2): 493,
    (3, 1): 583,
    (1, 3): 603,
    (4, 1): 683,
    (2, 2): 693,
    (1, 4): 713,
    (5, 1): 783,
    (1, 5): 823,
    (6, 1): 883,
    (3, 2): 893,
    (2, 3): 903,
    (1, 6): 933,
}

# ---------------------------------------------------------------------------
# Token counts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("grid, expected", sorted(GRIDS_6.items()))
def test_count_tokens_tiled(grid, expected):
    assert count_tokens(grid) == expected


def test_count_tokens_untiled():
    assert count_tokens((1, 1)) == 273


@pytest.mark.parametrize(
    "mode, expected", [("tiny", 73), ("small", 111), ("base", 273), ("large", 421)]
)
def test_count_tokens_per_mode(mode, expected):
    assert count_tokens((1, 1), base_size=MODES[mode].base_size) == expected
    image = Image.new("RGB", (900, 700), (10, 20, 30))
    assert preprocess(image, mode=mode).num_tokens == expected


def test_modes_table():
    assert {name: (m.base_size, m.crop, m.pad) for name, m in MODES.items()} == {
        "tiny": (512, False, False),
        "small": (640, False, False),
        "base": (1024, False, True),
        "large": (1280, False, True),
        "gundam": (1024, True, True),
    }
    assert CROP_SIZE == 640
    assert MAX_IMAGE_PIXELS == 64_000_000


# ---------------------------------------------------------------------------
# Candidate grids
# ---------------------------------------------------------------------------


def test_candidate_grids_pinned_6_and_9():
    assert candidate_grids(6) == [
        (1, 2), (2, 1), (3, 1), (1, 3), (4, 1), (1, 4), (2, 2), (1, 5), (5, 1),
        (6, 1), (2, 3), (1, 6), (3, 2),
    ]  # fmt: skip
    assert candidate_grids(9) == [
        (1, 2), (2, 1), (3, 1), (1, 3), (2, 2), (4, 1), (1, 4), (5, 1), (1, 5),
        (1, 6), (6, 1), (3, 2), (2, 3), (7, 1), (1, 7), (4, 2), (2, 4), (1, 8),
        (8, 1), (1, 9), (3, 3), (9, 1),
    ]  # fmt: skip


@pytest.mark.parametrize("max_crops", range(2, 10))
def test_candidate_grids_match_reference_expression(max_crops):
    assert candidate_grids(max_crops) == _reference_candidates(max_crops, 2)


def test_candidate_grids_returns_a_fresh_list():
    grids = candidate_grids(6)
    grids.clear()
    assert len(candidate_grids(6)) == 13


# ---------------------------------------------------------------------------
# Grid choice and tiling shapes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("grid", sorted(GRIDS_6))
def test_each_grid_is_picked_by_its_aspect(grid):
    i, j = grid
    image = Image.new("RGB", (400 * i, 400 * j), (200, 100, 50))
    out = preprocess(image)
    assert out.grid == grid
    assert out.tiled
    assert out.crops.shape == (i * j, 3, 640, 640)
    assert out.crops.dtype == torch.uint8
    assert out.global_view.shape == (3, 1024, 1024)
    assert out.num_tokens == GRIDS_6[grid]
    assert out.original_size == (400 * i, 400 * j)
    assert out.mode == "gundam"


@pytest.mark.parametrize(
    "size, grid, tokens",
    [
        ((640, 640), (1, 1), 273),
        ((641, 640), (2, 2), 693),
        ((640, 641), (2, 2), 693),
        ((640, 300), (1, 1), 273),
        ((300, 640), (1, 1), 273),
        ((1191, 1684), (2, 3), 903),  # A4 at 144 dpi
        ((1920, 1080), (2, 1), 483),
        ((640, 3840), (1, 6), 933),
    ],
)
def test_tiling_boundaries(size, grid, tokens):
    out = preprocess(Image.new("RGB", size, (0, 0, 0)))
    assert out.grid == grid
    assert out.num_tokens == tokens
    expected_crops = 0 if grid == (1, 1) else grid[0] * grid[1]
    assert out.crops.shape == (expected_crops, 3, 640, 640)
    assert out.tiled == (grid != (1, 1))


@pytest.mark.parametrize(
    "size, max_crops, expected",
    [
        # aspect 0.75: (1,2) and (2,2) both differ by exactly 0.25; (2,2) wins
        # only above 0.5 * 640^2 * 4 = 819200 pixels.  (With max_crops=6 the
        # grid (2,3) is closer still, hence max_crops=4.)
        ((768, 1024), 4, (1, 2)),  # 786432 pixels
        ((1536, 2048), 4, (2, 2)),  # 3145728 pixels
        # aspect 1: (2,2) and (3,3) tie at 0; threshold 0.5 * 640^2 * 9 = 1843200.
        ((1000, 1000), 9, (2, 2)),
        ((2000, 2000), 9, (3, 3)),
        # exactly at the threshold the earlier grid stays ("area >", not ">=")
        ((1280, 1440), 9, (2, 2)),  # 1843200 pixels, aspect 0.889
        ((1281, 1440), 9, (3, 3)),  # 1844640 pixels
        # aspect 1/2 and 2: (1,2)/(2,4) and (2,1)/(4,2); threshold 1638400.
        ((700, 1400), 8, (1, 2)),
        ((1000, 2000), 8, (2, 4)),
        ((1400, 700), 8, (2, 1)),
        ((2000, 1000), 8, (4, 2)),
        # default max_crops=6, aspect 1.25: (2,2) and (3,2) both differ by
        # exactly 0.25; threshold 0.5 * 640^2 * 6 = 1228800.
        ((1200, 960), 6, (2, 2)),  # 1152000 pixels
        ((1250, 1000), 6, (3, 2)),  # 1250000 pixels
        # aspect 2.5: (2,1) and (3,1) differ by 0.5; threshold 614400.
        ((1000, 400), 6, (2, 1)),
        ((2000, 800), 6, (3, 1)),
    ],
)
def test_tie_area_rule(size, max_crops, expected):
    assert reference_choose_grid(*size, max_crops) == expected
    assert choose_grid(*size, max_crops) == expected
    out = preprocess(Image.new("RGB", size, 0), max_crops=max_crops)
    assert out.grid == expected
    assert out.crops.shape[0] == expected[0] * expected[1]


def _area_dependent_aspects(max_crops):
    """Aspects p/q where the reference result depends on the image area (a tie)."""
    found = []
    for p in range(1, 13):
        for q in range(1, 13):
            small = reference_choose_grid(p, q, max_crops)  # tiny area: never > threshold
            big = reference_choose_grid(p * 10_000, q * 10_000, max_crops)
            if small != big:
                found.append((p, q, small, big))
    return found


@pytest.mark.parametrize("max_crops", range(2, 10))
def test_tie_cases_found_by_search(max_crops):
    cases = _area_dependent_aspects(max_crops)
    # (1,2) and (2,1) tie at aspect 1.25 for every max_crops
    assert cases, "expected at least one exact tie"
    for p, q, small, big in cases:
        assert choose_grid(p, q, max_crops) == small
        assert choose_grid(p * 10_000, q * 10_000, max_crops) == big
        # the later candidate is only taken for the large image
        order = candidate_grids(max_crops)
        assert order.index(big) > order.index(small)


@settings(max_examples=400, deadline=None)
@given(
    width=st.integers(1, 20_000),
    height=st.integers(1, 20_000),
    max_crops=st.integers(2, 9),
)
def test_choose_grid_matches_reference_random(width, height, max_crops):
    assert choose_grid(width, height, max_crops) == reference_choose_grid(width, height, max_crops)


@settings(max_examples=400, deadline=None)
@given(
    p=st.integers(1, 12),
    q=st.integers(1, 12),
    scale=st.integers(1, 2_000),
    max_crops=st.integers(2, 9),
)
def test_choose_grid_matches_reference_rational_aspects(p, q, scale, max_crops):
    # small-integer aspects hit exact ties far more often than random sizes
    width, height = p * scale, q * scale
    assert choose_grid(width, height, max_crops) == reference_choose_grid(width, height, max_crops)


def test_max_crops_9_allows_more_tiles():
    out = preprocess(Image.new("RGB", (640 * 9, 640), 0), max_crops=9)
    assert out.grid == (9, 1)
    assert out.crops.shape == (9, 3, 640, 640)
    assert preprocess(Image.new("RGB", (640 * 9, 640), 0)).grid == (6, 1)


# ---------------------------------------------------------------------------
# Pixel content
# ---------------------------------------------------------------------------


def test_crops_are_row_major_tiles_of_bicubic_resize():
    image = noise_image(700, 500, seed=1)
    out = preprocess(image)
    i, j = out.grid
    assert (i, j) == choose_grid(700, 500) == (3, 2)
    resized = image.resize((640 * i, 640 * j), Image.BICUBIC)
    for k in range(i * j):
        col, row = k % i, k // i
        box = (col * 640, row * 640, (col + 1) * 640, (row + 1) * 640)
        assert torch.equal(out.crops[k], to_tensor(resized.crop(box))), f"tile {k}"


def test_gundam_global_view_is_grey_padded():
    image = noise_image(700, 500, seed=2)
    out = preprocess(image)
    expected = ImageOps.pad(image, (1024, 1024), method=Image.BICUBIC, color=(127, 127, 127))
    assert torch.equal(out.global_view, to_tensor(expected))
    assert out.global_view.is_contiguous()
    assert out.global_view.dtype == torch.uint8


@pytest.mark.parametrize("mode", ["tiny", "small"])
def test_stretch_modes_resize(mode):
    image = noise_image(300, 200, seed=3)
    out = preprocess(image, mode=mode)
    size = MODES[mode].base_size
    assert torch.equal(out.global_view, to_tensor(image.resize((size, size), Image.BICUBIC)))
    assert out.crops.shape == (0, 3, 640, 640)
    assert out.grid == (1, 1)
    assert not out.tiled


@pytest.mark.parametrize("mode", ["base", "large"])
def test_pad_modes(mode):
    image = noise_image(300, 200, seed=4)
    out = preprocess(image, mode=mode)
    size = MODES[mode].base_size
    expected = ImageOps.pad(image, (size, size), method=Image.BICUBIC, color=(127, 127, 127))
    assert out.global_view.shape == (3, size, size)
    assert torch.equal(out.global_view, to_tensor(expected))
    assert out.crops.shape == (0, 3, 640, 640)
    assert out.crops.dtype == torch.uint8


def test_non_gundam_modes_never_tile():
    out = preprocess(Image.new("RGB", (3000, 1000), 0), mode="large")
    assert out.grid == (1, 1)
    assert out.crops.shape[0] == 0
    assert out.num_tokens == 421


def test_pad_colour_in_border_of_wide_image():
    out = preprocess(Image.new("RGB", (2000, 500), (255, 0, 0)), mode="base")
    view = out.global_view
    # 2000x500 -> 1024x256 pasted at y = 384: grey above and below
    assert torch.all(view[:, :380, :] == 127)
    assert torch.all(view[:, -380:, :] == 127)
    assert pixel(view, 512, 512) == (255, 0, 0)


# ---------------------------------------------------------------------------
# EXIF orientation
# ---------------------------------------------------------------------------


def _marked_image() -> Image.Image:
    """40x20 blue image with a red top-left 20x10 block."""
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 10))
    return image


def _with_orientation(image: Image.Image, fmt: str, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    extra = {"quality": 95} if fmt == "JPEG" else {}
    return encode(image, fmt, exif=exif, **extra)


# orientation 6: rotate 90 degrees clockwise -> top-left lands top-right
# orientation 8: rotate 90 degrees counter-clockwise -> top-left lands bottom-left
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("orientation, red_xy, blue_xy", [(6, (17, 2), (2, 2)), (8, (2, 37), (2, 2))])
def test_exif_orientation(fmt, orientation, red_xy, blue_xy):
    data = _with_orientation(_marked_image(), fmt, orientation)
    loaded = load_image(data)
    assert loaded.size == (20, 40)
    red = loaded.getpixel(red_xy)
    blue = loaded.getpixel(blue_xy)
    assert red[0] > 200 and red[2] < 60, red
    assert blue[2] > 200 and blue[0] < 60, blue
    out = preprocess(data)
    assert out.original_size == (20, 40)


def test_exif_orientation_on_pil_input_does_not_modify_caller_image():
    image = _marked_image()
    image.getexif()[0x0112] = 6
    loaded = load_image(image)
    assert loaded.size == (20, 40)
    assert loaded.getpixel((19, 0)) == (255, 0, 0)
    assert image.size == (40, 20)
    assert image.getpixel((0, 0)) == (255, 0, 0)


# ---------------------------------------------------------------------------
# Colour modes
# ---------------------------------------------------------------------------


def _assert_rgb_view(image_or_data):
    loaded = load_image(image_or_data)
    assert loaded.mode == "RGB"
    out = preprocess(image_or_data, mode="tiny")
    assert out.global_view.dtype == torch.uint8
    assert out.global_view.shape == (3, 512, 512)
    return loaded


def test_rgb_unchanged():
    image = noise_image(30, 20, seed=5)
    loaded = _assert_rgb_view(encode(image))
    assert np.array_equal(np.asarray(loaded), np.asarray(image))


def test_rgba_transparent_becomes_white_opaque_unchanged():
    image = Image.new("RGBA", (4, 2), (0, 0, 0, 0))
    image.putpixel((1, 0), (200, 10, 20, 255))
    image.putpixel((2, 0), (0, 0, 0, 128))
    loaded = _assert_rgb_view(encode(image))
    assert loaded.getpixel((0, 0)) == (255, 255, 255)
    assert loaded.getpixel((1, 0)) == (200, 10, 20)
    half = loaded.getpixel((2, 0))
    assert all(abs(v - 127) <= 1 for v in half), half


def test_opaque_rgba_equals_plain_convert():
    image = noise_image(50, 40, seed=6, mode="RGBA")
    image.putalpha(255)
    loaded = load_image(image)
    assert np.array_equal(np.asarray(loaded), np.asarray(image.convert("RGB")))


def test_la_alpha():
    image = Image.new("LA", (2, 1), (10, 0))
    image.putpixel((1, 0), (50, 255))
    loaded = _assert_rgb_view(encode(image))
    assert loaded.getpixel((0, 0)) == (255, 255, 255)
    assert loaded.getpixel((1, 0)) == (50, 50, 50)


@pytest.mark.parametrize("premultiplied", ["La", "RGBa"])
def test_premultiplied_alpha_modes(premultiplied):
    base_mode = "LA" if premultiplied == "La" else "RGBA"
    image = Image.new(base_mode, (2, 1), (0,) * len(base_mode))
    image.putpixel((1, 0), (90,) * (len(base_mode) - 1) + (255,))
    converted = image.convert(premultiplied)
    assert converted.mode == premultiplied
    loaded = _assert_rgb_view(converted)
    assert loaded.getpixel((0, 0)) == (255, 255, 255)
    assert loaded.getpixel((1, 0)) == (90, 90, 90)


def _palette_image() -> Image.Image:
    image = Image.new("P", (2, 1), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * (256 * 3 - 6))
    image.putpixel((1, 0), 1)
    return image


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_with_transparency(fmt):
    data = encode(_palette_image(), fmt, transparency=0)
    reopened = Image.open(io.BytesIO(data))
    assert reopened.mode == "P" and "transparency" in reopened.info
    loaded = _assert_rgb_view(data)
    assert loaded.getpixel((0, 0)) == (255, 255, 255)  # plain convert would give black
    assert loaded.getpixel((1, 0)) == (255, 0, 0)


def test_palette_without_transparency():
    loaded = _assert_rgb_view(encode(_palette_image()))
    assert loaded.getpixel((0, 0)) == (0, 0, 0)
    assert loaded.getpixel((1, 0)) == (255, 0, 0)


def test_pa_mode():
    image = _palette_image().convert("PA")
    image.putpixel((0, 0), (1, 0))  # red but fully transparent
    loaded = _assert_rgb_view(image)
    assert loaded.getpixel((0, 0)) == (255, 255, 255)
    assert loaded.getpixel((1, 0)) == (255, 0, 0)


def test_greyscale_l():
    image = Image.new("L", (2, 1), 40)
    loaded = _assert_rgb_view(encode(image))
    assert loaded.getpixel((0, 0)) == (40, 40, 40)


def test_bilevel_1():
    image = Image.new("1", (2, 1), 0)
    image.putpixel((1, 0), 1)
    loaded = _assert_rgb_view(encode(image))
    assert loaded.getpixel((0, 0)) == (0, 0, 0)
    assert loaded.getpixel((1, 0)) == (255, 255, 255)


@pytest.mark.parametrize("fmt", ["TIFF", "JPEG"])
def test_cmyk(fmt):
    image = Image.new("CMYK", (32, 16), (0, 0, 0, 0))  # white
    image.paste((0, 255, 255, 0), (0, 0, 16, 16))  # red left half
    data = encode(image, fmt)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    loaded = _assert_rgb_view(data)
    tolerance = 0 if fmt == "TIFF" else 12
    red = loaded.getpixel((4, 8))
    white = loaded.getpixel((28, 8))
    assert all(abs(a - b) <= tolerance for a, b in zip(red, (255, 0, 0))), red
    assert all(abs(a - b) <= tolerance for a, b in zip(white, (255, 255, 255))), white


def test_16_bit_png_greyscale_is_scaled():
    values = np.array([[0x8000, 0xFFFF, 0x00FF, 0x1234]], dtype=np.uint16)
    data = encode(Image.fromarray(values))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    loaded = _assert_rgb_view(data)
    assert [loaded.getpixel((x, 0))[0] for x in range(4)] == [128, 255, 0, 0x12]
    assert loaded.getpixel((0, 0)) == (128, 128, 128)


@pytest.mark.parametrize("mode", ["I;16B", "I;16L"])
def test_16_bit_in_memory_modes(mode):
    image = Image.new(mode, (2, 1), 0x8000)
    loaded = _assert_rgb_view(image)
    assert loaded.getpixel((0, 0)) == (128, 128, 128)


def test_32_bit_int_with_16_bit_data_is_scaled():
    image = Image.new("I", (2, 1), 40000)
    loaded = _assert_rgb_view(image)
    assert loaded.getpixel((0, 0)) == (156, 156, 156)  # 40000 >> 8


def test_32_bit_int_with_8_bit_data_kept():
    image = Image.new("I", (3, 1), 100)
    image.putpixel((1, 0), 255)
    image.putpixel((2, 0), -5)
    loaded = _assert_rgb_view(image)
    assert [loaded.getpixel((x, 0))[0] for x in range(3)] == [100, 255, 0]


def test_float_mode_clipped():
    image = Image.fromarray(np.array([[300.5, -3.0, 100.7, 0.0]], dtype=np.float32))
    assert image.mode == "F"
    loaded = _assert_rgb_view(image)
    assert [loaded.getpixel((x, 0))[0] for x in range(4)] == [255, 0, 100, 0]


@pytest.mark.parametrize("mode", ["YCbCr", "HSV"])
def test_other_modes_use_pil_convert(mode):
    image = noise_image(8, 4, seed=7).convert(mode)
    loaded = _assert_rgb_view(image)
    assert np.array_equal(np.asarray(loaded), np.asarray(image.convert("RGB")))


# ---------------------------------------------------------------------------
# Input types and bad input
# ---------------------------------------------------------------------------


@pytest.fixture
def sample() -> Image.Image:
    return noise_image(40, 30, seed=8)


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_byte_inputs(sample, wrap):
    loaded = load_image(wrap(encode(sample)))
    assert np.array_equal(np.asarray(loaded), np.asarray(sample))


@pytest.mark.parametrize("as_path", [str, Path])
def test_path_inputs(sample, tmp_path, as_path):
    path = tmp_path / "page.png"
    sample.save(path)
    loaded = load_image(as_path(path))
    assert np.array_equal(np.asarray(loaded), np.asarray(sample))
    assert preprocess(as_path(path)).original_size == (40, 30)


def test_pil_input(sample):
    loaded = load_image(sample)
    assert loaded is not sample
    assert np.array_equal(np.asarray(loaded), np.asarray(sample))


def test_lazily_opened_pil_input(sample, tmp_path):
    path = tmp_path / "page.png"
    sample.save(path)
    with Image.open(path) as lazy:
        assert np.array_equal(np.asarray(load_image(lazy)), np.asarray(sample))


@pytest.mark.parametrize("bad", [42, None, 3.5, ["a"], np.zeros((2, 2, 3), np.uint8)])
def test_wrong_input_type(bad):
    with pytest.raises(ImageError, match=type(bad).__name__):
        load_image(bad)
    with pytest.raises(ImageError):
        preprocess(bad)


@pytest.mark.parametrize("empty", [b"", bytearray(), memoryview(b"")])
def test_empty_data(empty):
    with pytest.raises(ImageError, match="empty image data"):
        preprocess(empty)


def test_random_junk():
    junk = np.random.default_rng(9).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    with pytest.raises(ImageError, match="cannot decode image"):
        preprocess(junk)


def test_text_is_not_an_image():
    with pytest.raises(ImageError, match="cannot decode image"):
        load_image(b"hello, I am not an image")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file(fmt):
    data = encode(noise_image(200, 200, seed=10), fmt)
    with pytest.raises(ImageError, match="cannot decode image"):
        preprocess(data[: len(data) // 2])


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.png"
    with pytest.raises(ImageError, match="not found"):
        preprocess(missing)
    with pytest.raises(ImageError, match="not found"):
        preprocess(str(missing))


def test_directory_path(tmp_path):
    with pytest.raises(ImageError, match="directory"):
        preprocess(tmp_path)


def test_zero_size_pil_image():
    with pytest.raises(ImageError, match="zero size"):
        preprocess(Image.new("RGB", (0, 5)))


# ---------------------------------------------------------------------------
# Decompression bombs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "width, height",
    [
        (9_000, 9_000),  # above our default limit, below PIL's warning threshold
        (10_000, 10_000),  # PIL would warn (DecompressionBombWarning)
        (20_000, 20_000),  # PIL refuses in Image.open (DecompressionBombError)
    ],
)
def test_bomb_header_refused_without_decoding(width, height):
    data = png_header_only(width, height)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ImageError, match="too large") as info:
            preprocess(data)
    assert str(MAX_IMAGE_PIXELS) in str(info.value)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # PIL's global left alone


def test_header_only_png_within_limit_fails_as_undecodable():
    # the same kind of file, small enough to pass the limit, fails only when
    # its (missing) pixels are decoded: the bomb check above ran before that
    with pytest.raises(ImageError, match="cannot decode image"):
        preprocess(png_header_only(100, 100))


def test_real_image_over_custom_limit(sample):
    data = encode(sample)  # 40 x 30 = 1200 pixels
    with pytest.raises(ImageError, match="1200 pixels exceeds the limit of 1000"):
        preprocess(data, max_pixels=1000)
    assert preprocess(data, max_pixels=1200).original_size == (40, 30)


def test_pil_image_over_custom_limit(sample):
    with pytest.raises(ImageError, match="limit of 1000"):
        preprocess(sample, max_pixels=1000)


def test_large_palette_png_is_refused():
    # a genuinely large image compresses to a few KB as a 1-bit PNG
    image = Image.new("1", (9_000, 8_000), 0)
    data = encode(image, optimize=False)
    del image
    assert len(data) < 100_000
    with pytest.raises(ImageError, match="9000x8000"):
        preprocess(data, max_pixels=50_000_000)


# ---------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["huge", "", "Gundam", None, 3])
def test_invalid_mode(sample, mode):
    with pytest.raises(ImageError, match="valid modes: tiny, small, base, large, gundam"):
        preprocess(sample, mode=mode)


@pytest.mark.parametrize("max_crops", [1, 10, 0, -6, "6", 6.0, True, None])
def test_invalid_max_crops(sample, max_crops):
    with pytest.raises(ImageError, match="max_crops"):
        preprocess(sample, max_crops=max_crops)


@pytest.mark.parametrize("max_crops", range(2, 10))
def test_valid_max_crops(max_crops):
    out = preprocess(Image.new("RGB", (1300, 700), 0), max_crops=max_crops)
    assert out.grid == reference_choose_grid(1300, 700, max_crops)
    assert out.crops.shape[0] == out.grid[0] * out.grid[1]


def test_result_is_frozen(sample):
    out = preprocess(sample)
    assert isinstance(out, PreprocessedImage)
    with pytest.raises(AttributeError):
        out.grid = (2, 2)


# ---------------------------------------------------------------------------
# normalize
# ---------------------------------------------------------------------------


def test_normalize_values():
    x = torch.tensor([0, 127, 255], dtype=torch.uint8)
    y = normalize(x)
    assert y.dtype == torch.float32
    assert y[0].item() == -1.0
    assert y[2].item() == 1.0
    assert y[1].item() == pytest.approx((127 / 255 - 0.5) / 0.5)


def test_normalize_bit_identical_to_torchvision_ops():
    x = torch.arange(256, dtype=torch.uint8).repeat(3, 4, 1)
    expected = (x.float().div(255) - 0.5) / 0.5
    assert torch.equal(normalize(x), expected)
    crops = preprocess(noise_image(700, 500, seed=11)).crops
    assert torch.equal(normalize(crops), (crops.float().div(255) - 0.5) / 0.5)


def test_normalize_rejects_float():
    with pytest.raises(TypeError):
        normalize(torch.zeros(3, dtype=torch.float32))


def _tile_count_in_child(queue):
    queue.put(preprocess(Image.new("RGB", (1191, 1684), (200, 10, 10))).crops.shape[0])


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_tiling_works_in_a_forked_child():
    """Tiling runs on a helper thread pool; a child forked after the parent used it (a
    DataLoader worker, say) must get its own pool instead of waiting on the parent's threads."""
    import multiprocessing
    for _ in range(8):  # fill the parent's pool with live threads
        preprocess(Image.new("RGB", (1191, 1684)))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_tile_count_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert not child.is_alive(), "preprocess hung in the forked child"
    assert queue.get(timeout=5) == 6


# ---------------------------------------------------------------------------
# Grey images resized as one channel (the fast path) against three (the reference)
# ---------------------------------------------------------------------------


def grey_noise(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width), dtype=np.uint8))


def almost_grey(width: int, height: int, seed: int) -> Image.Image:
    """Grey in RGB but for one pixel away from the sampled grid: the full check must see it."""
    rgb = np.array(grey_noise(width, height, seed).convert("RGB"))
    rgb[height // 2 + 1, width // 2 + 1, 2] ^= 1
    return Image.fromarray(rgb)


@pytest.mark.parametrize("mode", ["gundam", "tiny", "base", "large"])
@pytest.mark.parametrize("make, one_channel", [
    (lambda: grey_noise(700, 500, 1), True),                    # an "L" scan, tiled 3x2
    (lambda: grey_noise(1191, 1684, 2).convert("RGB"), True),   # a grey page stored as RGB
    (lambda: grey_noise(300, 200, 3).convert("1"), True),       # bilevel
    (lambda: almost_grey(640, 900, 4), False),                  # one pixel off grey
    (lambda: noise_image(700, 500, seed=5), False),             # colour
], ids=["L", "grey-rgb", "bilevel", "almost-grey", "colour"])
def test_grey_fast_path_gives_the_reference_pixels(mode, make, one_channel):
    from encoder.preprocess import _grey_channel
    image = make()
    assert (_grey_channel(load_image(image)) is not None) == one_channel
    fast, reference = preprocess(image, mode=mode), preprocess(image, mode=mode, grey=False)
    assert torch.equal(fast.global_view, reference.global_view)
    assert torch.equal(fast.crops, reference.crops)
    assert (fast.grid, fast.num_tokens, fast.original_size) == \
        (reference.grid, reference.num_tokens, reference.original_size)
    assert fast.global_view.is_contiguous() and fast.crops.is_contiguous()


# ---------------------------------------------------------------------------
# Header only (decode_on_encoder): what the router reads before the encoder decodes
# ---------------------------------------------------------------------------


def _png_with_text_chunk(image: Image.Image, keyword: str) -> bytes:
    from PIL import PngImagePlugin
    info = PngImagePlugin.PngInfo()
    info.add_itxt(keyword, '<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>')
    return encode(image, "PNG", pnginfo=info)


@pytest.mark.parametrize("make", [
    lambda: encode(noise_image(1191, 1684, seed=1)),                                      # a page
    lambda: encode(grey_noise(1400, 700, 2)),                                             # grey PNG
    lambda: encode(noise_image(300, 200, seed=3), "JPEG"),                                # untiled
    *[lambda o=o: _with_orientation(noise_image(1400, 700, seed=o), "JPEG", o) for o in range(1, 9)],
], ids=["page-png", "grey-png", "small-jpeg", *[f"jpeg-orientation-{o}" for o in range(1, 9)]])
@pytest.mark.parametrize("mode, max_crops", [("gundam", 6), ("gundam", 9), ("base", 6)])
def test_header_says_what_decoding_finds(make, mode, max_crops):
    from encoder.preprocess import decode, decode_header, read_header
    data = make()
    header, decoded = read_header(data, mode, max_crops), decode(data, mode, max_crops)
    assert header is not None and header.data == data
    assert (header.grid, header.num_tokens, header.original_size) == \
        (decoded.grid, decoded.num_tokens, decoded.original_size)
    from_header = decode_header(header)
    assert torch.equal(from_header.pixels, decoded.pixels)
    assert (from_header.grid, from_header.num_tokens) == (decoded.grid, decoded.num_tokens)


@pytest.mark.parametrize("make", [
    lambda: _with_orientation(noise_image(1400, 700, seed=1), "PNG", 6),  # eXIf chunk
    lambda: _png_with_text_chunk(noise_image(1400, 700, seed=1), "XML:com.adobe.xmp"),  # XMP
    lambda: encode(noise_image(1400, 700, seed=1), "WEBP"),
    lambda: encode(noise_image(1400, 700, seed=1), "BMP"),
], ids=["png-exif", "png-xmp", "webp", "bmp"])
def test_header_declines_what_only_decoding_can_orient(make):
    """A PNG whose orientation may sit after its pixels, and formats other than PNG and JPEG:
    None (the router decodes them itself); non-bytes inputs too."""
    from encoder.preprocess import read_header
    assert read_header(make()) is None
    assert read_header(noise_image(40, 30)) is None


def test_header_refuses_what_decode_refuses_from_the_header():
    from encoder.preprocess import read_header
    with pytest.raises(ImageError, match="too large"):
        read_header(png_header_only(10_000, 10_000))
    with pytest.raises(ImageError, match="unknown mode"):
        read_header(encode(noise_image(40, 30)), mode="huge")
    with pytest.raises(ImageError, match="cannot decode image"):  # a PNG signature, then junk
        read_header(b"\x89PNG\r\n\x1a\n" + b"junk" * 10)


def test_decoding_from_a_header_fails_on_bad_pixels_or_another_size():
    import dataclasses

    from encoder.preprocess import decode_header, read_header
    header = read_header(png_header_only(100, 100))  # a header, no pixel data
    with pytest.raises(ImageError, match="cannot decode image"):
        decode_header(header)
    good = read_header(encode(noise_image(40, 30)))
    with pytest.raises(ImageError, match="header said 41x30"):
        decode_header(dataclasses.replace(good, original_size=(41, 30)))


def test_pin_memory_keeps_every_pixel_and_pins_where_cuda_is():
    """`pin_memory=True` (what `encode_images` asks for on a GPU): the same views and decoded
    pixels as without, page-locked where a CUDA device is present, left as they are without one
    (a CPU-only process asking gets no error)."""
    from encoder.preprocess import decode
    page = encode(Image.fromarray(np.random.default_rng(5).integers(0, 256, (900, 700, 3), dtype=np.uint8)))
    plain, pinned = preprocess(page), preprocess(page, pin_memory=True)
    assert plain.grid == pinned.grid != (1, 1)
    for a, b in ((plain.global_view, pinned.global_view), (plain.crops, pinned.crops)):
        assert torch.equal(a, b) and not a.is_pinned()
        assert b.is_pinned() == torch.cuda.is_available()
    decoded, decoded_pinned = decode(page), decode(page, pin_memory=True)
    assert torch.equal(decoded.pixels, decoded_pinned.pixels)
    assert decoded_pinned.pixels.is_pinned() == torch.cuda.is_available()
