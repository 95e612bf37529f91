"""Continuous batching, KV cache, stop conditions and streaming of the generation engine (CPU)."""
import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
import time

import pytest
import torch

from tests.conftest import run_in_triton_interpreter
from decoder.checkpoint import load_decoder, random_decoder
from decoder.config import DecoderArgs
from deployments.model_source import write_random_model
from decoder.async_engine import AsyncEngine
from decoder.engine import Delta, GenerationEngine, GenerationRequest, SamplingParams
from decoder.kv_cache import PAGE_TOKENS, KVCache, gathered_decode_attention, pages_for
from decoder.ngram import NGramConfig
from decoder.tokenizer import IMAGE_TOKEN_ID, ByteTokenizer, build_prompt
from tests.helpers import rel_err

OFF = NGramConfig.off()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_decoder(write_random_model(tmp_path_factory.mktemp("lm"), dtype=torch.float32))


@pytest.fixture(scope="module")
def tokenizer():
    return ByteTokenizer()


def deterministic_expert_sums(monkeypatch) -> None:
    """The Triton down kernel's stores and one sum (large prefills' way) for decode batches and
    small ones (their own tiles): its fp32 atomic adds sum a token's experts in an order that
    varies run to run."""
    from decoder import triton_moe
    for name in ("DOWN_TILE", "SMALL_DOWN_TILE"):
        if getattr(triton_moe, name) is not None:
            monkeypatch.setattr(triton_moe, name, getattr(triton_moe, name)._replace(atomic_add=False))


def make_request(tokenizer, prompt, image_tokens=(), max_tokens=24, seed=0, **params):
    gen = torch.Generator().manual_seed(seed)
    ids = build_prompt(tokenizer, prompt, list(image_tokens))
    embeds = [torch.randn(n, 64, generator=gen) for n in image_tokens]
    return GenerationRequest(ids, embeds, SamplingParams(max_tokens=max_tokens, **params))


def requests(tokenizer, ngram=OFF):
    return [make_request(tokenizer, "<image>\nFree OCR.", [273], 30, 1, ngram=ngram),
            make_request(tokenizer, "hello", (), 12, 2, ngram=ngram),
            make_request(tokenizer, "<image><image>\n<|grounding|>Convert the document to markdown.",
                         [903, 273], 40, 3, ngram=ngram),
            make_request(tokenizer, "a b c", (), 5, 4, ngram=ngram),
            make_request(tokenizer, "<image>x", [111], 33, 5, ngram=ngram)]


def greedy_without_cache(model, request):
    """Reference: recompute the whole sequence every step (no KV cache, no batching)."""
    ids = torch.tensor(request.prompt_ids)
    embeds = model.embed(ids)
    if request.image_embeds:
        embeds[ids == IMAGE_TOKEN_ID] = torch.cat(request.image_embeds)
    out = []
    with torch.inference_mode():
        for _ in range(request.params.max_tokens):
            token = model(inputs_embeds=embeds[None])[0, -1].argmax().item()
            out.append(token)
            if token == model.args.eos_id:
                break
            embeds = torch.cat([embeds, model.embed(torch.tensor([token]))])
    return out


def test_cached_generation_equals_recomputation(model, tokenizer):
    request = requests(tokenizer)[0]
    (result,) = GenerationEngine(model, tokenizer, max_batch=2, max_len=1024).generate([request])
    assert result.token_ids == greedy_without_cache(model, requests(tokenizer)[0])


@pytest.mark.parametrize("max_batch", [2, 5])
@pytest.mark.parametrize("ngram", [OFF, NGramConfig(ngram_size=3, window=20)], ids=["plain", "ngram"])
def test_continuous_batching_equals_alone(model, tokenizer, ngram, max_batch):
    # max_batch 2 < 5 requests: later ones join as earlier ones finish; max_batch 5: all five
    # prompts (8 to ~1,200 tokens, with and without images) prefill in one right-padded batch.
    engine = GenerationEngine(model, tokenizer, max_batch=max_batch, max_len=2048)
    together = engine.generate(requests(tokenizer, ngram))
    alone = [GenerationEngine(model, tokenizer, max_batch=1, max_len=2048).generate([r])[0]
             for r in requests(tokenizer, ngram)]
    for t, a in zip(together, alone):
        assert t.token_ids == a.token_ids and t.text == a.text
        assert t.finished and t.finish_reason == a.finish_reason
    assert [t.completion_tokens for t in together] == [len(t.token_ids) for t in together]
    assert together[1].prompt_tokens == 1 + len(tokenizer.encode("hello"))


def test_an_fp8_kv_cache_holds_more_tokens_and_attends_near_the_model_dtypes(model, tokenizer):
    """kv_cache_dtype "fp8": keys and values stored in 8-bit floats (saturated at 448), the
    same memory holding 4x an fp32 cache's tokens (2x bf16's); attention over it within fp8's
    precision of the full-precision cache's; generations run to their lengths, batched as alone."""
    engines = {name: GenerationEngine(model, tokenizer, max_batch=5, max_len=2048, kv_cache_gb=0.05,
                                      kv_cache_dtype=name) for name in ("auto", "fp8")}
    assert engines["fp8"].cache.k.dtype == torch.float8_e4m3fn and engines["auto"].cache.k.dtype == torch.float32
    assert engines["fp8"].cache.num_pages // 4 == engines["auto"].cache.num_pages  # whole pages of one budget
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        GenerationEngine(model, tokenizer, max_batch=1, kv_cache_dtype="int8")
    from decoder.kv_cache import FP8_MAX, stored
    big = torch.tensor([1e4, -1e4, 0.5, 3.0])
    assert stored(big, torch.float8_e4m3fn).float().tolist() == [FP8_MAX, -FP8_MAX, 0.5, 3.0]
    # One decode step's attention over the same keys and values, kept both ways.
    gen = torch.Generator().manual_seed(0)
    heads, d, rows, kv_len = model.args.n_heads, model.args.head_dim, 4, 300
    outs = []
    for cache in (engines["auto"].cache, engines["fp8"].cache):
        for row in range(rows):
            cache.reserve(row, kv_len)
        cache.sync()
        gen.manual_seed(0)
        k, v = (torch.randn(rows, heads, kv_len, d, generator=gen) for _ in range(2))
        cache.write_prefill(0, 0, k, v)
        q = torch.randn(rows, heads, 1, d, generator=gen)
        outs.append(cache.attend(0, q, torch.tensor([299, 0, 64, 150]), kv_len))
        cache.clear()
    err = rel_err(outs[1], outs[0])
    print(f"fp8 cache attention vs fp32: {err:.2e}")
    assert 1e-4 < err < 5e-2  # fp8 keeps 3 mantissa bits: ~2% off, never equal
    together = engines["fp8"].generate(requests(tokenizer))
    alone = [GenerationEngine(model, tokenizer, max_batch=1, max_len=2048, kv_cache_dtype="fp8").generate([r])[0]
             for r in requests(tokenizer)]
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    assert all(t.finished for t in together)


def test_the_rope_kernels_fp8_write_saturates_as_the_reference_in_triton_interpreter():
    """Keys and values over fp8's largest value are stored as it by the RoPE kernel's write, as
    `kv_cache.stored` does (a plain conversion gives no number). Values fp8 holds exactly: the
    interpreter's own fp8 rounding is wrong where it carries into the exponent (1.99 -> 1.0);
    the rounding is the GPU test's (test_rope_kernel_equals_rope_and_cache_writes_on_gpu)."""
    pytest.importorskip("triton")
    stdout = run_in_triton_interpreter("""
import torch, triton, triton.language as tl
from decoder.kv_cache import FP8, FP8_MAX, stored
from decoder.triton_rope import _to_cache
@triton.jit
def write(X, Y, N: tl.constexpr, CACHE_MAX: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(Y + o, _to_cache(tl.load(X + o), Y.dtype.element_ty, CACHE_MAX))
x = torch.tensor([1e4, -1e4, 0.5, 3.0, 448.0, -600.0, 0.25, 1.5])
y = torch.empty(8, dtype=FP8)
write[(1,)](x, y, N=8, CACHE_MAX=FP8_MAX)
assert torch.equal(y.float(), stored(x, FP8).float()), y
print(y.float().tolist())
""")
    assert stdout.split("\n")[0] == "[448.0, -448.0, 0.5, 3.0, 448.0, -448.0, 0.25, 1.5]", stdout


