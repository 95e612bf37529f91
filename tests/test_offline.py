"""Offline OCR on Ray Data (deployments/offline.py, through the batch command of
deployments/offline_run.py) against the running service, on the shared app's cluster: the same
pages and options give the same greedy text, finish reason and usage; a PDF's pages each the
service's page; a file that cannot be read is a row with its error; a run resumes where the last
one stopped."""
import base64
import io
import json
from pathlib import Path

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


@pytest.mark.parametrize("options, param", [({"max_crops": 99}, "max_crops"), ({"max_tokens": 0}, "max_tokens"),
                                             ({"return_crops": True}, "return_crops"),
                                             ({"output_format": "html"}, "output_format"),
                                             ({"mode": "huge"}, "mode"), ({"colour": "red"}, "colour"),
                                             ({"pages_per_request": 2}, "mode"),
                                             ({"pages_per_request": 64, "mode": "base"}, "pages_per_request")])
def test_bad_options_are_refused_before_any_work(options, param):
    """Checked as the service checks a request's, before the dataset is touched."""
    with pytest.raises(BadRequest) as refused:
        ocr_dataset(None, **options)
    assert refused.value.param == param


def test_a_row_s_own_max_tokens_is_checked_as_the_run_s():
    """(In process, no Ray Data job.) The Decode stage: a row whose `max_tokens` is out of range
    is that row's error naming the field; one in range caps the row's tokens; 0 is the run's."""
    import asyncio

    import torch

    from deployments.config import AppConfig
    from deployments.offline import NOT_WRITTEN, Decode
    from deployments.protocol import OcrOptions, validate
    decode = Decode(AppConfig(max_len=2048), validate(OcrOptions, {"max_tokens": 5, "mode": "tiny"}, strict=False))
    hidden = decode.server.engine.engine.model.args.hidden
    rows = {"source": ["a.png"] * 3, "content_sha256": ["x"] * 3, "page": [0, 0, 0], "pages": [1] * 3,
            "window": [False] * 3, "written": [NOT_WRITTEN] * 3, "text_layers": [[""]] * 3, "error": [""] * 3,
            "sequence": [np.zeros((1, 73, hidden), np.float32)] * 3, "original_size": [np.array([(64, 48)])] * 3,
            "max_tokens": [-3, 2, 0]}
    out = asyncio.run(decode(rows))
    assert out["error"][0].startswith("request: max_tokens") and out["text"][0] is None
    assert out["error"][1:] == [None, None] and out["completion_tokens"][1:] == [2, 5]


def test_a_run_with_gpus_and_no_shares_given_shares_one_card_as_gpu_shared_yaml():
    """`deepseek-ocr batch`'s layout: on CPUs none of a GPU; with GPUs and no share given, the
    encoder paths a quarter of the card each and the decoder half, each pool's memory capped as
    gpu-shared.yaml caps its tier (the decoder's KV cache leaves the encoders theirs); shares
    given: those, no caps (the pools may be on GPUs of their own)."""
    import yaml

    from deployments.offline import Stages, default_layout
    assert default_layout(None, 0, decoders=2) == (Stages(decoders=2), default_layout(None, 0)[1])
    stages, config = default_layout(None, 1)
    assert (stages.encoder_gpus * 2 + stages.decoder_gpus, stages.decoder_gpus) == (1.0, 0.5)
    with open(Path(__file__).parents[1] / "deployments/configs/gpu-shared.yaml") as f:
        shipped = yaml.safe_load(f)["applications"][0]["args"]
    caps = {k: v for k, v in config.model_dump().items() if k.startswith("gpu_memory_fraction")}
    assert caps == {k: shipped[k] for k in caps}
    stages, config = default_layout(None, 1, decoder_gpus=1.0)
    assert (stages.encoder_gpus, stages.decoder_gpus, config.gpu_memory_fraction_decoder) == (0.0, 1.0, None)


KEEP = ("source", "content_sha256", "page", "text", "finish_reason", "completion_tokens", "error")


def read_rows(out, keep=KEEP) -> list[dict]:
    """Every row written under `out` (all runs), sorted by file content and page."""
    return rows_of(out.rglob("*"), keep)


def rows_of(paths, keep=KEEP) -> list[dict]:
    """The rows of these files (Parquet or JSONL; others skipped), sorted by content and page;
    their `keep` columns (None: all)."""
    from deployments.offline_run import FORMATS
    rows = []
    for path in sorted(paths):
        if path.suffix == FORMATS["parquet"]:
            import pyarrow.parquet as pq
            rows += pq.read_table(path).to_pylist()
        elif path.suffix == FORMATS["jsonl"]:
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    rows = [row if keep is None else {k: row[k] for k in keep} for row in rows]
    return sorted(rows, key=lambda r: (r["content_sha256"], r["page"]))


