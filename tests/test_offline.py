"""Offline OCR on Ray Data (deployments/offline.py) against the running service, on the shared
app's cluster: the same pages and options give the same greedy text, finish reason and usage;
a PDF's pages each the service's page; a file that cannot be read is a row with its error; the
batch command's runs (deployments/offline_run.py) resume where the last one stopped."""
import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
from deployments.offline import ocr_dataset  # noqa: E402
from deployments.protocol import BadRequest  # noqa: E402
from tests.conftest import SERVE_URL  # noqa: E402
from tests.pdfs import make_pdf  # noqa: E402

requests = pytest.importorskip("requests")


def noise_png(size: tuple[int, int], seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def by_source(rows: list[dict]) -> dict:
    return {(row["source"], row["page"]): row for row in rows}


def test_pages_read_offline_equal_the_service_s_answers(serve_app):
    """A tiled page, an untiled one, a PDF's two pages (each rendered as the service renders
    it) and a file that is no image, in one run: each page's answer equals the service's (text,
    finish reason, usage), the file that cannot be read is a row with its error."""
    files = {"wide.png": noise_png((1400, 700), 1), "square.png": noise_png((448, 448), 2),
             "two.pdf": make_pdf(2, size=(400, 600)), "broken.png": b"not an image"}
    options = {"max_tokens": 6, "prompt": "<image>\nFree OCR."}
    rows = by_source(ocr_dataset(ray.data.from_items([{"path": p, "bytes": b} for p, b in files.items()]),
                                 **options).take_all())
    assert set(rows) == {(name, 0) for name in files} | {("two.pdf", 1)}

    def service(field: str, data: bytes) -> dict:
        return requests.post(f"{SERVE_URL}/v1/ocr", timeout=300, json={
            field: base64.b64encode(data).decode(), **options}).json()
    served = {(name, 0): service("image", files[name]) for name in ("wide.png", "square.png")}
    served |= {("two.pdf", page["index"]): page for page in service("document", files["two.pdf"])["pages"]}
    for key, answer in served.items():
        row = rows[key]
        assert row["error"] is None and row["text"] == answer["text"], (row, answer)
        assert row["finish_reason"] == answer["finish_reason"]
        assert {k: row[k] for k in answer["usage"]} == answer["usage"]
    broken = rows[("broken.png", 0)]
    assert broken["text"] is None and broken["error"].startswith("image: cannot decode image")


@pytest.mark.parametrize("options, param", [({"max_crops": 99}, "max_crops"), ({"max_tokens": 0}, "max_tokens"),
                                             ({"output_format": "blocks"}, "output_format"),
                                             ({"mode": "huge"}, "mode"), ({"colour": "red"}, "colour")])
def test_bad_options_are_refused_before_any_work(options, param):
    """Checked as the service checks a request's, before the dataset is touched."""
    with pytest.raises(BadRequest) as refused:
        ocr_dataset(None, **options)
    assert refused.value.param == param


def read_rows(out) -> list[dict]:
    """Every row written under `out` (all runs), sorted by file content and page."""
    return rows_of(out.rglob("*"))


def rows_of(paths) -> list[dict]:
    """The rows of these files (Parquet or JSONL; others skipped), sorted by content and page."""
    from deployments.offline_run import FORMATS
    rows = []
    for path in sorted(paths):
        if path.suffix == FORMATS["parquet"]:
            import pyarrow.parquet as pq
            rows += pq.read_table(path).to_pylist()
        elif path.suffix == FORMATS["jsonl"]:
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    keep = ("source", "content_sha256", "page", "text", "finish_reason", "completion_tokens", "error")
    return sorted(({k: row[k] for k in keep} for row in rows), key=lambda r: (r["content_sha256"], r["page"]))


def batch_command(*arguments: str, timeout: int = 600):
    """`deepseek-ocr batch` as a user runs it, on this cluster (`--address`, with the token Ray
    made for it, as test_serve's handle example joins it)."""
    import os
    import subprocess
    import sys
    command = os.path.join(os.path.dirname(sys.executable), "deepseek-ocr")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_AUTH_MODE": "token"}
    return subprocess.run([command, "batch", *arguments], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_batch_command_then_reruns_redo_only_what_was_cut_off_and_what_is_new(serve_app, tmp_path):
    """`deepseek-ocr batch` into a folder (Parquet, its default): a row per page (a PDF's two
    pages, two images, an error row for a file that is no image), its summary printed. A file
    then cut off mid-write (as by a run killed while writing) is removed by the next run (JSONL
    into the same folder), which does its pages again and no other; a new file (named by a
    glob) is all the run after reads. The rows end equal to the uninterrupted first run's, plus
    the new one. A bad option exits 2 naming it, before any cluster is joined."""
    from deployments.offline_run import run
    inputs = tmp_path / "in"
    (inputs / "scans").mkdir(parents=True)
    (inputs / "a.png").write_bytes(noise_png((640, 480), 1))
    (inputs / "scans" / "b.png").write_bytes(noise_png((448, 448), 2))
    (inputs / "scans" / "two.pdf").write_bytes(make_pdf(2, size=(300, 400)))
    (inputs / "broken.jpg").write_bytes(b"not a jpeg")
    (inputs / "notes.txt").write_text("not an input")
    options, out = {"max_tokens": 4}, tmp_path / "out"
    done = batch_command(str(inputs), "--out", str(out), "--max-tokens", "4",
                         "--address", ray.get_runtime_context().gcs_address)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout[done.stdout.index("{"):])
    assert (first["files"], first["pages"], first["errors"], first["pages_done_before"]) == (4, 5, 1, 0)
    assert first["completion_tokens"] == 16
    uninterrupted = read_rows(out)
    cut = max(out.rglob("*.parquet"), key=lambda path: path.stat().st_size)
    cut_rows = len(rows_of([cut]))
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    redone = run([str(inputs)], str(out), "jsonl", **options)
    assert not cut.exists() and (redone["pages"], redone["pages_done_before"]) == (cut_rows, 5 - cut_rows)
    assert read_rows(out) == uninterrupted
    (inputs / "c.png").write_bytes(noise_png((320, 240), 3))
    new = run([str(inputs) + "/*.png"], str(out), "jsonl", **options)  # a.png, c.png: not scans/b.png
    assert (new["files"], new["pages"], new["pages_done_before"]) == (2, 1, 5)
    assert len(read_rows(out)) == 6 and "c.png" in {r["source"].rsplit("/", 1)[1] for r in read_rows(out)}
    refused = batch_command(str(inputs), "--out", str(out), "--mode", "huge", timeout=120)
    assert refused.returncode == 2 and "mode" in refused.stderr
