"""Our encoder against transformers' UnlimitedOcr (same DeepSeek-OCR v1 vision stack, written by
other people), sharing random weights through the released key layout. fp32 throughout."""
import pytest
import torch
from PIL import Image

from encoder import DualPathEncoder, EncoderArgs, load_encoder, preprocess, write_random_checkpoint
from encoder.preprocess import normalize
from tests.reference import unlimited_ocr_model
from tests.helpers import rel_err

# Real head dim (64) in SAM, reduced widths and depths; global blocks 1 and 3 so a 640 crop
# runs a global block on a 40x40 grid (rel-pos tables interpolated from 127 to 79 rows).
REF_ARGS = EncoderArgs(sam_width=128, sam_depth=4, sam_heads=2, sam_global_blocks=(1, 3),
                       sam_out_chans=32, downsample_channels=(64, 128), clip_width=128,
                       clip_depth=2, clip_heads=2, n_embed=96, name="reference-test")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("ref"), REF_ARGS, seed=1,
                                   dtype=torch.float32)
    ours = load_encoder(path)
    return ours, unlimited_ocr_model(ours, REF_ARGS)


@pytest.mark.parametrize("impl", ["fused", "dense"])
@pytest.mark.parametrize("size", [512, 640, 1024, 1280])
def test_view_features_match_unlimited_ocr(pair, size, impl):
    ours, theirs = pair
    gen = torch.Generator().manual_seed(size)
    pixels = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8, generator=gen)
    with torch.inference_mode():
        expected = theirs.vision_tower(normalize(pixels)).last_hidden_state
        got = ours.set_attention(impl).features(pixels)
    ours.set_attention("fused")
    assert got.shape == expected.shape == (1, (size // 64) ** 2, REF_ARGS.projector_in)
    assert rel_err(got, expected) <= 1e-4


def _image(w, h, seed):
    gen = torch.Generator().manual_seed(seed)
    # Smooth random content (upsampled noise) so resizing does not wash it out.
    small = torch.randint(0, 256, (h // 32 + 1, w // 32 + 1, 3), dtype=torch.uint8, generator=gen)
    return Image.fromarray(small.numpy()).resize((w, h), Image.BILINEAR)


@pytest.mark.parametrize("size, grid, tokens", [
    ((448, 448), (1, 1), 273),       # untiled
    ((1191, 1684), (2, 3), 903),     # A4 page at 144 dpi
    ((640, 3840), (1, 6), 933),      # 1x6 strip
])
def test_assembled_sequence_matches_unlimited_ocr(pair, size, grid, tokens):
    ours, theirs = pair
    image = _image(*size, seed=sum(size))
    item = preprocess(image)
    assert (item.grid, item.num_tokens) == (grid, tokens)
    with torch.inference_mode():
        (got,) = DualPathEncoder(ours).encode_images([image])
        local = normalize(item.crops) if item.tiled else None
        expected = theirs.get_image_features(
            normalize(item.global_view)[None], pixel_values_local=local,
            num_local_patches=[len(item.crops)], patches_grid=[list(item.grid)]).pooler_output[0]
    assert got.shape == expected.shape == (tokens, REF_ARGS.n_embed)
    assert rel_err(got, expected) <= 1e-4
