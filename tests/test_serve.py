"""The Serve application on a real Ray cluster (tests/conftest.py: serve_app), CPU, tiny random model."""
import base64
import glob
import io
import json
import time

import pytest
import torch
from PIL import Image

ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")
from ray import serve  # noqa: E402

from decoder import GenerationEngine, GenerationRequest, SamplingParams, build_prompt, load_decoder  # noqa: E402
from decoder.tokenizer import ByteTokenizer  # noqa: E402
from deployments.client import AppHandle  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from deployments.protocol import BadRequest, replica_error  # noqa: E402
from deployments.model_source import resolve_checkpoint  # noqa: E402
from encoder import DualPathEncoder, ImageError, load_encoder  # noqa: E402
from ray.exceptions import RayTaskError  # noqa: E402
from tests.conftest import SERVE_APP as APP  # noqa: E402
from tests.conftest import SERVE_URL as URL  # noqa: E402
from tests.conftest import routers_over_the_shared_tiers  # noqa: E402
from tests.helpers import assert_clean_error, truncated_image  # noqa: E402

# untiled photo, A4 page at 144 dpi (2x3), 1x6 strip, an image <= 640 (never tiled)
CASES = [((448, 448), 273), ((1191, 1684), 903), ((640, 3840), 933), ((500, 300), 273)]


def picture(size, seed):
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (size[1] // 16 + 1, size[0] // 16 + 1, 3), dtype=torch.uint8, generator=gen)
    return Image.fromarray(noise.numpy()).resize(size, Image.BILINEAR)


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def handle(serve_app):
    return serve_app


@pytest.fixture(scope="module")
def local_models():
    directory, _ = resolve_checkpoint(None)
    return DualPathEncoder(load_encoder(directory)), load_decoder(directory)


@pytest.mark.parametrize("size, tokens", CASES)
def test_assembled_sequences_equal_encode_images(handle, local_models, size, tokens):
    image = picture(size, sum(size))
    (seq,) = handle.encode.remote(image).result(timeout_s=300)
    (expected,) = local_models[0].encode_images([image])
    assert seq.shape == (tokens, local_models[0].encoder.args.n_embed)
    assert seq.dtype == expected.dtype and seq.device == expected.device
    assert torch.equal(seq, expected)  # the same shapes run, alone: bit for bit


def test_generated_text_equals_in_process_decoder(handle, local_models):
    image, prompt = picture((1191, 1684), 7), "<image>\nFree OCR."
    result = handle.ocr.remote(image, prompt=prompt, max_tokens=12).result(timeout_s=300)
    encoder, lm = local_models
    (seq,) = encoder.encode_images([image])
    tokenizer = ByteTokenizer()
    ids = build_prompt(tokenizer, prompt, [seq.shape[0]])
    (expected,) = GenerationEngine(lm, tokenizer, max_len=2048).generate(
        [GenerationRequest(ids, [seq], SamplingParams(max_tokens=12))])
    assert result["text"] == expected.text
    assert result["usage"] == {"prompt_tokens": len(ids), "image_tokens": 903,
                               "completion_tokens": expected.completion_tokens}
    assert result["model"] == "tiny-random" and "RANDOM" in result["warning"]


def test_streaming_matches_ocr(handle):
    image = picture((900, 700), 8)
    full = handle.ocr.remote(image, max_tokens=6).result(timeout_s=300)
    deltas = list(handle.options(stream=True).ocr_stream.remote(image, max_tokens=6))
    assert "".join(d["text"] for d in deltas) == full["text"]
    assert deltas[-1]["finished"] and deltas[-1]["completion_tokens"] == 6


def test_http_streaming_server_sent_events(handle):
    body = {"image": base64.b64encode(png(picture((900, 700), 8))).decode(), "max_tokens": 6}
    full = requests.post(f"{URL}/v1/ocr", json=body, timeout=300).json()
    response = requests.post(f"{URL}/v1/ocr", json={**body, "stream": True}, timeout=300, stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e) for e in events[:-1]]
    assert "".join(d["text"] for d in deltas) == full["text"]
    assert deltas[-1]["finished"] and deltas[-1]["completion_tokens"] == 6
    bad = requests.post(f"{URL}/v1/ocr", json={**body, "stream": True, "mode": "huge"}, timeout=60)
    assert bad.status_code == 400  # validation happens before the stream starts


