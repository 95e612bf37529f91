"""The OpenAI-style API through the real `openai` client against the running app (tiny model,
CPU, real Serve): chat completions (plain and streamed), vLLM's extra_body knobs, models, errors
in the one envelope; and the chat prompt built as vLLM builds it."""
import base64
import json

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("ray")

from decoder.tokenizer import IMAGE_TOKEN_ID, ByteTokenizer, build_prompt  # noqa: E402
from deployments.openai_api import ChatRequest  # noqa: E402
from deployments.protocol import BadRequest, OcrOptions  # noqa: E402
from tests.conftest import SERVE_URL  # noqa: E402
from tests.helpers import png  # noqa: E402


IMAGE = png((500, 300), (200, 120, 40))
DATA_URL = "data:image/png;base64," + base64.b64encode(IMAGE).decode()


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image_part(url=DATA_URL):
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text):
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{SERVE_URL}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def ocr(**body):
    response = requests.post(f"{SERVE_URL}/v1/ocr", timeout=300,
                             json={"image": base64.b64encode(IMAGE).decode(), **body})
    assert response.status_code == 200, response.text
    return response.json()


# -- the prompt, as vLLM builds it ----------------------------------------------------------
@pytest.mark.parametrize("messages, prompt", [
    (user(image_part(), text_part("Free OCR.")), "<image>\nFree OCR."),
    (user(text_part("Free OCR."), image_part()), "<image>\nFree OCR."),  # images go first
    (user(image_part(), text_part("<|grounding|>Convert the document to markdown.")),
     "<image>\n<|grounding|>Convert the document to markdown."),
    (user(image_part(), image_part(), text_part("Free OCR.")), "<image>\n<image>\nFree OCR."),
    (user(image_part(), text_part("a"), text_part("b")), "<image>\na\nb"),
    (user(text_part("<image>\nParse the figure."), image_part()), "<image>\nParse the figure."),
    ([{"role": "system", "content": "S."}] + user(image_part(), text_part("Free OCR.")),
     "S.<image>\nFree OCR."),
])
def test_chat_prompt_is_vllms(messages, prompt):
    urls, document, built = ChatRequest.parse({"messages": messages}).sources_and_prompt()
    assert built == prompt and document is None and urls == [DATA_URL] * prompt.count("<image>")


def test_chat_and_ocr_prompt_ids_are_deepseeks_template():
    """The same request through both APIs gives one prompt, and its ids are DeepSeek's:
    BOS, the image placeholders, then the text after the tag, no role tags, no EOS."""
    tokenizer = ByteTokenizer()
    chat = ChatRequest.parse({"messages": user(image_part(), text_part("Free OCR."))})
    _, _, prompt = chat.sources_and_prompt()
    via_chat = chat.ocr_options(prompt).prompt_for(1, 16)
    via_ocr = OcrOptions.parse({"prompt": "<image>\nFree OCR."}).prompt_for(1, 16)
    assert via_chat == via_ocr
    ids = build_prompt(tokenizer, via_chat, [273])
    assert ids == [0] + [IMAGE_TOKEN_ID] * 273 + tokenizer.encode("\nFree OCR.")
    preset = ChatRequest.parse({"messages": user(image_part()), "prompt_preset": "free"})
    _, _, no_prompt = preset.sources_and_prompt()
    assert preset.ocr_options(no_prompt).prompt_for(1, 16) == via_ocr


def test_chat_carries_the_loop_options():
    """`repetition_guard`, `retry` and `text_layer_fallback` in extra_body mean what they mean on /v1/ocr."""
    chat = ChatRequest.parse({"messages": user(image_part()), "repetition_guard": {"min_tokens": 64},
                              "retry": {"temperatures": []}, "text_layer_fallback": False})
    options = chat.ocr_options(chat.sources_and_prompt()[2])
    assert (options.repetition_guard.min_tokens, options.retry.temperatures, options.text_layer_fallback) == (64, [], False)


