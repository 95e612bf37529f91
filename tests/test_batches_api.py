"""OpenAI's Files and Batch API on the running app, through the real `openai` client: a batch of
`/v1/ocr` lines and one of chat lines each answer what the same requests sent alone answer, bad
lines fail alone into the error file; files are listed, read and deleted; batches listed, and
their errors named. (The store's and worker's own tests, on SQLite and PostgreSQL, with a worker
stopped midway: tests/test_batch_runner.py.)"""
import base64
import io
import json
import time

import numpy as np
import pytest
from PIL import Image

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
from tests.conftest import SERVE_URL, routers_over_the_shared_tiers  # noqa: E402


def png(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{SERVE_URL}/v1", api_key="unused", max_retries=0)


def run_batch(client, lines: list[dict], endpoint: str) -> tuple[object, dict, dict]:
    """Upload the lines, create the batch, wait for its end: (the batch, its output lines and
    its error lines by custom_id)."""
    upload = client.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h",
                                  metadata={"test": "yes"})
    assert batch.status == "validating" and batch.metadata == {"test": "yes"}
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)

    def read(file_id):
        if file_id is None:
            return {}
        return {row["custom_id"]: row for row in map(json.loads, client.files.content(file_id).text.splitlines())}
    return batch, read(batch.output_file_id), read(batch.error_file_id)


def test_a_batch_of_ocr_lines_answers_what_each_request_alone_answers(client):
    bodies = {f"page-{i}": {"image": png(i), "mode": "tiny", "max_tokens": 4} for i in range(3)}
    lines = [{"custom_id": key, "method": "POST", "url": "/v1/ocr", "body": body} for key, body in bodies.items()]
    lines += [{"custom_id": "bad-mode", "method": "POST", "url": "/v1/ocr", "body": {"image": png(9), "mode": "huge"}},
              {"custom_id": "page-0", "method": "POST", "url": "/v1/ocr", "body": bodies["page-0"]}]
    batch, output, errors = run_batch(client, lines, "/v1/ocr")
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (3, 2)
    for key, body in bodies.items():
        alone = requests.post(f"{SERVE_URL}/v1/ocr", json=body, timeout=120).json()
        got = output[key]["response"]
        assert got["status_code"] == 200 and got["body"]["text"] == alone["text"], key
        assert got["body"]["usage"] == alone["usage"]
    assert errors["bad-mode"]["response"]["status_code"] == 400
    assert errors["bad-mode"]["response"]["body"]["error"]["param"] == "mode"
    assert "earlier line" in errors["page-0"]["error"]["message"]  # its duplicate, refused alone


def test_a_batch_of_chat_lines_answers_chat_completions(client):
    url = f"data:image/png;base64,{png(5)}"
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "Free OCR."}]}], "max_tokens": 3}
    batch, output, errors = run_batch(client, [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                                                "body": body}], "/v1/chat/completions")
    assert batch.status == "completed" and not errors
    reply = output["chat"]["response"]["body"]
    alone = client.chat.completions.create(model=reply["model"], **body)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"] == alone.choices[0].message.content


