"""Offline OCR on Ray Data (deployments/offline.py) against the running service, on the shared
app's cluster: the same pages and options give the same greedy text, finish reason and usage;
a PDF's pages each the service's page; a file that cannot be read is a row with its error."""
import base64
import io

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
    """A tiled page, an untiled one and a small one in `base` mode (each with the service's
    default prompt), and a file that is no image: three answers equal the service's, one error."""
    files = {"wide.png": noise_png((1400, 700), 1), "square.png": noise_png((448, 448), 2),
             "broken.png": b"not an image"}
    options = {"max_tokens": 8}
    rows = by_source(ocr_dataset(ray.data.from_items([{"path": p, "bytes": b} for p, b in files.items()]),
                                 **options).take_all())
    assert set(rows) == {(name, 0) for name in files}
    for name in ("wide.png", "square.png"):
        served = requests.post(f"{SERVE_URL}/v1/ocr", timeout=300, json={
            "image": base64.b64encode(files[name]).decode(), **options}).json()
        row = rows[(name, 0)]
        assert row["error"] is None and row["text"] == served["text"], (row, served)
        assert row["finish_reason"] == served["finish_reason"]
        assert {k: row[k] for k in served["usage"]} == served["usage"]
    broken = rows[("broken.png", 0)]
    assert broken["text"] is None and broken["error"].startswith("image: cannot decode image")


def test_a_pdf_s_pages_are_rows_each_the_service_s_page(serve_app):
    pdf = make_pdf(3, size=(400, 600))
    options = {"max_tokens": 6, "prompt": "<image>\nFree OCR.", "output_format": "markdown"}
    rows = ocr_dataset(ray.data.from_items([{"path": "three.pdf", "bytes": pdf}]), **options).take_all()
    served = requests.post(f"{SERVE_URL}/v1/ocr", timeout=300, json={
        "document": base64.b64encode(pdf).decode(), **options}).json()["pages"]
    assert sorted(row["page"] for row in rows) == [0, 1, 2]
    for row in rows:
        page = served[row["page"]]
        assert row["error"] is None and row["text"] == page["text"]
        assert {k: row[k] for k in page["usage"]} == page["usage"]


@pytest.mark.parametrize("options, param", [({"max_crops": 99}, "max_crops"), ({"max_tokens": 0}, "max_tokens"),
                                             ({"output_format": "blocks"}, "output_format"),
                                             ({"mode": "huge"}, "mode"), ({"colour": "red"}, "colour")])
def test_bad_options_are_refused_before_any_work(options, param):
    """Checked as the service checks a request's, before the dataset is touched."""
    with pytest.raises(BadRequest) as refused:
        ocr_dataset(None, **options)
    assert refused.value.param == param
