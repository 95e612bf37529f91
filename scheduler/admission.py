"""A decoder replica's admission: every sequence it can decode now, plus a bounded queue.

A decoder decodes up to `max_batch` sequences together, fewer when the KV cache's pages run out;
the rest wait. Admission is sized from that, not from a per-Router constant: a replica takes a
request while fewer than `queue_limit` of those it holds are waiting (for a batch slot or for
KV pages), and refuses it at once otherwise, so a caller gets a 503 to retry instead of a queue
without bound. Waiting requests keep their own time limits (the Router cancels them).
"""
from __future__ import annotations


class DecoderAdmission:
    def __init__(self, queue_limit: int):
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be at least 0, got {queue_limit}")
        self.queue_limit = queue_limit
        self.held = 0  # requests taken and not yet released: decoding, waiting, or being added
        self.refused = 0

    def waiting(self, running: int) -> int:
        """Requests held but not decoding (`running`: the sequences in the decode batch now)."""
        return max(self.held - running, 0)

    def take(self, running: int) -> bool:
        """Whether a request is taken (then `release` it when it ends); False: the queue is full."""
        if self.waiting(running) >= self.queue_limit:
            self.refused += 1
            return False
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1