def served(field: str, data: bytes, options: dict) -> dict:
    """The running service's answer to one image or document with these options."""
    return requests.post(f"{SERVE_URL}/v1/ocr", timeout=300, json={
        field: base64.b64encode(data).decode(), **options}).json()


def batch_command(*arguments: str, timeout: int = 600):
    """`deepseek-ocr batch` as a user runs it, on this cluster (`--address`, with the token Ray
    made for it, as test_serve's handle example joins it)."""
    import subprocess
    return subprocess.run(batch_argv(*arguments), env=batch_env(), capture_output=True, text=True, timeout=timeout)


def complete_files(folder) -> list:
    """The Parquet files under `folder` written whole (their footer read; one being written has none)."""
    import pyarrow.parquet as pq
    whole = []
    for path in folder.rglob("*.parquet"):
        try:
            pq.read_metadata(path)
            whole.append(path)
        except Exception:  # noqa: BLE001 - still being written (or removed meanwhile)
            pass
    return whole


def batch_argv(*arguments: str) -> list[str]:
    import os
    import sys
    return [os.path.join(os.path.dirname(sys.executable), "deepseek-ocr"), "batch", *arguments]


def batch_env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_AUTH_MODE": "token"}


def test_the_batch_command_equals_the_service_and_a_run_killed_midway_is_finished_by_a_rerun(
        serve_app, tmp_path):
    """`deepseek-ocr batch` into a folder (Parquet, its default): a row per page (a tiled image,
    an untiled one, a PDF's two pages each rendered as the service renders it), each equal to
    the service's answer with the same options (text, finish reason, usage), an error row for a
    file that is no image, its summary printed. The same command into another folder, killed
    (SIGTERM) once its first rows are written; of what it wrote, a file cut off mid-write (as by
    a kill while writing); then a rerun (JSONL, through `run`, in this process) removes the cut
    file, skips the pages still written, does the others and a new file: the rows end equal to
    the uninterrupted run's, plus the new one, none twice. A glob names only what it matches. A
    bad option exits 2 naming it, before any cluster is joined. (Three Ray Data jobs in all:
    each starts its own actor pools, seconds of 2 cores.)"""
    import signal
    import subprocess
    import time

    from deployments.offline_run import done_pages, find_files, run
    inputs = tmp_path / "in"
    (inputs / "scans").mkdir(parents=True)
    files = {"wide.png": noise_png((1400, 700), 1), "scans/square.png": noise_png((448, 448), 2),
             "scans/two.pdf": make_pdf(2, size=(400, 600)), "broken.jpg": b"not a jpeg"}
    for name, data in files.items():
        (inputs / name).write_bytes(data)
    (inputs / "notes.txt").write_text("not an input")
    options, out = {"max_tokens": 6, "prompt": "<image>\nFree OCR."}, tmp_path / "out"
    arguments = [str(inputs), "--max-tokens", "6", "--prompt", options["prompt"],
                 "--address", ray.get_runtime_context().gcs_address]
    done = batch_command(*arguments, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout[done.stdout.index("{"):])
    assert (first["files"], first["pages"], first["errors"], first["pages_done_before"]) == (4, 5, 1, 0)
    assert first["completion_tokens"] == 24
    answers = {(str(inputs / name), 0): served("image", files[name], options)
               for name in ("wide.png", "scans/square.png")}
    answers |= {(str(inputs / "scans/two.pdf"), page["index"]): page
                for page in served("document", files["scans/two.pdf"], options)["pages"]}
    rows = {(row["source"], row["page"]): row for row in read_rows(out, keep=None)}
    assert set(rows) == set(answers) | {(str(inputs / "broken.jpg"), 0)}
    for key, answer in answers.items():
        row = rows[key]
        assert row["error"] is None and row["text"] == answer["text"], (row, answer)
        assert row["finish_reason"] == answer["finish_reason"]
        assert {k: row[k] for k in answer["usage"]} == answer["usage"]
    broken = rows[(str(inputs / "broken.jpg"), 0)]
    assert broken["text"] is None and broken["error"].startswith("image: cannot decode image")

    killed_out = tmp_path / "killed"
    killed = subprocess.Popen(batch_argv(*arguments, "--out", str(killed_out)), env=batch_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 300
    while not complete_files(killed_out) and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.send_signal(signal.SIGTERM)
    stdout, _ = killed.communicate(timeout=120)
    assert killed.returncode != 0 and "pages_per_s" not in stdout  # killed before its summary
    written = done_pages(str(killed_out))  # (a file the kill left half-written: removed)
    print(f"\nkilled with {len(written)} of 5 pages written")
    cut = max(complete_files(killed_out), key=lambda path: path.stat().st_size)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (inputs / "c.png").write_bytes(noise_png((320, 240), 3))
    redone = run([str(inputs)], str(killed_out), "jsonl", **options)
    assert not cut.exists()  # unreadable: removed, its pages done again
    assert redone["files"] == 5 and redone["pages"] + redone["pages_done_before"] == 6
    assert redone["pages_done_before"] < 5  # at least the cut file's pages done again
    uninterrupted = read_rows(out)
    assert [r for r in read_rows(killed_out) if not r["source"].endswith("/c.png")] == uninterrupted
    assert len(read_rows(killed_out)) == 6
    _, matched = find_files([str(inputs) + "/*.png"])  # not scans/square.png
    assert [path.rsplit("/", 1)[1] for path in matched] == ["c.png", "wide.png"]
    refused = batch_command(str(inputs), "--out", str(out), "--mode", "huge", timeout=120)
    assert refused.returncode == 2 and "mode" in refused.stderr


@pytest.fixture(scope="module")
def bucket():
    """A local S3-compatible server (moto's, from PyPI) with one empty bucket: the URI prefix
    of that bucket, credentials and endpoint in it as pyarrow reads them (so Ray's workers,
    which the filesystem is pickled to, reach it too)."""
    from pyarrow import fs as pafs

    from tests.helpers import free_port
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        s3 = pafs.S3FileSystem(access_key="testing", secret_key="testing", endpoint_override=f"127.0.0.1:{port}",
                               scheme="http", region="us-east-1", allow_bucket_creation=True)
        s3.create_dir("scans-bucket")
        yield lambda path: f"s3://testing:testing@scans-bucket/{path}?endpoint_override=127.0.0.1:{port}" \
                           "&scheme=http&region=us-east-1"
    finally:
        server.stop()


def test_inputs_and_rows_on_object_storage_with_blocks_and_windows_of_pages(serve_app, bucket):
    """Inputs read from a bucket (a folder of an image and a three-page PDF) and rows written to
    it, Parquet, through the same run, with output_format "blocks" and the PDF's pages two at a
    time (`pages_per_request`, base mode: how Unlimited-OCR reads documents): each page's
    markdown and blocks (a JSON list), its window and whether the answer was split, equal the
    service's; what a rerun would skip is read back from the bucket."""
    from pyarrow import fs as pafs
    from pyarrow import parquet

    from deployments.offline_run import done_pages, filesystem_of, run
    s3, root = filesystem_of(bucket("in"))
    files = {"page.png": noise_png((448, 448), 4), "three.pdf": make_pdf(3, size=(300, 400))}
    for name, data in files.items():
        with s3.open_output_stream(f"{root}/{name}") as f:
            f.write(data)
    options = {"max_tokens": 3, "output_format": "blocks", "mode": "base", "pages_per_request": 2}
    summary = run([bucket("in")], bucket("out"), **options)
    # The image and two windows, 3 tokens each (a window's usage on its first page).
    assert (summary["files"], summary["pages"], summary["errors"], summary["completion_tokens"]) == (2, 4, 0, 9)
    written = [i.path for i in s3.get_file_info(pafs.FileSelector("scans-bucket/out", recursive=True))
               if i.path.endswith(".parquet")]
    assert written and all(path.startswith(summary["out"]) for path in written)
    rows = {(row["source"].rsplit("/", 1)[1], row["page"]): row
            for path in written for row in parquet.read_table(path, filesystem=s3).to_pylist()}
    answers = {("page.png", 0): {**served("image", files["page.png"], options), "window": [0], "split": False}}
    answers |= {("three.pdf", page["index"]): page
                for page in served("document", files["three.pdf"], options)["pages"]}
    assert set(rows) == set(answers)
    assert [answers["three.pdf", i]["window"] for i in range(3)] == [[0, 1], [0, 1], [2]]
    for key, answer in answers.items():
        assert rows[key]["text"] == answer["text"] and rows[key]["markdown"] == answer["markdown"], key
        assert json.loads(rows[key]["blocks"]) == answer["blocks"], key
        assert (rows[key]["window"], rows[key]["split"]) == (answer["window"], answer["split"]), key
        assert rows[key]["completion_tokens"] == answer["usage"]["completion_tokens"], key
    assert len(done_pages(bucket("out"))) == 4


def test_a_window_with_pages_written_before_is_read_whole_and_writes_only_the_others():
    """(In process, the stages called in order, no Ray Data job.) A three-page PDF two pages at a
    time, its page 0 written by an earlier run: the window [0, 1] is still read as one request
    (its answer is the whole window's) and only page 1's row comes out, then page 2's."""
    import asyncio
    import hashlib

    from deployments.config import AppConfig
    from deployments.offline import Decode, PathStage, assemble, pages_of, views_of
    from deployments.protocol import OcrOptions, validate
    pdf = make_pdf(3, size=(300, 400))
    config = AppConfig(max_len=2048)
    options = validate(OcrOptions, {"max_tokens": 4, "mode": "base", "pages_per_request": 2}, strict=False)
    stages = [PathStage("global", config), PathStage("local", config), Decode(config, options)]

    def rows_out(skip: frozenset) -> list[dict]:
        rows = list(pages_of({"bytes": pdf, "path": "three.pdf"}, 144, 400, skip, per_request=2))
        batch = views_of({key: [row[key] for row in rows] for key in rows[0]}, None, "base", None)
        batch = assemble(stages[1](stages[0](batch)), None)
        out = asyncio.run(stages[2](batch))
        return [dict(zip(out, values)) for values in zip(*out.values())]
    whole = rows_out(frozenset())
    assert [(row["page"], row["window"]) for row in whole] == [(0, [0, 1]), (1, [0, 1]), (2, [2])]
    rest = rows_out(frozenset({(hashlib.sha256(pdf).hexdigest(), 0)}))
    assert rest == whole[1:]


def decode_actor_pids() -> list[int]:
    """The processes of this cluster's live Decode actors (Ray Data's map workers, told apart by
    the name their process takes)."""
    from ray._private import state
    pids = [a["Pid"] for a in state.actors().values() if a["State"] == "ALIVE" and a.get("Pid")]
    return [pid for pid in pids if _cmdline(pid).startswith("ray::MapWorker(MapBatches(Decode))")]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def test_a_decoder_actor_takes_several_batches_at_once_and_holds_back_what_its_engine_cannot_admit():
    """Ray Data gives an actor one call at a time unless told otherwise: the Decode stage asks
    for several (a batch ending is replaced while the others decode), their pages together
    twice what its engine admits; the pages over that wait in the actor (here, in process:
    three batches of three pages against an engine of 2 running and 2 waiting), none refused."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.offline import DECODE_CALLS_IN_FLIGHT, Decode, PathStage, assemble, pages_of, views_of
    from deployments.protocol import OcrOptions, validate
    config = AppConfig(max_batch=2, decoder_queue=2)
    decode = ocr_dataset(ray.data.from_items([{"bytes": b""}]), config=config, mode="tiny")._logical_plan.dag
    assert decode.name == "MapBatches(Decode)" and decode.compute.max_concurrent_calls_per_actor > 1
    assert decode.batch_size * DECODE_CALLS_IN_FLIGHT == 2 * (2 + 2)

    options = validate(OcrOptions, {"max_tokens": 40, "mode": "tiny"}, strict=False)
    stages = [PathStage("global", config), PathStage("local", config), Decode(config, options)]

    def batch(first: int) -> dict:
        rows = [row for i in range(first, first + 3)
                for row in pages_of({"bytes": noise_png((400, 300), i), "path": f"p{i}.png"}, 144, 10)]
        views = views_of({key: [row[key] for row in rows] for key in rows[0]}, None, "tiny", options.max_crops)
        return assemble(stages[1](stages[0](views)), None)

    async def together():
        return await asyncio.gather(*(stages[2](batch(first)) for first in (0, 3, 6)))
    outs = asyncio.run(together())
    assert [out["source"] for out in outs] == [[f"p{i}.png" for i in range(f, f + 3)] for f in (0, 3, 6)]
    assert all(error is None for out in outs for error in out["error"]), [out["error"] for out in outs]
    assert all(tokens == 40 for out in outs for tokens in out["completion_tokens"])


def test_a_killed_decoder_actor_s_pages_are_done_again_and_appear_once(serve_app):
    """The Decode actor's process killed (SIGKILL) once the first page is out, the others still
    queued or generating in it (a decoder of 2 running and 2 waiting, a page per batch): Ray Data
    starts another and sends it their batches; every page appears exactly once, whole."""
    import os
    import signal

    from deployments.config import AppConfig
    from deployments.offline import Stages
    rows = [{"path": f"p{i}.png", "bytes": noise_png((400, 300), i)} for i in range(10)]
    ds = ocr_dataset(ray.data.from_items(rows), config=AppConfig(max_batch=2, decoder_queue=2),
                     stages=Stages(encoder_batch=1), max_tokens=60, mode="tiny")
    got, killed = [], []
    for row in ds.iter_rows():
        got.append(row)
        if not killed:  # the first page out: most of the others still queued or decoding in it
            killed = decode_actor_pids()
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
    assert len(killed) == 1
    assert sorted(row["source"] for row in got) == sorted(row["path"] for row in rows)
    assert all(row["error"] is None and row["completion_tokens"] == 60 for row in got)
