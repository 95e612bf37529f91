"""A run: decide what each input needs (`plan`), then OCR documents on N threads (`run_jobs`).

One document, top to bottom (`process`):
  1. read it and build the request: the whole document, or only a partial document's failed
     pages (`page_range` of their indices);
  2. `POST /v1/ocr` (corpus/client.py retries what is transient);
  3. merge the answered pages into the stored ones, by page index;
  4. write the figure crops, the chosen formats and the per-page state, each atomically;
  5. append the manifest line last: a document killed before it is simply done again.
A document the server refuses (a corrupt PDF: 400) or that keeps failing is recorded failed and
the run goes on; only usage errors (a refused key, an option the server rejects) stop it.
"""
from __future__ import annotations

import base64
import hashlib
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .client import Client, InputRejected, RequestFailed
from .errors import UsageError
from .inputs import Input
from .manifest import Manifest, StateStore, document_key
from .outputs import FORMATS, error_text, missing_outputs, take_crops, write_document
from .progress import Outcome, Progress

SERVER_MAX_TIMEOUT_S = 3600  # the app's largest timeout_s
_PAGE_RANGE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")  # a page object, not the /Pages tree


@dataclass(frozen=True)
class RunOptions:
    page_range: str | None = None  # 0-based, "0,5-10" (marker's syntax)
    dpi: int | None = None
    preset: str | None = None
    max_tokens: int | None = None
    formats: frozenset[str] = frozenset(FORMATS)
    force: bool = False
    # How long the server may work on one document (its own default, 600 s, would cut a long PDF
    # short with a 408 while this client still waits); the server's limit is 3,600.
    timeout_s: float | None = None
    model: str | None = None  # of the server's models (GET /v1/models); none: its default

    def keyed(self) -> dict:
        """The options that change the server's answer (the manifest key hashes them; a model
        only when named, so manifests written before models could be named keep their keys)."""
        return {"page_range": self.page_range, "dpi": self.dpi, "preset": self.preset,
                "max_tokens": self.max_tokens, **({"model": self.model} if self.model else {})}


@dataclass
class Job:
    input: Input
    sha256: str
    key: str
    estimated_pages: int  # for the progress total until the server answers
    pages: list[int] | None = None  # only these pages: the failed ones of a partial document
    previous: dict | None = None  # the stored state the answer is merged into


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    unreadable: list[Outcome] = field(default_factory=list)
    skipped: int = 0


def parse_page_range(text: str) -> set[int]:
    """`"0,5-10"` -> {0, 5, ..., 10}; ValueError names what is wrong."""
    compact = text.replace(" ", "")
    if not _PAGE_RANGE.match(compact):
        raise ValueError(f"page range {text!r} is not like 0,5-10 (0-based page numbers)")
    pages = set()
    for part in compact.split(","):
        first, _, last = part.partition("-")
        if last and int(last) < int(first):
            raise ValueError(f"page range {text!r}: {part} runs backwards")
        pages.update(range(int(first), int(last or first) + 1))
    return pages


def format_page_range(indices: list[int]) -> str:
    """[1, 3, 4, 5, 9] -> "1,3-5,9"."""
    runs: list[list[int]] = []
    for index in sorted(set(indices)):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def estimate_pages(kind: str, data: bytes, page_range: str | None) -> int:
    if kind == "image":
        return 1
    count = len(_PDF_PAGE.findall(data))
    if page_range:
        count = len([i for i in parse_page_range(page_range) if i < count]) if count else 0
    return max(count, 1)


def plan(inputs: list[Input], manifest: Manifest, store: StateStore, options: RunOptions,
         out_dir: str) -> Plan:
    """What each input needs: nothing (recorded done), its failed pages, or everything."""
    result = Plan()
    for item in inputs:
        try:
            with open(item.path, "rb") as f:
                data = f.read()
        except OSError as e:
            result.unreadable.append(Outcome(item.path, "failed", reason=f"cannot read: {e.strerror or e}"))
            continue
        sha256 = hashlib.sha256(data).hexdigest()
        key = document_key(sha256, item.kind, options.keyed())
        record = None if options.force else manifest.latest(key, item.output)
        state = None if options.force else store.load(item.output, key)
        if record and record.get("status") == "done" and _outputs_present(item, state, options, out_dir):
            result.skipped += 1
            continue
        failed = [p["index"] for p in state["pages"] if p.get("error")] if state else []
        if record and record.get("status") == "partial" and failed:
            result.jobs.append(Job(item, sha256, key, len(failed), pages=failed, previous=state))
        else:
            result.jobs.append(Job(item, sha256, key, estimate_pages(item.kind, data, options.page_range)))
    return result


def _outputs_present(item: Input, state: dict | None, options: RunOptions, out_dir: str) -> bool:
    """True when every chosen format exists, writing missing ones from the stored state (a
    rerun that adds `--format json` asks the server nothing)."""
    if not missing_outputs(out_dir, item.output, options.formats):
        return True
    if state is None:
        return False
    write_document(out_dir, item.output, state, [], options.formats)
    return True


def request_body(job: Job, data: bytes, options: RunOptions) -> dict:
    """The `/v1/ocr` JSON body: blocks with crops, so figures can be written as files."""
    encoded = base64.b64encode(data).decode("ascii")
    if job.input.kind == "document":
        body = {"document": encoded}
        page_range = format_page_range(job.pages) if job.pages is not None else options.page_range
        if page_range:
            body["page_range"] = page_range
        if options.dpi is not None:
            body["dpi"] = options.dpi
    else:
        body = {"image": encoded}
    if options.preset:
        body["prompt_preset"] = options.preset
    if options.model:
        body["model"] = options.model
    body["output_format"] = "blocks"
    body["return_crops"] = True
    if options.max_tokens is not None:
        body["max_tokens"] = options.max_tokens
    if options.timeout_s is not None:
        body["timeout_s"] = min(options.timeout_s, SERVER_MAX_TIMEOUT_S)
    return body


