"""The grounding parser: the reference's example, truncated and malformed variants, pixel boxes
checked by hand, and fuzzing (it never raises)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder.grounding import parse_blocks, parse_boxes, to_markdown, to_pixels

EXAMPLE = """<|ref|>title<|/ref|><|det|>[[62, 45, 938, 98]]<|/det|>
# Annual Report 2024

<|ref|>text<|/ref|><|det|>[[62, 120, 938, 300]]<|/det|>
Revenue grew by 12% ...

<|ref|>image<|/ref|><|det|>[[100, 320, 480, 700], [520, 320, 900, 700]]<|/det|>

<|ref|>table<|/ref|><|det|>[[62, 720, 938, 900]]<|/det|>
<table><tr><td>Q1</td><td>4.1</td></tr></table>"""


def test_example_blocks_with_pixel_boxes_of_a_non_square_page():
    blocks = parse_blocks(EXAMPLE, width=1191, height=1684)
    assert [b["label"] for b in blocks] == ["title", "text", "image", "table"]
    assert [b["text"] for b in blocks] == ["# Annual Report 2024", "Revenue grew by 12% ...", "",
                                           "<table><tr><td>Q1</td><td>4.1</td></tr></table>"]
    assert blocks[2]["boxes_norm"] == [[100, 320, 480, 700], [520, 320, 900, 700]]
    # int(v / 999 * side): 62/999*1191 = 73.9, 45/999*1684 = 75.9, 938/999*1191 = 1118.3,
    # 98/999*1684 = 165.2
    assert blocks[0]["boxes"] == [[73, 75, 1118, 165]]
    # 100/999*1191 = 119.2, 320/999*1684 = 539.4, 480/999*1191 = 572.3, 700/999*1684 = 1179.98
    assert blocks[2]["boxes"][0] == [119, 539, 572, 1179]
    assert all(b["parse_error"] is None for b in blocks)


def test_without_an_image_size_only_normalised_boxes():
    (block, *_) = parse_blocks(EXAMPLE)
    assert block["boxes_norm"] == [[62, 45, 938, 98]] and block["boxes"] is None


@pytest.mark.parametrize("cut", [20, 60, 200, len(EXAMPLE) - 60])
def test_truncated_output_keeps_what_it_has(cut):
    blocks = parse_blocks(EXAMPLE[:cut], 1000, 1000)
    last = blocks[-1]
    if last["parse_error"] is not None:  # cut inside a box list
        assert "cut off" in last["parse_error"] and last["boxes"] is None
    assert all(b["parse_error"] is None for b in blocks[:-1])


@pytest.mark.parametrize("det, error", [
    ("[[1, 2, 3]]", "four numbers"), ("[[1, 2, 3, 1000]]", "outside 0..999"), ("[]", "non-empty"),
    ("[[1, 2, 3, 4], 5]", "four numbers"), ("[[1, 2, 3, 4]", "not a list"), ("__import__('os')", "not a list"),
    ("[[true, 2, 3, 4]]", "four numbers"), ('[["1", 2, 3, 4]]', "four numbers"),
])
def test_malformed_box_lists_keep_the_text(det, error):
    (block,) = parse_blocks(f"<|ref|>text<|/ref|><|det|>{det}<|/det|>Hello", 640, 480)
    assert block["text"] == "Hello" and block["boxes"] is None and block["boxes_norm"] is None
    assert error in block["parse_error"]


def test_text_before_the_first_tag_and_without_tags():
    assert parse_blocks("plain text") == [{"label": None, "text": "plain text", "boxes_norm": None,
                                           "boxes": None, "parse_error": None}]
    blocks = parse_blocks("intro\n<|ref|>text<|/ref|><|det|>[[0, 0, 999, 999]]<|/det|>body", 10, 20)
    assert [b["label"] for b in blocks] == [None, "text"] and blocks[1]["boxes"] == [[0, 0, 10, 20]]
    assert parse_blocks("") == []


def test_markdown_clean_up_is_deepseeks():
    md = to_markdown(EXAMPLE + "\n$a \\coloneqq b \\eqqcolon c$", page=3)
    assert "<|ref|>" not in md and "<|det|>" not in md
    assert "![](images/3_0.jpg)" in md and md.count("![](") == 1
    assert md.startswith("# Annual Report 2024") and "$a := b =: c$" in md


def test_boxes_and_pixels_helpers():
    assert parse_boxes("[[0, 0, 999, 999]]") == ([[0, 0, 999, 999]], None)
    assert to_pixels([0, 0, 999, 999], 640, 480) == [0, 0, 640, 480]


PIECES = ["<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "[[", "]]", "[", "]", ", ", "1", "999",
          "1000", "-5", "text", "image", "\n", "é", "😀", "{", "null", "1e309", "\\", "<|"]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=5)), max_size=40),
       st.integers(1, 5000), st.integers(1, 5000))
def test_fuzz_never_raises_and_boxes_stay_inside_the_image(parts, width, height):
    text = "".join(parts)
    for block in parse_blocks(text, width, height):
        assert set(block) == {"label", "text", "boxes_norm", "boxes", "parse_error"}
        if block["boxes"] is not None:
            assert all(0 <= x <= width and 0 <= y <= height
                       for x1, y1, x2, y2 in block["boxes"] for x, y in ((x1, y1), (x2, y2)))
        assert (block["boxes_norm"] is None) == (block["parse_error"] is not None) or block["label"] is None
    to_markdown(text)
