"""What several test files make or check the same way (not a test file)."""
from __future__ import annotations

import io
import random
import socket

from PIL import Image

from bench.common import rel_err  # noqa: F401  (one error measure for tests and benchmarks)


def png(size=(64, 48), color=(10, 20, 30)) -> bytes:
    """A plain RGB PNG of `size` in `color`."""
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def free_port() -> int:
    """A TCP port nothing listens on now: two copies of the suite can run on one machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What Ray's wrapper of a replica's exception carries, and what a client must never see.
LEAKS = ("ray::", "pid=", "ip=", "actor_id", "\x1b[", "Traceback", "ServeReplica")


def assert_clean_error(response, status: int, words: str, param: str | None) -> dict:
    """`response` is the one error envelope with `status`, naming `param`, its message holding
    `words` and none of Ray's internals; returns the error."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    assert words in error["message"], error
    assert not any(leak in response.text for leak in LEAKS), response.text[:2000]
    return error


def truncated_image(fmt: str) -> bytes:
    """A noisy 1200x900 page in `fmt` (PNG or JPEG), cut to its first third: its header reads
    (size, orientation, grid) and its pixels do not, so it fails wherever it is decoded (an
    encoder replica, by default), not where the header is read."""
    noise = Image.frombytes("RGB", (300, 225), random.Random(1).randbytes(300 * 225 * 3))
    buffer = io.BytesIO()
    noise.resize((1200, 900)).save(buffer, fmt)
    whole = buffer.getvalue()
    return whole[:len(whole) // 3]
