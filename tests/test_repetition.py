"""The loop detector (decoder/repetition.py): loops of periods 1 to 300 tokens, exact and with
small variations, end as "repetition" once they pass the threshold; the outputs that
legitimately repeat (empty and same-shaped table rows, dotted leaders, numbered lists, page
furniture and identical pages of one multi-page answer) do not; in the engine, a looping
sequence stops at its threshold with the text before the loop, and one that does not loop is
generated exactly as with the detector off."""
import random
import re

import pytest
import torch

from decoder.engine import GenerationEngine, GenerationRequest, SamplingParams
from decoder.ngram import NGramConfig
from decoder.repetition import STRUCTURE, TEXT, RepetitionGuard, unit_kind
from decoder.tokenizer import ByteTokenizer, build_prompt

GUARD = RepetitionGuard()
OFF = RepetitionGuard(enabled=False)


class WordTokenizer:
    """Words, spaces, punctuation and tags as tokens, each a fresh id: about as many tokens as
    a BPE vocabulary makes of these outputs (bytes would make a table row five times longer)."""

    PIECES = re.compile(r"<[^>]+>|\w+|\s+|[^\w\s<]+")

    def __init__(self):
        self.ids, self.pieces = {}, []

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in self.PIECES.findall(text):
            if piece not in self.ids:
                self.ids[piece] = len(self.pieces)
                self.pieces.append(piece)
            out.append(self.ids[piece])
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def first_loop(ids: list[int], decode, guard: RepetitionGuard = GUARD):
    """(tokens pushed when the loop was found, the Loop), or None."""
    detector = guard.detector(decode)
    for n, token in enumerate(ids, 1):
        found = detector.push(token)
        if found is not None:
            return n, found
    return None


