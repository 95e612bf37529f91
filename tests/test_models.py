"""Several models behind one address (`models` in the app's arguments): each its own tiers,
requests choosing by `model` through HTTP, the OpenAI client and handles; an unknown model
answers 404 in the envelope; the single-model app is unchanged (every other test runs it)."""
import base64
import json
import time

import pytest
import torch

from deployments.config import AppConfig
from tests.helpers import png

IMAGE = png((900, 700), (30, 120, 200))  # tiled: 3x2 crops, 893 image tokens


# -- the arguments ------------------------------------------------------------------------------
def test_each_model_gets_its_own_config_and_tier_names():
    config = AppConfig(max_len=2048, api_key="k" * 8, models=[
        {"name": "ocr-1"}, {"name": "ocr.2", "one_encoder": True, "max_batch": 8}])
    first, second = config.served_models()
    assert (first.name, first.config.max_batch, first.config.one_encoder) == ("ocr-1", 256, False)
    assert (second.name, second.config.max_batch, second.config.one_encoder) == ("ocr.2", 8, True)
    assert second.config.max_len == 2048 and second.config.api_key == "k" * 8  # the app's, shared
    assert [first.tier_name("Decoder"), second.tier_name("Encoder")] == ["Decoder-ocr-1", "Encoder-ocr.2"]
    (alone,) = AppConfig().served_models()
    assert alone.config == AppConfig() and alone.tier_name("Decoder") == "Decoder"


@pytest.mark.parametrize("models, message", [
    ([], "at least one model"),
    ([{"name": "a"}, {"name": "a"}], "given twice"),
    ([{"name": "a b"}], r"models\[0\].name must be"),
    ([{"checkpoint": "/x"}], r"models\[0\].name must be"),
    ([{"name": "a", "api_key": "k" * 8}], "api_key is not an argument a model sets"),
    ([{"name": "a", "max_batch": 0}], r"models\[0\] \(a\).*max_batch"),
    ([{"name": "a", "one_encoder": True, "views_on_encoder": False}], "needs views_on_encoder"),
])
def test_bad_models_are_refused_naming_the_entry(models, message):
    with pytest.raises(ValueError, match=message):
        AppConfig(models=models)


def test_served_model_name_and_models_do_not_mix():
    with pytest.raises(ValueError, match="each entry's name is its id"):
        AppConfig(served_model_name="x", models=[{"name": "a"}])


def test_a_checkpoint_whose_halves_disagree_is_refused_when_the_app_is_built(tmp_path):
    from deployments.app import build
    from deployments.model_source import write_random_model
    from encoder import EncoderV2Args
    with pytest.raises(ValueError, match="vision projector's width 80 must be the language model's 64"):
        write_random_model(tmp_path / "w", vision=EncoderV2Args.tiny())
    directory = write_random_model(tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    config["language_config"]["hidden_size"] = 128
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="makes 64-wide tokens but its language model is 128 wide"):
        build(AppConfig(checkpoint=directory))


def test_corpus_requests_name_the_model_only_when_asked():
    from corpus.run import RunOptions
    assert "model" not in RunOptions().keyed()  # manifests written before keep their keys
    assert RunOptions(model="b").keyed()["model"] == "b"


# -- served -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ocr2_checkpoint():
    """The tiny random DeepSeek-OCR-2 model's directory: what `checkpoint: tiny-random-ocr2`
    serves (its id in the apps below is their entry's name)."""
    from deployments.model_source import resolve_checkpoint
    return resolve_checkpoint("tiny-random-ocr2")[0]


@pytest.fixture
def three_models(serve_app):
    """DeepSeek-OCR's tiny model as `a` (two path encoders: the shared app's, the same model),
    and DeepSeek-OCR-2's tiny one twice: `b` on two path encoders (the router lays the sequence
    out), `c` on one Encoder. Deleted after its test: its six replicas and the next test's
    app would not fit the test cluster's CPUs together."""
    from ray import serve

    from deployments.app import model_tiers
    from deployments.placement import ModelTiers
    from deployments.router import Router
    from tests.conftest import shared_tier
    config = AppConfig(max_len=2048, max_images=4, models=[
        {"name": "a"}, {"name": "b", "checkpoint": "tiny-random-ocr2"},
        {"name": "c", "checkpoint": "tiny-random-ocr2", "one_encoder": True}])
    a, *others = config.served_models()
    shared = [shared_tier(tier) for tier in ("GlobalEncoder", "LocalEncoder", "Decoder")]
    app = Router.bind([ModelTiers(a, *shared)] + [model_tiers(model) for model in others], config)
    yield serve.run(app, name="models", route_prefix="/models")
    serve.delete("models")


