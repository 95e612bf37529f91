"""Progress on stderr: one line redrawn in place on a terminal, a line every few seconds into a
log, and the final summary with every failure and its reason.

A PDF's page count is only known once the server has answered it; until then the total counts
the `/Type /Page` objects in its bytes (a guess: compressed object streams hide them) and shows
as `~N`.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

LOG_INTERVAL_S = 5.0
TERMINAL_INTERVAL_S = 0.2


@dataclass
class Outcome:
    """What one document attempt came to."""

    source: str
    status: str  # "done", "partial" (some pages failed) or "failed"
    pages_done: int = 0  # pages OCR'd in this run
    pages_failed: list[int] = field(default_factory=list)
    truncated: int = 0  # pages kept although they hit the token limit
    retried: int = 0  # pages generated again after a loop
    looped: int = 0  # pages whose every attempt looped (kept, as the server answered them)
    text_layer: int = 0  # pages answered with their PDF text layer after every attempt failed
    reason: str | None = None  # why it (or its pages) failed


class Progress:
    def __init__(self, documents: int, estimated_pages: int, skipped: int, stream=None,
                 log_interval_s: float = LOG_INTERVAL_S):
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty()
        self.interval_s = TERMINAL_INTERVAL_S if self.terminal else log_interval_s
        self.documents, self.skipped = documents, skipped
        self.pending_estimate = estimated_pages  # estimated pages of documents not answered yet
        self.outcomes: list[Outcome] = []
        self.start = time.monotonic()
        self._shown_at = 0.0
        self._shown = ""
        self._lock = threading.Lock()

    @property
    def pages_done(self) -> int:
        return sum(o.pages_done for o in self.outcomes)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != "done"]

    def finished(self, outcome: Outcome, estimate: int) -> None:
        with self._lock:
            self.outcomes.append(outcome)
            self.pending_estimate -= estimate
        self.tick()

    def note(self, message: str) -> None:
        """A line of its own (a retry), without breaking the progress line."""
        with self._lock:
            self._clear()
            print(message, file=self.stream, flush=True)
            if self.terminal and self._shown:
                self.stream.write(self._shown)
                self.stream.flush()

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._shown_at < self.interval_s:
                return
            self._shown_at = now
            line = self.line(now)
            if self.terminal:
                self._shown = "\r" + line + "\x1b[K"
                self.stream.write(self._shown)
            elif line != self._shown:
                self._shown = line
                self.stream.write(line + "\n")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.start, 1e-9)
        pages = self.pages_done
        failed_pages = sum(len(o.pages_failed) for o in self.outcomes)
        total = pages + failed_pages + self.pending_estimate
        approx = "~" if self.pending_estimate and len(self.outcomes) < self.documents else ""
        return (f"documents {len(self.outcomes)}/{self.documents}, pages {pages}/{approx}{total}, "
                f"{pages / elapsed:.2f} pages/s, {len(self.failures)} failed")

    def summary(self) -> list[str]:
        """`N documents (M pages) in T s: P pages/s; F failed`, the extras, then each failure."""
        elapsed = time.monotonic() - self.start
        pages = self.pages_done
        line = (f"{len(self.outcomes)} documents ({pages} pages) in {elapsed:.1f} s: "
                f"{pages / max(elapsed, 1e-9):.2f} pages/s; {len(self.failures)} failed")
        truncated = sum(o.truncated for o in self.outcomes)
        if truncated:
            line += f"; {_count(truncated, 'page')} truncated (hit the token limit, kept)"
        for count, what in ((sum(o.retried for o in self.outcomes), "retried after a loop"),
                            (sum(o.looped for o in self.outcomes), "looped on every attempt (kept)"),
                            (sum(o.text_layer for o in self.outcomes), "answered with their text layer")):
            if count:
                line += f"; {_count(count, 'page')} {what}"
        if self.skipped:
            line += f"; {self.skipped} skipped (done before)"
        lines = [line]
        for outcome in self.failures:
            if outcome.status == "partial":
                listed = ", ".join(str(i) for i in outcome.pages_failed)
                noun = "pages" if len(outcome.pages_failed) > 1 else "page"
                lines.append(f"  {outcome.source}: {noun} {listed} failed: {outcome.reason}")
            else:
                lines.append(f"  {outcome.source}: {outcome.reason}")
        return lines

    def finish(self) -> None:
        with self._lock:
            self._clear()
            for line in self.summary():
                print(line, file=self.stream)
            self.stream.flush()

    def _clear(self) -> None:
        if self.terminal and self._shown:
            self.stream.write("\r\x1b[K")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