def test_ngram_rule_holds_in_generated_tokens(model, tokenizer):
    n, window = 3, 20
    request = make_request(tokenizer, "zz", (), 60, ngram=NGramConfig(ngram_size=n, window=window))
    (result,) = GenerationEngine(model, tokenizer, max_len=512).generate([request])
    tokens = result.token_ids
    for end in range(n, len(tokens)):
        seen = {tuple(tokens[i:i + n]) for i in range(max(0, end - window), end - n + 1)}
        assert tuple(tokens[end - n + 1:end + 1]) not in seen or tokens[end] in (128821, 128822)


def test_random_model_repeats_without_the_rule(model, tokenizer):
    # Guards the test above: without the rule this model does repeat 3-grams.
    (result,) = GenerationEngine(model, tokenizer, max_len=512).generate(
        [make_request(tokenizer, "zz", (), 60, ngram=OFF)])
    t = result.token_ids
    grams = [tuple(t[i:i + 3]) for i in range(len(t) - 2)]
    assert len(set(grams)) < len(grams)


def test_max_tokens_and_stop_strings(model, tokenizer):
    engine = GenerationEngine(model, tokenizer, max_len=512)
    (full,) = engine.generate([make_request(tokenizer, "hi", (), 40)])
    assert full.finish_reason == "length" and full.completion_tokens == 40
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    (stopped,) = engine.generate([make_request(tokenizer, "hi", (), 40, stop=(stop,))])
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def test_eos_finishes_and_is_not_in_the_text(tmp_path, tokenizer):
    model = load_decoder(write_random_model(tmp_path, dtype=torch.float32))
    with torch.no_grad():
        model.lm_head.weight[model.args.eos_id] = 50 * model.model.norm.weight.sign()
    (result,) = GenerationEngine(model, tokenizer, max_len=256).generate(
        [make_request(tokenizer, "hi", (), 10)])
    assert (result.finish_reason, result.token_ids, result.text) == ("eos", [1], "")


def test_context_limit_caps_generation(model, tokenizer):
    engine = GenerationEngine(model, tokenizer, max_len=64)
    request = make_request(tokenizer, "x" * 50, (), 100)
    (result,) = engine.generate([request])
    assert result.finish_reason == "length" and result.completion_tokens == 64 - len(request.prompt_ids)


def test_bad_requests_are_refused(model, tokenizer):
    engine = GenerationEngine(model, tokenizer, max_len=64)
    with pytest.raises(ValueError, match="placeholder"):
        engine.add(GenerationRequest([0, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], [torch.zeros(1, 64)]))
    with pytest.raises(ValueError, match="does not fit"):
        engine.add(GenerationRequest([0] * 64))
    with pytest.raises(ValueError, match=r"\[n, 64\]"):
        engine.add(GenerationRequest([0, IMAGE_TOKEN_ID], [torch.zeros(1, 32)]))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(GenerationRequest([]))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not engine.has_work()


def test_abort_frees_the_slot(model, tokenizer):
    engine = GenerationEngine(model, tokenizer, max_batch=2, max_len=256)
    a = engine.add(make_request(tokenizer, "one", (), 50))
    b = engine.add(make_request(tokenizer, "two", (), 5))
    engine.step()
    assert engine.abort(a).finish_reason == "aborted"
    # A decode step is in flight (launched by step()): the row frees once it is done.
    assert all(d.request_id == b for d in engine.step())
    assert [s.request.request_id for s in engine.running] == [b] and engine.running[0].slot == 0
    while engine.has_work():
        engine.step()
    assert engine.abort("nope") is None


def test_async_engine_streams_and_matches_offline(model, tokenizer):
    offline = GenerationEngine(model, tokenizer, max_batch=4, max_len=2048).generate(requests(tokenizer))
    engine = AsyncEngine(GenerationEngine(model, tokenizer, max_batch=4, max_len=2048))

    async def collect(request):
        text, tokens, chunks = "", [], 0
        async for delta in engine.generate(request):
            text, tokens, chunks = text + delta.text, tokens + delta.token_ids, chunks + 1
        return text, tokens, chunks, delta.finish_reason

    async def main():
        return await asyncio.gather(*(collect(r) for r in requests(tokenizer)))

    streamed = asyncio.run(main())
    for (text, tokens, chunks, reason), expected in zip(streamed, offline):
        assert (text, tokens, reason) == (expected.text, expected.token_ids, expected.finish_reason)
        assert chunks == len(tokens)  # one delta per generated token

    async def whole(request):  # not streamed: one delta, merged on the engine thread
        return [d async for d in engine.generate(request, stream=False)]

    async def main_whole():
        return await asyncio.gather(*(whole(r) for r in requests(tokenizer)))
    for deltas, expected in zip(asyncio.run(main_whole()), offline):
        [delta] = deltas
        assert (delta.text, delta.token_ids, delta.finish_reason, delta.completion_tokens) == \
            (expected.text, expected.token_ids, expected.finish_reason, expected.completion_tokens)
        assert delta.finished and delta.first_token_at is not None


def test_a_profile_window_counts_the_engine_threads_steps_and_samples_its_stack(model, tokenizer):
    """`AsyncEngine.profile` (what `DecoderServer.profile` opens on a replica): over a window
    that sees a whole generation, its tokens and steps as counted, its time in `step`."""
    engine = AsyncEngine(GenerationEngine(model, tokenizer, max_batch=4, max_len=2048))
    window = concurrent.futures.ThreadPoolExecutor(1).submit(engine.profile, 3.0, 0.002)

    async def main():
        await asyncio.sleep(0.2)  # the window is open
        return await asyncio.gather(*(collect(engine, r) for r in requests(tokenizer)))
    produced = sum(len(tokens) for tokens in asyncio.run(main()))
    profile = window.result(timeout=60)
    assert profile["steps"] > 0 and profile["tokens_per_s"] * profile["seconds"] == pytest.approx(produced, abs=0.5)
    assert profile["prefills_per_s"] > 0 and 1 <= profile["sequences_per_step"] <= 4
    assert 0 < profile["stepping_share"] < 1 and 0 < profile["idle_share"] < 1
    assert 0 < profile["stepping_cpu_share"] <= profile["stepping_share"] + 0.05
    assert profile["device_wait_share"] == 0  # on a CPU picks are read at once
    stacks = profile["stacks"]
    assert stacks["samples"] > 100 and stacks["missing_share"] == 0
    inclusive = dict(stacks["inclusive"])
    assert inclusive["decoder.async_engine.AsyncEngine._loop"] == 1.0
    assert 0 < inclusive["decoder.engine.GenerationEngine.step"] < 1


async def collect(engine, request) -> list[int]:
    return [t async for delta in engine.generate(request) for t in delta.token_ids]


def test_async_engine_bad_request_and_early_exit(model, tokenizer):
    engine = AsyncEngine(GenerationEngine(model, tokenizer, max_batch=2, max_len=256))

    async def bad():
        async for _ in engine.generate(GenerationRequest([0, IMAGE_TOKEN_ID])):
            pass

    async def early():
        async for delta in engine.generate(make_request(tokenizer, "long", (), 200)):
            break  # client went away after the first delta
        await asyncio.sleep(0.2)
        return delta

    with pytest.raises(ValueError, match="placeholder"):
        asyncio.run(bad())
    first = asyncio.run(early())
    assert not first.finished
    for _ in range(50):
        if not engine.engine.has_work():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not engine.engine.has_work()