@pytest.mark.parametrize("body, param", [
    ({"messages": user(image_part()), "n": 2}, "n"),
    ({"messages": user(image_part()) * 2}, "messages"),
    ({"messages": user(image_part()) + [{"role": "assistant", "content": "x"}]}, "messages"),
    ({"messages": user(image_part(), text_part("x")), "prompt_preset": "free"}, "prompt_preset"),
    ({"messages": user(image_part()), "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
    ({"messages": user(image_part()), "logprobs": True}, "logprobs"),
    ({"messages": user(image_part()), "temperature": 3}, "temperature"),
    ({"messages": user(image_part()), "vllm_xargs": {"ngram": 3}}, "vllm_xargs.ngram"),
    ({"messages": user(image_part()), "repetition_guard": {"max_period": 0}}, "repetition_guard"),
    ({"messages": user(image_part()), "retry": {"temperatures": [9]}}, "retry.temperatures"),
])
def test_bad_chat_requests_name_the_field(body, param):
    with pytest.raises(BadRequest) as error:
        chat = ChatRequest.parse(body)
        chat.ocr_options(chat.sources_and_prompt()[2])
    assert error.value.param == param, str(error.value)


# -- through the openai client --------------------------------------------------------------
def test_models_list_and_retrieve(client, model_id):
    assert model_id == "tiny-random"  # a plain token: usable in a URL as it is
    assert client.models.retrieve(model_id).id == model_id
    assert requests.get(f"{SERVE_URL}/v1/models/tiny-random", timeout=30).status_code == 200
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("deepseek-ai/DeepSeek-OCR")
    assert error.value.body["code"] == "model_not_found"


def test_chat_completion_equals_ocr_of_the_same_request(client, model_id):
    response = client.chat.completions.create(
        model=model_id, max_tokens=16, temperature=0.0,
        messages=user(image_part(), text_part("Free OCR.")))
    expected = ocr(prompt="<image>\nFree OCR.", max_tokens=16)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == model_id and choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected["finish_reason"]]
    usage = expected["usage"]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == \
        (usage["prompt_tokens"], usage["completion_tokens"])
    assert response.usage.total_tokens == usage["prompt_tokens"] + usage["completion_tokens"]
    # `model` may be left out (the openai client always sends one): the one model served answers
    raw = requests.post(f"{SERVE_URL}/v1/chat/completions", timeout=300, json={
        "messages": user(image_part(), text_part("Free OCR.")), "max_tokens": 16}).json()
    assert raw["choices"][0]["message"]["content"] == expected["text"] and raw["model"] == model_id
    assert "RANDOM" in raw["warning"]  # the tiny random model says so in every answer, beside its id


def test_streamed_chat_matches_the_whole_answer(client, model_id):
    messages = user(image_part(), text_part("Free OCR."))
    whole = client.chat.completions.create(model=model_id, max_tokens=12, messages=messages)
    chunks = list(client.chat.completions.create(
        model=model_id, max_tokens=12, messages=messages, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_vllm_extra_body_knobs(client, model_id):
    """vllm_xargs as vLLM's users send them mean what they mean in vLLM; without them the app's
    30/90 rule with the <td> whitelist holds (the same text as /v1/ocr's default)."""
    messages = user(image_part(), text_part("Free OCR."))

    def chat(**extra):
        return client.chat.completions.create(model=model_id, max_tokens=40, messages=messages,
                                              extra_body=extra).choices[0].message.content
    small_rule = {"ngram_size": 3, "window_size": 20, "whitelist_token_ids": [128821, 128822]}
    assert chat(vllm_xargs=small_rule) == ocr(prompt="<image>\nFree OCR.", max_tokens=40, ngram={
        "ngram_size": 3, "window": 20, "whitelist": [128821, 128822]})["text"]
    off = ocr(prompt="<image>\nFree OCR.", max_tokens=40, ngram={"enabled": False})["text"]
    assert chat(vllm_xargs={}) == off  # vLLM: no ngram_size, no rule
    assert chat() == ocr(prompt="<image>\nFree OCR.", max_tokens=40)["text"]
    assert chat(vllm_xargs=small_rule) != off  # the random model repeats without the rule
    assert chat(skip_special_tokens=False) == chat()


def test_seeded_sampling_through_chat(client, model_id):
    messages = user(image_part(), text_part("Free OCR."))

    def chat(**sampling):
        return client.chat.completions.create(model=model_id, max_tokens=12, messages=messages,
                                              **sampling).choices[0].message.content
    assert chat(temperature=1.0, top_p=0.9, seed=11) == chat(temperature=1.0, top_p=0.9, seed=11)
    assert chat(temperature=1.0, seed=11) != chat(temperature=1.0, seed=12)
    assert chat(temperature=1.0, seed=11) != chat()


def test_unknown_model_and_bad_image_are_errors_in_the_envelope(client, model_id):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=user(image_part()))
    assert error.value.body["param"] == "model"
    bad = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_id, messages=user(image_part(bad)), max_tokens=4)
    assert error.value.status_code == 400 and error.value.body["type"] == "invalid_request"
    assert error.value.body["param"] == "messages[0].content[0]"
    assert "cannot decode image" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="fetch_image_urls") as error:
        client.chat.completions.create(messages=user(text_part("x"), image_part("http://127.0.0.1:9/x.png")),
                                       model=model_id)
    assert error.value.body["param"] == "messages[0].content[1]"
    with pytest.raises(openai.BadRequestError, match="no image") as error:
        client.chat.completions.create(messages=user(text_part("Free OCR.")),
                                       model=model_id)
    assert error.value.body["param"] == "messages" and "image_url part" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="2 <image> tags for 1 image_url") as error:
        client.chat.completions.create(messages=user(image_part(), text_part("<image><image>x")),
                                       model=model_id)
    assert error.value.body["param"] == "messages"
    raw = requests.post(f"{SERVE_URL}/v1/chat/completions", data="{", timeout=30,
                        headers={"content-type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_presets_and_output_formats_through_chat(client, model_id):
    messages = user(image_part())
    free = client.chat.completions.create(model=model_id, max_tokens=10, messages=messages,
                                          extra_body={"prompt_preset": "free"})
    assert free.choices[0].message.content == ocr(prompt_preset="free", max_tokens=10)["text"]
    blocks = client.chat.completions.create(model=model_id, max_tokens=10, messages=messages,
                                            extra_body={"output_format": "blocks",
                                                        "prompt_preset": "markdown"})
    assert blocks.model_extra["blocks"] == ocr(output_format="blocks", max_tokens=10)["blocks"]
    # an image alone is vLLM's prompt "<image>\n", not a preset
    bare = client.chat.completions.create(model=model_id, max_tokens=10, messages=messages)
    assert bare.choices[0].message.content == ocr(prompt="<image>\n", max_tokens=10)["text"]


def test_handle_chat_mirrors_http(serve_app, model_id):
    messages = user(image_part(), text_part("Free OCR."))
    answer = serve_app.chat.remote(messages, max_tokens=8).result(timeout_s=300)
    assert answer["object"] == "chat.completion" and answer["model"] == model_id
    assert answer["choices"][0]["message"]["content"] == ocr(prompt="<image>\nFree OCR.", max_tokens=8)["text"]
    chunks = list(serve_app.options(stream=True).chat_stream.remote(messages, max_tokens=8))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        answer["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]


def test_chat_stream_out_of_time_sends_an_error_chunk_then_done(serve_app):
    body = {"messages": user(image_part()), "max_tokens": 2000, "stream": True, "timeout_s": 3,
            "vllm_xargs": {}}
    response = requests.post(f"{SERVE_URL}/v1/chat/completions", json=body, timeout=120, stream=True)
    events = [line[6:] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "timeout"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"


def test_readme_openai_example_runs_as_written(serve_app, tmp_path):
    """The README's openai-client block in a fresh interpreter; only the port and image path are
    this test's."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    section = open(os.path.join(root, "README.md")).read().split("## Usage: the OpenAI-style API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "page.png").write_bytes(png((900, 1200)))
    code = code.replace("http://127.0.0.1:8000", SERVE_URL).replace("max_tokens=2048", "max_tokens=8")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "<|id:" in done.stdout and "'parse_error': None}]" in done.stdout  # random text, its blocks