@pytest.mark.slow
def test_requests_choose_their_model(three_models, ocr2_checkpoint):
    requests = pytest.importorskip("requests")
    openai = pytest.importorskip("openai")
    from ray import serve

    from encoder import DEEPSEEK_OCR_2, DualPathEncoder, decode, load_encoder
    from tests.conftest import SERVE_URL
    url = f"{SERVE_URL}/models"
    deployments = set(serve.status().applications["models"].deployments)  # (a's: the shared app's)
    assert deployments == {"Router", "GlobalEncoder-b", "LocalEncoder-b", "Decoder-b", "Encoder-c", "Decoder-c"}
    assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=60).json()["data"]] == ["a", "b", "c"]
    assert requests.get(f"{url}/v1/models/b", timeout=60).json()["id"] == "b"
    # Polled as a probe is: while no Router has answered /ready in half a second (its first
    # answer asks nine tiers; once that took longer on two busy cores), the proxy says "starting".
    for _ in range(60):
        ready = requests.get(f"{url}/ready", timeout=60).json()
        if ready["status"] != "starting":
            break
        time.sleep(1)
    assert ready["status"] == "ready" and set(ready["tiers"]) == deployments - {"Router"} | {
        "GlobalEncoder-a", "LocalEncoder-a", "Decoder-a"}

    ocr2_tokens = DEEPSEEK_OCR_2.count_tokens(decode(IMAGE, tiling=DEEPSEEK_OCR_2).grid)
    body = {"image": base64.b64encode(IMAGE).decode(), "max_tokens": 6}
    answers = {}
    for model, tokens in ((None, 893), ("a", 893), ("b", ocr2_tokens), ("c", ocr2_tokens)):
        response = requests.post(f"{url}/v1/ocr", json={**body, **({"model": model} if model else {})},
                                 timeout=300)
        assert response.status_code == 200, response.text
        answers[model] = response.json()
        assert answers[model]["model"] == (model or "a") and answers[model]["usage"]["image_tokens"] == tokens
    assert answers["b"]["text"] == answers["c"]["text"]  # one checkpoint, either placement
    for field, value in (("mode", "tiny"), ("max_crops", 9)):  # DeepSeek-OCR-2's own limits
        response = requests.post(f"{url}/v1/ocr", json={**body, "model": "b", field: value}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    image_url = {"url": "data:image/png;base64," + body["image"]}
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": image_url},
                                             {"type": "text", "text": "Free OCR."}]}]
    chat = client.chat.completions.create(model="c", messages=messages, max_tokens=6)
    assert chat.model == "c"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="d", messages=messages, max_tokens=6)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"

    for response in (requests.post(f"{url}/v1/ocr", json={**body, "model": "d"}, timeout=60),
                     requests.get(f"{url}/v1/models/d", timeout=60)):
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and "'a', 'b', 'c'" in error["message"]

    got = three_models.ocr.remote(IMAGE, max_tokens=6, model="c").result(timeout_s=300)
    assert got["model"] == "c" and got["text"] == answers["c"]["text"]
    (seq_a,) = three_models.encode.remote(IMAGE).result(timeout_s=300)
    assert seq_a.shape[0] == 893
    (want,) = DualPathEncoder(load_encoder(ocr2_checkpoint)).encode_images([IMAGE])
    for model in ("b", "c"):  # the router's layout and the Encoder's equal the engine in process
        (seq,) = three_models.encode.remote(IMAGE, model=model).result(timeout_s=300)
        torch.testing.assert_close(seq, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="not served here"):
        three_models.ocr.remote(IMAGE, model="d").result(timeout_s=60)
    assert three_models.stats.remote("b").result()["model"] == "b"


# -- Unlimited-OCR ------------------------------------------------------------------------------
def test_a_models_own_ngram_rule_fills_what_a_request_leaves_unset():
    from decoder import DecoderArgs, NGramConfig, ngram_defaults
    from deployments.protocol import OcrOptions
    unlimited = DecoderArgs.tiny(sliding_window=8)
    assert OcrOptions().sampling(ngram_defaults(unlimited, 1)).ngram == NGramConfig(
        35, 128, (), include_prompt=True)
    assert OcrOptions().sampling(ngram_defaults(unlimited, 3)).ngram.window == 1024
    assert OcrOptions().sampling(ngram_defaults(DecoderArgs.tiny(), 3)).ngram == NGramConfig()
    asked = OcrOptions.parse({"ngram": {"ngram_size": 20}}).sampling(ngram_defaults(unlimited, 1)).ngram
    assert (asked.ngram_size, asked.window, asked.whitelist, asked.include_prompt) == (20, 128, (), True)
    assert OcrOptions.parse({"ngram": {"enabled": False}}).sampling(ngram_defaults(unlimited, 1)).ngram.enabled is False


def test_window_answers_split_where_the_model_marks_pages():
    from deployments.pages import split_pages
    result = {"text": "<PAGE>one<PAGE> two", "finish_reason": "eos",
              "usage": {"prompt_tokens": 5, "image_tokens": 546, "completion_tokens": 7}}
    first, second = split_pages((4, 5), result, [(10, 20), (30, 40)])
    assert (first["text"], second["text"], first["split"], second["window"]) == ("one", "two", True, [4, 5])
    assert first["usage"]["completion_tokens"] == 7 and second["usage"]["completion_tokens"] == 0
    unsplit = split_pages((4, 5, 6), {**result, "text": "all of it"}, [(1, 1)] * 3)
    assert [e["text"] for e in unsplit] == ["all of it", "", ""] and not unsplit[0]["split"]


