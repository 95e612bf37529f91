"""PDFs through the running app (tiny model, CPU, real Serve): pages as units of work, page
ranges, per-page errors, streaming page by page, the chat `file` part, the handle, the encoder
cache, and the corpus command against the real app."""
import base64
import io
import json
import signal
import subprocess
import sys
import time

import pypdfium2 as pdfium
import pytest

requests = pytest.importorskip("requests")
pytest.importorskip("ray")

from documents import PdfDocument  # noqa: E402
from tests.conftest import SERVE_APP, SERVE_URL  # noqa: E402
from tests.pdfs import corrupt_pdf, encrypted_pdf, make_pdf  # noqa: E402

OCR = f"{SERVE_URL}/v1/ocr"
SMALL = (200, 300)  # points: 400 x 600 pixels at 144 dpi, never tiled


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post(body, **kwargs):
    return requests.post(OCR, json=body, timeout=600, **kwargs)


def with_oversized_page(pdf: bytes, at: int) -> bytes:
    """`pdf` with a 14,400-point-square page (829 MP at 144 dpi: over the render limit) at `at`."""
    doc, big = pdfium.PdfDocument(pdf), pdfium.PdfDocument(make_pdf(1, size=(14400, 14400)))
    doc.import_pages(big, index=at)
    buffer = io.BytesIO()
    doc.save(buffer)
    return buffer.getvalue()


def png_of_page(pdf: bytes, index: int, dpi: int = 144) -> bytes:
    with PdfDocument(pdf) as doc:
        buffer = io.BytesIO()
        doc.render(index, dpi).save(buffer, "PNG")
        return buffer.getvalue()


def test_each_page_is_the_ocr_of_its_rendered_image(serve_app):
    pdf = make_pdf(3, size=SMALL)
    answer = post({"document": b64(pdf), "max_tokens": 6, "prompt": "<image>\nFree OCR."})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [p["index"] for p in body["pages"]] == [0, 1, 2] and body["failed_pages"] == []
    for page in body["pages"]:
        alone = post({"image": b64(png_of_page(pdf, page["index"])), "max_tokens": 6,
                      "prompt": "<image>\nFree OCR."}).json()
        assert page["text"] == alone["text"] and page["usage"] == alone["usage"]
        assert (page["width"], page["height"]) == (400, 600) and page["error"] is None
        assert page["finish_reason"] == "length"  # kept and flagged, not dropped
    assert body["text"] == "\n\n<--- Page Split --->\n".join(p["text"] for p in body["pages"])
    assert body["usage"]["completion_tokens"] == 18 and "RANDOM" in body["warning"]


def test_page_range_dpi_and_blocks(serve_app):
    pdf = make_pdf(6, size=SMALL)
    body = post({"document": "data:application/pdf;base64," + b64(pdf), "page_range": "0, 3-4",
                 "dpi": 72, "max_tokens": 2, "output_format": "blocks", "return_crops": True}).json()
    assert [p["index"] for p in body["pages"]] == [0, 3, 4]
    assert all((p["width"], p["height"]) == SMALL for p in body["pages"])  # 72 dpi: 1 px a point
    assert all(isinstance(p["blocks"], list) and "markdown" in p for p in body["pages"])


def test_a_failing_page_does_not_fail_the_document(serve_app):
    """Its error in its entry (`text_layer_fallback` off); by default its PDF text layer
    answers for it, the error kept as `ocr_error`."""
    pdf = with_oversized_page(make_pdf(3, size=SMALL), at=1)
    body = post({"document": b64(pdf), "max_tokens": 2, "text_layer_fallback": False}).json()
    assert body["failed_pages"] == [1]
    failed = body["pages"][1]
    assert failed["error"]["type"] == "invalid_request" and "pixels" in failed["error"]["message"]
    assert failed["text"] is None
    assert [p["error"] for p in body["pages"][::2]] == [None, None]
    body = post({"document": b64(pdf), "max_tokens": 2}).json()
    layered = body["pages"][1]
    assert body["failed_pages"] == [] and (layered["source"], layered["error"]) == ("text_layer", None)
    assert layered["text"] == "Page 0" and layered["ocr_error"] == failed["error"]  # the inserted page's own text


@pytest.mark.parametrize("make, status, words", [
    (lambda: {"document": b64(corrupt_pdf())}, 400, "not a readable PDF"),
    (lambda: {"document": b64(encrypted_pdf())}, 400, "encrypted"),
    (lambda: {"document": b64(b"just text")}, 400, "not a readable PDF"),
    (lambda: {"document": b64(make_pdf(3, size=SMALL)), "page_range": "5"}, 400, "page"),
    (lambda: {"document": b64(make_pdf(3, size=SMALL)), "page_range": "2-1"}, 400, "reversed"),
    (lambda: {"document": b64(make_pdf(401, size=SMALL))}, 413, "401"),
    (lambda: {"document": b64(make_pdf(1)), "dpi": 20}, 400, "dpi"),
    (lambda: {"document": "data:image/png;base64,AAAA"}, 400, "application/pdf"),
    (lambda: {"document": b64(make_pdf(1)), "image": b64(b"x")}, 400, "not both"),
    (lambda: {"image": b64(png_of_page(make_pdf(1, size=SMALL), 0)), "page_range": "0"}, 400, "documents"),
])
def test_bad_documents_answer_4xx_naming_the_problem(serve_app, make, status, words):
    answer = post(make())
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert words.lower() in error["message"].lower(), error
    assert error["param"] in ("document", "page_range", "dpi"), error


