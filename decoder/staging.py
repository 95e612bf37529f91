"""Small host lists (row indices, token ids, banned tokens) onto the device, each step, without
the host waiting and without a pinned allocation per copy.

`to_device(torch.tensor(values))` pins a fresh host tensor for every copy (the caching host
allocator hands out a block and records an event on it), which on an H100 inside the service's
Decoder took a quarter of the engine thread at 256 sequences once every row had n-gram bans to
write (docs/results.md). `StagedCopies` writes the values into one pinned ring allocated once and
copies that slice asynchronously; a slice is written again only a lap later, after waiting for
the copies that read it (an event each, passed long before: a lap is hundreds of steps).
DEEPSEEK_OCR_STAGED_COPIES=0: a pinned tensor per copy (`to_device`, the reference twin).
"""
from __future__ import annotations

from collections import deque

import torch

from common import switches


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without the host waiting: a host tensor goes through pinned memory
    (the caching host allocator keeps it until the copy has run)."""
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class StagedCopies:
    on = switches.on("DEEPSEEK_OCR_STAGED_COPIES")

    def __init__(self, device: torch.device, capacity: int = 1 << 20):
        self.device, self.capacity = torch.device(device), capacity
        self.cuda = self.device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.long, pin_memory=self.cuda)
        self.values = self.host.numpy()
        self.at, self.lap = 0, 0
        self.reading: deque = deque()  # (lap, start, event) of copies that may still read the ring

    def __call__(self, values: list[int]) -> torch.Tensor:
        """`values` (ints) as an int64 tensor on the device, the copy queued behind the work
        queued so far (what is launched after it may use it)."""
        n = len(values)
        if not self.on or n > self.capacity:
            return to_device(torch.tensor(values, dtype=torch.long), self.device)
        if self.at + n > self.capacity:
            # Copies of the lap before the one ending now (where it was not reached again): two
            # laps back once this one starts. Then `reading` is the last lap's copies, in ring
            # order, before this lap's, so its front is the next one a new slice may overlap.
            while self.reading and self.reading[0][0] < self.lap:
                self.reading.popleft()[2].synchronize()
            self.at, self.lap = 0, self.lap + 1
        start, end = self.at, self.at + n
        while self.reading and self.reading[0][0] < self.lap and self.reading[0][1] < end:
            self.reading.popleft()[2].synchronize()  # a lap back: done long ago in practice
        self.values[start:end] = values
        self.at = end
        if not self.cuda:
            return self.host[start:end].clone()
        copy = self.host[start:end].to(self.device, non_blocking=True)
        self.reading.append((self.lap, start, torch.cuda.current_stream(self.device).record_event()))
        return copy
