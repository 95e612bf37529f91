"""DeepSeek-OCR-2's tiling and views against its own rule (`process/image_process.py`, in
tests/reference_ocr2.py) and against transformers' `deepseek_ocr2` image processor: grids on
the hard cases (exact ties, the no-crop boundary, strips, tiny and odd sizes), token counts, and
the pixels of the global view and of every crop."""
import numpy as np
import pytest
import torch
from PIL import Image

from encoder import DEEPSEEK_OCR_2, preprocess
from encoder.tiling import choose_grid, ocr2_count_tokens, ocr2_grid
from encoder.views import normalize
from tests import reference_ocr2 as ref


def preprocess_ocr2(image, **options):
    """DeepSeek-OCR-2's views by the package's one preprocessing path, for its family."""
    return preprocess(image, tiling=DEEPSEEK_OCR_2, **options)


def deepseek_grid(width, height):
    """DeepSeek's (w_t, h_t): untiled when both sides are <= 768, else `count_tiles`."""
    if width <= 768 and height <= 768:
        return (1, 1)
    return tuple(ref.count_tiles(width, height))


def noise(width, height, seed=0, grey=False) -> Image.Image:
    """Random pixels: every resampling or placement difference shows."""
    rng = np.random.default_rng(seed)
    if grey:
        return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8)).convert("RGB")
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (width, height, grid): each a case that breaks a near-miss of the rule.
HARD_CASES = [
    (768, 768, (1, 1)),      # the no-crop boundary: both sides <= 768
    (769, 768, (2, 2)),      # one pixel over: tiled, aspect ~1
    (768, 769, (2, 2)),
    (1, 1, (1, 1)),          # tiny
    (3, 1, (1, 1)),
    (1, 769, (1, 6)),        # a one-pixel-wide strip just over the boundary
    (10000, 100, (6, 1)),    # strips: the most tiles in a row / a column
    (100, 10000, (1, 6)),
    # Exact ties (aspect halfway between two grids, equal differences in floating point): the
    # later grid wins only above 0.5 * 768² * its tiles. Halfway points fall exactly on a
    # double for the wide ties and for 9/40; the other tall ones (5/12, 7/12, 5/6...) never
    # tie in floating point, so one side is always strictly closer.
    (1000, 800, (2, 2)),     # 5/4 between (2, 2) and (3, 2), area 0.8M below 1.77M
    (1400, 1120, (2, 2)),    # the same tie at 1.57M: still below (with 640 tiles: (3, 2))
    (1600, 1280, (3, 2)),    # the same tie, area 2.05M above: the later (3, 2) wins
    (1400, 800, (2, 1)),     # 7/4 between (2, 1) and (3, 2), area below
    (2100, 1200, (3, 2)),    # the same tie, area above
    (1000, 400, (2, 1)),     # 5/2 between (2, 1) and (3, 1), area below 0.88M
    (2000, 800, (3, 1)),     # the same tie, area above
    (180, 800, (1, 4)),      # 9/40 between (1, 4) and (1, 5), area below 1.47M
    (900, 4000, (1, 5)),     # the same tie, area above
    (645, 774, (2, 2)),      # 5/6, halfway between 2/3 and 1, but no tie in floating point
    (1001, 777, (3, 2)),     # odd sizes
    (1191, 1684, (2, 3)),    # A4 at 144 dpi
    (2480, 3508, (2, 3)),    # A4 at 300 dpi
]


@pytest.mark.parametrize("width, height, grid", HARD_CASES)
def test_hard_cases_grid_and_tokens(width, height, grid):
    assert deepseek_grid(width, height) == grid  # the case says what DeepSeek's rule says
    assert ocr2_grid(width, height) == grid
    w_t, h_t = grid
    expected = 256 + 1 + (144 * w_t * h_t if grid != (1, 1) else 0)
    assert ocr2_count_tokens(grid) == expected


def test_tie_threshold_uses_768_tiles_not_640():
    """The mistake SGLang shipped (640² crops for OCR-2) also moves tie decisions."""
    assert choose_grid(1400, 1120, 6, 2, crop_size=640) == (3, 2)
    assert ocr2_grid(1400, 1120) == (2, 2)


def sweep():
    sides = sorted({1, 2, 767, 768, 769, 770, 1023, 1024, 1025, 1535, 1536, 1537, 2304, 4608}
                   | set(range(3, 5000, 61)))
    return [(w, h) for w in sides for h in sides]


def test_grid_matches_deepseek_on_a_sweep():
    bad = [(w, h, ocr2_grid(w, h), deepseek_grid(w, h)) for w, h in sweep()
           if ocr2_grid(w, h) != deepseek_grid(w, h)]
    assert not bad, bad[:10]


