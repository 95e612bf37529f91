"""Odd and bad inputs sent to the running app over HTTP (tiny model, CPU, real Serve).

Odd but valid images answer 200 with the image-token count of their tiling; invalid requests
answer a 4xx JSON error naming the problem, never a 500 and never a traceback; and afterwards
every replica is the one that started (none crashed or was replaced).
"""
import base64
import io
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

requests = pytest.importorskip("requests")
pytest.importorskip("ray")

from tests.conftest import SERVE_URL, replica_ids  # noqa: E402
from tests.helpers import assert_clean_error, truncated_image  # noqa: E402
from tests.pdfs import make_pdf  # noqa: E402

OCR = f"{SERVE_URL}/v1/ocr"


def encoded(image: Image.Image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def page(size=(1191, 1684), color=(250, 250, 250)) -> Image.Image:
    return Image.new("RGB", size, color)


def exif_rotated_jpeg() -> bytes:
    """1000x500 pixels stored, EXIF orientation 6 (rotate 90°): a 500x1000 image to a viewer."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(Image.new("RGB", (1000, 500), (30, 60, 90)), "JPEG", exif=exif)


def animated_gif() -> bytes:
    frames = [Image.new("P", (300, 200), i) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buf.getvalue()


def palette_with_transparency() -> bytes:
    image = Image.new("P", (300, 300), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    return encoded(image, "PNG", transparency=0)


def decompression_bomb() -> bytes:
    """A 20,000 x 20,000 PNG in a few hundred kilobytes (one colour compresses to nothing)."""
    return encoded(Image.new("1", (20_000, 20_000), 0), "PNG", optimize=True)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# name -> image bytes, image tokens (the token count of the image's tiling, as in the model card)
ODD_BUT_VALID = {
    "cmyk-jpeg": (lambda: encoded(Image.new("CMYK", (800, 600), (0, 50, 100, 0)), "JPEG"), 893),
    "16-bit-grey": (lambda: encoded(Image.new("I;16", (300, 200), 40_000), "PNG"), 273),
    "1-bit": (lambda: encoded(Image.new("1", (700, 700), 1), "PNG"), 693),
    "palette-transparency": (palette_with_transparency, 273),
    "grey-alpha": (lambda: encoded(Image.new("LA", (500, 500), (90, 128)), "PNG"), 273),
    "1x1": (lambda: encoded(Image.new("RGB", (1, 1)), "PNG"), 273),
    "10x10": (lambda: encoded(Image.new("RGB", (10, 10)), "PNG"), 273),
    "640x640": (lambda: encoded(page((640, 640)), "PNG"), 273),
    "641x100": (lambda: encoded(page((641, 100)), "PNG"), 883),
    "strip-163x4096": (lambda: encoded(page((163, 4096)), "PNG"), 933),
    "strip-4096x163": (lambda: encoded(page((4096, 163)), "PNG"), 883),
    "exif-rotated": (exif_rotated_jpeg, 493),
    "blank-page": (lambda: encoded(page(), "PNG"), 903),
    "animated-gif-first-frame": (animated_gif, 273),
    "8000x8000-at-the-64mp-limit": (lambda: encoded(Image.new("L", (8000, 8000), 255), "PNG"), 693),
}


@pytest.fixture(scope="module")
def app(serve_app):
    """The running app, and its replicas' ids before the first bad request."""
    return replica_ids()


@pytest.mark.parametrize("name", sorted(ODD_BUT_VALID))
def test_odd_but_valid_images_are_read(app, name):
    make, tokens = ODD_BUT_VALID[name]
    response = requests.post(OCR, json={"image": b64(make()), "max_tokens": 1}, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["image_tokens"] == tokens


def tiny_png() -> str:
    return b64(encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG"))


def a4() -> str:
    return b64(encoded(page(), "PNG"))

# name -> (makes the JSON body, or (content type, raw body)), expected status, words of the
# message, the field it names (`param`: None when no one field is at fault)
BAD = {
    "zero-bytes": (lambda: {"image": ""}, 400, "empty image data", "image"),
    "truncated-jpeg": (lambda: {"image": b64(encoded(page((900, 900)), "JPEG")[:2000])}, 400, "cannot decode image", "image"),
    "truncated-png": (lambda: {"image": b64(encoded(page((900, 900), (9, 99, 199)), "PNG")[:300])}, 400, "cannot decode image", "image"),
    "random-bytes": (lambda: {"image": b64(random.Random(0).randbytes(5000))}, 400, "cannot decode image", "image"),
    "text": (lambda: {"image": b64(b"Just some text, not an image.\n")}, 400, "cannot decode image", "image"),
    "html": (lambda: {"image": b64(b"<!doctype html><html><body>hi</body></html>")}, 400, "cannot decode image", "image"),
    "svg": (lambda: {"image": b64(b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>')},
            400, "cannot decode image", "image"),
    "decompression-bomb": (lambda: {"image": b64(decompression_bomb())}, 400, "image too large", "image"),
    "second-of-two-undecodable": (lambda: {"images": [tiny_png(), b64(b"not an image")], "prompt": "<image><image>x"},
                                  400, "cannot decode image", "images[1]"),
    "invalid-base64": (lambda: {"image": "not base64 at all!"}, 400, "not valid base64", "image"),
    "invalid-base64-in-a-list": (lambda: {"images": [tiny_png(), "***"]}, 400, "not valid base64", "images[1]"),
    "data-url-wrong-type": (lambda: {"image": "data:text/plain;base64," + b64(b"hello")}, 400, "data: URL", "image"),
    "image-a-number": (lambda: {"image": 12345}, 400, "base64 strings, got int", "image"),
    "image-null": (lambda: {"image": None}, 400, "no image given", "image"),
    "no-image": (lambda: {"max_tokens": 3}, 400, "no image given", "image"),
    "image-and-images": (lambda: {"image": "PNG", "images": ["PNG"]}, 400, "not both", "images"),
    "100-images": (lambda: {"images": [tiny_png()] * 100}, 400, "at most 16 images", "images"),
    "prompt-without-tag": (lambda: {"image": "PNG", "prompt": "Free OCR."}, 400, "one <image> tag per image", "prompt"),
    "two-tags-one-image": (lambda: {"image": "PNG", "prompt": "<image><image>x"}, 400, "it has 2", "prompt"),
    "max-tokens-0": (lambda: {"image": "PNG", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    "max-tokens-negative": (lambda: {"image": "PNG", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    "max-tokens-1e9": (lambda: {"image": "PNG", "max_tokens": 10 ** 9}, 400, "max_tokens", "max_tokens"),
    "max-tokens-abc": (lambda: {"image": "PNG", "max_tokens": "abc"}, 400, "max_tokens", "max_tokens"),
    "unknown-mode": (lambda: {"image": "PNG", "mode": "huge"}, 400, "unknown mode", "mode"),
    "max-crops-0": (lambda: {"image": "PNG", "max_crops": 0}, 400, "max_crops", "max_crops"),
    "max-crops-1": (lambda: {"image": "PNG", "max_crops": 1}, 400, "max_crops", "max_crops"),
    "max-crops-10": (lambda: {"image": "PNG", "max_crops": 10}, 400, "max_crops", "max_crops"),
    "max-crops-100": (lambda: {"image": "PNG", "max_crops": 100}, 400, "max_crops", "max_crops"),
    "unknown-field": (lambda: {"image": "PNG", "frequency_penalty": 0.2}, 400, "frequency_penalty: unknown field",
                      "frequency_penalty"),
    "field-named-self": (lambda: {"image": "PNG", "self": 1}, 400, "self: unknown field", "self"),
    "lone-surrogate-prompt": (lambda: {"image": "PNG", "prompt": "<image>\ud800"}, 400, "lone surrogate", "prompt"),
    "1000-stop-strings": (lambda: {"image": "PNG", "stop": [f"s{i}" for i in range(1000)]}, 400, "at most 16 stop", "stop"),
    "empty-stop-string": (lambda: {"image": "PNG", "stop": [""]}, 400, "non-empty", "stop"),
    "ngram-a-number": (lambda: {"image": "PNG", "ngram": 5}, 400, "ngram", "ngram"),
    "ngram-enabled-no": (lambda: {"image": "PNG", "ngram": {"enabled": "no"}}, 400, "ngram.enabled", "ngram.enabled"),
    "ngram-window-too-small": (lambda: {"image": "PNG", "ngram": {"ngram_size": 40, "window": 20}}, 400, "window 20",
                               "ngram"),
    "repetition-guard-too-low": (lambda: {"image": "PNG", "repetition_guard": {"min_tokens": 2}}, 400,
                                 "min_tokens must be an integer in [16, 32768]", "repetition_guard"),
    "repetition-guard-unknown": (lambda: {"image": "PNG", "repetition_guard": {"period": 5}}, 400, "unknown field",
                                 "repetition_guard.period"),
    "1mb-prompt": (lambda: {"image": "PNG", "prompt": "<image>" + "x" * 1_000_000}, 400, "context holds 2048", None),
    "over-the-context": (lambda: {"images": [a4()] * 3, "prompt": "<image>" * 3}, 400, "context holds 2048", None),
    "json-array-body": (lambda: ("application/json", b"[1, 2]"), 400, "must be an object", None),
    "invalid-json": (lambda: ("application/json", b'{"image": '), 400, "not valid JSON", None),
    "deeply-nested-json": (lambda: ("application/json", b"[" * 100_000 + b"]" * 100_000), 400, "nests deeper", None),
    "deeply-nested-object": (lambda: ("application/json", b'{"image": ' + b'{"a": ' * 50 + b"1" + b"}" * 51),
                             400, "nests deeper", None),
    "wrong-content-type": (lambda: ("text/plain", b"hello"), 415, "content-type", None),
    "100mb-body": (lambda: ("application/json", b'{"image": "' + b"A" * (100 << 20) + b'"}'), 413, "over the limit", None),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_requests_answer_4xx_json_naming_the_problem(app, name):
    make, status, words, param = BAD[name]
    body = make()
    if isinstance(body, tuple):
        content_type, raw = body
        response = requests.post(OCR, data=raw, headers={"content-type": content_type}, timeout=300)
    else:
        body = {k: tiny_png() if v == "PNG" else [tiny_png()] if v == ["PNG"] else v for k, v in body.items()}
        response = requests.post(OCR, json=body, timeout=300)
    assert_clean_error(response, status, words, param)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_header_valid_truncated_images_answer_their_own_problem(app, fmt):
    """The image's own problem, with the field it came in, on every route; never Ray's wrapper
    of the replica's exception (actor, pid, address, colours)."""
    broken = truncated_image(fmt)
    assert_clean_error(requests.post(OCR, json={"image": b64(broken)}, timeout=300),
                       400, "cannot decode image", "image")
    two = {"images": [tiny_png(), b64(broken)], "prompt": "<image><image>x"}
    assert_clean_error(requests.post(OCR, json=two, timeout=300), 400, "cannot decode image", "images[1]")
    files = [("images", ("a.png", base64.b64decode(tiny_png()), "image/png")),
             ("images", ("b", broken, "application/octet-stream"))]
    response = requests.post(OCR, files=files, data={"prompt": "<image><image>x"}, timeout=300)
    assert_clean_error(response, 400, "cannot decode image", "images[1]")
    part = {"type": "image_url", "image_url": {"url": f"data:image/{fmt.lower()};base64,{b64(broken)}"}}
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Free OCR."}, part]}]}
    response = requests.post(f"{SERVE_URL}/v1/chat/completions", json=chat, timeout=300)
    assert_clean_error(response, 400, "cannot decode image", "messages[0].content[1]")


def test_valid_edge_prompts_are_answered(app):
    """NUL in a prompt is a character like any other; line-wrapped base64 is base64."""
    for body in [{"image": tiny_png(), "prompt": "<image>\x00Free\x00OCR.", "max_tokens": 2},
                 {"image": base64.encodebytes(encoded(page((300, 200)), "PNG")).decode(), "max_tokens": 2}]:
        response = requests.post(OCR, json=body, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["image_tokens"] == 273


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/ocr", 405), ("POST", "/v1/nothing-here", 404), ("GET", "/", 404)])
def test_wrong_routes_and_methods_answer_in_the_same_envelope(app, method, path, status):
    response = requests.request(method, f"{SERVE_URL}{path}", timeout=60)
    assert response.status_code == status
    assert set(response.json()) == {"error"} and path in response.json()["error"]["message"]


def test_multipart_with_form_fields(app):
    files = {"image": ("page.png", encoded(page((1400, 700)), "PNG"), "image/png")}
    response = requests.post(OCR, files=files, timeout=300, data={
        "max_tokens": "2", "ngram": '{"enabled": false}', "prompt": "<image>\nFree OCR."})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["image_tokens"] == 483
    response = requests.post(OCR, files=files, data={"max_tokens": "many"}, timeout=300)
    assert_clean_error(response, 400, "max_tokens", "max_tokens")


def test_multipart_takes_the_json_field_names_and_refuses_others(app):
    """`image`, `images` and `document` as in JSON (files, or base64 text); any other file
    field is refused by its name."""
    wide, small = encoded(page((1400, 700)), "PNG"), encoded(page((300, 200)), "PNG")
    files = [("images", ("a.png", wide, "image/png")), ("images", ("b.png", small, "image/png"))]
    response = requests.post(OCR, files=files, data={"max_tokens": "1", "prompt": "<image><image>x"}, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["image_tokens"] == 483 + 273
    response = requests.post(OCR, files={"image": (None, b64(small))}, data={"max_tokens": "1"}, timeout=300)
    assert response.status_code == 200 and response.json()["usage"]["image_tokens"] == 273, response.text
    response = requests.post(OCR, files={"file": ("a.png", small, "image/png")}, timeout=300)
    assert_clean_error(response, 400, "unknown file field 'file'", "file")
    both = [("image", ("a.png", small, "image/png")), ("images", ("b.png", small, "image/png"))]
    assert_clean_error(requests.post(OCR, files=both, timeout=300), 400, "not both", "images")


def test_form_fields_that_would_break_the_parser_answer_400_naming_them(app):
    """A JSON option in a form is held to a JSON body's depth limit and names its field; a form
    of 2,000 image parts is refused at the limit, not parsed whole; base64 text of over 1 MB (the
    parser's default part limit) is an image like any other. For images and PDFs alike."""
    png = encoded(page((300, 200)), "PNG")
    for source in ({"image": ("page.png", png, "image/png")},
                   {"document": ("doc.pdf", make_pdf(1), "application/pdf")}):
        deep = "[" * 10_000 + "]" * 10_000
        response = requests.post(OCR, files=source, data={"ngram": deep, "max_tokens": "1"}, timeout=300)
        assert_clean_error(response, 400, "ngram nests deeper than 32 levels", "ngram")
        response = requests.post(OCR, files=source, data={"ngram": "{bad", "max_tokens": "1"}, timeout=300)
        assert_clean_error(response, 400, "ngram must be a JSON object", "ngram")
        response = requests.post(OCR, files=source, data={"repetition_guard": '{"similarity": 2}', "max_tokens": "1"},
                                 timeout=300)
        assert_clean_error(response, 400, "similarity must be in [0.5, 1]", "repetition_guard")
    parts = [("images", (f"{i}.png", png, "image/png")) for i in range(2_000)]
    response = requests.post(OCR, files=parts, timeout=300)
    assert_clean_error(response, 400, "more than 16 images in one request (max_images_per_request)", "images")
    response = requests.post(OCR, files=parts[:1], data={f"x{i}": "1" for i in range(2_000)}, timeout=300)
    assert_clean_error(response, 400, "form fields", None)
    noise = Image.frombytes("RGB", (700, 700), random.Random(2).randbytes(700 * 700 * 3))
    text = b64(encoded(noise, "PNG"))
    assert len(text) > 1 << 20
    response = requests.post(OCR, files={"image": (None, text)}, data={"max_tokens": "1"}, timeout=300)
    assert response.status_code == 200 and response.json()["usage"]["image_tokens"] == 693, response.text


def test_mixed_load_at_concurrency_8_is_answered_correctly(app):
    """Rounds of 6-crop pages, 4-crop squares and untiled images, 8 in flight."""
    kinds = [(page((1191, 1684)), 903), (page((1024, 1024)), 693), (page((600, 400)), 273)]
    bodies = [({"image": b64(encoded(image, "PNG")), "max_tokens": 2}, tokens) for image, tokens in kinds]

    def send(i):
        body, tokens = bodies[i % len(bodies)]
        response = requests.post(OCR, json=body, timeout=600)
        return response.status_code, response.json()["usage"]["image_tokens"], tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(48)))
    assert all(status == 200 and got == want for status, got, want in results), results


def test_no_replica_was_restarted(app):
    """Runs last in this module: every replica is still the one that started."""
    assert replica_ids() == app
    assert requests.get(f"{SERVE_URL}/health", timeout=30).json()["status"] == "ok"


def test_corpus_size():
    assert len(ODD_BUT_VALID) + len(BAD) >= 40