def test_concurrent_requests_batch_in_the_encoders(handle):
    sizes = [s for s, _ in CASES] * 4  # 16 requests, mixed tiled and untiled
    responses = [handle.ocr.remote(picture(size, i), max_tokens=4) for i, size in enumerate(sizes)]
    results = [r.result(timeout_s=600) for r in responses]
    assert all(r["usage"]["completion_tokens"] == 4 for r in results)
    # Calls that reach an encoder together are encoded together: 16 global views sent at once
    # (through the router, arrival depends on its preprocessing pace, so they are sent directly).
    encoder = serve.get_deployment_handle("GlobalEncoder", APP)
    view = torch.zeros(3, 1024, 1024, dtype=torch.uint8)
    assert all(r.result(timeout_s=300).shape[0] == 272 for r in [encoder.encode.remote(view) for _ in range(16)])
    stats = encoder.stats.remote().result()
    assert max(stats["requests_per_batch"]) > 1, stats
    decoder = serve.get_deployment_handle("Decoder", APP).stats.remote().result()
    assert decoder["decode_graphs"] is False and decoder["running"] >= 0  # CPU: eager decoding
    stages = handle.timings.remote().result()
    assert stages["requests"] >= 16 and all(stages[k] >= 0 for k in ("preprocess_ms", "encode_ms",
                                                                     "assemble_ms"))


@pytest.mark.parametrize("body, message", [
    ({}, "no image"),
    ({"image": base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode()}, "cannot decode"),
    ({"image": "***"}, "base64"),
    ({"image": "IMAGE", "prompt": "Free OCR."}, "<image> tag"),
    ({"image": "IMAGE", "mode": "huge"}, "unknown mode 'huge'"),
    ({"image": "IMAGE", "max_tokens": 0}, "max_tokens"),
    ({"image": "IMAGE", "max_tokens": "12"}, "max_tokens: Input should be a valid integer"),
    ({"image": "IMAGE", "temprature": 0.5}, "temprature: unknown field"),
    ({"image": "IMAGE", "self": 1}, "self: unknown field"),
    ({"image": "IMAGE", "ngram": {"enabled": "no"}}, "ngram.enabled"),
    ({"image": "IMAGE", "ngram": {"ngram_size": 40, "window": 20}}, "window 20 must be at least"),
    ({"image": ["IMAGE"] * 3, "max_crops": 9, "prompt": "<image>" * 3},
     "the decoder's context holds 2048"),
], ids=["no-image", "corrupt-image", "not-base64", "prompt-without-tag", "wrong-mode",
        "bad-max-tokens", "string-max-tokens", "unknown-field", "field-named-self", "ngram-not-bool",
        "ngram-window", "over-the-context"])
