"""Replica loss and faults: the router retries encoder calls, an encoder replica with a broken
CUDA context fails its health check, and so does a Router with the encoder inside (no Ray
cluster needed)."""
import asyncio
import io

import pytest
import torch
from PIL import Image

pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402

from deployments.placement import call_with_retry  # noqa: E402


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


def cuda_fault(*args):
    """Stands in for the engine's run when the CUDA context has faulted."""
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_retries_replica_loss_then_succeeds():
    method = FlakyMethod(failures=2)
    assert asyncio.run(call_with_retry(method, "pixels", backoff_s=0)) == ("pixels",)
    assert method.calls == 3


def test_gives_up_after_the_last_attempt():
    method = FlakyMethod(failures=5)
    with pytest.raises(RayActorError):
        asyncio.run(call_with_retry(method, "pixels", attempts=3, backoff_s=0))
    assert method.calls == 3


class Response:
    """Stands in for a DeploymentResponse that never answers: awaitable, cancellable."""

    def __init__(self):
        self.cancelled = False

    def __await__(self):
        return asyncio.get_running_loop().create_future().__await__()  # never set

    def cancel(self):
        self.cancelled = True


def test_a_cancelled_caller_cancels_its_call():
    """The time limit cancels the task awaiting the call: the call itself (the replica's work)
    must be cancelled too, or the replica keeps working for nobody."""
    responses = []

    class Method:
        def remote(self, *args):
            responses.append(Response())
            return responses[-1]

    async def scenario():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call_with_retry(Method(), "pixels"), timeout=0.05)
    asyncio.run(scenario())
    assert [r.cancelled for r in responses] == [True]


def test_other_errors_are_not_retried():
    method = FlakyMethod(failures=1, error=lambda: ValueError("bad image"))
    with pytest.raises(ValueError, match="bad image"):
        asyncio.run(call_with_retry(method, "pixels", backoff_s=0))
    assert method.calls == 1


def test_encoder_replica_reports_a_cuda_fault_to_its_health_check(monkeypatch):
    from deployments.config import AppConfig
    from deployments.encoders import PathEncoder, QueuedImage
    from encoder import DecodedImage
    from encoder.preprocess import count_tokens
    encoder = PathEncoder.func_or_class("global", AppConfig())
    asyncio.run(encoder.check_health())  # healthy
    view = QueuedImage(torch.zeros(3, 1024, 1024, dtype=torch.uint8))  # a global view, as sent
    decoded = QueuedImage(DecodedImage(torch.zeros(1, 700, 500, dtype=torch.uint8), (1, 2),
                                       count_tokens((1, 2)), "gundam", (500, 700)))
    assert [r.shape[0] for r in encoder._run_batch([view, decoded])] == [272, 272]  # a real batch runs

    monkeypatch.setattr(encoder.engine, "run", cuda_fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        encoder._run_batch([view])  # the body of the @serve.batch handler
    with pytest.raises(RuntimeError, match="unusable after"):
        asyncio.run(encoder.check_health())


def test_router_with_the_encoder_inside_fails_its_health_check_with_the_encoder(monkeypatch):
    """encoder_in_router: the Router encodes through the encoder in its process, and its own
    health check is the encoder's, so a CUDA fault in a batch gets the Router (and with it the
    encoder) replaced."""
    from deployments.config import AppConfig
    from deployments.placement import ModelTiers
    from deployments.router import Router
    router_class = Router.func_or_class.__bases__[0]  # the class under Serve's ASGI wrapper
    config = AppConfig(encoder_in_router=True, encode_only=True, encoder_cache_mb=0)  # every call encodes
    router = router_class(ModelTiers.of(config, None, None, None), config)
    asyncio.run(router.check_health())  # healthy
    assert router.stats()["encoder"]["path"] == "both"

    page = io.BytesIO()
    Image.new("L", (900, 1300), 255).save(page, "PNG")

    async def encode_then_fault():  # one event loop, as in the replica
        (seq,) = await router.encode(page.getvalue())  # through the encoder in this process
        assert seq.shape[0] == 903  # 2x3 crops
        monkeypatch.setattr(router._pipeline(None).encoder.replica.engine, "run", cuda_fault)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await router.encode(page.getvalue())
    asyncio.run(encode_then_fault())
    with pytest.raises(RuntimeError, match="Encoder of both paths unusable after"):
        asyncio.run(router.check_health())


def test_a_stream_whose_replica_is_lost_ends_with_a_retryable_error_then_done():
    """A stream whose Decoder replica is lost mid-generation (its node went) cannot go on; it
    ends in-band with the retryable `overloaded` error (as the 503 of a request that meets a lost
    replica before it streams), then [DONE], and its generator is closed."""
    import json

    from deployments.http_io import event_stream
    closed = []

    async def deltas():
        try:
            yield {"text": "a", "finished": False}
            raise RayActorError()
        finally:
            closed.append(True)

    async def read():
        generator = deltas()
        return [chunk async for chunk in event_stream(generator, generator, limit=10).body_iterator]
    events = [chunk.removeprefix("data: ").strip() for chunk in asyncio.run(read())]
    assert json.loads(events[0])["text"] == "a"
    error = json.loads(events[1])["error"]
    assert error["type"] == "overloaded" and "retry" in error["message"]
    assert events[2:] == ["[DONE]"] and closed == [True]
