"""Unlimited-OCR's n-gram guard: the same windowed rule as DeepSeek-OCR's, but over the prompt and
the generated tokens together and with nothing exempt (its `SlidingWindowNoRepeatNgramProcessor`;
transformers' `UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor`), size 35 over 128 tokens
for one page and 1,024 for several."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder import DecoderArgs, GenerationEngine, GenerationRequest, SamplingParams, ngram_defaults
from decoder.checkpoint import random_decoder
from decoder.ngram import NGramConfig
from decoder.tokenizer import TD_CLOSE_ID, TD_ID, ByteTokenizer


def transformers_processor(n, window):
    mod = pytest.importorskip("transformers.models.unlimited_ocr.generation_unlimited_ocr",
                              reason="transformers >= 5.20 (unlimited_ocr) not installed")
    return mod.UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor(ngram_size=n, window_size=window)


def banned_by(processor, sequence, vocab=16) -> set[int]:
    scores = processor(torch.tensor([sequence]), torch.zeros(1, vocab))
    return set(torch.nonzero(scores[0] == float("-inf")).flatten().tolist())


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(2, 5))
def test_prompt_spanning_rule_matches_transformers(data, n):
    """After the prompt and after every generated token, the banned set equals transformers'
    processor over prompt + generated (a small alphabet so that n-grams repeat, in the prompt,
    across its end and after it)."""
    window = data.draw(st.integers(n, 20), label="window")
    prompt = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=40), label="prompt")
    generated = data.draw(st.lists(st.integers(0, 3), max_size=30), label="generated")
    processor = transformers_processor(n, window)
    rule = NGramConfig(ngram_size=n, window=window, whitelist=(), include_prompt=True).rule(prompt)
    assert rule.banned() == banned_by(processor, prompt)
    for length, token in enumerate(generated, 1):
        rule.push(token)
        assert rule.banned() == banned_by(processor, prompt + generated[:length]), length


def test_the_prompt_counts_only_when_asked():
    prompt = [5, 6, 7, 5, 6]

    def banned(window, include_prompt):
        config = NGramConfig(ngram_size=3, window=window, whitelist=(), include_prompt=include_prompt)
        return config.rule(prompt).banned()
    assert banned(10, True) == {7} and banned(10, False) == set()
    # Only the last `window` tokens of the prompt count: the 3-gram (5, 6, 7) is out of 4
    assert banned(4, True) == set()
    assert NGramConfig.off().rule(prompt) is None


def test_release_defaults_per_model():
    unlimited = DecoderArgs.unlimited_ocr()
    one, several = ngram_defaults(unlimited, 1), ngram_defaults(unlimited, 3)
    assert (one.ngram_size, one.window, one.whitelist, one.include_prompt) == (35, 128, (), True)
    assert (several.ngram_size, several.window) == (35, 1024) and several.include_prompt
    assert ngram_defaults(unlimited, 0) == one  # a text-only prompt: the one-page guard
    assert ngram_defaults(DecoderArgs(), 1) == ngram_defaults(DecoderArgs(), 5) == NGramConfig()
    assert NGramConfig().whitelist == (TD_ID, TD_CLOSE_ID) and not NGramConfig().include_prompt
    with pytest.raises(ValueError, match="num_images"):
        ngram_defaults(unlimited, -1)
    with pytest.raises(ValueError, match="include_prompt"):
        NGramConfig(include_prompt="yes")


def test_engine_applies_the_prompt_spanning_rule():
    """Greedy generation under the rule with `include_prompt`, through the engine, against a
    reference loop (full recomputation, transformers' processor over prompt + generated). The
    prompt [BOS, 70, a, u, a] is built so that the model's first pick after it is u: the bigram
    (a, u) of the prompt bans it at once, and the generated-only rule's generation differs."""
    model = random_decoder(DecoderArgs.tiny(), seed=2)

    def first_pick(ids):
        with torch.inference_mode():
            return int(model(input_ids=torch.tensor([ids]))[0, -1].argmax())
    prompt = None
    for a in range(60, 80):  # u <- the pick after [BOS, 70, a, u, a], to a fixed point
        u = 5
        for _ in range(8):
            u, previous = first_pick([0, 70, a, u, a]), u
            if u == previous:
                prompt = [0, 70, a, u, a]
                break
        if prompt:
            break
    assert prompt, "no prompt whose first pick repeats one of its bigrams"
    n, window, steps = 2, 20, 30
    processor = transformers_processor(n, window)
    expected = []
    with torch.inference_mode():
        for _ in range(steps):
            sequence = prompt + expected
            logits = model(input_ids=torch.tensor([sequence]))[:, -1]
            expected.append(int(processor(torch.tensor([sequence]), logits).argmax()))
    rules = [NGramConfig(ngram_size=n, window=window, whitelist=(), include_prompt=p) for p in (True, False)]
    engine = GenerationEngine(model, ByteTokenizer(), max_batch=2, max_len=512)
    spanning, generated_only = engine.generate(
        [GenerationRequest(prompt, params=SamplingParams(max_tokens=steps, ngram=r, ignore_eos=True))
         for r in rules])
    assert spanning.token_ids == expected and expected[0] != prompt[3]
    assert generated_only.token_ids[0] == prompt[3]
