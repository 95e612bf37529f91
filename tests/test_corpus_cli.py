"""The `deepseek-ocr run` corpus command against a fake app that speaks `/v1/ocr`'s contract.

The fake reads everything from the request body: a "PDF" is a few bytes with one `/Type /Page`
line per page (`fake_pdf`), and markers in it make pages fail (`%FAIL=1,3`, while
`fail_pages` is on) or hit the token limit (`%LENGTH=2`); a body starting with b"corrupt" is
refused with a 400 envelope. Queued `transient` answers (503 with Retry-After, 429, a plain-text
502) come before real ones, `api_key` turns on 401s, `delay_s` slows every answer. Every request
is recorded, so the tests count exactly what a run asked for.
"""
import ast
import base64
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import corpus.client
from corpus.cli import main
from corpus.inputs import find_inputs
from corpus.errors import UsageError
from corpus.outputs import PAGE_SPLIT, rewrite_links
from corpus.progress import Outcome, Progress
from corpus.run import format_page_range, parse_page_range

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEPARATOR = f"\n{PAGE_SPLIT}\n"  # after every page, as DeepSeek's run_dpsk_ocr_pdf.py writes it


def fake_pdf(pages: int, label: str = "", fail: str = "", length: str = "") -> bytes:
    data = f"%PDF-1.4 fake {label}\n".encode() + b"1 0 obj << /Type /Pages >>\n"
    data += b"<< /Type /Page >>\n" * pages
    data += f"%FAIL={fail}\n".encode() if fail else b""
    return data + (f"%LENGTH={length}\n".encode() if length else b"")


def fake_png(label: str = "") -> bytes:
    return b"\x89PNG\r\n\x1a\n fake " + label.encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def crop_bytes(digest: str, page: int, k: int, j: int) -> bytes:
    return f"JPEG {digest[:8]} p{page} k{k} j{j}".encode()


def page_answer(digest: str, index: int, finish_reason: str = "stop") -> dict:
    """A page with a title, a two-box figure, text and a one-box figure (the model's format)."""
    text = (f"<|ref|>title<|/ref|><|det|>[[10, 10, 900, 80]]<|/det|>\n# Page {index}\n\n"
            f"<|ref|>image<|/ref|><|det|>[[100, 100, 400, 400], [500, 100, 900, 400]]<|/det|>\n\n"
            f"<|ref|>text<|/ref|><|det|>[[10, 500, 900, 600]]<|/det|>\nbody {digest[:8]} {index}\n\n"
            f"<|ref|>image<|/ref|><|det|>[[100, 700, 400, 900]]<|/det|>\n")
    markdown = (f"# Page {index}\n\n![](images/{index}_0.jpg)\n\nbody {digest[:8]} {index}\n\n"
                f"![](images/{index}_1.jpg)")

    def block(label, body, boxes):
        out = {"label": label, "text": body, "boxes_norm": boxes, "boxes": boxes, "parse_error": None}
        if label == "image":
            k = sum(1 for b in blocks if b["label"] == "image")
            out["crops"] = [base64.b64encode(crop_bytes(digest, index, k, j)).decode()
                            for j in range(len(boxes))]
        return out
    blocks = []
    for args in (("title", f"# Page {index}", [[10, 10, 900, 80]]),
                 ("image", "", [[100, 100, 400, 400], [500, 100, 900, 400]]),
                 ("text", f"body {digest[:8]} {index}", [[10, 500, 900, 600]]),
                 ("image", "", [[100, 700, 400, 900]])):
        blocks.append(block(*args))
    return {"index": index, "text": text, "markdown": markdown, "finish_reason": finish_reason,
            "usage": {"prompt_tokens": 10, "completion_tokens": 20}, "width": 1000, "height": 1400,
            "blocks": blocks, "error": None}