def test_bad_http_requests_get_400_and_replicas_stay_up(handle, body, message):
    page = base64.b64encode(png(picture((1191, 1684), 1))).decode()
    if body.get("image") == "IMAGE" or body.get("image") == ["IMAGE"] * 3:
        body["image"] = page if body["image"] == "IMAGE" else [page] * 3
    response = requests.post(f"{URL}/v1/ocr", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert requests.get(f"{URL}/health", timeout=30).json()["status"] == "ok"


def test_http_ocr_multipart_and_encode(handle):
    data = png(picture((1400, 700), 9))
    response = requests.post(f"{URL}/v1/ocr", files={"image": ("page.png", data, "image/png")},
                             data={"max_tokens": "3", "prompt": "<image>\nFree OCR.",
                                   "ngram": '{"enabled": false}'}, timeout=300)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) >= {"text", "usage", "model", "timings"}
    assert body["usage"]["image_tokens"] == 483 and body["usage"]["completion_tokens"] == 3
    timings = body["timings"]  # the router's stages and the decoder's own, inside decode_ms
    assert set(timings) >= {"preprocess_ms", "encode_ms", "decode_ms", "decoder_queue_ms", "prefill_ms",
                            "generate_ms"}, timings
    assert timings["decoder_queue_ms"] + timings["prefill_ms"] + timings["generate_ms"] <= timings["decode_ms"]
    response = requests.post(f"{URL}/v1/encode", json={"image": base64.b64encode(data).decode()}, timeout=300)
    (image,) = response.json()["images"]
    embedding = torch.frombuffer(bytearray(base64.b64decode(image["embedding_base64"])), dtype=torch.float32)
    assert image["num_tokens"] == 483 and embedding.numel() == 483 * image["dim"]


def test_a_profile_window_opens_on_the_decoders_engine_thread(handle):
    """`DecoderServer.profile`: the window a bench opens on the running service's Decoder sees
    generations sent while it is open (some of their tokens: on busy cores they may outlast
    it), and samples the engine thread's stack."""
    decoder = serve.get_deployment_handle("Decoder", APP)
    window = decoder.profile.remote(4.0)
    time.sleep(0.5)
    results = [handle.ocr.remote(picture((448, 448), i), max_tokens=8) for i in range(4)]
    produced = sum(r.result(timeout_s=300)["usage"]["completion_tokens"] for r in results)
    profile = window.result(timeout_s=60)
    assert profile["steps"] > 0 and 0 < profile["tokens_per_s"] * profile["seconds"] <= produced + 0.5
    assert dict(profile["stacks"]["inclusive"])["decoder.async_engine.AsyncEngine._loop"] == 1.0
    with pytest.raises(Exception, match="lasts"):
        decoder.profile.remote(0).result(timeout_s=60)


def replica_log_lines(words: str) -> int:
    """Lines holding `words` in this cluster's replica logs (Serve's files and their stderr)."""
    logs = ray._private.worker._global_node.get_logs_dir_path()
    paths = glob.glob(f"{logs}/serve/*.log") + glob.glob(f"{logs}/worker-*.err")
    return sum(open(path, errors="replace").read().count(words) for path in paths)


def test_handle_errors_are_the_apps_own_exceptions_and_log_one_line(handle):
    """Through `AppHandle`, a failed call raises the Router's own exception (class, message,
    field), not Ray's wrapper; Serve logs it as one line, not a traceback on the Router and on
    each encoder replica the image reached."""
    ocr = AppHandle(handle)
    tracebacks = replica_log_lines("tiling.ImageError")  # a traceback's last line names its module
    with pytest.raises(BadRequest) as raised:
        ocr.encode.remote(picture((64, 64), 1), mode="huge").result(timeout_s=60)
    assert not isinstance(raised.value, RayTaskError) and raised.value.param == "mode"
    assert str(raised.value).startswith("unknown mode 'huge'"), str(raised.value)
    for call in (lambda: ocr.ocr.remote(truncated_image("PNG")).result(timeout_s=60),
                 lambda: list(ocr.options(stream=True).ocr_stream.remote(truncated_image("JPEG")))):
        with pytest.raises(ImageError) as raised:
            call()
        assert not isinstance(raised.value, RayTaskError), type(raised.value)
        assert str(raised.value).startswith("cannot decode image"), str(raised.value)
        assert raised.value.image_index == 0
    with pytest.raises(Exception, match="cannot decode image") as raised:  # Serve's own handle
        handle.ocr.remote(b"not an image").result(timeout_s=60)
    assert isinstance(raised.value, RayTaskError) and str(replica_error(raised.value)).startswith("cannot")
    deadline = time.monotonic() + 60  # the replicas' stderr reaches its files within a moment
    while replica_log_lines("Request refused, the caller's to fix: ImageError") < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replica_log_lines("Request refused, the caller's to fix: ImageError") >= 3
    assert replica_log_lines("tiling.ImageError") == tracebacks


