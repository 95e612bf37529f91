"""Next-token picking: greedy unchanged, seeded temperature / top-p sampling (decoder/sampling.py)."""
import tempfile

import pytest
import torch

from decoder.checkpoint import load_decoder
from decoder.engine import GenerationEngine, GenerationRequest, SamplingParams
from decoder.ngram import NGramConfig
from decoder import sampling
from decoder.sampling import argmax_rows, pick_tokens, uniform_draws
from decoder.tokenizer import SPECIAL_TOKENS, ByteTokenizer, build_prompt
from deployments.model_source import write_random_model

# Greedy tokens of the tiny random model (write_random_model seed 0, fp32) for the two requests
# of `golden_requests`, recorded with the engine as it was before sampling existed (commit
# 18daf8d): greedy decoding must not move by one token.
GOLDEN = [
    [96273, 44802, 2083, 51480, 18602, 39160, 19010, 125500, 71911, 109207, 49713, 82135, 89625,
     75500, 8609, 22292, 100794, 99249, 62567, 107813, 9059, 828, 40051, 20924, 66225, 11481,
     70583, 112337, 17702, 91277, 73584, 46199, 53169, 90805, 35969, 91835, 98083, 22987, 15085,
     78282],
    [37161, 87405, 10229, 10229, 10229, 81730, 36252, 89988, 77288, 125866, 121111, 39808, 16563,
     121032, 3601, 5026, 104825, 37161, 56987, 49660, 56987, 56987, 48646, 71705, 98660, 10229,
     89710, 75895, 87175, 62698, 33238, 67514, 107710, 69608, 74111, 25188, 50764, 7580, 53286,
     116042],
]


@pytest.fixture(scope="module")
def model():
    return load_decoder(write_random_model(tempfile.mkdtemp(), dtype=torch.float32))


def request(prompt, image_tokens, max_tokens=40, ngram=NGramConfig(), **params):
    gen = torch.Generator().manual_seed(len(prompt))
    ids = build_prompt(ByteTokenizer(), prompt, image_tokens)
    embeds = [torch.randn(n, 64, generator=gen) for n in image_tokens]
    return GenerationRequest(ids, embeds, SamplingParams(max_tokens=max_tokens, ngram=ngram, **params))


def golden_requests(**params):
    return [request("<image>\nFree OCR.", [273], **params),
            request("hello", [], ngram=NGramConfig(ngram_size=3, window=20), **params)]


def generate(model, requests, max_batch=4):
    return [d.token_ids for d in GenerationEngine(model, ByteTokenizer(), max_batch).generate(requests)]


def test_greedy_tokens_are_those_of_the_engine_before_sampling(model):
    assert [generate(model, [r])[0] for r in golden_requests()] == GOLDEN
    assert generate(model, golden_requests(temperature=0.0, top_p=0.5, seed=3)) == GOLDEN


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0, 1.0, 0, 0.7, 0, 1.5])
    picks = pick_tokens(logits, temperature, torch.ones(6), torch.arange(6), torch.zeros(6, dtype=torch.long))
    greedy = temperature == 0
    assert torch.equal(picks[greedy], logits.argmax(-1)[greedy])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", [1, 3, sampling.SPLIT_ARGMAX_ROWS, sampling.SPLIT_ARGMAX_ROWS + 1])
def test_split_argmax_picks_what_argmax_picks_ties_included(rows, device):
    """`argmax_rows` (a max per chunk of the vocabulary, then the chunks' argmax) against one
    argmax: rows with one maximum, with ties inside a chunk and across chunks (the first wins),
    a maximum at either end, rows of -inf but one (banned tokens)."""
    vocab = 129280
    torch.manual_seed(rows)
    logits = torch.randn(rows, vocab).to(torch.bfloat16)  # bf16: ties are common, as in the model's
    top = logits.max() + 1
    cases = [(5, 7), (1010 * 3 + 2, 1010 * 3 + 900), (1010 * 9, 1010 * 100), (0, vocab - 1)]
    for row in range(rows):
        first, second = cases[row % len(cases)]
        logits[row, first] = logits[row, second] = top
    if rows > 2:
        logits[2] = float("-inf")
        logits[2, vocab - 1] = 0
    logits = logits.to(device)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[0] == 5