def error_body(message: str, kind: str = "invalid_request", param=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class FakeApp:
    """`/health` and `/v1/ocr` from the request body; thread-safe request log."""

    def __init__(self):
        self.requests: list[dict] = []
        self.transient: list[tuple[int, str | None]] = []  # (status, Retry-After) to answer first
        self.api_key = None
        self.fail_pages = True
        self.delay_s = 0.0
        self.lock = threading.Lock()

    def requested(self) -> list[str]:
        """sha256 of the input each /v1/ocr request carried, in order."""
        return [r["sha256"] for r in self.requests]

    def answer(self, headers, body: dict) -> tuple[int, dict, dict]:
        data = base64.b64decode(body.get("document") or body.get("image") or "")
        with self.lock:
            self.requests.append({"body": body, "sha256": sha(data),
                                  "authorization": headers.get("Authorization")})
            transient = self.transient.pop(0) if self.transient else None
        time.sleep(self.delay_s)
        if self.api_key and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {}, error_body("missing or wrong API key", "authentication_error")
        if transient:
            status, retry_after = transient
            return status, {"Retry-After": retry_after} if retry_after else {}, error_body("overloaded", "overloaded")
        if body.get("prompt_preset") not in (None, "markdown", "ocr", "free"):
            return 400, {}, error_body(f"unknown prompt_preset {body['prompt_preset']!r}", param="prompt_preset")
        if data.startswith(b"corrupt"):
            what = "document is not a PDF" if "document" in body else "cannot decode the image"
            return 400, {}, error_body(f"{what}: no header", param="document" if "document" in body else "image")
        if "image" in body:
            page = page_answer(sha(data), 0)
            return 200, {}, {"model": "fake", "text": page["text"], "markdown": page["markdown"],
                             "blocks": page["blocks"], "finish_reason": "stop", "usage": page["usage"]}
        return self.document(data, body)

    def document(self, data: bytes, body: dict) -> tuple[int, dict, dict]:
        count = data.count(b"/Type /Page >>")
        indices = sorted(parse_page_range(body["page_range"])) if "page_range" in body else range(count)
        if any(i >= count for i in indices):
            return 400, {}, error_body(f"page_range is past the last page ({count})", param="page_range")
        failing = _marker(data, b"FAIL") if self.fail_pages else set()
        length = _marker(data, b"LENGTH")
        pages = []
        for i in indices:
            if i in failing:
                pages.append({"index": i, "text": None, "markdown": None, "finish_reason": None,
                              "usage": None, "width": 1000, "height": 1400, "blocks": None,
                              "error": {"type": "render_error", "message": f"page {i} did not render"}})
            else:
                pages.append(page_answer(sha(data), i, "length" if i in length else "stop"))
        return 200, {}, {"model": "fake", "pages": pages, "usage": {},
                         "text": "".join(p["text"] or "" for p in pages),
                         "failed_pages": sorted(i for i in indices if i in failing)}


def _marker(data: bytes, name: bytes) -> set[int]:
    found = re.search(rb"%" + name + rb"=([\d,]+)", data)
    return {int(v) for v in found.group(1).split(b",")} if found else set()


class Handler(BaseHTTPRequestHandler):
    app: FakeApp

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {}, {"status": "ok", "model": "fake"})
        else:
            self.reply(404, {}, error_body(f"no route {self.path}"))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, headers, payload = self.app.answer(self.headers, body)
        if status == 502:  # a proxy's plain-text answer, not the envelope
            self.reply(502, headers, None, b"Bad Gateway")
        else:
            self.reply(status, headers, payload)

    def reply(self, status, headers, payload, raw=None):
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if raw is None else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def app():
    fake = FakeApp()
    handler = type("BoundHandler", (Handler,), {"app": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(corpus.client, "BACKOFF_BASE_S", 0.01)
    monkeypatch.delenv("DEEPSEEK_OCR_API_KEY", raising=False)
    monkeypatch.delenv("DEEPSEEK_OCR_SERVER", raising=False)


def write(path, data: bytes) -> bytes:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return data


def read_text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def manifest(out, skip_torn: bool = False) -> list[dict]:
    records = []
    for line in read_text(os.path.join(out, "manifest.jsonl")).splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            if not skip_torn:
                raise
    return records


def ocr(app, *args) -> int:
    return main(["run", *map(str, args), "--server", app.url])


@pytest.fixture
def corpus_tree(tmp_path):
    """A folder of mixed inputs: nested dirs, PDFs, images (an upper-case extension), a corrupt
    PDF and a file that is not an input."""
    root = tmp_path / "in"
    files = {
        "a.pdf": write(root / "a.pdf", fake_pdf(3, "a")),
        "sub/b.png": write(root / "sub" / "b.png", fake_png("b")),
        "sub/deep/c.pdf": write(root / "sub" / "deep" / "c.pdf", fake_pdf(2, "c", length="1")),
        "sub/D.JPG": write(root / "sub" / "D.JPG", fake_png("d")),
        "bad.pdf": write(root / "bad.pdf", b"corrupt bytes"),
    }
    write(root / "notes.txt", b"not an input")
    write(root / "._a.pdf", b"corrupt: macOS metadata")  # hidden names are skipped
    write(root / ".git" / "x.pdf", b"corrupt: not part of the corpus")
    return root, files


def test_a_folder_is_done_except_the_corrupt_file_outputs_mirror_the_tree(app, corpus_tree, capsys):
    root, files = corpus_tree
    out = root / "_ocr"  # inside the input folder: its crops must not become inputs on a rerun
    assert ocr(app, root, "--out", out) == 1
    assert sorted(app.requested()) == sorted(sha(d) for d in files.values())

    records = {r["source"]: r for r in manifest(out)}
    bad = records[str(root / "bad.pdf")]
    assert bad["status"] == "failed" and "document is not a PDF: no header" in bad["error"]
    assert {r["status"] for s, r in records.items() if s != str(root / "bad.pdf")} == {"done"}
    assert not (out / "bad.md").exists()

    a_md = read_text(out / "a.md")
    assert a_md.count(SEPARATOR) == 3 and a_md.endswith(SEPARATOR)
    assert "![](images/a_0_0.jpg)" in a_md and "![](images/a_2_1.jpg)" in a_md
    assert "images/0_0.jpg" not in a_md
    assert (out / "images" / "a_0_0.jpg").read_bytes() == crop_bytes(sha(files["a.pdf"]), 0, 0, 0)
    assert (out / "images" / "a_0_0_1.jpg").read_bytes() == crop_bytes(sha(files["a.pdf"]), 0, 0, 1)
    assert (out / "images" / "a_2_1.jpg").read_bytes() == crop_bytes(sha(files["a.pdf"]), 2, 1, 0)
    assert "<|ref|>image<|/ref|>" in read_text(out / "a.raw.mmd")
    assert "![](images/b_0_0.jpg)" in read_text(out / "sub" / "b.md")
    assert (out / "sub" / "images" / "b_0_0.jpg").exists() and (out / "sub" / "images" / "D_0_1.jpg").exists()

    c = json.loads(read_text(out / "sub" / "deep" / "c.json"))
    assert c["source"] == str(root / "sub" / "deep" / "c.pdf") and c["sha256"] == sha(files["sub/deep/c.pdf"])
    assert [(p["index"], p["finish_reason"], p["width"]) for p in c["pages"]] == [(0, "stop", 1000), (1, "length", 1000)]
    figure = c["pages"][0]["blocks"][1]
    assert "crops" not in figure and figure["crop_files"] == ["images/c_0_0.jpg", "images/c_0_0_1.jpg"]

    summary = capsys.readouterr().err
    assert re.search(r"^5 documents \(7 pages\) in [\d.]+ s: [\d.]+ pages/s; 1 failed; 1 page truncated", summary, re.M)
    assert f"{root / 'bad.pdf'}: document is not a PDF: no header (HTTP 400)" in summary

    # A rerun asks for nothing that is done; the failed document is tried again (once: a 400 is not retried).
    app.requests.clear()
    assert ocr(app, root, "--out", out) == 1
    assert app.requested() == [sha(files["bad.pdf"])]
    assert "4 skipped (done before)" in capsys.readouterr().err


def test_the_request_carries_the_options_and_the_contract_fields(app, tmp_path):
    pdf, png = write(tmp_path / "in" / "p.pdf", fake_pdf(3)), write(tmp_path / "in" / "i.png", fake_png())
    assert ocr(app, tmp_path / "in", "--out", tmp_path / "out", "--page-range", "0, 2", "--dpi", "200",
               "--preset", "ocr", "--max-tokens", "64", "--api-key", "k") == 0
    bodies = {r["sha256"]: r["body"] for r in app.requests}
    document, image = bodies[sha(pdf)], bodies[sha(png)]
    assert base64.b64decode(document["document"]) == pdf
    assert {k: v for k, v in document.items() if k != "document"} == {
        "page_range": "0,2", "dpi": 200, "prompt_preset": "ocr", "output_format": "blocks",
        "return_crops": True, "max_tokens": 64, "timeout_s": 1800}
    assert {k: v for k, v in image.items() if k != "image"} == {
        "prompt_preset": "ocr", "output_format": "blocks", "return_crops": True, "max_tokens": 64,
        "timeout_s": 1800}
    assert {r["authorization"] for r in app.requests} == {"Bearer k"}
    assert [p["index"] for p in json.loads(read_text(tmp_path / "out" / "p.json"))["pages"]] == [0, 2]


def test_a_partial_document_reruns_only_its_failed_pages_and_merges_them(app, tmp_path, capsys):
    pdf = write(tmp_path / "in" / "doc.pdf", fake_pdf(5, fail="1,3"))
    out = tmp_path / "out"
    assert ocr(app, tmp_path / "in", "--out", out) == 1
    [record] = manifest(out)
    assert record["status"] == "partial" and record["failed_pages"] == [1, 3]
    assert "render_error: page 1 did not render" in record["error"]
    first = read_text(out / "doc.md")
    assert first.count(SEPARATOR) == 5 and "<!-- page 3: OCR failed: render_error: page 3 did not render -->" in first
    assert "doc.pdf: pages 1, 3 failed" in capsys.readouterr().err
    assert not (out / "images" / "doc_1_0.jpg").exists()

    app.fail_pages, app.requests[:] = False, []
    assert ocr(app, tmp_path / "in", "--out", out) == 0
    [request] = app.requests
    assert request["body"]["page_range"] == "1,3" and base64.b64decode(request["body"]["document"]) == pdf
    merged = read_text(out / "doc.md").split(SEPARATOR)
    assert [re.match(r"# Page (\d)", page).group(1) for page in merged[:-1]] == ["0", "1", "2", "3", "4"]
    pages = json.loads(read_text(out / "doc.json"))["pages"]
    assert [p["index"] for p in pages] == [0, 1, 2, 3, 4] and not any(p["error"] for p in pages)
    assert all((out / "images" / f"doc_{i}_0.jpg").exists() for i in range(5))
    assert manifest(out)[-1]["status"] == "done"
    assert re.search(r"^1 documents \(2 pages\)", capsys.readouterr().err, re.M)
    app.requests.clear()
    assert ocr(app, tmp_path / "in", "--out", out) == 0 and app.requests == []


def test_force_redoes_done_documents_and_changed_options_change_the_key(app, tmp_path):
    write(tmp_path / "in" / "a.pdf", fake_pdf(2))
    write(tmp_path / "in" / "b.png", fake_png())
    out = tmp_path / "out"
    assert ocr(app, tmp_path / "in", "--out", out) == 0 and len(app.requests) == 2
    app.requests.clear()
    assert ocr(app, tmp_path / "in", "--out", out, "--concurrency", "1", "--retries", "0") == 0
    assert app.requests == []  # concurrency and retries are not part of the key
    assert ocr(app, tmp_path / "in", "--out", out, "--force") == 0 and len(app.requests) == 2
    app.requests.clear()
    assert ocr(app, tmp_path / "in", "--out", out, "--dpi", "200") == 0
    assert [r["body"].get("dpi") for r in app.requests] == [200]  # an image has no dpi: not redone


def test_transient_failures_are_retried_honouring_retry_after_a_400_is_not(app, tmp_path, capsys):
    bad = write(tmp_path / "bad" / "x.pdf", b"corrupt")
    assert ocr(app, tmp_path / "bad", "--out", tmp_path / "out1") == 1
    assert app.requested() == [sha(bad)]

    good = write(tmp_path / "good" / "y.png", fake_png())
    app.requests.clear()
    app.transient = [(503, "1"), (429, None), (502, None)]
    start = time.monotonic()
    assert ocr(app, tmp_path / "good", "--out", tmp_path / "out2") == 0
    assert time.monotonic() - start >= 1.0  # the Retry-After, not the (tiny) backoff
    assert app.requested() == [sha(good)] * 4
    err = capsys.readouterr().err
    assert "HTTP 503: overloaded; retry 1/5 in 1.0 s" in err and "HTTP 502: Bad Gateway" in err


def test_a_document_failing_past_its_retries_is_recorded_and_redone_next_time(app, tmp_path, capsys):
    write(tmp_path / "in" / "y.png", fake_png())
    app.transient = [(503, "0")] * 3
    assert ocr(app, tmp_path / "in", "--out", tmp_path / "out", "--retries", "2") == 1
    assert len(app.requests) == 3
    [record] = manifest(tmp_path / "out")
    assert record["status"] == "failed" and "gave up after 3 attempts" in record["error"]
    assert "HTTP 503" in capsys.readouterr().err
    assert ocr(app, tmp_path / "in", "--out", tmp_path / "out") == 0 and len(app.requests) == 4


def test_a_refused_api_key_is_a_usage_error(app, tmp_path, capsys, monkeypatch):
    write(tmp_path / "in" / "y.png", fake_png())
    app.api_key = "secret"
    assert ocr(app, tmp_path / "in", "--out", tmp_path / "out", "--api-key", "wrong") == 2
    assert "refused the API key" in capsys.readouterr().err
    monkeypatch.setenv("DEEPSEEK_OCR_API_KEY", "secret")
    assert ocr(app, tmp_path / "in", "--out", tmp_path / "out") == 0
    assert app.requests[-1]["authorization"] == "Bearer secret"


def test_an_option_the_server_rejects_stops_the_run(app, tmp_path, capsys):
    for name in "abc":
        write(tmp_path / "in" / f"{name}.png", fake_png(name))
    assert ocr(app, tmp_path / "in", "--out", tmp_path / "out", "--preset", "nonsense", "--concurrency", "1") == 2
    assert len(app.requests) == 1 and "rejects --preset: unknown prompt_preset" in capsys.readouterr().err


@pytest.mark.parametrize("arguments", [["{empty}"], ["{text_only}"], ["{missing}"], ["{pdf}", "--format", "md,pdf"],
                                       ["{pdf}", "--page-range", "3-1"], ["{pdf}", "--concurrency", "0"], []])
def test_usage_errors_exit_2(app, tmp_path, arguments):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "text_only" / "a.txt", b"x")
    write(tmp_path / "p.pdf", fake_pdf(1))
    paths = {"empty": tmp_path / "empty", "text_only": tmp_path / "text_only",
             "missing": tmp_path / "nope.pdf", "pdf": tmp_path / "p.pdf"}
    assert ocr(app, *[a.format(**paths) for a in arguments], "--out", tmp_path / "out") == 2
    assert app.requests == []


def test_a_server_that_is_not_a_url_is_a_usage_error(tmp_path, capsys):
    write(tmp_path / "p.pdf", fake_pdf(1))
    assert main(["run", str(tmp_path / "p.pdf"), "--out", str(tmp_path / "out"), "--server", "localhost:8000"]) == 2
    assert "is not an http:// or https:// URL" in capsys.readouterr().err


def test_an_unreachable_server_is_a_usage_error(tmp_path, capsys):
    write(tmp_path / "p.pdf", fake_pdf(1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["run", str(tmp_path / "p.pdf"), "--out", str(tmp_path / "out"),
                 "--server", f"http://127.0.0.1:{port}"]) == 2
    assert "is unreachable" in capsys.readouterr().err


def test_a_killed_run_resumes_without_redoing_recorded_documents(app, tmp_path):
    inputs = {write(tmp_path / "in" / f"d{i}.pdf", fake_pdf(1, str(i))) for i in range(12)}
    out = tmp_path / "out"
    app.delay_s = 0.3  # 2 in flight: about 1.2 s between the 3rd record and the last
    command = [sys.executable, "-m", "corpus", "run", str(tmp_path / "in"), "--out", str(out),
               "--server", app.url, "--concurrency", "2"]
    with open(tmp_path / "stderr.txt", "wb") as stderr:
        child = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    manifest_path = out / "manifest.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and child.poll() is None:
        if manifest_path.exists() and manifest_path.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    recorded = {r["sha256"] for r in manifest(out, skip_torn=True)}  # a line may be torn by the kill
    assert 3 <= len(recorded) < 12, (read_text(tmp_path / "stderr.txt"), len(recorded))

    app.delay_s, app.requests[:] = 0.0, []
    assert ocr(app, tmp_path / "in", "--out", out) == 0
    redone = set(app.requested())
    assert not redone & recorded and redone | recorded == {sha(d) for d in inputs}
    assert all((out / f"d{i}.md").exists() for i in range(12))


def test_a_torn_manifest_line_is_ignored_and_not_glued_to_the_next(app, tmp_path, capsys):
    files = [write(tmp_path / "in" / f"{n}.png", fake_png(n)) for n in "abc"]
    out = tmp_path / "out"
    assert ocr(app, tmp_path / "in", "--out", out, "--concurrency", "1") == 0
    path = out / "manifest.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])  # the last record cut mid-line
    torn_sha = json.loads(lines[-1])["sha256"]
    app.requests.clear()
    assert ocr(app, tmp_path / "in", "--out", out) == 0
    assert app.requested() == [torn_sha]
    assert "skipped 1 unreadable line" in capsys.readouterr().err
    readable = [json.loads(line) for line in path.read_text().splitlines()[-1:]]
    assert readable[0]["sha256"] == torn_sha  # a line of its own after the torn one
    app.requests.clear()
    assert ocr(app, tmp_path / "in", "--out", out) == 0 and app.requests == []
    assert path.read_text().splitlines()[len(lines) - 1] == lines[-1][:40].decode()  # kept, unread
    assert {sha(f) for f in files} == {r["sha256"] for r in manifest(out, skip_torn=True)}


def test_list_file_inputs(app, tmp_path, monkeypatch):
    write(tmp_path / "docs" / "x.pdf", fake_pdf(1, "x"))
    write(tmp_path / "docs" / "sub" / "y.png", fake_png("y"))
    write(tmp_path / "loose" / "z.webp", fake_png("z"))
    write(tmp_path / "loose" / "ignored.png", fake_png("ignored"))
    (tmp_path / "list.txt").write_text("# the corpus\n\ndocs\n  loose/z.webp  \n# loose/ignored.png\n")
    monkeypatch.chdir(tmp_path)  # relative list entries are relative to the working directory
    assert ocr(app, "@list.txt", "--out", "out", "--format", "md") == 0
    assert len(app.requests) == 3
    assert sorted(os.path.relpath(os.path.join(d, f), "out") for d, _, fs in os.walk("out") for f in fs
                  if f.endswith(".md")) == ["sub/y.md", "x.md", "z.md"]
    assert not os.path.exists("out/x.json") and not os.path.exists("out/x.raw.mmd")
    # A format added later is written from the stored page results: no request.
    app.requests.clear()
    assert ocr(app, "@list.txt", "--out", "out", "--format", "md,json") == 0
    assert app.requests == [] and json.loads(read_text("out/x.json"))["pages"][0]["index"] == 0


def test_output_names_keep_the_extension_only_where_stems_clash(tmp_path):
    write(tmp_path / "in" / "scan.pdf", fake_pdf(1))
    write(tmp_path / "in" / "scan.png", fake_png())
    write(tmp_path / "in" / "other.gif", fake_png())
    outputs = {os.path.basename(i.path): i.output for i in find_inputs([str(tmp_path / "in")], str(tmp_path / "out"))}
    assert outputs == {"scan.pdf": "scan.pdf", "scan.png": "scan.png", "other.gif": "other"}
    write(tmp_path / "elsewhere" / "other.gif", fake_png("2"))
    with pytest.raises(UsageError, match="would write the same outputs"):
        find_inputs([str(tmp_path / "in" / "other.gif"), str(tmp_path / "elsewhere" / "other.gif")], str(tmp_path / "out"))


def test_links_are_rewritten_for_the_exact_pattern_only():
    markdown = "![](images/0_0.jpg) ![](images/0_12.jpg) ![](images/1_0.jpg) [x](images/0_0.jpg) images/0_0.jpg"
    assert rewrite_links(markdown, 0, "my report") == (
        "![](images/my%20report_0_0.jpg) ![](images/my%20report_0_12.jpg) ![](images/1_0.jpg) "
        "[x](images/0_0.jpg) images/0_0.jpg")


def test_page_ranges():
    assert parse_page_range("0,5-7") == {0, 5, 6, 7}
    assert format_page_range([9, 1, 3, 4, 5]) == "1,3-5,9"
    for bad in ("", "1-", "a", "3-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_page_range(bad)


def test_progress_redraws_one_line_on_a_terminal_and_writes_lines_to_a_log():
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    terminal = Terminal()
    progress = Progress(documents=2, estimated_pages=3, skipped=0, stream=terminal)
    progress.finished(Outcome("a.pdf", "done", pages_done=2, truncated=1), estimate=2)
    progress.note("b.pdf: HTTP 503; retry 1/5 in 1.0 s")
    progress.finish()
    shown = terminal.getvalue()
    assert "\rdocuments 1/2, pages 2/~3, " in shown and "\x1b[K" in shown
    assert "\r\x1b[Kb.pdf: HTTP 503; retry 1/5 in 1.0 s\n\rdocuments 1/2" in shown  # cleared, redrawn
    assert shown.endswith("1 page truncated (hit the token limit, kept)\n")

    log = io.StringIO()
    progress = Progress(documents=1, estimated_pages=1, skipped=0, stream=log, log_interval_s=0)
    progress.finished(Outcome("c.png", "failed", reason="HTTP 400"), estimate=1)
    progress.finish()
    assert "\r" not in log.getvalue() and log.getvalue().splitlines()[0].startswith("documents 1/1, pages 0/0")
    assert log.getvalue().splitlines()[-1] == "  c.png: HTTP 400"


def parse(source: str, path: str):
    """ast.parse, once more after CPython 3.11's "AST constructor recursion depth mismatch"
    (gh-106905: its depth counter is shared by threads; a server thread of an earlier test
    compiling an import at that moment trips it), which says nothing of `source`."""
    try:
        return ast.parse(source, path)
    except SystemError:
        return ast.parse(source, path)


def test_the_client_imports_only_the_standard_library():
    """`pip install` of the client must not need torch or Ray: corpus/ imports the standard
    library and itself only (read from the source, imports inside functions included)."""
    found = set()
    for directory, _, files in os.walk(os.path.join(ROOT, "corpus")):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            for node in ast.walk(parse(read_text(path), path)):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    found.add(node.module.split(".")[0])
    assert found and found <= set(sys.stdlib_module_names) | {"__future__"}, found - set(sys.stdlib_module_names)


def test_loops_are_counted_per_document_in_the_manifest_and_the_summary(tmp_path):
    """A document answered with a page retried after a loop, one that looped on every attempt
    and one answered with its text layer: the manifest lists each, the outcome and the
    summary count them, the JSON keeps the loop's place and the text layer's mark."""
    from corpus.inputs import Input
    from corpus.manifest import Manifest, StateStore
    from corpus.run import Job, RunOptions, Worker
    attempts = [{"temperature": 0.0, "finish_reason": "repetition", "completion_tokens": 300},
                {"temperature": 0.3, "finish_reason": "eos", "completion_tokens": 90}]
    loop = {"start_token": 40, "period": 12, "text_chars": 120}
    pages = [{**page_answer("d" * 64, 0, "stop"), "usage": {"prompt_tokens": 10, "completion_tokens": 390, "attempts": attempts}},
             {**page_answer("d" * 64, 1, "repetition"), "repetition": loop},
             {**page_answer("d" * 64, 2, "repetition"), "repetition": loop, "source": "text_layer"}]
    out = str(tmp_path)
    worker = Worker(None, Manifest(out), StateStore(out), RunOptions(), out)
    outcome = worker._finish(Job(Input(str(tmp_path / "doc.pdf"), "doc"), "d" * 64, "key", 3),
                             {"model": "m", "pages": pages, "failed_pages": []})
    assert (outcome.status, outcome.retried, outcome.looped, outcome.text_layer) == ("done", 1, 1, 1)
    [record] = manifest(tmp_path)
    assert (record["retried_pages"], record["looped_pages"], record["text_layer_pages"]) == ([0], [1], [2])
    written = json.loads(read_text(tmp_path / "doc.json"))["pages"]
    assert "repetition" not in written[0] and written[1]["repetition"] == loop and written[2]["source"] == "text_layer"
    log = io.StringIO()
    progress = Progress(documents=1, estimated_pages=3, skipped=0, stream=log)
    progress.finished(outcome, estimate=3)
    progress.finish()
    assert ("1 page retried after a loop; 1 page looped on every attempt (kept); "
            "1 page answered with their text layer") in log.getvalue()
