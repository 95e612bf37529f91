"""The Router's cache of encoded images: duplicate pages skip preprocessing and the GPU.

Keyed by a hash of the image's content (its bytes as sent, or a PIL image's pixels) and the view
options that change its tokens (mode, max_crops); holds the assembled sequence and the image's
original size. Capped in bytes, least recently used out. Retries, resumed corpus runs and
repeated pages (cover sheets, letterheads) then cost no encoder time.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict


def content_key(image, mode: str, max_crops: int) -> str | None:
    """A key for `image` (bytes, a path or a PIL image) with these options; None when the
    content cannot be read here (the request then goes the normal way and fails or not there)."""
    digest = hashlib.blake2b(f"{mode}:{max_crops}:".encode(), digest_size=20)
    if isinstance(image, (bytes, bytearray, memoryview)):
        digest.update(b"bytes:")
        digest.update(image)
    elif isinstance(image, (str, os.PathLike)):
        try:
            with open(image, "rb") as f:
                digest.update(b"bytes:")
                digest.update(f.read())
        except OSError:
            return None
    elif hasattr(image, "tobytes") and hasattr(image, "mode") and hasattr(image, "size"):
        digest.update(f"pixels:{image.mode}:{image.size}:".encode())  # a PIL image
        digest.update(image.tobytes())
    else:
        return None
    return digest.hexdigest()


class EncodedCache:
    """key -> (value, nbytes), at most `max_bytes` in all; thread-safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = self.evictions = 0

    def get(self, key: str | None):
        with self._lock:
            if key is None or key not in self._items:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key][0]

    def put(self, key: str | None, value, nbytes: int) -> None:
        if key is None or nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self.bytes -= self._items.pop(key)[1]
            self._items[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped
                self.evictions += 1

    def stats(self) -> dict:
        with self._lock:
            lookups = self.hits + self.misses
            return {"entries": len(self._items), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "hit_rate": self.hits / lookups if lookups else None}