def answered_pages(kind: str, response: dict) -> list[dict]:
    """The response's pages; an image's answer is a one-page document (page 0)."""
    if kind == "image":
        return [{"index": 0, "text": response.get("text"), "markdown": response.get("markdown"),
                 "finish_reason": response.get("finish_reason"), "usage": response.get("usage"),
                 "width": response.get("width"), "height": response.get("height"),
                 "blocks": response.get("blocks"), "error": response.get("error")}]
    pages = response.get("pages")
    if not isinstance(pages, list):
        raise ValueError("the response has no list of pages")
    failed = set(response.get("failed_pages") or [])
    for page in pages:  # a page listed in failed_pages without an error still failed
        if page["index"] in failed and not page.get("error"):
            page["error"] = {"type": "failed", "message": "listed in failed_pages"}
    return pages


class Worker:
    """Processes jobs: the request, the merge, the files, the manifest line."""

    def __init__(self, client: Client, manifest: Manifest, store: StateStore,
                 options: RunOptions, out_dir: str):
        self.client, self.manifest, self.store = client, manifest, store
        self.options, self.out_dir = options, out_dir

    def process(self, job: Job) -> Outcome:
        source = job.input.path
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as e:  # gone since the plan: not recorded, so a rerun tries again
            return Outcome(source, "failed", reason=f"cannot read: {e.strerror or e}")
        try:
            response = self.client.ocr(request_body(job, data, self.options), label=source)
        except (InputRejected, RequestFailed) as e:
            return self._record_failure(job, str(e))
        try:
            return self._finish(job, response)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return self._record_failure(job, f"unexpected response: {type(e).__name__}: {e}")

    def _finish(self, job: Job, response: dict) -> Outcome:
        name, crops, answered = job.input.name, [], []
        for page in answered_pages(job.input.kind, response):
            page, page_crops = take_crops(page, name)
            answered.append(page)
            crops += page_crops
        merged = {p["index"]: p for p in (job.previous or {}).get("pages", [])}
        merged.update((p["index"], p) for p in answered)
        pages = [merged[i] for i in sorted(merged)]
        state = {"key": job.key, "source": job.input.path, "sha256": job.sha256,
                 "model": response.get("model") or (job.previous or {}).get("model"),
                 "options": self.options.keyed(), "pages": pages}
        write_document(self.out_dir, job.input.output, state, crops, self.options.formats)
        self.store.save(job.input.output, state)
        failed = [p for p in pages if p.get("error")]
        status = "done" if not failed else "partial" if len(failed) < len(pages) else "failed"
        truncated = [p["index"] for p in answered if p.get("finish_reason") == "length"]
        # Loops (the server's repetition guard): pages retried, still looping, or answered with
        # their PDF's text layer.
        retried = [p["index"] for p in answered if len((p.get("usage") or {}).get("attempts") or ()) > 1]
        text_layer = [p["index"] for p in answered if p.get("source") == "text_layer"]
        looped = [p["index"] for p in answered if p.get("finish_reason") == "repetition" and p["index"] not in text_layer]
        reason = error_text(failed[0]["error"]) if failed else None
        self.manifest.append(self._record(job, status, reason, pages=len(pages), model=state["model"],
                                          failed_pages=[p["index"] for p in failed],
                                          truncated_pages=truncated, retried_pages=retried,
                                          looped_pages=looped, text_layer_pages=text_layer))
        return Outcome(job.input.path, status, pages_done=sum(not p.get("error") for p in answered),
                       pages_failed=[p["index"] for p in failed], truncated=len(truncated),
                       retried=len(retried), looped=len(looped), text_layer=len(text_layer), reason=reason)

    def _record_failure(self, job: Job, reason: str) -> Outcome:
        self.manifest.append(self._record(job, "failed", reason))
        return Outcome(job.input.path, "failed", reason=reason)

    def _record(self, job: Job, status: str, error: str | None, **extra) -> dict:
        return {"key": job.key, "output": job.input.output, "source": job.input.path,
                "sha256": job.sha256, "options": self.options.keyed(), "status": status,
                "error": error, **extra,
                "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def run_jobs(jobs: list[Job], process: Callable[[Job], Outcome], concurrency: int,
             progress: Progress, stop: threading.Event) -> None:
    """`concurrency` documents in flight on daemon threads (a stopped run does not wait for
    requests in flight); a usage error from any of them stops the run and is raised here."""
    todo: queue.Queue[Job] = queue.Queue()
    for job in jobs:
        todo.put(job)
    done: queue.Queue[tuple[Job, Outcome | BaseException]] = queue.Queue()

    def work():
        while not stop.is_set():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((job, process(job)))
            except UsageError as e:
                done.put((job, e))
                return
            except Exception as e:  # noqa: BLE001 - a bug or a full disk fails this document only
                done.put((job, Outcome(job.input.path, "failed", reason=f"{type(e).__name__}: {e}")))

    for _ in range(min(concurrency, len(jobs))):
        threading.Thread(target=work, daemon=True).start()
    for _ in jobs:
        while True:
            try:
                job, outcome = done.get(timeout=0.2)
                break
            except queue.Empty:
                progress.tick()
        if isinstance(outcome, BaseException):
            stop.set()
            raise outcome
        progress.finished(outcome, job.estimated_pages)

