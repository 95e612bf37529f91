"""Admission sized from what the decoder holds (issue 38): the gate alone, a Decoder replica in
process, and the app with the defaults over two Routers on a real Serve cluster."""
import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray.serve.exceptions import BackPressureError

from decoder import SamplingParams
from deployments.config import AppConfig
from scheduler import DecoderAdmission
from tests.conftest import routers_over_the_shared_tiers
from tests.helpers import png

requests = pytest.importorskip("requests")


def test_the_gate_takes_a_full_batch_plus_a_bounded_queue():
    gate = DecoderAdmission(max_batch=2, queue_limit=2)
    assert all(gate.take() for _ in range(4))  # a burst: a batch's worth and a queue's
    assert not gate.take() and gate.refused == 1 and gate.held == {"interactive": 4, "batch": 0}
    gate.release()
    assert gate.take() and not gate.take()
    # batch jobs' lines are counted apart: a full batch class leaves interactive places alone
    assert all(gate.take("batch") for _ in range(4)) and not gate.take("batch")
    gate.release("interactive")
    assert gate.take("interactive") and gate.held == {"interactive": 4, "batch": 4}
    assert DecoderAdmission(max_batch=1, queue_limit=0).take()
    with pytest.raises(ValueError, match="queue_limit"):
        DecoderAdmission(1, -1)


def test_the_router_s_default_limit_is_what_the_decoders_hold():
    assert AppConfig().inflight_limit() == 256 + 256
    assert AppConfig(max_batch=8, decoder_queue=4).inflight_limit() == 12
    assert AppConfig(max_inflight_requests=3).inflight_limit() == 3
    two = AppConfig(models=[{"name": "a", "max_batch": 8}, {"name": "b", "decoder_queue": 0}])
    assert two.inflight_limit() == (8 + 256) + (256 + 0)


def test_a_full_decoder_refuses_at_once_and_takes_again_when_room_frees():
    """A batch of one and a queue of one: a third request is refused before any work, with
    Serve's BackPressureError (the Router's 503 with Retry-After); the two complete."""
    from deployments.decoder_server import DecoderServer
    server = DecoderServer.func_or_class(AppConfig(max_batch=1, decoder_queue=1, max_len=2048))
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def scenario():
        first = asyncio.ensure_future(server.generate([0] * 8, [], params))
        second = asyncio.ensure_future(server.generate([0] * 8, [], params))
        await asyncio.sleep(0)  # both taken: one decodes, one waits for the batch's one slot
        with pytest.raises(BackPressureError):
            await server.generate([0] * 8, [], params)
        stream = server.generate_stream([0] * 8, [], params)
        with pytest.raises(BackPressureError):
            await stream.__anext__()
        done = await asyncio.gather(first, second)
        assert [d["completion_tokens"] for d in done] == [200, 200]
        assert server.stats()["admission"] == {"held": {"interactive": 0, "batch": 0}, "capacity": 2, "refused": 2}
        return (await server.generate([0] * 8, [], params))["completion_tokens"]
    assert asyncio.run(scenario()) == 200


ROUTERS = 2  # more than one: each Router's own limit must take what the Decoder holds


@pytest.fixture(scope="module")
def routers(serve_app):
    """The app with its defaults (the tiny model, as the other Serve tests set it up) behind
    two Router replicas, on the test cluster: the Routers of an app of their own over the
    shared app's encoders and Decoder (its defaults: what the Routers' admission must match)."""
    from ray import serve
    yield routers_over_the_shared_tiers("admission", AppConfig(max_len=2048, max_images=8), routers=ROUTERS)
    serve.delete("admission")


def post_all(url: str, bodies: list[dict]) -> list:
    """Every body posted at once (a thread each): the responses."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: requests.post(f"{url}/v1/ocr", json=body, timeout=600), bodies))


@pytest.mark.slow
def test_256_requests_over_two_routers_are_all_taken_while_the_decoder_has_room(routers):
    """What the decoder holds (256 decoding + 256 waiting by default) is what the app takes:
    a per-Router limit of 64 (the old default) refused some, even over 4 Routers (Serve does not
    balance 256 requests evenly over them)."""
    body = {"image": base64.b64encode(png((64, 48))).decode(), "mode": "tiny", "max_tokens": 8, "ngram": {"enabled": False}}
    responses = post_all(routers, [body] * 256)
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * 256, {s: statuses.count(s) for s in set(statuses)}
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)


@pytest.fixture(scope="module")
def small_decoder(serve_app):
    """A Router and a Decoder that holds 2 decoding and 2 waiting, over the shared encoders."""
    from ray import serve
    config = AppConfig(max_len=2048, max_images=8, max_batch=2, decoder_queue=2)
    yield routers_over_the_shared_tiers("small-decoder", config, own_decoder=True)
    serve.delete("small-decoder")


@pytest.mark.slow
def test_past_what_the_decoder_holds_requests_are_refused_with_retry_after(small_decoder):
    body = {"image": base64.b64encode(png((64, 48))).decode(), "mode": "tiny", "max_tokens": 200, "ngram": {"enabled": False}}
    responses = post_all(small_decoder, [body] * 16)
    taken = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(taken) >= 4 and refused, [r.status_code for r in responses]
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["type"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in taken)