def test_a_consumer_cancelled_before_the_engine_thread_adds_its_request_frees_it(model, tokenizer, monkeypatch):
    """A request whose caller is cancelled before the engine thread has taken it in (a time
    limit right after the call): it is aborted once added, not left to run to max_tokens
    (the abort once carried the id, which only the add gives: seen in the suite, a PDF page's
    generation running on ~30 s past its request's 408)."""
    engine = AsyncEngine(GenerationEngine(model, tokenizer, max_batch=2, max_len=256))
    thread_free, drain = threading.Event(), engine._drain_inbox

    def held_drain():
        thread_free.wait()
        drain()
    monkeypatch.setattr(engine, "_drain_inbox", held_drain)

    async def cancelled_at_once():
        task = asyncio.create_task(collect(engine, make_request(tokenizer, "long", (), 200)))
        while engine._inbox.empty():  # until the add is in the inbox (the engine thread holds)
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(cancelled_at_once())
    thread_free.set()
    for _ in range(100):
        if not engine.engine.has_work() and engine._inbox.empty():
            break
        time.sleep(0.05)
    assert not engine.engine.has_work() and not engine._streams


def test_identical_requests_batch_together(model, tokenizer):
    # Equal prompts and equal embeddings: requests are told apart by identity, not value.
    same = [make_request(tokenizer, "<image>\nFree OCR.", [273], 8 + i % 3, seed=1) for i in range(5)]
    results = GenerationEngine(model, tokenizer, max_batch=3, max_len=1024).generate(same)
    assert [r.completion_tokens for r in results] == [8, 9, 10, 8, 9]
    assert results[0].token_ids == results[3].token_ids[:8]


def test_async_engine_survives_a_failed_step(model, tokenizer, monkeypatch):
    engine = AsyncEngine(GenerationEngine(model, tokenizer, max_batch=2, max_len=256))
    real_step, calls = engine.engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", failing_once)

    async def run():
        out = []
        async for delta in engine.generate(make_request(tokenizer, "hi", (), 3)):
            out.append(delta)
        return out

    with pytest.raises(RuntimeError, match="generation failed: boom"):
        asyncio.run(run())
    assert engine.alive and not engine.engine.has_work()
    assert sum(d.completion_tokens == 3 for d in asyncio.run(run())) == 1


@pytest.mark.gpu
def test_decode_graphs_match_eager_decoding():
    """Real dims, bf16: a replayed decode step gives the eager step's logits on the same cache."""
    from decoder.checkpoint import random_decoder
    from decoder.config import DecoderArgs
    from decoder.model import CacheStep
    model = random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16)
    tokenizer = ByteTokenizer()
    engine = GenerationEngine(model, tokenizer, max_batch=8, max_len=1024, decode_graphs=True)
    for text in ("first page", "a second, longer prompt", "3"):
        engine.add(GenerationRequest([0] + tokenizer.encode(text), params=SamplingParams(max_tokens=16)))
    engine.step()  # captures the graphs, prefills three requests, launches a graphed decode step
    engine._take(*engine._inflight)  # its picks (what the next step would begin with)
    engine._inflight = None
    assert len(engine.decode_graphs.graphs) > 1
    tokens = [s.pending for s in engine.running]
    positions = [s.length for s in engine.running]
    with torch.inference_mode():
        graphed = engine.decode_graphs.run(tokens, positions)
        # The eager step writes the same keys and values at the same positions again.
        p = torch.tensor(positions, device="cuda")
        eager = model(input_ids=torch.tensor(tokens, device="cuda")[:, None], positions=p[:, None],
                      step=CacheStep(engine.cache, positions=p, kv_len=max(positions) + 1))[:, -1]
    err = ((graphed.float() - eager.float()).norm() / eager.float().norm()).item()
    print(f"decode graph vs eager logits: {err:.2e}")
    assert err <= 1e-2
    while engine.has_work():
        engine.step()
    assert not engine.running


# Of the top logit: bf16 values near it lie up to 2**-7 (0.78%) of it apart, and the two runs'
# logits may each land on a neighbouring value, so ties within two spacings can flip (seen on
# the H200: a first difference where eager's gap was 0.0131). Eager's gaps over these
# generations: p10 ~0.007, median ~0.03; a bug's first differences fall anywhere among them.
NEAR_TIE = 2 * 2 ** -7


@pytest.mark.gpu
def test_decode_graphs_reproduce_eager_generations_token_for_token():
    """Whole greedy generations (n-gram rule on, sequences joining and leaving at different
    steps) with decode graphs and with the switch off (`decode_graphs=False`), token for token.

    The two runs may round differently (a graph replays a padded batch bucket over a padded
    context), so where eager's two best logits are within rounding of each other the pick may go
    either way, and the sequences part there. Scaling the output layer cannot prevent that (it
    scales the rounding too). So: every point where a graphed sequence first differs from its
    eager twin must be such a near tie in the eager run (gap under NEAR_TIE of the top logit,
    after the n-gram bans), and most tokens must match before any difference. A bug (wrong
    position, stale cache, another row's logits) makes differences at clear margins."""
    model, tokenizer = random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16), ByteTokenizer()
    runs, gaps = {}, {}
    for graphs in (True, False):
        engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=1024, decode_graphs=graphs)
        if not graphs:  # the eager run's margin behind each token it picks
            record_margins(engine, gaps)
        requests = joining_and_leaving(tokenizer)
        runs[graphs] = [d.token_ids for d in engine.generate(requests)]
        assert (engine.decode_graphs is not None) == graphs  # the switch is honoured
    assert_equal_but_near_ties(requests, runs[True], runs[False], gaps)


def joining_and_leaving(tokenizer) -> list[GenerationRequest]:
    """Six greedy requests (n-gram rule on) of different lengths for four rows: sequences join
    as others leave."""
    prompts = ["first page", "a second, longer prompt " * 8, "3", "table <td>x</td>" * 20,
               "an image-sized prompt " * 40, "short"]
    return [GenerationRequest([0] + tokenizer.encode(p), params=SamplingParams(max_tokens=24 + 8 * i))
            for i, p in enumerate(prompts)]


def record_margins(engine, gaps: dict) -> None:
    """Each pick's margin (top two logits after the n-gram bans, relative) per request, into `gaps`."""
    choose = engine.runner.pick_on_device

    def recording(seqs, logits):
        picks = choose(seqs, logits)  # applies the n-gram bans to `logits` in place
        top = logits.float().topk(2, dim=-1).values
        for seq, (first, second) in zip(seqs, top.tolist()):
            if not seq.done:
                gaps.setdefault(seq.request.request_id, []).append((first - second) / abs(first))
        return picks
    engine.runner.pick_on_device = recording


def assert_equal_but_near_ties(requests, tested, reference, gaps) -> None:
    """Every point where a tested generation first differs from its reference is a near tie in
    the reference (gap under NEAR_TIE), and most tokens match before any difference."""
    matched = 0
    for request, got, want in zip(requests, tested, reference):
        margins = gaps[request.request_id]
        differ = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
        print(f"\n{request.request_id}: {len(want)} tokens, first difference at {differ}"
              + ("" if differ is None else f" (reference gap there {margins[differ]:.4f})"))
        if differ is None:
            assert got == want
            matched += len(want)
        else:
            assert margins[differ] < NEAR_TIE, (request.request_id, differ, margins[differ])
            matched += differ
    total = sum(map(len, reference))
    every = sorted(g for margins in gaps.values() for g in margins)
    print(f"tokens matched before any difference: {matched} of {total}; identical sequences: "
          f"{sum(a == b for a, b in zip(tested, reference))} of {len(requests)}; reference gaps "
          f"min {every[0]:.4f} p10 {every[len(every) // 10]:.4f} median {every[len(every) // 2]:.4f}")
    assert matched >= total // 2