def rotated_jpeg(size, seed) -> bytes:
    """A JPEG stored sideways, EXIF orientation 6: a viewer turns it upright."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    picture(size, seed).save(buf, "JPEG", exif=exif)
    return buf.getvalue()


def test_encode_only_app_with_views_made_by_the_router(handle):
    """views_on_encoder=false (routers decode and resize with PIL, the reference path) gives the
    same sequences as the default, for PNG and JPEG bytes (routers read their headers, the
    encoders decode them and make the views) and PIL images (routers decode)."""
    # Routers of that config over the shared app's encoders, which take views as they take bytes
    url = routers_over_the_shared_tiers("encode-only", AppConfig(encode_only=True, views_on_encoder=False))
    encode_only = serve.get_app_handle("encode-only")
    try:
        for size, seed in [((1400, 700), 3), ((448, 448), 4)]:
            (seq,) = encode_only.encode.remote(picture(size, seed)).result(timeout_s=300)
            assert seq.shape[0] == {(1400, 700): 483, (448, 448): 273}[size]
            for sent in (picture(size, seed), png(picture(size, seed))):
                (got,) = handle.encode.remote(sent).result(timeout_s=300)
                assert torch.equal(got, seq)
        (seq,) = encode_only.encode.remote(rotated_jpeg((1400, 700), 5)).result(timeout_s=300)
        (got,) = handle.encode.remote(rotated_jpeg((1400, 700), 5)).result(timeout_s=300)
        assert seq.shape[0] == 493 and torch.equal(got, seq)  # upright: 700x1400, 1x2 crops
        with pytest.raises(Exception, match="encode-only"):
            encode_only.ocr.remote(picture((64, 64), 1)).result(timeout_s=60)
        for fmt in ("PNG", "JPEG"):  # decoded by the router: its own error, named
            body = {"image": base64.b64encode(truncated_image(fmt)).decode()}
            response = requests.post(f"{url}/v1/encode", json=body, timeout=120)
            assert_clean_error(response, 400, "cannot decode image", "image")
    finally:
        serve.delete("encode-only")


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["one_encoder", "encoder_in_router"])
def test_one_encoder_app_equals_the_two_encoder_app(handle, placement):
    """one_encoder (both paths in one Encoder deployment, one call per image) and
    encoder_in_router (that Encoder's class in the Router's process, no encoder deployment) give
    the same sequences and text as the default app; the Encoder batches images across requests,
    takes untiled and tiled images, refuses malformed requests alone, and /ready names it. (The
    app's Decoder is the shared app's: the placements differ in their encoders alone.)"""
    from encoder import DecodedImage
    from encoder.preprocess import count_tokens
    name = placement.replace("_", "-")
    routers_over_the_shared_tiers(name, AppConfig(**{placement: True}, max_len=2048, max_images=8))
    one = serve.get_app_handle(name)
    try:
        for size, _ in CASES:
            (expected,) = handle.encode.remote(picture(size, sum(size))).result(timeout_s=300)
            for sent in (picture(size, sum(size)), png(picture(size, sum(size)))):  # decoded where sent
                (seq,) = one.encode.remote(sent).result(timeout_s=300)
                assert torch.equal(seq, expected), size
        image = picture((1191, 1684), 7)
        got = one.ocr.remote(image, max_tokens=8).result(timeout_s=300)
        assert got["text"] == handle.ocr.remote(image, max_tokens=8).result(timeout_s=300)["text"]
        ready = requests.get(f"{URL}/{name}/ready", timeout=60).json()
        assert ready["status"] == "ready" and set(ready["tiers"]) == {"Encoder", "Decoder"}
        assert ready["tiers"]["Encoder"]["path"] == "both"
        # A PNG whose header reads but whose pixels do not: that request fails alone, naming it.
        broken = png(picture((900, 700), 3))[:2000]
        with pytest.raises(Exception, match="(?i)image"):
            one.encode.remote(broken).result(timeout_s=60)
        for fmt in ("PNG", "JPEG"):  # over HTTP: the image's own problem, never Ray's wrapper
            body = {"image": base64.b64encode(truncated_image(fmt)).decode()}
            response = requests.post(f"{URL}/{name}/v1/ocr", json=body, timeout=120)
            assert_clean_error(response, 400, "cannot decode image", "image")
        (seq,) = one.encode.remote(image).result(timeout_s=300)
        assert seq.shape[0] == 903

        if placement == "encoder_in_router":
            deployments = serve.status().applications[name].deployments
            assert set(deployments) == {"Router"}  # no encoder deployment (its Decoder: shared)
            calls = [one.encode.remote(png(picture((1400, 700), i))) for i in range(12)]
            assert all(c.result(timeout_s=300)[0].shape[0] == count_tokens((2, 1)) for c in calls)
            stats = one.stats.remote().result()["encoder"]  # batched across the handle's calls
            assert max(stats["requests_per_batch"]) > 1, stats
            assert stats["path"] == "both" and set(stats) >= {"global", "local"}
            return
        encoder = serve.get_deployment_handle("Encoder", name)
        pixels = torch.zeros(3, 700, 1400, dtype=torch.uint8)

        def decoded(grid, mode="gundam"):
            return DecodedImage(pixels, grid, count_tokens(grid), mode, (1400, 700))
        calls = [encoder.encode.remote(decoded(grid)) for grid in [(2, 1), (1, 1)] * 6]
        for call, grid in zip(calls, [(2, 1), (1, 1)] * 6):
            seq = call.result(timeout_s=300)  # the image's sequence, assembled
            assert seq.shape[0] == count_tokens(grid)
        stats = encoder.stats.remote().result()
        assert max(stats["requests_per_batch"]) > 1, stats
        assert set(stats) >= {"global", "local"}
        for sent, message in [(torch.zeros(3, 1024, 1024, dtype=torch.uint8), "makes its own views"),
                              (decoded((9, 9)), "grid must be"), (decoded((2, 1), "base"), "grid must be")]:
            with pytest.raises(Exception, match=message):
                encoder.encode.remote(sent).result(timeout_s=60)
    finally:
        serve.delete(name)


def test_encoders_refuse_bad_decoded_requests_alone(handle):
    """A malformed request fails by itself, named, before it joins a batch."""
    from encoder import DecodedImage
    from encoder.preprocess import count_tokens
    local = serve.get_deployment_handle("LocalEncoder", APP)
    pixels = torch.zeros(1, 700, 1400, dtype=torch.uint8)

    def decoded(grid=(2, 1), mode="gundam", tokens=None, sent=pixels):
        return DecodedImage(sent, grid, tokens or count_tokens(grid), mode, (1400, 700))
    for sent, message in [(torch.zeros(3, 1024, 1024, dtype=torch.uint8), r"views must be uint8 \[P, 3, 640, 640\]"),
                          (decoded(mode="huge"), "unknown mode"),
                          (decoded((1, 1)), "not tiled"),
                          (decoded((2, 1), tokens=5), "does not match grid"),
                          (decoded(sent=torch.zeros(2, 64, 64, dtype=torch.uint8)), "decoded pixels must be"),
                          ("page.png", "takes an ImageHeader, a DecodedImage or views")]:
        with pytest.raises(Exception, match=message):
            local.encode.remote(sent).result(timeout_s=60)
    tokens = local.encode.remote(decoded()).result(timeout_s=300)
    assert tokens.shape[:2] == (2, 100)


@pytest.mark.slow
def test_readme_handle_example_runs_from_a_second_process(handle, tmp_path):
    """The README's Python-handle block, as written, in a fresh interpreter that joins this
    cluster (named by RAY_ADDRESS, which `address="auto"` reads); only the app name, the image
    path and the token limits are this test's (the tiny random model never stops: the
    README's limits made this test 15.5 s alone, 16 tokens 5.8 s)."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    section = readme.split("## Usage: Python handles", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    page = tmp_path / "page.png"
    picture((1191, 1684), 5).save(page)
    code = (code.replace('"default"', repr(APP)).replace("/abs/path/page.png", str(page))
            .replace('open("page.png"', f'open({str(page)!r}'))
    code = re.sub(r"max_tokens=\d+", "max_tokens=16", code)
    script = tmp_path / "example.py"
    script.write_text(code + "\nprint('RESULT', result['usage'], seq.shape)\n")
    # address="auto" joins the newest cluster on the machine, and another worker's may be newer:
    # this one by its address, with the token Ray made for it (~/.ray/auth_token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT {'prompt_tokens'" in done.stdout and "torch.Size([903, 64])" in done.stdout


