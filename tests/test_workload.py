"""bench/workload.py: a fixed seed gives the same mix byte for byte, every kind is in it, the
lengths follow the stated distribution, and every page is one the app reads."""
import dataclasses
import io

import pytest
from PIL import Image

from bench.workload import (KIND_SHARES, LENGTH_CLIP, describe, draw_lengths, draw_specs, image_tokens,
                            make_workload, render)
from encoder.headers import decode_header, read_header

SEED = 38


@pytest.fixture(scope="module")
def mix():
    return make_workload(60, SEED, workers=2)


def first_of_each_kind(specs):
    return [next(spec for spec in specs if spec.kind == kind) for kind in KIND_SHARES]


def test_a_fixed_seed_gives_the_same_mix_byte_for_byte(mix):
    specs = draw_specs(60, SEED)
    assert specs == draw_specs(60, SEED)
    assert [(item.kind, item.max_tokens) for item in mix] == [(spec.kind, spec.max_tokens) for spec in specs]
    for spec in first_of_each_kind(specs):  # rendered again, alone, in this process
        assert render(spec) == mix[spec.index]


def test_different_seeds_give_different_mixes():
    one, other = draw_specs(60, 1), draw_specs(60, 2)
    assert [s.kind for s in one] != [s.kind for s in other]
    assert [s.max_tokens for s in one] != [s.max_tokens for s in other]
    for spec in first_of_each_kind(one):  # the same kind of page, drawn from another seed
        assert render(spec).image != render(dataclasses.replace(spec, seed=2)).image


def test_every_kind_format_and_size_class_is_in_a_mix_of_60(mix):
    mixed = describe(mix)
    assert mixed["pages"] == 60
    assert mixed["kinds"] == {kind: round(60 * share) for kind, share in KIND_SHARES.items()}
    assert set(mixed["formats"]) == {"png", "jpeg"}
    assert set(mixed["size_classes"]) == {"a4", "letter", "odd", "photo", "16:9", "receipt", "strip"}
    assert len({item.image for item in mix}) == 60  # every page differs: an encoder cache never hits


def test_lengths_follow_the_stated_distribution():
    lengths = sorted(draw_lengths(200_000, SEED))
    at = lambda q: lengths[int(q * len(lengths))]  # noqa: E731
    assert 680 <= at(0.5) <= 720
    assert 140 <= at(0.05) <= 160
    assert 2400 <= at(0.95) <= 2600
    assert LENGTH_CLIP == (lengths[0], lengths[-1])


def test_image_tokens_span_the_models_range():
    """From an untiled line (273 tokens) to a tall 1x6 grid (933)."""
    assert image_tokens((600, 80)) == 273
    assert image_tokens((1240, 1754)) == 903
    assert image_tokens((384, 2600)) == 933


def test_every_page_decodes_and_reads_as_the_app_reads_it(mix):
    """PIL decodes each page; the router's header reader finds its size (EXIF orientation
    applied) and the encoder decodes it from that header, grey pages on one channel."""
    for item in mix:
        with Image.open(io.BytesIO(item.image)) as image:
            image.load()
            assert image.format == item.format.upper()
        header = read_header(item.image)
        assert header is not None and header.original_size == item.size
        assert header.num_tokens == item.image_tokens
        decoded = decode_header(header)
        if item.kind == "grey_text":
            assert decoded.pixels.shape[0] == 1
        elif item.kind in ("colour_scan", "photo", "slide"):
            assert decoded.pixels.shape[0] == 3
    turned = [item for item in mix if Image.open(io.BytesIO(item.image)).size != item.size]
    assert turned and {item.kind for item in turned} == {"photo"}  # stored turned, EXIF saying so