@pytest.mark.gpu
def test_overlapped_picks_with_decode_graphs_generate_what_reading_each_pick_does(monkeypatch):
    """`overlap_picks` with decode graphs (picks fed to the next graph from the device, read back
    while it runs; pinned buffers in turn): greedy generations, n-gram rule on, sequences
    joining and leaving, equal the reference path's but at near ties (a sequence's unused last
    row can change a step's batch bucket, so rounding may differ)."""
    # Stores and one sum in the down kernel: its atomic adds' order varies run to run.
    deterministic_expert_sums(monkeypatch)
    model, tokenizer = random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16), ByteTokenizer()
    runs, gaps = {}, {}
    for overlap in (True, False):
        monkeypatch.setattr(GenerationEngine, "overlap_picks", overlap)
        engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=1024, decode_graphs=True)
        if not overlap:
            record_margins(engine, gaps)
        requests = joining_and_leaving(tokenizer)
        runs[overlap] = [d.token_ids for d in engine.generate(requests)]
        print(f"overlap {overlap}: {engine.overlapped_steps} overlapped steps")
        assert (engine.overlapped_steps > 40) == overlap
    assert_equal_but_near_ties(requests, runs[True], runs[False], gaps)


def test_prefill_groups_respect_the_token_budget(model, tokenizer):
    engine = GenerationEngine(model, tokenizer, max_batch=8, max_len=2048, prefill_tokens=1300)
    for r in requests(tokenizer):  # prompt lengths ~290, 6, ~1200, 6, ~120
        engine.add(r)
    groups = []
    while engine.waiting:
        group = engine.scheduler.next_prefill_group()
        groups.append(len(group))
        assert len(group) == 1 or max(len(s.request.prompt_ids) for s in group) * len(group) <= 1300
    assert groups == [2, 1, 2]


def test_a_burst_of_requests_interleaves_with_running_decodes(model, tokenizer):
    """With sequences running, a step prefills one group at most, then decodes; an idle engine
    admits all it can at once."""
    engine = GenerationEngine(model, tokenizer, max_batch=8, max_len=2048, prefill_tokens=12)
    burst = [make_request(tokenizer, "hello", (), 20, i, ngram=OFF) for i in range(6)]  # 6 tokens each
    for r in burst[:2]:
        engine.add(r)
    engine.step()
    assert len(engine.running) == 2 and not engine.waiting  # idle: both admitted in one step
    for r in burst[2:]:
        engine.add(r)
    running = []
    while engine.waiting:
        before = {s.request.request_id: len(s.tokens) for s in engine.running}
        engine.step()
        running.append(len(engine.running))
        # the sequences that were running got their decode token in the same step
        assert all(len(s.tokens) == before[s.request.request_id] + 1
                   for s in engine.running if s.request.request_id in before)
    assert running == [4, 6]  # two prompts per group (12 tokens), one group per step


def test_a_prefill_behind_the_decode_step_gives_its_first_token_a_step_later(model, tokenizer, monkeypatch):
    """With sequences running, a step launches their decode step, then a new group's prefill
    behind it; the group's first tokens come with the next step's picks
    (`GenerationEngine.prefill_behind_decode`). Every generation equals the reference order's
    (the prefill first and picked at once: DEEPSEEK_OCR_PREFILL_BEHIND_DECODE=0)."""
    generations = {}
    for behind in (True, False):
        monkeypatch.setattr(GenerationEngine, "prefill_behind_decode", behind)
        engine = GenerationEngine(model, tokenizer, max_batch=3, max_len=2048)
        generations[behind] = [(d.token_ids, d.text, d.finish_reason) for d in engine.generate(requests(tokenizer))]
    assert generations[True] == generations[False]
    monkeypatch.setattr(GenerationEngine, "prefill_behind_decode", True)
    engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=2048)
    first, later = (make_request(tokenizer, text, (), 20, i, ngram=OFF) for i, text in enumerate(("hello", "world")))
    engine.add(first)
    assert [d.request_id for d in engine.step()] == [first.request_id]  # idle: picked at once
    engine.add(later)
    assert [d.request_id for d in engine.step()] == [first.request_id]  # later's prefill behind
    assert len(engine.running) == 2 and not engine.running[1].tokens
    assert sorted(d.request_id for d in engine.step()) == sorted([first.request_id, later.request_id])
    assert [len(s.tokens) for s in engine.running] == [3, 1]


def run_both_ways(make_engine, requests_at: dict, monkeypatch, abort_at: dict | None = None):
    """Generations (token ids, text, finish reason) with `overlap_picks` off and on: requests
    added at the steps `requests_at` names, aborted at the steps `abort_at` names; and the
    overlapping engine (its counts)."""
    out = {}
    for overlap in (False, True):
        monkeypatch.setattr(GenerationEngine, "overlap_picks", overlap)
        engine, results, step = make_engine(), {}, 0
        ids = {}
        while step in requests_at or engine.has_work() or step <= max(requests_at):
            for i, request in enumerate(requests_at.get(step, ())):
                request = GenerationRequest(request.prompt_ids, request.image_embeds, request.params)
                ids[engine.add(request)] = (step, i)
            for request_id, at in list(ids.items()):
                if (abort_at or {}).get(at) == step and (delta := engine.abort(request_id)):
                    results.setdefault(at, []).append(delta)
            for delta in engine.step():
                results.setdefault(ids[delta.request_id], []).append(delta)
            step += 1
        out[overlap] = {at: ([t for d in ds for t in d.token_ids], "".join(d.text for d in ds), ds[-1].finish_reason)
                        for at, ds in results.items()}
        assert engine.cache.free_pages == engine.cache.num_pages  # every page came back
    return out[False], out[True], engine


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_overlapped_picks_generate_what_reading_each_pick_first_does(model, tokenizer, monkeypatch, max_batch):
    """`GenerationEngine.overlap_picks`: the next decode step launched from the last one's picks
    on the device, read back after. Every generation equals the reference path's (each pick
    read before the next launch): requests joining while others run, different lengths, the
    n-gram rule banning often, seeded sampling, a stop string, an abort, sequences leaving
    from the middle rows; and most steps took the overlapped path."""
    ngram = NGramConfig(ngram_size=3, window=20)
    early = [make_request(tokenizer, "<image>\nFree OCR.", [40], 30, 1, ngram=ngram),
             make_request(tokenizer, "hello", (), 7, 2, ngram=OFF),
             GenerationRequest(build_prompt(tokenizer, "sampled", []), [],
                               SamplingParams(max_tokens=25, ngram=ngram, temperature=0.8, top_p=0.9, seed=7))]
    reference_text = GenerationEngine(model, tokenizer, max_len=512).generate(
        [make_request(tokenizer, "stop here", (), 40, 4, ngram=OFF)])[0].text
    stop = reference_text[12:15]
    later = [make_request(tokenizer, "stop here", (), 40, 4, ngram=OFF, stop=(stop,)),
             make_request(tokenizer, "<image>x", [30], 18, 5, ngram=ngram),
             make_request(tokenizer, "aborted", (), 40, 6, ngram=OFF)]
    plain, overlapped, engine = run_both_ways(
        lambda: GenerationEngine(model, tokenizer, max_batch=max_batch, max_len=2048),
        {0: early, 9: later}, monkeypatch, abort_at={(9, 2): 20})
    assert plain == overlapped
    assert plain[(9, 0)][2] == "stop" and plain[(9, 2)][2] == "aborted" and plain[(0, 1)][2] == "length"
    assert engine.overlapped_steps > 20


def test_staged_copies_hand_back_what_was_staged_across_laps():
    """decoder/staging.py's ring: every copy holds its own values after the ring wrapped past
    it; a list longer than the ring goes as a tensor of its own."""
    from decoder.staging import StagedCopies
    staged = StagedCopies("cpu", capacity=10)
    copies = [(values, staged(values)) for values in ([1, 2, 3], [4, 5, 6, 7], [8, 9, 10], [11], [], [12] * 10)]
    assert staged.lap == 2 and [c.tolist() for _, c in copies] == [v for v, _ in copies]
    assert staged(list(range(11))).tolist() == list(range(11))


