import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decoder.tokenizer import (BOS_ID, DEFAULT_PROMPT, EOS_ID, IMAGE_TOKEN_ID, SPECIAL_TOKENS,
                               ByteTokenizer, HFTokenizer, IncrementalDecoder, build_prompt,
                               byte_tokenizer_json, count_image_tags, find_stop, holdback,
                               load_tokenizer)

SENTENCES = ["Convert the document to markdown.", "Free OCR. 中文 字符 😀", "Parse the figure.",
             "Describe this image in detail.", "| a | b |\n|---|---|"]


def tokenizer_json(special_tokens: dict[str, int]) -> str:
    """A byte-level BPE trained on a few sentences, like DeepSeek's, with the special tokens
    added at the given ids (the vocabulary need not be contiguous)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab = {token: i + 3 for token, i in vocab.items()}  # 0..2 are BOS, EOS, PAD
    vocab.update(special_tokens)
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [{"id": i, "content": s, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for s, i in special_tokens.items()]
    return json.dumps(spec, ensure_ascii=False)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    (path / "tokenizer.json").write_text(tokenizer_json(SPECIAL_TOKENS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf(checkpoint_dir):
    return load_tokenizer(checkpoint_dir)


@pytest.fixture(scope="module", params=["hf", "byte"])
def tokenizer(request, checkpoint_dir):
    return load_tokenizer(checkpoint_dir if request.param == "hf" else None)


# -- loading ----------------------------------------------------------------------------------

def test_load_none_is_the_byte_tokenizer():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.is_random
    assert tok.vocab_size == 129280 and (tok.bos_id, tok.eos_id) == (0, 1)


def test_load_directory_is_the_hf_tokenizer(hf, checkpoint_dir):
    assert isinstance(hf, HFTokenizer) and not hf.is_random and hf.name == "tokenizer.json"
    assert (hf.bos_id, hf.eos_id) == (BOS_ID, EOS_ID)
    assert hf.vocab_size == Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json")) \
        .get_vocab_size(with_added_tokens=True)


def test_load_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json at .*" + tmp_path.name):
        load_tokenizer(tmp_path)


def test_tokenizer_without_deepseek_image_token_is_refused(tmp_path):
    moved = {**SPECIAL_TOKENS, "<image>": 500}
    (tmp_path / "tokenizer.json").write_text(tokenizer_json(moved), encoding="utf-8")
    with pytest.raises(ValueError, match="not DeepSeek-OCR's tokenizer"):
        load_tokenizer(tmp_path)


# -- encode / decode --------------------------------------------------------------------------

@pytest.mark.parametrize("special, token_id", sorted(SPECIAL_TOKENS.items()))
def test_special_tokens_in_text_map_to_their_ids(tokenizer, special, token_id):
    ids = tokenizer.encode(f"Free {special}OCR.")
    assert ids.count(token_id) == 1
    assert tokenizer.decode(ids) == f"Free {special}OCR."


def test_hf_encodes_without_bos_or_eos(hf):
    ids = hf.encode("Parse the figure.")
    assert ids and BOS_ID not in ids and EOS_ID not in ids
    assert hf.decode(ids) == "Parse the figure."


@pytest.mark.parametrize("text, ids", [
    ("", []),
    ("A", [3 + 65]),
    ("é", [3 + 0xC3, 3 + 0xA9]),
    ("<|det|><|/det|>", [128818, 128819]),
    ("<td>x</td>", [128821, 3 + ord("x"), 128822]),
    ("<imag", [3 + b for b in b"<imag"]),  # not a special token
])
def test_byte_tokenizer_encode(text, ids):
    assert ByteTokenizer().encode(text) == ids


@pytest.mark.parametrize("ids, text", [
    ([3 + 0xE4, 3 + 0xB8, 3 + 0xAD], "中"),
    ([0, 3 + 104, 1], "<｜begin▁of▁sentence｜>h<｜end▁of▁sentence｜>"),
    ([3 + 0xE4, 128815], "\ufffd<image>"),  # invalid bytes are visible, not dropped
    ([12345, 259, 129279], "<|id:12345|><|id:259|><|id:129279|>"),
])
def test_byte_tokenizer_decode(ids, text):
    assert ByteTokenizer().decode(ids) == text


TEXT = st.lists(st.text() | st.sampled_from([*SPECIAL_TOKENS, "😀", "中文字符", "<ima", "ge>",
                                             "<|id:7|>", "\ufffd"])).map("".join)


@settings(max_examples=200, deadline=None)
@given(TEXT)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_refuses_lone_surrogates():
    with pytest.raises(ValueError, match="surrogate"):
        ByteTokenizer().encode("a\ud800")


# -- prompts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["\nFree OCR.",
                                  "\n<|grounding|>Convert the document to markdown."])
def test_prompt_token_count(tokenizer, text):
    ids = build_prompt(tokenizer, "<image>" + text, [903])
    assert len(ids) == 1 + 903 + len(tokenizer.encode(text))
    assert ids[0] == BOS_ID and EOS_ID not in ids
    assert ids[1:904] == [IMAGE_TOKEN_ID] * 903
    assert ids[904:] == tokenizer.encode(text)


def test_prompt_with_two_images_places_each_run(tokenizer):
    before, between, after = "Compare ", " with ", " please."
    ids = build_prompt(tokenizer, f"{before}<image>{between}<image>{after}", [3, 5])
    a, b, c = (tokenizer.encode(t) for t in (before, between, after))
    assert ids == [BOS_ID, *a, *[IMAGE_TOKEN_ID] * 3, *b, *[IMAGE_TOKEN_ID] * 5, *c]


def test_empty_chunks_encode_to_nothing(tokenizer):
    assert build_prompt(tokenizer, "<image><image>", [2, 1]) == [BOS_ID] + [IMAGE_TOKEN_ID] * 3
    assert build_prompt(tokenizer, "", []) == [BOS_ID]


def test_default_prompt_maps_grounding_to_its_id(tokenizer):
    ids = build_prompt(tokenizer, DEFAULT_PROMPT, [4])
    assert ids[5:5 + len(tokenizer.encode("\n"))] == tokenizer.encode("\n")
    assert ids[5 + len(tokenizer.encode("\n"))] == SPECIAL_TOKENS["<|grounding|>"]


@pytest.mark.parametrize("prompt, counts, message", [
    ("<image><image>x", [10], "prompt has 2 <image> tags but 1 image was given"),
    ("<image>x", [10, 20], "prompt has 1 <image> tag but 2 images were given"),
    ("no image", [10], "prompt has 0 <image> tags but 1 image was given"),
    ("<image>x", [], "prompt has 1 <image> tag but 0 images were given"),
])
def test_tag_and_image_count_mismatch(prompt, counts, message):
    with pytest.raises(ValueError, match=message):
        build_prompt(ByteTokenizer(), prompt, counts)


@pytest.mark.parametrize("count", [0, -3, 2.0, True, "5", None])
def test_image_token_counts_must_be_positive_ints(count):
    with pytest.raises(ValueError, match="positive ints"):
        build_prompt(ByteTokenizer(), "<image>x", [count])


@pytest.mark.parametrize("prompt, tags", [("", 0), ("<image>", 1), ("a<image>b<image>", 2),
                                          ("<imag e>", 0)])
def test_count_image_tags(prompt, tags):
    assert count_image_tags(prompt) == tags


def test_byte_tokenizer_json_encodes_like_the_byte_tokenizer(tmp_path):
    """The tokenizer.json random checkpoints carry: the real (HF) loading path, byte ids."""
    (tmp_path / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    hf, byte = load_tokenizer(tmp_path), ByteTokenizer()
    for text in [*SENTENCES, DEFAULT_PROMPT, "x<td>y</td>\x00 é\n\t", "  two  spaces "]:
        assert hf.encode(text) == byte.encode(text)
        assert hf.decode(hf.encode(text)) == text


# -- incremental decoding ---------------------------------------------------------------------

def stream(tokenizer, ids, chunks=None):
    """Push ids in the given chunk sizes (default one at a time); the deltas and flush()."""
    decoder = IncrementalDecoder(tokenizer)
    deltas, pos = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(decoder.push(ids[pos:pos + size]))
        pos += size
    return deltas, decoder.flush()


@pytest.mark.parametrize("text", ["漢字🦀 and ç", "😀😀 <td>中</td>", "plain ascii", "ﬁ𝕏"])
def test_deltas_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    # The test is only meaningful if some character really spans tokens.
    if text != "plain ascii":
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas, tail = stream(tokenizer, ids)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas) and tail == ""


def test_incomplete_tail_is_held_until_completed_or_flushed(tokenizer):
    ids = tokenizer.encode("a漢")
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # the last id completes 漢
    completed = IncrementalDecoder(tokenizer)
    assert completed.push(ids[:-1]) == ""
    assert completed.push(ids[-1:]) == "a漢" and completed.flush() == ""
    flushed = IncrementalDecoder(tokenizer)
    assert flushed.push(ids[:-1]) == ""
    assert flushed.flush() == tokenizer.decode(ids[:-1]) and flushed.flush() == ""


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_the_full_decode(data):
    tok = ByteTokenizer()
    # Bytes (valid and broken UTF-8), special tokens and arbitrary ids, as the random model emits.
    ids = data.draw(st.lists(st.integers(3, 258) | st.sampled_from([0, 1, 128815, 128821, 5000]),
                             max_size=40), label="ids")
    chunks, left = [], len(ids)
    while left:
        chunks.append(data.draw(st.integers(1, left), label="chunk"))
        left -= chunks[-1]
    deltas, tail = stream(tok, ids, chunks)
    assert "".join(deltas) + tail == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(TEXT)
def test_deltas_of_valid_text_have_no_replacement_chars(text):
    tok = ByteTokenizer()
    deltas, tail = stream(tok, tok.encode(text))
    assert "".join(deltas) + tail == text
    # A literal U+FFFD at the end is held back until flush(); none is ever made up.
    assert "".join(deltas).count("\ufffd") <= text.count("\ufffd")


# -- stop strings -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, stops, start, found", [
    ("hello world", ["world"], 0, 6),
    ("hello world", ["world"], 8, 6),  # spans the delta boundary at 8
    ("hello world", ["xyz"], 0, None),
    ("hello world", [], 0, None),
    ("hello world", [""], 0, None),
    ("ab STOP cd END", ["END", "STOP"], 0, 3),  # earliest, not first listed
    ("ab STOP cd END", ["END", "STOP"], 12, 11),  # only what may be new since 12
    ("</s>", ["</s>"], 4, None),  # text[:start] was searched before
    ("x</s>", ["</s>"], 4, 1),
])
def test_find_stop(text, stops, start, found):
    assert find_stop(text, stops, start) == found


@pytest.mark.parametrize("text, stops, held", [
    ("hello wor", ["world"], 3),
    ("hello", ["world"], 0),
    ("abc<", ["<|end|>", "x"], 1),
    ("abc<|en", ["<|end|>", "n"], 4),
    ("abc", [], 0),
    ("ww", ["www"], 2),
    ("w", ["www"], 1),
])
def test_holdback(text, stops, held):
    assert holdback(text, stops) == held


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="ab<>", max_size=30), cuts=st.lists(st.integers(0, 30)),
       stops=st.lists(st.text(alphabet="ab<>", min_size=1, max_size=4), min_size=1, max_size=3))
def test_streamed_stop_search_finds_the_first_stop(text, cuts, stops):
    """Searching each new delta only where a stop could now end finds what a full search of
    each prefix (in stream order) finds first, and nothing past that stop's start was sent."""
    ends = sorted({*(c for c in cuts if c <= len(text)), len(text)})
    expected = None  # the first prefix that holds a stop, searched whole
    for end in ends:
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            expected = min(hits)
            break
    found, searched, sent = None, 0, 0
    for end in ends:
        found = find_stop(text[:end], stops, searched)
        if found is not None:
            break
        searched = end
        sent = end - holdback(text[:end], stops)  # what streaming may send so far
    assert found == expected
    assert found is None or sent <= found
