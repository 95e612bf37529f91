"""A decoder replica's admission: a full batch, plus a bounded queue.

A decoder decodes up to `max_batch` sequences together; the rest wait. Admission is sized from
that, not from a per-Router constant: a replica holds at most `max_batch + queue_limit`
requests (decoding, waiting for a batch slot or KV pages, or arriving) and refuses more at once,
so a caller gets a 503 to retry instead of a queue without bound. Counted against `max_batch`,
not against the sequences running at the moment: a burst arriving together would otherwise be
refused before the engine has had a step to start it. Waiting requests keep their own time
limits (the Router cancels them).

Batch work (batch jobs' lines, `priority` "batch") is counted apart, against a capacity of its
own: a running batch never takes an interactive request's place here, and the engine runs it
below interactive work (decoder/scheduling.py).
"""
from __future__ import annotations


class DecoderAdmission:
    def __init__(self, max_batch: int, queue_limit: int):
        if max_batch < 1 or queue_limit < 0:
            raise ValueError(f"max_batch must be at least 1 and queue_limit at least 0, got "
                             f"{max_batch} and {queue_limit}")
        self.max_batch, self.queue_limit = max_batch, queue_limit
        self.held = {"interactive": 0, "batch": 0}  # requests taken and not yet released, by class
        self.refused = 0

    @property
    def capacity(self) -> int:
        """What each class may hold."""
        return self.max_batch + self.queue_limit

    def take(self, priority: str = "interactive") -> bool:
        """Whether a request of that class is taken (then `release` it when it ends); False:
        the replica holds a full batch and a full queue of that class."""
        if self.held[priority] >= self.capacity:
            self.refused += 1
            return False
        self.held[priority] += 1
        return True

    def release(self, priority: str = "interactive") -> None:
        self.held[priority] -= 1