@pytest.mark.gpu
def test_staged_copies_on_the_gpu_hold_their_values_across_laps():
    """On CUDA each copy reads its slice of the pinned ring asynchronously: copies of uneven
    sizes through a ring that wraps many times (slices of two laps back and of the last lap
    both waited for before they are written again) arrive as written."""
    from decoder.staging import StagedCopies
    staged = StagedCopies("cuda", capacity=37)
    gen = torch.Generator().manual_seed(0)
    sent = [torch.randint(0, 1 << 40, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(300)]
    copies = [staged(values) for values in sent]
    assert staged.lap > 50 and [c.tolist() for c in copies] == sent


def test_staged_copies_generate_what_a_tensor_per_copy_does(model, tokenizer, monkeypatch):
    """The small host lists of each step (n-gram bans, overlapped picks' row orders and held
    tokens) through one ring that wraps every few steps, against a tensor per copy (the twin,
    DEEPSEEK_OCR_STAGED_COPIES=0): the same generations, the rule banning often, sequences
    leaving from the middle rows and joining."""
    from decoder.staging import StagedCopies
    ngram = NGramConfig(ngram_size=2, window=30)
    batches = {0: [make_request(tokenizer, "<image>\nFree OCR.", [40], 30, 1, ngram=ngram),
                   make_request(tokenizer, "hello", (), 7, 2, ngram=ngram),
                   make_request(tokenizer, "zz", (), 45, 3, ngram=ngram)],
               6: [make_request(tokenizer, "<image>x", [30], 18, 5, ngram=ngram),
                   make_request(tokenizer, "later", (), 25, 6, ngram=ngram)]}
    out = {}
    for on in (False, True):
        monkeypatch.setattr(StagedCopies, "on", on)
        engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=2048)
        engine.runner.staged = StagedCopies(engine.model.device, capacity=6)
        out[on] = run_steps(engine, batches)
        assert engine.runner.bans >= 3  # the rule banned tokens: their rows and columns staged
    assert engine.runner.staged.lap >= 2 and out[False] == out[True]


def run_steps(engine, batches: dict) -> dict:
    """Each step's requests (`batches`: step -> requests) added before it, until all finish:
    each request's (text, tokens, finish reason)."""
    results, step = {}, 0
    while step <= max(batches) or engine.has_work():
        for request in batches.get(step, []):
            results[engine.add(request)] = Delta(request.request_id, "", [])
        for delta in engine.step():
            results[delta.request_id].merge(delta)
        step += 1
    return {rid: (d.text, d.token_ids, d.finish_reason) for rid, d in results.items()}


def test_overlapped_picks_launch_no_row_past_a_known_end(model, tokenizer, monkeypatch):
    """A sequence that its pick brings to max_tokens ends there whatever the token: with
    overlapped picks it leaves before the next launch, so the decode steps carry exactly the
    rows the reference's do (no extra step after the last pick of a batch ending together)."""
    batch = [make_request(tokenizer, "hello " * (1 + i), (), n, i, ngram=OFF)
             for i, n in enumerate((4, 4, 9, 17, 1))]
    launched = {}

    def make_engine():
        engine = GenerationEngine(model, tokenizer, max_batch=8, max_len=512)
        rows = launched[GenerationEngine.overlap_picks] = []
        decode = engine.runner.decode
        engine.runner.decode = lambda seqs, *a: rows.append(len(seqs)) or decode(seqs, *a)
        return engine

    plain, overlapped, engine = run_both_ways(make_engine, {0: batch, 30: batch[:2]}, monkeypatch)
    assert plain == overlapped and engine.overlapped_steps > 10
    assert [len(plain[(0, i)][0]) for i in range(5)] == [4, 4, 9, 17, 1]
    assert launched[True] == launched[False]


def test_overlapped_picks_with_eos_and_preemption_equal_the_reference(tmp_path, tokenizer, monkeypatch):
    """A sequence that ends by EOS has one unused row in the step launched before its pick was
    read; a cache that runs out of pages preempts (that step reads its picks first); both
    paths generate the same."""
    model = load_decoder(write_random_model(tmp_path, dtype=torch.float32))
    reference = GenerationEngine(model, tokenizer, max_len=512).generate(
        [make_request(tokenizer, "hi there", (), 30, 1, ngram=OFF)])[0].token_ids
    model.args = dataclasses.replace(model.args, eos_id=reference[10])  # its 11th token now ends it
    batch = [make_request(tokenizer, "hi there", (), 30, 1, ngram=OFF),
             make_request(tokenizer, "<image>\nFree OCR.", [40], 100, 1, ngram=OFF),
             make_request(tokenizer, "hello " * 8, (), 90, 2, ngram=OFF),
             make_request(tokenizer, "<image>x", [30], 110, 3, ngram=OFF)]
    plain, overlapped, engine = run_both_ways(
        lambda: GenerationEngine(model, tokenizer, max_batch=3, max_len=2048,
                                 kv_cache_gb=page_budget_gb(model, 5)), {0: batch}, monkeypatch)
    assert plain == overlapped and plain[(0, 0)][2] == "eos" and len(plain[(0, 0)][0]) == 11
    assert engine.preemptions > 0 and engine.overlapped_steps > 50


def test_overlapped_picks_feed_a_resumed_sequence_its_held_token(model, tokenizer, monkeypatch):
    """A sequence preempted and resumed (its context prefilled again, behind a decode step)
    joins an overlapped step with the token the host holds for it, not a pick: both paths
    generate the same. (Six pages for three growing sequences: one preemption.)"""
    batch = [make_request(tokenizer, "hello " * (2 + 4 * i), (), n, i, ngram=OFF)
             for i, n in enumerate((100, 90, 110))]
    plain, overlapped, engine = run_both_ways(
        lambda: GenerationEngine(model, tokenizer, max_batch=3, max_len=2048,
                                 kv_cache_gb=page_budget_gb(model, 6)), {0: batch}, monkeypatch)
    assert plain == overlapped and engine.preemptions == 1 and engine.overlapped_steps > 100


def test_overlapped_picks_with_a_sliding_window_equal_the_reference(tokenizer, monkeypatch):
    """An R-SWA model (Unlimited-OCR's attention, window 8: its gap pages given back while the
    sequences run past 64 tokens): both paths generate the same."""
    model = random_decoder(DecoderArgs.tiny(sliding_window=8), seed=3)
    batch = [make_request(tokenizer, text, (), n, i, ngram=OFF)
             for i, (text, n) in enumerate((("window " * 12, 150), ("b", 90), ("c " * 30, 120)))]
    plain, overlapped, engine = run_both_ways(
        lambda: GenerationEngine(model, tokenizer, max_batch=2, max_len=1024), {0: batch, 40: batch[1:2]},
        monkeypatch)
    assert plain == overlapped and engine.overlapped_steps > 100


def test_prefill_graph_path_equals_the_eager_prefill(model, tokenizer):
    """`PrefillGraphs`' path run on a CPU (its static buffers and forward, without capture): a
    one-sequence prefill right-padded with zeros to its token bucket, its row of the page table
    copied, its last real position's logits taken. The logits equal the eager prefill's, and an
    engine taking that path generates what the eager engine does, alone and behind decode steps
    (groups of several and prompts past the largest bucket stay eager)."""
    from decoder.prefill_graphs import PrefillGraphs
    want = GenerationEngine(model, tokenizer, max_batch=2, max_len=2048).generate(requests(tokenizer))
    engine = GenerationEngine(model, tokenizer, max_batch=2, max_len=2048)
    graphs = PrefillGraphs(model, engine.cache, engine.max_len, buckets=(256, 384, 1280), use_graphs=False)
    engine.runner.prefill_graphs = graphs
    replayed = []
    run = graphs.run
    graphs.run = lambda embeds, row: replayed.append(embeds.shape[1]) or run(embeds, row)
    got = engine.generate(requests(tokenizer))
    assert [d.token_ids for d in got] == [d.token_ids for d in want]
    assert replayed and max(replayed) > 384, replayed  # padded to 1,280 at least once
    # One prefill both ways: its logits, and its keys and values at the real positions.
    results = []
    for path in ("eager", "graphs"):
        engine = GenerationEngine(model, tokenizer, max_batch=2, max_len=2048)
        if path == "graphs":
            engine.runner.prefill_graphs = PrefillGraphs(model, engine.cache, engine.max_len, use_graphs=False)
        engine.add(requests(tokenizer)[2])  # 1,200-odd tokens: padded to 1,280
        group = engine.scheduler.next_prefill_group()
        engine.scheduler.place(group)
        with torch.inference_mode():
            logits = engine.runner.prefill(group)
        pages, length = engine.cache._pages[0], group[0].length
        keys = engine.cache.k[:, pages].transpose(1, 2).flatten(2, 3)[:, :, :length]
        results.append((logits, keys))
    (eager_logits, eager_keys), (logits, keys) = results
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, eager_keys, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="R-SWA"):
        PrefillGraphs(random_decoder(DecoderArgs.tiny(sliding_window=8)), engine.cache, 1024, use_graphs=False)


