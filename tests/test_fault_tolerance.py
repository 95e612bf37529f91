"""Replica loss and faults: the router retries encoder calls, an encoder replica with a broken
CUDA context fails its health check (no Ray cluster needed)."""
import asyncio

import pytest

pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402

from deployments.router import call_with_retry  # noqa: E402


class FlakyMethod:
    """Stands in for `handle.encode`: fails `failures` times, then answers."""

    def __init__(self, failures, error=RayActorError):
        self.failures, self.error, self.calls = failures, error, 0

    def remote(self, *args):
        self.calls += 1

        async def answer():
            if self.calls <= self.failures:
                raise self.error()
            return args
        return answer()


def test_retries_replica_loss_then_succeeds():
    method = FlakyMethod(failures=2)
    assert asyncio.run(call_with_retry(method, "pixels", backoff_s=0)) == ("pixels",)
    assert method.calls == 3


def test_gives_up_after_the_last_attempt():
    method = FlakyMethod(failures=5)
    with pytest.raises(RayActorError):
        asyncio.run(call_with_retry(method, "pixels", attempts=3, backoff_s=0))
    assert method.calls == 3


def test_other_errors_are_not_retried():
    method = FlakyMethod(failures=1, error=lambda: ValueError("bad image"))
    with pytest.raises(ValueError, match="bad image"):
        asyncio.run(call_with_retry(method, "pixels", backoff_s=0))
    assert method.calls == 1


def test_encoder_replica_reports_a_cuda_fault_to_its_health_check(monkeypatch):
    import numpy as np

    from deployments.config import AppConfig
    from deployments.encoders import PathEncoder, Request
    encoder = PathEncoder.func_or_class("global", AppConfig())
    asyncio.run(encoder.check_health())  # healthy
    view = Request((np.zeros((3, 1024, 1024), np.uint8), "uint8"))  # a global view, as sent
    decoded = Request((np.zeros((1, 700, 500), np.uint8), "uint8"), ("global", "gundam", (1, 2)))
    assert [r[0].shape[0] for r in encoder._run_batch([view, decoded])] == [272, 272]  # a real batch runs

    def cuda_fault(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(encoder.engine, "run", cuda_fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        encoder._run_batch([view])  # the body of the @serve.batch handler
    with pytest.raises(RuntimeError, match="unusable after"):
        asyncio.run(encoder.check_health())