def test_uniform_draws_are_a_fixed_function_of_seed_step_and_token():
    seeds, steps = torch.tensor([1, 1, 2, 1]), torch.tensor([0, 1, 0, 0])
    u = uniform_draws(seeds, steps, 100_000)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(u[0], u[3])  # same (seed, step): same draws, whatever the row
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(uniform_draws(seeds[:1], steps[:1], 100_000)[0], u[0])  # alone: the same


def test_sampling_follows_softmax_of_logits_over_temperature():
    """Empirical frequencies over 6,000 seeds match softmax(logits / T)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n, temperature = 6000, 0.8
    picks = pick_tokens(logits.expand(n, -1), torch.full((n,), temperature), torch.ones(n),
                        torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(picks, minlength=5).float() / n
    expected = (logits / temperature).softmax(-1)
    assert (freq - expected).abs().max() < 0.025, (freq, expected)


def test_top_p_restricts_the_support_to_the_nucleus():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1000, generator=gen) * 3
    n, top_p = 3000, 0.6
    picks = pick_tokens(logits.expand(n, -1), torch.ones(n), torch.full((n,), top_p),
                        torch.arange(n), torch.zeros(n, dtype=torch.long))
    probs, order = logits[0].softmax(-1).sort(descending=True)
    nucleus_size = int((probs.cumsum(-1) < top_p).sum()) + 1  # the token that crosses top_p is in
    nucleus = set(order[:nucleus_size].tolist())
    assert set(picks.tolist()) <= nucleus
    assert len(set(picks.tolist())) > 1  # it still samples inside the nucleus
    # without top_p, tokens outside that nucleus do come up
    free = pick_tokens(logits.expand(n, -1), torch.ones(n), torch.ones(n), torch.arange(n),
                       torch.zeros(n, dtype=torch.long))
    assert not set(free.tolist()) <= nucleus
    # a tiny top_p leaves only the most likely token
    tiny = pick_tokens(logits.expand(50, -1), torch.ones(50), torch.full((50,), 1e-4),
                       torch.arange(50), torch.zeros(50, dtype=torch.long))
    assert set(tiny.tolist()) == {int(order[0])}


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(200, 8)
    logits[:, [2, 5]] = float("-inf")
    picks = pick_tokens(logits, torch.ones(200), torch.ones(200), torch.arange(200),
                        torch.zeros(200, dtype=torch.long))
    assert not ({2, 5} & set(picks.tolist())) and len(set(picks.tolist())) == 6


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model):
    sampled = dict(temperature=1.0, top_p=0.9, seed=1234, ngram=NGramConfig.off())
    alone = generate(model, [request("<image>\nFree OCR.", [273], 24, **sampled)])[0]
    again = generate(model, [request("<image>\nFree OCR.", [273], 24, **sampled)])[0]
    assert alone == again
    # Third in a batch of three, two of them greedy neighbours that finish early: same tokens.
    neighbours = [request("hello", [], 5), request("a b c", [], 9, temperature=0.5, seed=9)]
    batched = generate(model, neighbours + [request("<image>\nFree OCR.", [273], 24, **sampled)])[2]
    assert batched == alone
    other_seed = generate(model, [request("<image>\nFree OCR.", [273], 24, **{**sampled, "seed": 1235})])[0]
    assert other_seed != alone
    greedy = generate(model, [request("<image>\nFree OCR.", [273], 24, ngram=NGramConfig.off())])[0]
    assert alone != greedy


def test_unseeded_requests_draw_their_own_seeds(model):
    runs = [generate(model, [request("hello", [], 12, temperature=1.0)])[0] for _ in range(3)]
    assert len({tuple(r) for r in runs}) > 1


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0),
                                 dict(top_p=1.5), dict(seed=1.5), dict(seed=True), dict(priority="high")])
def test_bad_sampling_params_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_skip_special_tokens_drops_them_from_the_text(model, monkeypatch):
    """Scripted picks: 'a', <|ref|>, 'b', <|/ref|>, 'c'."""
    tokenizer = ByteTokenizer()
    script = [tokenizer.encode("a")[0], SPECIAL_TOKENS["<|ref|>"], tokenizer.encode("b")[0],
              SPECIAL_TOKENS["<|/ref|>"], tokenizer.encode("c")[0]]
    texts = {}
    for skip in (False, True):
        engine = GenerationEngine(model, tokenizer, 2)
        picks = iter(script)
        monkeypatch.setattr(engine.runner, "pick", lambda seqs, logits: torch.tensor([next(picks)]))
        (result,) = engine.generate([request("hello", [], 5, skip_special_tokens=skip)])
        assert result.token_ids == script
        texts[skip] = result.text
    assert texts == {False: "a<|ref|>b<|/ref|>c", True: "abc"}


@pytest.mark.gpu
def test_sampler_graphs_pick_what_eager_picks():
    from decoder.sampling import SamplerGraphs
    gen = torch.Generator(device="cuda").manual_seed(0)
    graphs = SamplerGraphs([1, 4, 16, 64], 129280, torch.device("cuda"))
    for rows in (1, 3, 16, 40, 64):
        logits = torch.randn(rows, 129280, device="cuda", generator=gen).to(torch.bfloat16) * 4
        logits[:, :7] = float("-inf")
        temperature = torch.rand(rows, device="cuda", generator=gen) * 1.5
        temperature[::3] = 0  # greedy rows among sampling ones
        top_p = torch.rand(rows, device="cuda", generator=gen).clamp_min(0.05)
        top_p[1::4] = 1.0
        seeds = torch.arange(rows, device="cuda") * 7919
        steps = torch.arange(rows, device="cuda") % 5
        eager = pick_tokens(logits, temperature, top_p, seeds, steps)
        replayed = graphs.run(logits, temperature, top_p, seeds, steps)
        assert torch.equal(eager, replayed), rows
        assert torch.equal(replayed[::3], logits[::3].argmax(-1))
        assert (replayed >= 7).all()
    print(f"sampler graphs: {len(graphs.graphs)} batch buckets, eager == replay")


@pytest.mark.gpu
def test_seeded_sampling_with_decode_graphs_matches_eager_on_gpu(tmp_path):
    """The same seeded requests through an engine with decode + sampler graphs and an eager one
    (real decode graphs, tiny dims, bf16): identical tokens for most; a difference may start only
    where the bf16 logits of the two paths differ, which the decode-graph test bounds."""
    from decoder.config import DecoderArgs
    directory = write_random_model(tmp_path, language=DecoderArgs.tiny(), dtype=torch.bfloat16)
    model = load_decoder(directory, device="cuda", dtype=torch.bfloat16)
    reqs = lambda: [request("<image>\nFree OCR.", [273], 32, temperature=0.9, top_p=0.95, seed=s,  # noqa: E731
                            ngram=NGramConfig.off()) for s in range(6)]
    tokenizer = ByteTokenizer()
    graphed = GenerationEngine(model, tokenizer, 8, 2048, decode_graphs=True)
    eager = GenerationEngine(model, tokenizer, 8, 2048, decode_graphs=False)
    a = [d.token_ids for d in graphed.generate(reqs())]
    b = [d.token_ids for d in eager.generate(reqs())]
    assert graphed.sampler_graphs is not None
    same = sum(x == y for x, y in zip(a, b))
    print(f"seeded sampling, graphs vs eager: {same} of 6 sequences identical")
    assert same >= 4