@pytest.mark.gpu
def test_prefill_graphs_match_the_eager_prefill_on_gpu(monkeypatch):
    """Real dims, bf16: a page-sized prompt (903 image tokens) prefilled by its bucket's graph
    against the eager prefill: the logits and the keys cached at its positions within bf16
    rounding. Then an engine with the graphs on generates requests that join behind decode
    steps to their end, replaying the graphs."""
    from decoder.prefill_graphs import PrefillGraphs
    from decoder.running import ModelRunner
    model = random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16)
    tokenizer = ByteTokenizer()
    ids = build_prompt(tokenizer, "<image>\nFree OCR.", [903])
    image = torch.randn(903, model.args.hidden, generator=torch.Generator().manual_seed(0)) * 0.05
    results = []
    for graphs in (False, True):
        monkeypatch.setattr(ModelRunner, "prefill_graphs_on", graphs)
        engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=2048)
        engine.prepare()
        assert (engine.runner.prefill_graphs is not None) == graphs
        engine.add(GenerationRequest(ids, [image], SamplingParams(max_tokens=8)))
        group = engine.scheduler.next_prefill_group()
        engine.scheduler.place(group)
        with torch.inference_mode():
            logits = engine.runner.prefill(group).float()
        pages, length = engine.cache._pages[0], group[0].length
        results.append((logits, engine.cache.k[:, pages].transpose(1, 2).flatten(2, 3)[:, :, :length].float()))
    (eager_logits, eager_keys), (logits, keys) = results
    logit_err, key_err = rel_err(logits, eager_logits), rel_err(keys, eager_keys)
    print(f"prefill graph vs eager: logits {logit_err:.2e}, keys {key_err:.2e}")
    assert logit_err <= 1e-2 and key_err <= 1e-2
    engine = GenerationEngine(model, tokenizer, max_batch=2, max_len=2048)  # the switch still on
    engine.prepare()
    graphs, replays = engine.runner.prefill_graphs, []
    graphs.run = lambda embeds, row: replays.append(embeds.shape[1]) or PrefillGraphs.run(graphs, embeds, row)
    sizes = (903, 273, 100, 400)
    done = engine.generate([
        GenerationRequest(build_prompt(tokenizer, "<image>\nFree OCR.", [n]), [image[:n]],
                          SamplingParams(max_tokens=12 + 4 * i, ignore_eos=True))
        for i, n in enumerate(sizes)])
    assert [len(d.token_ids) for d in done] == [12, 16, 20, 24] and len(replays) >= 2, replays


def test_decode_graphs_need_bf16_cuda(model, tokenizer):
    with pytest.raises(ValueError, match="bf16 model on CUDA"):
        GenerationEngine(model, tokenizer, max_batch=2, max_len=64, decode_graphs=True)
    assert not GenerationEngine(model, tokenizer, max_batch=2, max_len=64).use_decode_graphs


def test_async_engine_probe_runs_the_model_between_steps(model, tokenizer, monkeypatch):
    """The decoder's health check: one token through the real model on the engine thread."""
    engine = AsyncEngine(GenerationEngine(model, tokenizer, max_batch=2, max_len=64))
    engine.probe().result(timeout=60)
    calls = []
    original = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    engine.probe().result(timeout=60)
    assert calls == [1]

    def broken():
        raise RuntimeError("CUDA error: device-side assert triggered")
    monkeypatch.setattr(engine.engine, "probe", broken)
    with pytest.raises(RuntimeError, match="device-side assert"):
        engine.probe().result(timeout=60)
    assert engine.alive  # a failed probe is reported, the engine thread goes on


def test_async_engine_start_failure_is_raised(model, tokenizer, monkeypatch):
    """A failed graph capture on the engine thread fails the constructor (the replica's
    __init__), instead of leaving a replica that looks healthy but never answers."""
    engine = GenerationEngine(model, tokenizer, max_batch=2, max_len=64)

    def broken():
        raise RuntimeError("capture failed")
    monkeypatch.setattr(engine, "prepare", broken)
    with pytest.raises(RuntimeError, match="failed to start: capture failed"):
        AsyncEngine(engine)


def page_budget_gb(model, pages):
    args = model.args
    return pages * PAGE_TOKENS * KVCache.bytes_per_token(args.n_layers, args.n_heads, args.head_dim,
                                                         model.dtype) / 1e9


@pytest.mark.parametrize("ngram", [OFF, NGramConfig(ngram_size=3, window=20)], ids=["plain", "ngram"])
def test_preempted_sequences_resume_and_equal_alone(model, tokenizer, ngram):
    """A KV cache of 5 pages (320 tokens) for three sequences growing to ~150 tokens each: the
    newest are preempted when pages run out (pages freed, context recomputed on resumption,
    image rows included) and every generation still equals the request generated alone."""
    batch = [make_request(tokenizer, "<image>\nFree OCR.", [40], 100, 1, ngram=ngram),
             make_request(tokenizer, "hello " * 8, (), 90, 2, ngram=ngram),
             make_request(tokenizer, "<image>x", [30], 110, 3, ngram=ngram)]
    engine = GenerationEngine(model, tokenizer, max_batch=3, max_len=2048,
                              kv_cache_gb=page_budget_gb(model, 5))
    assert engine.cache.num_pages == 5 and engine.max_len == 5 * PAGE_TOKENS
    together = engine.generate(batch)
    assert engine.preemptions > 0
    assert engine.cache.free_pages == 5  # every page came back
    for request, t in zip(batch, together):
        (a,) = GenerationEngine(model, tokenizer, max_batch=1, max_len=2048).generate([request])
        assert t.token_ids == a.token_ids and t.text == a.text and len(t.token_ids) == request.params.max_tokens


def test_the_cache_bounds_sequences_and_prompts(model, tokenizer):
    """Admission waits for pages (one page kept per running sequence for its next token); a
    prompt longer than the whole cache is refused when added."""
    engine = GenerationEngine(model, tokenizer, max_batch=8, max_len=2048,
                              kv_cache_gb=page_budget_gb(model, 4))
    for i in range(4):
        engine.add(make_request(tokenizer, "a" * 100, (), 4, i, ngram=OFF))  # 2 pages each with BOS
    engine.step()
    assert len(engine.running) == 1 and len(engine.waiting) == 3  # 2 pages + 1 reserved + 2 > 4
    results = []
    while engine.has_work():
        results += [d for d in engine.step() if d.finished]
    assert len(results) == 4 and engine.cache.free_pages == 4
    with pytest.raises(ValueError, match="does not fit the context of 256"):
        engine.add(make_request(tokenizer, "a" * 300, (), 4, 0))