def test_prompt_presets_and_output_formats(handle):
    from decoder.tokenizer import PROMPT_PRESETS
    image = picture((1191, 1684), 11)
    tokenizer = ByteTokenizer()
    for preset, ref in [("free", None), ("locate", "the logo"), ("markdown", None)]:
        options = {"prompt_preset": preset, "max_tokens": 2} | ({"ref": ref} if ref else {})
        result = handle.ocr.remote(image, **options).result(timeout_s=300)
        prompt = PROMPT_PRESETS[preset].format(ref=ref)
        assert result["usage"]["prompt_tokens"] == len(build_prompt(tokenizer, prompt, [903]))
    blocks = handle.ocr.remote(image, output_format="blocks", max_tokens=4).result(timeout_s=300)
    assert isinstance(blocks["blocks"], list)
    assert all(set(b) == {"label", "text", "boxes_norm", "boxes", "parse_error"} for b in blocks["blocks"])
    with pytest.raises(Exception, match="prompt or prompt_preset, not both"):
        handle.ocr.remote(image, prompt="<image>x", prompt_preset="free").result(timeout_s=60)
    body = {"image": base64.b64encode(png(image)).decode(), "prompt_preset": "locate"}
    response = requests.post(f"{URL}/v1/ocr", json=body, timeout=120)
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_tensors_sent_out_of_band_arrive_equal(handle):
    """A process that called `send_tensors_out_of_band` (every Router does) returns torch
    tensors as out-of-band numpy, rebuilt here with no registration: bf16 and fp32 equal and
    of their dtype, a dtype numpy lacks (fp8) and a 0-dim tensor too; nested in a list as
    Router.encode returns them."""
    @ray.remote(num_cpus=0)
    def send():
        from deployments.protocol import send_tensors_out_of_band
        send_tensors_out_of_band()
        from ray import cloudpickle
        rebuild, (sent,) = cloudpickle.CloudPickler.dispatch[torch.Tensor](torch.ones(2, dtype=torch.bfloat16))
        assert rebuild.__qualname__.endswith("tensor") and sent[1:] == ("bfloat16", (2,)), sent
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(903, 1280, generator=gen).to(torch.bfloat16), torch.arange(6.0).reshape(2, 3),
                torch.arange(4.0).to(torch.float8_e4m3fn), torch.tensor(7)]

    got = ray.get(send.remote())
    gen = torch.Generator().manual_seed(0)
    want = [torch.randn(903, 1280, generator=gen).to(torch.bfloat16), torch.arange(6.0).reshape(2, 3),
            torch.arange(4.0).to(torch.float8_e4m3fn), torch.tensor(7)]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.float(), w.float())