def test_multipart_document_upload(serve_app):
    pdf = make_pdf(2, size=SMALL)
    answer = requests.post(OCR, files={"document": ("a.pdf", pdf, "application/pdf")},
                           data={"max_tokens": "3", "page_range": "1"}, timeout=300)
    assert answer.status_code == 200, answer.text
    assert [p["index"] for p in answer.json()["pages"]] == [1]


def test_a_long_pdf_streams_page_by_page_in_order(serve_app):
    n = 40
    body = {"document": b64(make_pdf(n, size=SMALL)), "max_tokens": 1, "mode": "tiny", "stream": True,
            "output_format": "markdown"}
    with requests.post(OCR, json=body, timeout=600, stream=True) as answer:
        assert answer.status_code == 200
        events = [line[6:] for line in answer.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pages = [json.loads(e) for e in events[:-1]]
    assert [p["index"] for p in pages] == list(range(n))
    assert all(p["error"] is None and p["usage"]["image_tokens"] == 73 for p in pages)


def test_chat_file_part_and_handle(serve_app):
    pdf = make_pdf(2, size=SMALL)
    chat = requests.post(f"{SERVE_URL}/v1/chat/completions", timeout=300, json={
        "max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "file", "file": {"file_data": "data:application/pdf;base64," + b64(pdf),
                                      "filename": "a.pdf"}},
            {"type": "text", "text": "Free OCR."}]}]}).json()
    direct = post({"document": b64(pdf), "max_tokens": 3, "prompt": "<image>\nFree OCR."}).json()
    assert chat["choices"][0]["message"]["content"] == direct["text"]
    assert chat["choices"][0]["finish_reason"] == "length" and len(chat["pages"]) == 2
    assert chat["usage"]["completion_tokens"] == 6
    handled = serve_app.ocr.remote(document=pdf, prompt="<image>\nFree OCR.", max_tokens=3).result(timeout_s=300)
    assert handled["text"] == direct["text"]
    streamed = list(serve_app.options(stream=True).ocr_stream.remote(document=pdf, max_tokens=2))
    assert [p["index"] for p in streamed] == [0, 1]


def test_repeated_pages_skip_the_encoders(serve_app):
    from ray import serve
    router = serve.get_deployment_handle("Router", SERVE_APP)
    pdf = make_pdf(3, size=(210, 290))
    before = router.stats.remote().result(timeout_s=60)["encoder_cache"]
    first = post({"document": b64(pdf), "max_tokens": 4}).json()
    middle = router.stats.remote().result(timeout_s=60)["encoder_cache"]
    second = post({"document": b64(pdf), "max_tokens": 4}).json()
    after = router.stats.remote().result(timeout_s=60)["encoder_cache"]
    assert middle["misses"] - before["misses"] == 3 and middle["hits"] == before["hits"]
    assert after["hits"] - middle["hits"] == 3  # the same pages again: no encoder call
    assert [p["text"] for p in second["pages"]] == [p["text"] for p in first["pages"]]
    assert after["bytes"] <= after["max_bytes"] and after["hit_rate"] > 0


def run_corpus(*args, **popen):
    command = [sys.executable, "-m", "corpus", "run", *map(str, args), "--server", SERVE_URL]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, **popen)


def manifest_lines(out):
    path = out / "manifest.jsonl"
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass  # a torn last line
    return lines


def test_corpus_command_against_the_running_app(serve_app, tmp_path):
    """A folder of mixed inputs with one corrupt file: the others done, the bad one recorded,
    exit 1; killed midway, a rerun redoes nothing that was recorded done."""
    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    (inputs / "bad.pdf").write_bytes(corrupt_pdf())
    for i in range(6):
        (inputs / "sub" / f"doc{i}.pdf").write_bytes(make_pdf(2 + i % 2, size=(200 + i, 300)))
    (inputs / "photo.png").write_bytes(png_of_page(make_pdf(1, size=SMALL), 0))
    out = tmp_path / "out"
    first = run_corpus(inputs, "--out", out, "--max-tokens", "2", "--concurrency", "1")
    deadline = time.monotonic() + 300
    while len([m for m in manifest_lines(out) if m.get("status") == "done"]) < 2:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    recorded = {m["key"] for m in manifest_lines(out) if m.get("status") == "done"}
    lines_before = len(manifest_lines(out))
    second = run_corpus(inputs, "--out", out, "--max-tokens", "2", "--concurrency", "2")
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 1, stderr  # the corrupt file failed
    lines = manifest_lines(out)
    redone = {m["key"] for m in lines[lines_before:] if m.get("status") == "done"}
    assert recorded and not redone & recorded
    done = {m["key"] for m in lines if m.get("status") == "done"}
    assert len(done) == 7  # six PDFs and the photo
    failed = [m for m in lines if m.get("status") == "failed"]
    assert failed and "readable PDF" in json.dumps(failed[-1])
    assert (out / "sub" / "doc0.md").read_text().count("<--- Page Split --->") >= 1
    assert json.loads((out / "photo.json").read_text())["pages"][0]["width"] == 400
    assert "1 failed" in stderr
