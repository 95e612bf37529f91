"""The exact tensor resize (encoder/resize.py) and the views made with it, against PIL itself."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from encoder import resize as exact
from encoder.preprocess import (MODES, crops_of, decode, global_view_of, preprocess,
                                start_preprocess, views_of)
from tests.conftest import run_in_triton_interpreter


def pil_resize(array: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """PIL's resize of an HW or HWC uint8 array, as [C, H, W]."""
    out = np.asarray(Image.fromarray(array).resize(size, Image.BICUBIC))
    return torch.from_numpy((out[None] if out.ndim == 2 else out.transpose(2, 0, 1)).copy())


def chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array[None] if array.ndim == 2 else array.transpose(2, 0, 1)))


def test_the_installed_pillow_follows_a_known_pass_order():
    assert exact.pil_rule() in ("horizontal-first", "height-first")


@settings(max_examples=150, deadline=None)
@given(src=st.tuples(st.integers(1, 260), st.integers(1, 260)),
       size=st.tuples(st.integers(1, 320), st.integers(1, 320)),
       channels=st.sampled_from([1, 3]), seed=st.integers(0, 2 ** 16))
def test_resize_equals_pil_pixel_for_pixel(src, size, channels, seed):
    shape = (src[1], src[0]) if channels == 1 else (src[1], src[0], 3)
    array = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    assert torch.equal(exact.resize(chw(array), size), pil_resize(array, size))


@pytest.mark.parametrize("src, size", [
    ((57, 285), (9, 156)),        # height loses more than twice the width's pixels: Pillow 13 goes vertical first
    ((300, 200), (100, 200)),     # one axis only
    ((200, 300), (200, 100)),
    ((64, 64), (64, 64)),         # no pass at all
    ((1191, 1684), (1280, 1920)),  # a page's crop grid (2x3), upscaled
    ((1191, 1684), (724, 1024)),   # the same page's global view, downscaled
])
def test_resize_equals_pil_on_named_cases(src, size):
    array = np.random.default_rng(sum(src)).integers(0, 256, (src[1], src[0], 3), dtype=np.uint8)
    assert torch.equal(exact.resize(chw(array), size), pil_resize(array, size))


def test_large_downscale_in_chunks_equals_pil(monkeypatch):
    """A 25-tap filter (a scan shrunk 6x), with the gathered temporary cut into many chunks."""
    monkeypatch.setattr(exact, "_CHUNK_ELEMENTS", 1 << 16)
    array = np.random.default_rng(5).integers(0, 256, (1900, 1300, 3), dtype=np.uint8)
    assert torch.equal(exact.resize(chw(array), (210, 320)), pil_resize(array, (210, 320)))


def test_resize_names_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        exact.resize(torch.zeros(3, 8, 8), (4, 4))


def test_coefficients_are_pillows_fixed_point():
    """Each output's weights sum to one in 22-bit fixed point, up to the rounding of each."""
    for in_size, out_size in [(1191, 1280), (1684, 1024), (5000, 640), (7, 300)]:
        _, weights = exact.coefficients(in_size, out_size)
        ksize = weights.shape[1]
        assert np.all(np.abs(weights.sum(1) - (1 << exact.PRECISION_BITS)) <= ksize)


