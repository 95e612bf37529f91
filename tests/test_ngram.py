import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder.ngram import NGramConfig, NoRepeatNGram
from decoder.tokenizer import TD_CLOSE_ID, TD_ID


def banned_reference(tokens, n, window, whitelist):
    """DeepSeek-OCR's vLLM NoRepeatNGramLogitsProcessor, a scan of the window per step."""
    if len(tokens) < n:
        return set()
    prefix = tuple(tokens[-(n - 1):])
    start, end = max(0, len(tokens) - window), len(tokens) - n + 1
    banned = {tokens[i + n - 1] for i in range(start, end) if tuple(tokens[i:i + n - 1]) == prefix}
    return banned - set(whitelist)


def pushed(tokens, **kwargs) -> NoRepeatNGram:
    rule = NoRepeatNGram(**kwargs)
    for t in tokens:
        rule.push(t)
    return rule


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(2, 5))
def test_matches_reference_after_every_push(data, n):
    window = data.draw(st.integers(n, 20), label="window")
    # A small alphabet so that n-grams repeat; 7 stands in for a whitelisted id.
    tokens = data.draw(st.lists(st.integers(0, 3) | st.just(7), max_size=60), label="tokens")
    whitelist = data.draw(st.sampled_from([(), (7,), (0, 7)]), label="whitelist")
    rule = NoRepeatNGram(n, window, whitelist)
    assert rule.banned() == set()
    for length, token in enumerate(tokens, 1):
        rule.push(token)
        assert rule.banned() == banned_reference(tokens[:length], n, window, whitelist), length


def test_defaults_are_deepseeks():
    rule = NoRepeatNGram()
    assert (rule.ngram_size, rule.window, rule.whitelist) == (30, 90, {TD_ID, TD_CLOSE_ID})
    assert (NGramConfig().ngram_size, NGramConfig().window) == (30, 90)
    assert NGramConfig().whitelist == (128821, 128822) and NGramConfig().enabled


@pytest.mark.parametrize("filler, banned", [(0, {129}), (31, {129}), (32, set()), (60, set())])
def test_repeat_of_a_30_gram_is_banned_only_within_90_tokens(filler, banned):
    pattern = list(range(100, 130))
    tokens = pattern + list(range(1000, 1000 + filler)) + pattern[:-1]
    # The earlier 30-gram starts at 0; it is in the window while len(tokens) <= 90.
    assert pushed(tokens).banned() == banned


@pytest.mark.parametrize("n, tokens, banned", [
    (2, [5, 6, 5], {6}),
    (2, [5, 6, 5, 7, 5], {6, 7}),
    (3, [5, 6, 7, 5, 6], {7}),
    (3, [5, 6, 7, 5, 8], set()),  # prefix (5, 8) never seen
    (3, [5, 5, 5], {5}),
    (4, [1, 2, 3], set()),  # shorter than n
])
def test_banned_small_cases(n, tokens, banned):
    assert pushed(tokens, ngram_size=n, window=10).banned() == banned


@pytest.mark.parametrize("cell", [TD_ID, TD_CLOSE_ID])
def test_table_cell_tags_are_never_banned(cell):
    tokens = [cell, 9, cell, 9, cell, 9]
    assert pushed(tokens, ngram_size=2, window=10).banned() == set()  # prefix 9 -> cell
    assert pushed(tokens + [cell], ngram_size=2, window=10).banned() == {9}
    assert pushed(tokens, ngram_size=2, window=10, whitelist=()).banned() == {cell}


@pytest.mark.parametrize("n, window, message", [
    (1, 10, "at least 2"), (0, 10, "at least 2"), (5, 4, "window 4"), (2.0, 10, "int"),
    (3, True, "int"),
])
def test_invalid_sizes_are_refused(n, window, message):
    with pytest.raises(ValueError, match=message):
        NoRepeatNGram(n, window)
    with pytest.raises(ValueError, match=message):
        NGramConfig(ngram_size=n, window=window)


@pytest.mark.parametrize("whitelist", [(-1,), ("<td>",), (1.5,)])
def test_invalid_whitelist_is_refused(whitelist):
    with pytest.raises(ValueError, match="whitelist"):
        NGramConfig(whitelist=whitelist)
    with pytest.raises(ValueError, match="whitelist"):
        NoRepeatNGram(whitelist=whitelist)


def test_config_off_and_overrides():
    assert not NGramConfig.off().enabled
    config = NGramConfig(ngram_size=3, window=6, whitelist=[4])
    assert config.whitelist == (4,) and config.enabled  # lists become tuples (hashable)
    with pytest.raises(ValueError, match="enabled"):
        NGramConfig(enabled="no")
