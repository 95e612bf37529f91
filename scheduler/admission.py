"""A decoder replica's admission: a full batch, plus a bounded queue.

A decoder decodes up to `max_batch` sequences together; the rest wait. Admission is sized from
that, not from a per-Router constant: a replica holds at most `max_batch + queue_limit`
requests (decoding, waiting for a batch slot or KV pages, or arriving) and refuses more at once,
so a caller gets a 503 to retry instead of a queue without bound. Counted against `max_batch`,
not against the sequences running at the moment: a burst arriving together would otherwise be
refused before the engine has had a step to start it. Waiting requests keep their own time
limits (the Router cancels them).
"""
from __future__ import annotations


class DecoderAdmission:
    def __init__(self, max_batch: int, queue_limit: int):
        if max_batch < 1 or queue_limit < 0:
            raise ValueError(f"max_batch must be at least 1 and queue_limit at least 0, got "
                             f"{max_batch} and {queue_limit}")
        self.max_batch, self.queue_limit = max_batch, queue_limit
        self.held = 0  # requests taken and not yet released
        self.refused = 0

    @property
    def capacity(self) -> int:
        return self.max_batch + self.queue_limit

    def take(self) -> bool:
        """Whether a request is taken (then `release` it when it ends); False: the replica
        holds a full batch and a full queue."""
        if self.held >= self.capacity:
            self.refused += 1
            return False
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1