def image(size, kind: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (size[1] // 4 + 1, size[0] // 4 + 1, 3), dtype=np.uint8)
    picture = Image.fromarray(rgb).resize(size, Image.BILINEAR)
    return {"rgb": picture, "L": picture.convert("L"), "grey-rgb": picture.convert("L").convert("RGB"),
            "1": picture.convert("1")}[kind]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("size, kind", [
    ((448, 448), "rgb"), ((1191, 1684), "L"), ((1191, 1684), "grey-rgb"), ((640, 3840), "rgb"),
    ((700, 500), "1"), ((641, 640), "rgb"), ((2000, 30), "L"), ((1, 3000), "L"), ((3, 2500), "rgb"),
], ids=str)
@pytest.mark.parametrize("exact_resize", [True, False], ids=["tensor-resize", "pil"])
def test_views_from_decoded_pixels_equal_preprocess(mode, size, kind, exact_resize):
    picture = image(size, kind, sum(size))
    reference = preprocess(picture, mode=mode)
    decoded = decode(picture, mode=mode)
    views = views_of(decoded, exact=exact_resize)
    assert decoded.pixels.shape[0] == (3 if kind == "rgb" else 1)  # grey images travel as one channel
    assert torch.equal(views.global_view, reference.global_view)
    assert torch.equal(views.crops, reference.crops)
    assert (views.grid, views.num_tokens, views.original_size, views.mode) == \
        (reference.grid, reference.num_tokens, reference.original_size, reference.mode)
    assert views.global_view.is_contiguous() and views.crops.is_contiguous()


def test_decode_keeps_exif_orientation_and_errors():
    picture = image((300, 700), "rgb", 3)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    data = io.BytesIO()
    picture.save(data, "JPEG", exif=exif)
    decoded = decode(data.getvalue())
    assert decoded.original_size == (700, 300) == start_preprocess(data.getvalue()).original_size
    assert torch.equal(views_of(decoded).global_view, preprocess(data.getvalue()).global_view)
    with pytest.raises(ValueError, match="cannot decode"):
        decode(b"not an image")


def test_single_views_on_the_device_of_the_pixels():
    decoded = decode(image((1191, 1684), "L", 1))
    reference = preprocess(image((1191, 1684), "L", 1))
    assert torch.equal(global_view_of(decoded.pixels, exact=True), reference.global_view)
    assert torch.equal(crops_of(decoded.pixels, decoded.grid, exact=True), reference.crops)


@pytest.mark.gpu
def test_views_on_the_gpu_equal_pil():
    for size, kind in [((1191, 1684), "L"), ((1191, 1684), "rgb"), ((4000, 3000), "rgb")]:
        picture = image(size, kind, 7)
        reference = preprocess(picture)
        views = views_of(decode(picture), device="cuda")  # exact: the default on a GPU
        assert views.global_view.is_cuda
        assert torch.equal(views.global_view.cpu(), reference.global_view)
        assert torch.equal(views.crops.cpu(), reference.crops)


RESIZE_KERNEL_SCRIPT = """
import numpy as np
import torch
from encoder import resize
from encoder.triton_resize import resample
rng = np.random.default_rng(0)
# (src w, h), (out w, h), channels: up and down, one channel and three, a 31-tap downscale
for (w, h), (ow, oh), c in [((37, 23), (50, 11), 3), ((64, 200), (20, 64), 1), ((300, 40), (41, 9), 1)]:
    x = torch.from_numpy(rng.integers(0, 256, (c, h, w), dtype=np.uint8))
    for dim, out in ((2, ow), (1, oh)):
        index, weights = resize._device_coefficients(x.shape[dim], out, x.device, torch.int32)
        got = resample(x, dim, index, weights, resize.PRECISION_BITS)
        assert torch.equal(got, resize._resample_torch(x, dim, out)), ((w, h), dim)
print("resize kernel ok")
"""


def test_resize_kernel_equals_torchs_pass_in_interpreter_mode():
    """The one-kernel pass (triton_resize) against torch's ops, its twin, on both axes."""
    pytest.importorskip("triton")
    assert "resize kernel ok" in run_in_triton_interpreter(RESIZE_KERNEL_SCRIPT)


@pytest.mark.gpu
def test_resize_kernel_equals_torchs_pass_on_the_gpu(monkeypatch):
    """On the GPU: pages' sizes and random ones, the kernel's passes against torch's (the switch
    off), and against PIL."""
    pytest.importorskip("triton")
    rng = np.random.default_rng(1)
    cases = [((1191, 1684), (1280, 1920)), ((1191, 1684), (724, 1024)), ((4000, 3000), (1024, 768)),
             ((57, 285), (9, 156))]
    cases += [(tuple(rng.integers(1, 900, 2)), tuple(rng.integers(1, 900, 2))) for _ in range(20)]
    for i, (src, size) in enumerate(cases):
        array = rng.integers(0, 256, (src[1], src[0]) if i % 2 else (src[1], src[0], 3), dtype=np.uint8)
        x = chw(array).cuda()
        monkeypatch.setattr(exact, "FUSED_PASS", True)
        fused = exact.resize(x, size)
        monkeypatch.setattr(exact, "FUSED_PASS", False)
        assert torch.equal(fused, exact.resize(x, size)), (src, size)
        assert torch.equal(fused.cpu(), pil_resize(array, size)), (src, size)
