"""The start-up probe middleware Serve's proxy runs (deployments/probes.py), on plain ASGI apps
standing in for the proxy's routing: a Router that answers, one not up yet, no route at all."""
import asyncio
import json

from deployments.probes import StartupProbes, proxy_middlewares


async def acall(app, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    """One request through `app`: (status, headers, body)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def call(app, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    return asyncio.run(acall(app, path, method))


def router(status=200, body=b'{"status": "ok"}', delay_s=0.0, log=None):
    """A Router replica answering JSON after `delay_s` (`log` records calls and cancellations)."""
    async def app(scope, receive, send):
        try:
            await asyncio.sleep(delay_s)
        except asyncio.CancelledError:
            log is not None and log.append("cancelled")
            raise
        log is not None and log.append(scope["path"])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


async def unrouted(scope, receive, send):
    """Serve's proxy before the app's route exists: a plain-text 404."""
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
    await send({"type": "http.response.body", "body": b"Path '/health' not found."})


def test_a_route_not_registered_yet_is_answered_starting():
    for path in ("/health", "/ready"):
        status, headers, body = call(StartupProbes(unrouted), path)
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["status"] == "starting"
        assert "not registered" in json.loads(body)["error"]["message"]


def test_a_held_probe_is_answered_within_the_limit_and_its_call_left_to_finish():
    """The held call is not cancelled (Serve's proxy would log a traceback for each); while it
    is held, further probes of its path are answered at once without another call; once the
    Router answers it, the middleware steps aside for that path."""
    log = []
    probes = StartupProbes(router(delay_s=0.3, log=log), answer_within_s=0.05)

    async def scenario():
        status, _, body = await acall(probes, "/ready")
        assert status == 503 and "no Router replica answered" in json.loads(body)["error"]["message"]
        status, _, body = await acall(probes, "/ready")  # at once: the first call is still held
        assert status == 503 and "has answered yet" in json.loads(body)["error"]["message"]
        assert log == [] and set(probes.held) == {"/ready"}
        await asyncio.sleep(0.5)  # the Router comes up and answers the held call
        assert log == ["/ready"] and probes.held == {} and probes.answered == {"/ready"}
        probes.answer_within_s = 0.01  # stepped aside: a slow answer now is the Router's
        return await acall(probes, "/ready")
    assert asyncio.run(scenario())[0] == 200
    assert log == ["/ready", "/ready"]


def test_a_held_call_answered_by_serve_s_404_is_tried_again():
    async def late_unrouted(scope, receive, send):
        await asyncio.sleep(0.1)
        await unrouted(scope, receive, send)
    probes = StartupProbes(late_unrouted, answer_within_s=0.01)

    async def scenario():
        assert (await acall(probes, "/health"))[0] == 503
        await asyncio.sleep(0.2)
        assert probes.held == {} and probes.answered == set()  # not a Router's answer
    asyncio.run(scenario())


def test_a_router_answer_passes_through_and_then_the_middleware_steps_aside():
    probes = StartupProbes(router(status=503, body=b'{"status": "not ready"}'))
    status, _, body = call(probes, "/ready")
    assert (status, json.loads(body)) == (503, {"status": "not ready"})  # the Router's own answer
    # Started: a slow answer later is the Router's (busy, not starting), waited for.
    probes.app = router(delay_s=0.2)
    probes.answer_within_s = 0.05
    assert call(probes, "/ready")[0] == 200
    # /health was never answered by a Router: still watched.
    assert call(probes, "/health")[0] == 503


def test_a_route_prefix_and_the_router_s_json_404_are_kept():
    status, _, body = call(StartupProbes(router()), "/ocr/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    status, _, _ = call(StartupProbes(router(status=404, body=b'{"error": {}}')), "/health")
    assert status == 404  # the Router's own JSON 404 is not Serve's "no route"


def test_other_requests_pass_untouched():
    log = []
    probes = StartupProbes(router(delay_s=0.1, log=log), answer_within_s=0.01)
    assert call(probes, "/v1/ocr", method="POST")[0] == 200
    assert call(probes, "/health", method="POST")[0] == 200
    assert call(probes, "/healthz")[0] == 200
    assert log == ["/v1/ocr", "/health", "/healthz"]


def test_the_proxy_callback_returns_starlette_middleware():
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    assert validate_http_proxy_callback_return(proxy_middlewares())[0].cls is StartupProbes