def test_grid_matches_transformers_on_a_sweep():
    """transformers' DeepseekOcr2ImageProcessorPil tiles when the longer side is over 768, on
    its own candidate list (built in another order) and tie rule. (Not its
    `get_number_of_image_patches`, inherited from GOT-OCR2: 1024 tiles, small images tiled.)"""
    pil = pytest.importorskip("transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2")

    def transformers_grid(width, height):
        if max(width, height) <= 768:
            return (1, 1)
        return pil.get_optimal_tiled_canvas((height, width), (768, 768), 2, 6)

    bad = [(w, h, ocr2_grid(w, h), transformers_grid(w, h)) for w, h in sweep()
           if ocr2_grid(w, h) != transformers_grid(w, h)]
    assert not bad, bad[:10]


@pytest.mark.parametrize("width, height, grid", HARD_CASES)
def test_views_are_deepseeks_pixels(width, height, grid):
    image = noise(width, height, seed=width * 7 + height)
    item = preprocess_ocr2(image)
    global_view, crops, crop_ratio, tokens = ref.deepseek_views(image)
    assert (item.grid, item.num_tokens, item.original_size) == (grid, tokens, (width, height))
    assert tuple(crop_ratio) == grid
    assert item.global_view.shape == (3, 1024, 1024) and item.global_view.dtype == torch.uint8
    assert torch.equal(normalize(item.global_view), global_view)
    if grid == (1, 1):
        assert crops is None and item.crops.shape == (0, 3, 768, 768)
    else:
        assert item.crops.shape == (grid[0] * grid[1], 3, 768, 768)
        assert torch.equal(normalize(item.crops), crops)  # same order: row-major


def test_grey_image_takes_the_one_channel_path_with_the_same_pixels():
    image = noise(1300, 900, seed=5, grey=True)
    global_view, crops, _, _ = ref.deepseek_views(image)
    for grey in (True, False):
        item = preprocess_ocr2(image, grey=grey)
        assert torch.equal(normalize(item.global_view), global_view)
        assert torch.equal(normalize(item.crops), crops)


def transformers_views(image):
    pil = pytest.importorskip("transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2")
    # channels_last: on a one-pixel-wide image its guess reads the width as the channels
    out = pil.DeepseekOcr2ImageProcessorPil()(images=[image], return_tensors="pt",
                                              input_data_format="channels_last")
    return out["pixel_values"][0], out.get("pixel_values_local"), int(out["num_local_patches"][0])


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Normalised pixels back to uint8 (their rescale and ours round differently in the last ulp)."""
    return ((x * 0.5 + 0.5) * 255).round().to(torch.uint8)


# Sizes whose global view has an even margin, or an odd one of 1 mod 4 (see below).
@pytest.mark.parametrize("width, height", [(769, 768), (2, 769), (10000, 100), (1000, 400),
                                           (1400, 1120), (1191, 1684), (500, 300), (1001, 777)])
def test_views_match_transformers(width, height):
    image = noise(width, height, seed=width + height)
    item = preprocess_ocr2(image)
    global_view, local, num_local = transformers_views(image)
    assert num_local == item.crops.shape[0]
    assert (normalize(item.global_view) - global_view).abs().max() <= 1e-6
    assert torch.equal(item.global_view, to_uint8(global_view))
    if num_local:
        assert (normalize(item.crops) - local).abs().max() <= 1e-6
        assert torch.equal(item.crops, to_uint8(local))


def test_transformers_global_view_sits_one_pixel_off_on_some_margins():
    """A known difference, not ours: DeepSeek pads with PIL's ImageOps.pad, which places the
    image at round(margin / 2), Python's round (half to even); transformers' pad_to_square at
    margin // 2. Where the margin is 3 mod 4 (a quarter of all sizes) transformers' view is
    one pixel left of (or above) the one DeepSeek-OCR-2 was trained with; we follow DeepSeek."""
    image = noise(1021, 1024, seed=3)  # contained at 1021 wide: margin 3, PIL x=2, theirs x=1
    item = preprocess_ocr2(image)
    assert torch.equal(normalize(item.global_view), ref.deepseek_views(image)[0])
    theirs = to_uint8(transformers_views(image)[0])
    assert not torch.equal(item.global_view, theirs)
    assert torch.equal(item.global_view[:, :, 2:1023], theirs[:, :, 1:1022])


@pytest.mark.parametrize("size", [(1400, 1120), (800, 2000), (700, 500), (3000, 600)])
def test_views_made_from_decoded_pixels_equal_the_pil_views(size):
    """What an encoder does with a decoded image (`views_of`: PIL, or the exact tensor resize a
    GPU uses) gives DeepSeek-OCR-2's views too: the 768 crops, bit for bit."""
    from encoder import decode, views_of
    image = noise(*size, seed=3)
    want = preprocess_ocr2(image)
    decoded = decode(image, tiling=DEEPSEEK_OCR_2)
    assert (decoded.grid, decoded.num_tokens) == (want.grid, want.num_tokens)
    for exact in (False, True):
        got = views_of(decoded, exact=exact)
        assert torch.equal(got.global_view, want.global_view) and torch.equal(got.crops, want.crops)
        assert (got.grid, got.num_tokens, got.tiling) == (want.grid, want.num_tokens, DEEPSEEK_OCR_2)