WORDS = ("the of and to in is was for on that with as by at from his an were are which this be "
         "report figure table value total annual income section page results method").split()


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.mark.parametrize("period", [1, 7, 60, 300])
def test_an_exact_loop_of_any_period_is_found_at_its_threshold(period):
    """A text unit of `period` tokens repeated after 150 tokens of prose: found once the
    repeats pass max(min_tokens, min_repeats periods), its start where the repeats begin (within
    one period: the unit's first occurrence may itself begin inside the prose)."""
    rng, tok = random.Random(period), WordTokenizer()
    head = tok.encode(prose(rng, 75) + " ")
    unit = tok.encode(" ".join(rng.choice(WORDS) for _ in range(max(1, period // 2))) + " ")[:period]
    unit = unit if len(unit) == period else (unit * period)[:period]
    ids = head + unit * (1 + (GUARD.min_tokens + 2 * period) // period + 5)
    n, loop = first_loop(ids, tok.decode)
    assert loop.period == period
    assert len(head) <= loop.start_token <= len(head) + period
    assert n <= loop.start_token + max(GUARD.min_tokens, GUARD.min_repeats * period) + 1


def test_a_loop_with_a_counter_in_it_passes_the_ngram_rule_but_not_the_detector():
    """`Item 1: ...`, `Item 2: ...`: a token differs every period, so no n-gram repeats (the
    rule bans nothing) while the detector, comparing a period back, finds the loop: one that
    varies, so at `varied_tokens` (lists of similar items look so too)."""
    tok = WordTokenizer()
    head = tok.encode(prose(random.Random(1), 50))
    ids = head + tok.encode("".join(f"\nItem {i}: the quick brown fox jumps over the dog." for i in range(400)))
    n, loop = first_loop(ids, tok.decode)
    assert loop.period == len(tok.encode("\nItem 1: the quick brown fox jumps over the dog."))
    assert GUARD.varied_tokens <= n - len(head) <= GUARD.varied_tokens + 2 * loop.period  # of ~8,000


LEGITIMATE = {
    # 150 empty rows: one unit of markup repeated exactly, 1,500 tokens (under varied_tokens)
    "empty table": "<table><tr><td>Name</td><td>Qty</td><td>Price</td></tr>"
                   + "<tr><td></td><td></td><td></td></tr>" * 150 + "</table>",
    "same-shaped rows": "| date | in | out |\n|---|---|---|\n"
                        + "".join(f"| 2024-01-{d % 28 + 1:02d} | 0.00 | 0.00 |\n" for d in range(120)),
    "empty markdown rows": "| a | b | c |\n|---|---|---|\n" + "| | | |\n" * 200,
    "dotted leaders": "\n".join(f"{i}. {prose(random.Random(i), 4)} " + "." * 60 + f" {i * 7}" for i in range(1, 80)),
    "numbered list": "\n".join(f"{i}." for i in range(1, 400)),
    "numbered items": "\n".join(f"{i}. {prose(random.Random(i), 8)}." for i in range(1, 300)),
    "similar items": "\n".join(f"{i}. See the note on page {i + 3}." for i in range(1, 100)),
    "signature lines": "Signed: ____________________\n" * 40,
    "page furniture": "".join(f"ACME Corp. Annual Report 2024\n{prose(random.Random(p), 80)}\nPage {p}\n<PAGE>\n"
                              for p in range(12)),
    "identical pages": "FORM 7 Name: ________ Address: ________ Signature: ________\n<PAGE>\n" * 40,
    "prose": prose(random.Random(3), 4000),
}


@pytest.mark.parametrize("name", LEGITIMATE)
def test_what_documents_legitimately_repeat_is_no_loop(name):
    tok = WordTokenizer()
    assert first_loop(tok.encode(LEGITIMATE[name]), tok.decode) is None


def test_a_loop_of_markup_is_found_past_the_structure_threshold():
    """Empty cells forever (a table loop the model cannot leave) end too, only later."""
    tok = WordTokenizer()
    ids = tok.encode("<table>" + "<tr><td></td><td></td></tr>" * 1000)
    n, loop = first_loop(ids, tok.decode)
    assert GUARD.varied_tokens <= n <= GUARD.varied_tokens + 2 * loop.period + 10


def test_what_a_unit_repeats():
    assert unit_kind("the same words again ") == TEXT
    assert unit_kind("<td></td>") == unit_kind("| | |") == unit_kind(" ....... 12") == STRUCTURE
    assert unit_kind("Header\n<PAGE>\n") == "exempt"


@pytest.mark.parametrize("settings", [{"min_tokens": 8}, {"max_period": 0}, {"similarity": 0.3},
                                      {"varied_tokens": 100, "min_tokens": 200}, {"enabled": "yes"},
                                      {"min_repeats": 2.0}])
def test_bad_settings_are_refused_naming_them(settings):
    with pytest.raises(ValueError, match=next(iter(settings)) if "varied" not in str(settings) else "varied"):
        RepetitionGuard(**settings)


# -- in the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from decoder.checkpoint import load_decoder
    from deployments.model_source import write_random_model
    import tempfile
    return load_decoder(write_random_model(tempfile.mkdtemp(), dtype=torch.float32))


UNIT = list(b"the same line once more ")  # 24 byte tokens, letters: a text loop
FREE = 40  # tokens the model makes of its own before it is steered into the loop


def steer_into_a_loop(model, monkeypatch, prompt_len: int):
    """The model's logits pushed (+1e4) toward UNIT's next token from generated token FREE on:
    greedy decoding loops (and where the n-gram rule bans the pushed token, varies)."""
    forward = model.forward

    def steered(*args, **kwargs):
        logits = forward(*args, **kwargs)
        positions = kwargs.get("positions")
        if positions is not None:  # a decode step: each row's position of the token it feeds
            for row, position in enumerate(positions[:, 0].tolist()):
                generated = position - prompt_len + 1  # the index of the token being picked
                if generated >= FREE:
                    logits[row, -1, UNIT[generated % len(UNIT)]] += 1e4
        return logits
    monkeypatch.setattr(model, "forward", steered)


def request(tokenizer, max_tokens: int, guard: RepetitionGuard = GUARD, ngram=NGramConfig.off()):
    ids = build_prompt(tokenizer, "loop", [])
    return GenerationRequest(ids, [], SamplingParams(max_tokens=max_tokens, ngram=ngram, repetition=guard))


# The n-gram rule on bans the loop's tokens here and there: the loop varies (with a longer
# period, found where that pattern settled); thresholds set lower, as a request may.
@pytest.mark.parametrize("ngram, guard", [(NGramConfig.off(), GUARD),
                                          (NGramConfig(), RepetitionGuard(min_tokens=64, varied_tokens=320))],
                         ids=["exact", "ngram-rule-on"])
def test_a_looping_sequence_ends_at_its_threshold_with_the_text_before_the_loop(model, monkeypatch, ngram, guard):
    tokenizer = ByteTokenizer()
    steer_into_a_loop(model, monkeypatch, len(request(tokenizer, 1).prompt_ids))
    engine = GenerationEngine(model, tokenizer, max_len=4096)
    [looped] = engine.generate([request(tokenizer, 3000, guard, ngram)])
    assert looped.finish_reason == "repetition"
    start, period = looped.repetition["start_token"], looped.repetition["period"]
    if ngram.enabled:
        assert period % len(UNIT) == 0 and FREE - period <= start
        assert looped.completion_tokens <= start + guard.varied_tokens + 2 * period  # not max_tokens
    else:
        assert period == len(UNIT) and FREE - period <= start <= FREE + period
        assert looped.completion_tokens <= start + guard.min_tokens + 2 * period
    kept = looped.text
    assert len(kept) == looped.repetition["text_chars"] and kept == tokenizer.decode(looped.token_ids[:start])
    [unguarded] = engine.generate([request(tokenizer, looped.completion_tokens, OFF, ngram)])
    assert unguarded.finish_reason == "length" and unguarded.token_ids == looped.token_ids  # the same until it stopped


def test_a_stream_ends_with_the_loop_s_place_and_the_whole_answer_is_cut_there(model, monkeypatch):
    from decoder.async_engine import AsyncEngine
    import asyncio
    tokenizer = ByteTokenizer()
    steer_into_a_loop(model, monkeypatch, len(request(tokenizer, 1).prompt_ids))
    engine = AsyncEngine(GenerationEngine(model, tokenizer, max_len=4096))

    async def both():
        streamed = [d async for d in engine.generate(request(tokenizer, 3000))]
        whole = [d async for d in engine.generate(request(tokenizer, 3000), stream=False)]
        return streamed, whole
    try:
        streamed, (whole,) = asyncio.run(both())
    finally:
        engine.stop()
    last = streamed[-1]
    assert last.finish_reason == "repetition" and all(d.repetition is None for d in streamed[:-1])
    sent = "".join(d.text for d in streamed)
    assert sent[:last.repetition["text_chars"]] == whole.text and whole.repetition == last.repetition


def test_sequences_that_do_not_loop_generate_exactly_what_they_do_with_the_detector_off(model):
    """Greedy and sampled, with and without the n-gram rule, batched: token for token."""
    tokenizer = ByteTokenizer()

    def run(guard):
        reqs = [GenerationRequest(build_prompt(tokenizer, prompt, []), [], SamplingParams(
            max_tokens=120, ngram=ngram, repetition=guard, temperature=temperature, seed=7))
            for prompt, ngram, temperature in (("a", NGramConfig(), 0.0), ("bb", NGramConfig.off(), 0.0),
                                               ("ccc", NGramConfig(), 0.8))]
        return [(d.token_ids, d.text, d.finish_reason) for d in GenerationEngine(model, tokenizer, max_len=1024).generate(reqs)]
    assert run(GUARD) == run(OFF)


# -- the retry ladder (deployments/pipeline.py), over a scripted decoder, no Serve ----------------
class ScriptedDecoder:
    """A decoder client answering with the finish reasons it is given, one per call in order."""

    def __init__(self, *finishes: str):
        self.finishes, self.calls = finishes, []

    async def generate(self, ids, seqs, params):
        self.calls.append(params)
        reason = self.finishes[min(len(self.calls), len(self.finishes)) - 1]  # the last one from there on
        if reason == "refused":
            from deployments.protocol import BadRequest
            raise BadRequest("refused by the script")
        return {"text": f"attempt {len(self.calls)}", "finished": True, "finish_reason": reason,
                "prompt_tokens": len(ids), "completion_tokens": 100 * len(self.calls),
                **({"repetition": {"start_token": 5, "period": 3, "text_chars": 7}} if reason == "repetition" else {})}


def answer(decoder: ScriptedDecoder, **options) -> dict:
    import asyncio

    from deployments.config import AppConfig
    from deployments.offline import sequence_layout
    from deployments.placement import Encoded, EncodedImage, pipeline_of
    from deployments.protocol import OcrOptions, validate
    pipeline = pipeline_of(AppConfig(), Encoded(sequence_layout(None)[0]), decoder)
    image = EncodedImage(torch.zeros(73, pipeline.language.hidden), (64, 48))
    return asyncio.run(pipeline.ocr([image], validate(OcrOptions, {"mode": "tiny", **options}, strict=False)))


def test_a_page_that_loops_is_generated_again_at_rising_seeded_temperatures_until_one_ends_cleanly():
    decoder = ScriptedDecoder("repetition", "repetition", "eos")
    result = answer(decoder, seed=11)
    assert [(p.temperature, p.seed) for p in decoder.calls] == [(0.0, 11), (0.3, 12), (0.6, 13)]
    assert result["text"] == "attempt 3" and result["finish_reason"] == "eos" and "repetition" not in result
    assert result["usage"]["completion_tokens"] == 100 + 200 + 300
    assert [(a["temperature"], a["finish_reason"], a["completion_tokens"]) for a in result["usage"]["attempts"]] == [
        (0.0, "repetition", 100), (0.3, "repetition", 200), (0.6, "eos", 300)]


def test_when_no_attempt_ends_cleanly_the_first_answers_and_clean_pages_are_not_retried():
    decoder = ScriptedDecoder("repetition", "repetition", "repetition")
    result = answer(decoder)
    assert [p.seed for p in decoder.calls][1:] == [1, 2]  # no seed given: 0 plus the attempt's number
    assert result["text"] == "attempt 1" and result["finish_reason"] == "repetition" and result["repetition"]["period"] == 3
    assert len(result["usage"]["attempts"]) == 3
    for finishes, options in ((("eos",), {}), (("length",), {}), (("repetition",), {"retry": {"temperatures": []}})):
        decoder = ScriptedDecoder(*finishes)
        result = answer(decoder, **options)
        assert len(decoder.calls) == 1 and "attempts" not in result["usage"]
    decoder = ScriptedDecoder("length", "stop")
    result = answer(decoder, retry={"temperatures": [0.5], "on_length": True})  # opted in
    assert result["finish_reason"] == "stop" and [p.temperature for p in decoder.calls] == [0.0, 0.5]


@pytest.mark.parametrize("retry, message", [({"temperatures": [0.0]}, "in (0, 2.0]"),
                                            ({"temperatures": [0.3] * 9}, "at most 8"),
                                            ({"after": 1}, "unknown field")])
def test_bad_retry_settings_are_refused_naming_the_field(retry, message):
    from deployments.protocol import BadRequest, OcrOptions, validate
    with pytest.raises(BadRequest, match=re.escape(message)) as refused:
        validate(OcrOptions, {"retry": retry})
    assert refused.value.param.startswith("retry")


@pytest.mark.parametrize("finish", ["repetition", "refused"])
def test_a_pdf_page_whose_every_attempt_failed_answers_with_its_text_layer_when_it_has_one(finish):
    """Looped on every attempt (or refused): a page with a text layer answers with it (marked,
    the OCR's finish reason or error kept); one without keeps the OCR's answer; opted out, none."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.placement import WholeImages, pipeline_of
    from deployments.protocol import Document, OcrOptions, validate
    from tests.pdfs import make_pdf
    config = AppConfig(max_len=2048)
    pipeline = pipeline_of(config, WholeImages.in_process(config), ScriptedDecoder(finish))

    async def pages_of(pdf: bytes, **options) -> list[dict]:
        options = validate(OcrOptions, {"mode": "tiny", "retry": {"temperatures": [0.5]}, **options}, strict=False)
        return (await pipeline.document(Document(pdf), options))["pages"]

    async def all_three():  # one event loop: the in-process encoder's queue lives on it
        return (await pages_of(make_pdf(2)), await pages_of(make_pdf(2, text=False)),
                await pages_of(make_pdf(2), text_layer_fallback=False))
    layered, scanned, opted_out = asyncio.run(all_three())
    for page in layered:
        assert (page["text"], page["source"], page["error"]) == (f"Page {page['index']}", "text_layer", None)
        if finish == "repetition":
            assert page["finish_reason"] == "repetition" and len(page["usage"]["attempts"]) == 2
        else:
            assert page["ocr_error"]["type"] == "invalid_request" and page["usage"]["completion_tokens"] == 0
    for page in scanned + opted_out:
        assert "source" not in page
        assert page["error"] is not None if finish == "refused" else page["text"].startswith("attempt")