def test_files_are_listed_read_and_deleted_and_batches_listed(client):
    made = client.files.create(file=("x.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    assert made.filename == "x.jsonl" and made.bytes == 19 and made.purpose == "batch"
    assert made.id in {f.id for f in client.files.list()}
    assert client.files.retrieve(made.id).id == made.id
    assert client.files.content(made.id).content == b'{"custom_id": "a"}\n'
    first = client.batches.create(input_file_id=made.id, endpoint="/v1/ocr", completion_window="24h")
    second = client.batches.create(input_file_id=made.id, endpoint="/v1/ocr", completion_window="24h")
    page = client.batches.list(limit=1)
    assert page.data[0].id == second.id and page.has_more
    assert first.id in {b.id for b in client.batches.list(limit=100)}
    assert client.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)


@pytest.mark.parametrize("call, param", [
    (lambda c: c.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune"), "purpose"),
    (lambda c: c.batches.create(input_file_id="file-none", endpoint="/v1/ocr", completion_window="24h"),
     "input_file_id"),
    (lambda c: c.batches.create(input_file_id="file-none", endpoint="/v1/embeddings", completion_window="24h"),
     "endpoint"),
    (lambda c: c.batches.create(input_file_id="file-none", endpoint="/v1/ocr", completion_window="soon"),
     "completion_window"),
])
def test_bad_files_and_batches_are_refused_naming_the_field(client, call, param):
    with pytest.raises(openai.BadRequestError) as refused:
        call(client)
    assert refused.value.body["param"] == param


def test_a_query_parameter_of_the_wrong_type_is_a_400_naming_it(serve_app):
    for route in ("/v1/batches?limit=abc", "/v1/files?limit=1.5", "/v1/batches?limit=0"):
        response = requests.get(f"{SERVE_URL}{route}", timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "limit", route


def test_any_request_may_ask_to_run_below_interactive_ones(serve_app):
    """`"priority": "batch"` (what batch lines run as) is a request option like any: answered
    the same; another value is a 400 naming it."""
    body = {"image": png(7), "mode": "tiny", "max_tokens": 4}
    answers = [requests.post(f"{SERVE_URL}/v1/ocr", json={**body, "priority": p}, timeout=120)
               for p in ("interactive", "batch", "high")]
    assert [a.status_code for a in answers] == [200, 200, 400]
    assert answers[0].json()["text"] == answers[1].json()["text"]
    assert answers[2].json()["error"]["param"] == "priority"


def test_a_batch_file_over_its_limits_is_413_naming_it(client):
    """Over `batch_file_mb` (16 on the test app) or over OpenAI's 50,000 lines: 413, the field
    named, nothing kept."""
    from deployments import batch_api
    before = len(client.files.list().data)
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("big.jsonl", b"x" * ((16 << 20) + 10)), purpose="batch")
    assert refused.value.status_code == 413 and refused.value.body["param"] == "file"
    assert len(client.files.list().data) == before
    with pytest.raises(batch_api.PayloadTooLarge, match="50000"):
        batch_api.upload(None, "batch", "many.jsonl", b"{}\n" * (batch_api.MAX_LINES + 1), 1 << 30)


def test_unknown_files_and_batches_are_404(client):
    for call in (lambda: client.files.retrieve("file-none"), lambda: client.files.content("file-none"),
                 lambda: client.batches.retrieve("batch-none"), lambda: client.batches.cancel("batch-none")):
        with pytest.raises(openai.NotFoundError):
            call()


def test_an_app_stopped_then_its_router_killed_mid_batch_finishes_it_as_an_uninterrupted_run(client, tmp_path):
    """A second app on its own store (a Router over the shared app's tiers, under
    /batch-restart): a batch started; the app deleted once some lines are answered (its Router's
    graceful shutdown gives the batch back) and started again on the same store, which goes on
    from the recorded lines; then that Router's process killed mid-batch (its lease runs out:
    `batch_lease_s`, 2 s here) and the replica Serve starts in its place takes the batch on.
    Each line is in the output once, and the output equals the same file's batch run without a
    stop."""
    import os
    import signal

    from ray import serve

    from deployments.batch_store import BatchStore, FileStorage
    from deployments.config import AppConfig
    config = AppConfig(max_len=2048, max_images=8, batch_store=str(tmp_path / "batches.db"),
                       batch_files=str(tmp_path / "files"), batch_lines_in_flight=2, batch_lease_s=2)
    bodies = [{"image": png(20 + i), "mode": "tiny", "max_tokens": 48} for i in range(24)]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/ocr", "body": b} for i, b in enumerate(bodies)]
    data = "\n".join(map(json.dumps, lines)).encode()
    deadline = time.monotonic() + 180

    def start():
        return routers_over_the_shared_tiers("batch-restart", config)

    def batch_when(done):
        """The batch once `done(batch)`; the calls that reach no Router while a killed one is
        replaced are tried again."""
        while time.monotonic() < deadline:
            try:
                batch = restart.batches.retrieve(batch_id)
            except (openai.APIConnectionError, openai.APIStatusError):
                batch = None
            if batch is not None and done(batch):
                return batch
            time.sleep(0.2)
        raise AssertionError(f"batch {batch_id} not there in time")

    def batch_once(completed: int):
        """The batch once `completed` lines are recorded (or it ended)."""
        return batch_when(lambda b: b.request_counts.completed >= completed or b.status == "completed")
    restart = openai.OpenAI(base_url=f"{start()}/v1", api_key="unused", max_retries=0)
    try:
        upload = restart.files.create(file=("in.jsonl", data), purpose="batch")
        batch_id = restart.batches.create(input_file_id=upload.id, endpoint="/v1/ocr", completion_window="24h").id
        batch_once(3)
        serve.delete("batch-restart")  # (its batch worker takes lines until its Router is told to stop)
        store = BatchStore(config.batch_store, FileStorage(config.batch_files))
        stopped_at = store.get_batch(batch_id)["request_counts"]["completed"]
        assert stopped_at < len(lines) // 2  # stopped midway
        store.close()
        start()
        assert batch_once(stopped_at + 2).status == "in_progress"  # resumed, not done
        router = serve.get_deployment_handle("Router", "batch-restart").stats.remote().result(timeout_s=60)
        os.kill(router["pid"], signal.SIGKILL)
        batch = batch_when(lambda b: b.status == "completed")  # past finalizing
        assert batch.request_counts.completed == len(lines)
        resumed = restart.files.content(batch.output_file_id).text
    finally:
        serve.delete("batch-restart")
    _, whole, _ = run_batch(client, lines, "/v1/ocr")

    def answers(text):
        rows = [json.loads(row) for row in text.splitlines()]
        assert len({row["custom_id"] for row in rows}) == len(rows) == len(lines)  # each line once
        return {row["custom_id"]: (row["response"]["status_code"], row["response"]["body"]["text"]) for row in rows}
    assert answers(resumed) == {key: (row["response"]["status_code"], row["response"]["body"]["text"])
                                for key, row in whole.items()}


@pytest.mark.slow
def test_priority_bench_smoke(serve_app, tmp_path):
    """bench/priority_bench.py's phases against this app (`--url`): interactive pages alone, a
    batch job of other pages, those as plain requests, then the interactive phase beside two
    running batch jobs, cancelled after; the ratios read from it."""
    from tests.test_bench_scripts import run_smoke
    result = run_smoke("priority_bench.py", "priority", tmp_path, "--url", SERVE_URL)
    summary, (rep,) = result["summary"], result["reps"]
    assert result["setup"]["url"] == SERVE_URL and result["setup"]["overrides"] is None
    assert rep["batch"]["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert rep["plain"]["pages"] == 6 and rep["plain"]["refusals"] == 0
    assert rep["beside"]["pages"] == 4
    assert summary["interactive_p50_beside_batch"] == pytest.approx(rep["beside"]["p50_s"] / rep["interactive"]["p50_s"])
    assert summary["batch_to_plain_lines_per_s"] == pytest.approx(
        rep["batch"]["pages_per_s"] / rep["plain"]["pages_per_s"])
    assert set(summary["met"]) == set(summary["targets"])