def test_kv_cache_pages_rows_and_scratch():
    cache = KVCache(1, 1, 4, num_pages=3, max_seqs=3, max_len=256, device="cpu", dtype=torch.float32)
    assert cache.reserve(0, 65) and cache.table[0].tolist() == [1, 2, 0, 0]
    assert not cache.reserve(1, 129) and cache.free_pages == 1  # all or nothing
    assert cache.reserve(1, 1) and cache.table[1].tolist() == [3, 0, 0, 0]
    cache.release(0)
    cache.move(1, 0)  # the last row moves into the freed one: its table row, no keys copied
    assert cache.table[:2].tolist() == [[3, 0, 0, 0], [0, 0, 0, 0]] and cache.free_pages == 2
    cache.clear()
    assert cache.free_pages == 3 and not cache.table.any()


def test_paged_kernel_equals_the_gathered_reference_in_triton_interpreter():
    """The Triton decode kernel, run by Triton's CPU interpreter (fp32), against the gathered
    SDPA reference: splits from 1 to many, rows at page edges, pages in any order."""
    triton = pytest.importorskip("triton")  # noqa: F841
    code = """
import torch
from decoder.kv_cache import FP8, PAGE_TOKENS, gathered_decode_attention, stored
from decoder.triton_paged_attention import paged_decode_attention, split_tokens_for
torch.manual_seed(0)
heads, d, pages = 3, 32, 40
k, v = torch.randn(pages, heads, PAGE_TOKENS, d), torch.randn(pages, heads, PAGE_TOKENS, d)
# split None: the module's choice for that many rows (split_tokens_for: 64 tokens at one row)
for rows, kv_len, positions, block, split in [(1, 1024, [1023], 64, 128), (4, 300, [0, 63, 64, 299], 32, 64),
                                             (6, 300, None, 128, 512), (1, 1024, [700], 32, None)]:
    table = torch.stack([torch.randperm(pages - 1)[:16] + 1 for _ in range(rows)]).int()
    p = torch.tensor(positions) if positions else torch.randint(0, kv_len, (rows,))
    q = torch.randn(rows, heads, 1, d)
    ref = gathered_decode_attention(q, k, v, table, p, kv_len)
    out = paged_decode_attention(q[:, :, 0], k, v, table, p, kv_len, block_t=block,
                                 split_tokens=split).view(rows, 1, heads * d)
    print(rows, -(-kv_len // (split or split_tokens_for(rows))), float((out - ref).abs().max()))
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
# An fp8 cache (kv_cache_dtype "fp8"): the kernel reads its values as the reference does.
k8, v8 = stored(k * 4, FP8), stored(v * 4, FP8)
out = paged_decode_attention(q[:, :, 0], k8, v8, table, p, kv_len, block_t=32).view(rows, 1, heads * d)
ref = gathered_decode_attention(q, k8, v8, table, p, kv_len)
print(rows, -(-kv_len // split_tokens_for(rows)), float((out - ref).abs().max()), "fp8")
assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
"""
    stdout = run_in_triton_interpreter(code, timeout=300)
    splits = [int(line.split()[1]) for line in stdout.split("\n") if line]
    assert splits[0] > 1 and splits[2] == 1, stdout  # both the split and the one-split path
    assert splits[3] == 16, stdout  # one row: 64 tokens a program
    assert len(splits) == 5 and stdout.strip().endswith("fp8"), stdout


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows,kv_len", [(1, 8192), (16, 1536), (64, 2048), (256, 1024)])
def test_paged_kernel_equals_the_gathered_reference_on_gpu(rows, kv_len, cache_dtype):
    from decoder.kv_cache import stored
    from decoder.triton_paged_attention import paged_decode_attention
    torch.manual_seed(0)
    heads, d, pages = 10, 128, rows * pages_for(kv_len) + 1
    k = stored(torch.randn(pages, heads, PAGE_TOKENS, d, device="cuda", dtype=torch.bfloat16), cache_dtype)
    v = stored(torch.randn(k.shape, device="cuda", dtype=torch.bfloat16), cache_dtype)
    table = (torch.randperm(pages - 1, device="cuda")[:rows * pages_for(kv_len)] + 1).view(rows, -1).int()
    p = torch.randint(0, kv_len, (rows,), device="cuda")
    p[0] = kv_len - 1
    q = torch.randn(rows, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    ref = gathered_decode_attention(q.float(), k.float(), v.float(), table, p, kv_len)
    out = paged_decode_attention(q[:, :, 0], k, v, table, p, kv_len).view(rows, 1, heads * d)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"rows {rows} kv_len {kv_len} {cache_dtype}: paged kernel vs fp32 reference {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("behind_decode", [False, True], ids=["idle", "behind-decode"])
def test_a_prefill_out_of_gpu_memory_is_retried_in_smaller_groups(model, tokenizer, monkeypatch, behind_decode):
    """A CUDA OOM in a batched prefill (seen under load when the KV cache left too little room)
    puts the group back and halves the prefill budget to below the failed forward: every
    request still completes, equal to a run without the failure, instead of the step failing
    every request in flight. `behind_decode`: the failed prefill was launched behind a running
    sequence's decode step (`prefill_behind_decode`), which keeps decoding."""
    batch = [make_request(tokenizer, "hello " * 4, (), 6, i, ngram=OFF) for i in range(4)]
    expected = [d.token_ids for d in GenerationEngine(model, tokenizer, max_batch=4, max_len=256).generate(batch)]
    monkeypatch.setattr(GenerationEngine, "prefill_behind_decode", True)
    engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=256, prefill_tokens=4096)
    forward, failures = model.forward, []

    def flaky(*args, **kwargs):
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None and embeds.shape[0] > 2:
            failures.append(embeds.shape[0])
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 468.00 MiB")
        return forward(*args, **kwargs)
    monkeypatch.setattr(model, "forward", flaky)
    fresh = [make_request(tokenizer, "hello " * 4, (), 6, i, ngram=OFF) for i in range(4)]
    tokens = collections.defaultdict(list)
    for request in fresh:
        engine.add(request)
        if behind_decode and request is fresh[0]:
            for delta in engine.step():  # idle: the first request alone, then it decodes
                tokens[delta.request_id] += delta.token_ids
    while engine.has_work():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    failed = 3 if behind_decode else 4  # the rows of the forward that failed
    assert failures == [failed] and engine.prefill_tokens == failed * len(fresh[0].prompt_ids) // 2
    assert [tokens[r.request_id] for r in fresh] == expected
    assert engine.cache.free_pages == engine.cache.num_pages


def test_first_forwards_write_only_the_scratch_page(model, tokenizer):
    """What `prepare()` runs before capture (compiling the Triton kernels ahead, so on garbage
    where no kernel ran): the decode step of every graph shape and the warm-up prefill. Their
    rows hold no pages, so they may write the cache's scratch page (0) and nothing else."""
    from decoder.decode_graphs import graph_shapes
    engine = GenerationEngine(model, tokenizer, max_batch=8, max_len=1024)
    assert len(graph_shapes(engine.cache, 8, 1024)) == 4 * 3  # batches 1-8, contexts 512-1024
    gen = torch.Generator().manual_seed(0)
    for cache in (engine.cache.k, engine.cache.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = engine.cache.k.clone(), engine.cache.v.clone()
    engine.runner._first_forwards(capture=True, warm_prefill=True)
    for cache, kept in zip((engine.cache.k, engine.cache.v), before):
        assert torch.equal(cache[:, 1:], kept[:, 1:])
        assert not torch.equal(cache[:, :1], kept[:, :1])  # the forwards did reach the cache


@pytest.mark.gpu
def test_compile_ahead_leaves_generations_unchanged(monkeypatch):
    """Decode graphs captured after compiling the kernels ahead (on garbage) generate the same
    tokens as with the switch off (DEEPSEEK_OCR_COMPILE_AHEAD=0: each kernel compiled at its
    first launch), bit for bit: the same kernels, and nothing of the garbage run left behind."""
    from decoder.checkpoint import random_decoder
    from decoder.config import DecoderArgs
    # The decode step's down kernel sums each token's experts by fp32 atomic adds, in an order
    # that varies run to run, so a greedy pick at a near-tie can differ between ANY two runs
    # (seen on the H200: this test failed 1 run in 4 with the switch the only difference).
    # Stores and one sum instead (large prefills' way) are deterministic: the two runs then
    # differ only in what compiling ahead could change.
    deterministic_expert_sums(monkeypatch)
    model = random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16)
    tokenizer = ByteTokenizer()
    prompts = ["first page", "a second, longer prompt " * 8, "3", "table <td>x</td>" * 20]
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("DEEPSEEK_OCR_COMPILE_AHEAD", switch)
        engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=1024, decode_graphs=True)
        runs[switch] = [d.token_ids for d in engine.generate(
            [GenerationRequest([0] + tokenizer.encode(p), params=SamplingParams(max_tokens=32))
             for p in prompts])]
        print(f"compile ahead {switch}: {engine.compile_ahead_s:.2f} s")
        assert (engine.compile_ahead_s > 0) == (switch == "1")
    assert runs["1"] == runs["0"]