@pytest.mark.slow
def test_unlimited_ocr_reads_many_pages_per_request(serve_app):
    """Unlimited-OCR's tiny random model (`checkpoint: tiny-random-unlimited-ocr`: DeepSeek-OCR's
    encoder, the R-SWA decoder) reads several pages a request."""
    requests = pytest.importorskip("requests")
    from ray import serve

    from decoder import build_prompt, load_tokenizer
    from deployments.app import build
    from tests.conftest import SERVE_URL
    from tests.pdfs import make_pdf
    from deployments.model_source import TINY_WARNING, resolve_checkpoint
    serve.run(build(AppConfig(checkpoint="tiny-random-unlimited-ocr", max_len=4096, max_images=4)),
              name="unlimited", route_prefix="/unlimited")
    try:
        url = f"{SERVE_URL}/unlimited/v1/ocr"
        pdf = base64.b64encode(make_pdf(3)).decode()
        body = {"document": pdf, "mode": "base", "pages_per_request": 2, "max_tokens": 5}
        response = requests.post(url, json=body, timeout=300)
        assert response.status_code == 200, response.text
        document = response.json()
        assert [p["index"] for p in document["pages"]] == [0, 1, 2] and document["failed_pages"] == []
        assert [p["window"] for p in document["pages"]] == [[0, 1], [0, 1], [2]]
        assert (document["model"], document["warning"]) == ("tiny-random-unlimited-ocr", TINY_WARNING)
        tokenizer = load_tokenizer(resolve_checkpoint("tiny-random-unlimited-ocr")[0])
        # Base mode: 273 tokens a page; its own multi-page prompt for two pages, one page's for one.
        first, _, last = document["pages"]
        assert first["usage"]["image_tokens"] == 2 * 273 and last["usage"]["image_tokens"] == 273
        assert first["usage"]["prompt_tokens"] == len(build_prompt(
            tokenizer, "<image><image>Multi page parsing.", [273, 273]))
        assert last["usage"]["prompt_tokens"] == len(build_prompt(tokenizer, "<image>document parsing.", [273]))
        assert document["usage"]["completion_tokens"] == sum(
            p["usage"]["completion_tokens"] for p in document["pages"]) <= 10
        for change, field in (({"mode": "gundam"}, "mode"), ({"pages_per_request": 17}, "pages_per_request")):
            refused = requests.post(url, json={**body, **change}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        images = requests.post(url, timeout=300, json={  # several images, one request, base mode
            "images": [base64.b64encode(IMAGE).decode()] * 3, "mode": "base", "max_tokens": 3})
        assert images.status_code == 200 and images.json()["usage"]["image_tokens"] == 3 * 273
    finally:
        serve.delete("unlimited")


def test_a_multi_page_prompt_is_laid_out_as_transformers_unlimited_ocr_lays_it_out():
    """Our prompt ids for three pages in base mode against transformers' `UnlimitedOcrProcessor`
    expanding each <image> itself (`replace_image_token`; its image processor needs torchvision,
    so the three pages' base-mode layouts are given to it as its image processor reports them),
    tokenized by the same tokenizer.json: equal after the BOS DeepSeek's prompts begin with."""
    from types import SimpleNamespace

    pytest.importorskip("transformers.models.unlimited_ocr.processing_unlimited_ocr")
    from transformers import PreTrainedTokenizerFast
    from transformers.models.unlimited_ocr.processing_unlimited_ocr import UnlimitedOcrProcessor

    from decoder import build_prompt, load_tokenizer
    from deployments.model_source import resolve_checkpoint
    from deployments.protocol import OcrOptions
    from encoder import DEEPSEEK_OCR, decode
    directory, _ = resolve_checkpoint(None)
    pages = [png(size) for size in ((1191, 1684), (800, 600), (300, 2000))]
    tokens = [decode(page, mode="base").num_tokens for page in pages]
    assert tokens == [DEEPSEEK_OCR.count_tokens((1, 1))] * 3 == [273] * 3
    prompt = OcrOptions().prompt_for(3, 16, "parse_pages")
    assert prompt == "<image><image><image>Multi page parsing."
    ours = build_prompt(load_tokenizer(directory), prompt, tokens)

    processor = SimpleNamespace(image_token="<image>", patch_size=16, downsample_ratio=4,
                                image_processor=SimpleNamespace(size={"height": 1024, "width": 1024},
                                                                tile_size=640))
    layout = {"patches_grid": [(1, 1)] * 3, "num_local_patches": [0] * 3}  # base mode: no tiles
    first, *after = prompt.split("<image>")
    expanded = first + "".join(UnlimitedOcrProcessor.replace_image_token(processor, layout, i) + text
                               for i, text in enumerate(after))
    theirs = PreTrainedTokenizerFast(tokenizer_file=f"{directory}/tokenizer.json")(expanded)["input_ids"]
    assert ours[0] == 0 and ours[1:] == theirs