@pytest.mark.gpu
def test_no_request_waits_on_a_kernel_compile_after_prepare():
    """After `prepare()` (decode graphs and the warm-up prefill), prefills of any length and any
    number of rows launch only Triton kernels compiled already: a fresh node's first requests
    never wait on a compile."""
    from decoder import triton_moe, triton_rope
    from decoder.checkpoint import random_decoder
    from decoder.config import DecoderArgs
    model = random_decoder(DecoderArgs(), device="cuda", dtype=torch.bfloat16)
    engine = GenerationEngine(model, ByteTokenizer(), max_batch=16, max_len=2048)
    engine.prepare()
    kernels = (triton_moe._gate_up_kernel, triton_moe._down_kernel, triton_rope._rope_cache_kernel)

    def compiled() -> int:  # each JIT function's compiled variants, over its device caches
        return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())

    before = compiled()
    assert before >= 5  # decode tiles (graph capture), prefill tiles and RoPE (the warm-up)
    for lengths in ((5,), (100, 999), (1000, 1024, 1001), (1600,)):
        engine.generate([GenerationRequest([0] + [65 + i % 26 for i in range(n - 1)],
                                           params=SamplingParams(max_tokens=2, ignore_eos=True))
                         for n in lengths])
    print(f"compiled kernel variants after prepare(): {before}, after prefills: {compiled()}")
    assert compiled() == before


def batch_request(tokenizer, prompt, max_tokens, seed):
    return make_request(tokenizer, prompt, (), max_tokens, seed, ngram=OFF, priority="batch")


def test_batch_work_gives_its_rows_to_interactive_work_and_takes_them_back(model, tokenizer):
    """Four batch requests fill the engine's 4 rows; an interactive one arrives: the next step
    the batch sequences yield their rows (preempted: none is kept beside interactive work by
    default), it runs alone, and after it (the quiet time set to none here) the batch resumes.
    Every answer equals the request generated alone: yielding loses nothing."""
    batch = [batch_request(tokenizer, f"page {i}", 30, i) for i in range(4)]
    interactive = make_request(tokenizer, "hello", (), 12, 9, ngram=OFF)
    engine = GenerationEngine(model, tokenizer, max_batch=4, max_len=1024)
    scheduler = engine.scheduler
    scheduler.batch_resume_s = 0.0
    ids = [engine.add(r) for r in batch]
    results = {i: Delta(i, "", []) for i in ids}
    for _ in range(3):
        for d in engine.step():
            results[d.request_id].merge(d)
    assert scheduler.batch_running == 4  # no interactive work: the batch takes every row
    ids.append(engine.add(interactive))
    results[ids[-1]] = Delta(ids[-1], "", [])
    alongside = []
    while not results[ids[-1]].finished:
        for d in engine.step():
            results[d.request_id].merge(d)
        if any(s.request is interactive for s in scheduler.running):
            alongside.append(scheduler.batch_running)
    assert alongside and max(alongside) == 0 and scheduler.yields == 4
    assert not any(results[i].finished for i in ids[:4])  # the batch waited
    while engine.has_work():
        for d in engine.step():
            results[d.request_id].merge(d)
    for request, request_id in zip(batch + [interactive], ids):
        (alone,) = GenerationEngine(model, tokenizer, max_batch=1, max_len=1024).generate([request])
        assert results[request_id].token_ids == alone.token_ids


def test_interactive_work_goes_ahead_of_batch_work_waiting_and_batch_work_waits_out_the_quiet(model, tokenizer):
    """One row: two batch requests queued first, then an interactive one: it runs first. After
    it, the batch waits the quiet time before it runs (`only_held_work` meanwhile: the async
    engine looks again every HELD_POLL_S instead of spinning); `batch_beside_interactive` rows
    let batch work run beside interactive work; a held request can be aborted."""
    engine = GenerationEngine(model, tokenizer, max_batch=1, max_len=1024)
    scheduler = engine.scheduler
    first, second = batch_request(tokenizer, "a", 8, 1), batch_request(tokenizer, "b", 8, 2)
    interactive = make_request(tokenizer, "hello", (), 6, 3, ngram=OFF)
    ids = [engine.add(r) for r in (first, second, interactive)]
    finished = []
    while not finished:
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == [ids[2]] and engine.only_held_work()  # within the quiet second
    assert engine.abort(ids[1]).finish_reason == "aborted"
    scheduler.batch_resume_s = 0.0
    while engine.has_work():
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == [ids[2], ids[0]]

    wide = GenerationEngine(model, tokenizer, max_batch=3, max_len=1024)
    wide.scheduler.batch_beside_interactive = 1
    for r in (batch_request(tokenizer, "c", 20, 4), batch_request(tokenizer, "d", 20, 5),
              make_request(tokenizer, "hi", (), 20, 6, ngram=OFF)):
        wide.add(r)
    for _ in range(3):
        wide.step()
    assert len(wide.scheduler.running) == 2 and wide.scheduler.batch_running == 1


def test_pages_running_out_preempt_batch_sequences_before_interactive_ones(model, tokenizer):
    """A KV cache of 5 pages: an interactive sequence admitted first and two batch ones (let in
    beside it) grow until pages run out: a batch sequence is the one preempted, never the
    newer interactive one, and all three still equal their requests generated alone."""
    engine = GenerationEngine(model, tokenizer, max_batch=3, max_len=2048, kv_cache_gb=page_budget_gb(model, 5))
    engine.scheduler.batch_beside_interactive = 2
    batch = [batch_request(tokenizer, "hello " * 8, 100, 1), batch_request(tokenizer, "page", 110, 2)]
    interactive = make_request(tokenizer, "<image>x", [30], 110, 3, ngram=OFF)
    together = engine.generate([*batch, interactive])
    assert engine.preemptions > 0 and engine.scheduler.yields == 0
    for request, t in zip([*batch, interactive], together):
        (alone,) = GenerationEngine(model, tokenizer, max_batch=1, max_len=2048).generate([request])
        assert t.token_ids == alone.token_ids


def test_batch_work_let_in_and_not_yet_running_goes_back_when_interactive_work_comes(model, tokenizer):
    """A batch sequence back from a preemption, let into the preempted queue (the first one a
    prefill takes) while no interactive work was there, would hold that queue's head: when an
    interactive request comes it goes back to the held work, and the interactive request is the
    one admitted."""
    engine = GenerationEngine(model, tokenizer, max_batch=2, max_len=1024)
    scheduler = engine.scheduler
    resumed = scheduler._sequence(batch_request(tokenizer, "later", 8, 1))
    scheduler.held_preempted.append(resumed)
    scheduler.let_in_batch()  # no interactive work: let in
    assert list(scheduler.preempted) == [resumed]
    interactive = make_request(tokenizer, "now", (), 8, 2, ngram=OFF)
    engine.add(interactive)
    scheduler.let_in_batch()
    assert not scheduler.preempted and list(scheduler.held_preempted) == [resumed]
    assert [seq.request for seq in scheduler.next_prefill_group()] == [interactive]
