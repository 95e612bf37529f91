"""Operating the app: readiness, health under load, admission control, time limits, dropped
streams, API keys and metrics (tiny model, CPU, real Serve where it matters)."""
import asyncio
import base64
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

requests = pytest.importorskip("requests")
pytest.importorskip("ray")

from tests.conftest import METRICS_PORT, SERVE_APP, SERVE_URL, routers_over_the_shared_tiers  # noqa: E402
from tests.helpers import png  # noqa: E402

KEY = "test-key-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def page(size=(1191, 1684)) -> str:
    """A light grey page as base64."""
    return base64.b64encode(png(size, (240, 240, 240))).decode()


# --- replicas, without a cluster ------------------------------------------------------------------
def test_encoder_health_check_answers_while_a_batch_runs(monkeypatch):
    """The batch runs on the replica's worker thread; the event loop (health checks, arrivals)
    stays free. A batch running for minutes fails the check."""
    from deployments.config import AppConfig
    from deployments.encoders import PathEncoder
    replica = PathEncoder.func_or_class("global", AppConfig())
    started, release = threading.Event(), threading.Event()

    def slow_run(*args):
        started.set()
        release.wait(30)
        return []
    monkeypatch.setattr(replica.engine, "run", slow_run)

    async def scenario():
        batch = asyncio.get_running_loop().run_in_executor(replica.worker, replica._run_batch, [])
        await asyncio.to_thread(started.wait, 10)
        begin = time.perf_counter()
        await replica.check_health()  # answers at once while the worker is busy
        answered = time.perf_counter() - begin
        replica.busy_since -= 10 * 60  # as if this batch had been running for ten minutes
        with pytest.raises(RuntimeError, match="stuck"):
            await replica.check_health()
        release.set()
        await batch
        await replica.check_health()  # done: healthy again
        return answered
    assert asyncio.run(scenario()) < 0.5


def test_idle_health_checks_run_the_real_path(monkeypatch):
    """Now and then an idle replica's health check runs its path's code; a CUDA fault there
    fails it (and every check after it)."""
    from deployments.config import AppConfig
    from deployments.encoders import PathEncoder
    replica = PathEncoder.func_or_class("local", AppConfig())
    runs = []
    monkeypatch.setattr(replica.engine.local_path, "probe", lambda: runs.append(1))
    asyncio.run(replica.check_health())
    assert runs == []  # just probed by the constructor
    replica.probed -= 3600
    asyncio.run(replica.check_health())
    assert runs == [1]

    def fault():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(replica.engine.local_path, "probe", fault)
    replica.probed -= 3600
    with pytest.raises(RuntimeError, match="illegal memory access"):
        asyncio.run(replica.check_health())
    with pytest.raises(RuntimeError, match="unusable after"):
        asyncio.run(replica.check_health())


class NeverReady:
    """Stands in for a tier still loading: its `ready` call never answers."""

    class _Method:
        def remote(self):
            return asyncio.sleep(3600)

    ready = _Method()


def test_ready_answers_503_within_a_second_naming_tiers_that_are_loading():
    from starlette.requests import Request

    from deployments.config import AppConfig
    from deployments.placement import ModelTiers
    from deployments.router import Router
    cls = Router.func_or_class  # the ingress wrapper: its constructor is a coroutine
    router = cls.__new__(cls)
    request = Request({"type": "http", "method": "GET", "path": "/ready", "headers": []})

    async def ask():
        config = AppConfig()
        await router.__init__(ModelTiers.of(config, NeverReady(), NeverReady(), NeverReady()), config)
        start = time.perf_counter()
        return await router.ready(request), time.perf_counter() - start
    response, seconds = asyncio.run(ask())
    assert seconds < 1.5
    assert response.status_code == 503 and response.headers["retry-after"]
    assert json.loads(response.body)["not_ready"] == ["GlobalEncoder", "LocalEncoder", "Decoder"]


def test_full_downstream_queue_answers_503_json_with_retry_after():
    """A tier's queue at its limit (`max_queued_requests`) raises BackPressureError in the
    router; the client gets the same 503 refusal as for a full router, not an error."""
    from ray.serve.exceptions import BackPressureError
    from starlette.requests import Request

    from deployments.config import AppConfig
    from deployments.placement import ModelTiers
    from deployments.router import Router
    cls = Router.func_or_class
    router = cls.__new__(cls)
    body = json.dumps({"image": page((64, 64))}).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    request = Request({"type": "http", "method": "POST", "path": "/v1/ocr",
                       "headers": [(b"content-type", b"application/json")]}, receive)

    async def full_queue(images, options):
        raise BackPressureError(num_queued_requests=512, max_queued_requests=512)

    async def ask():
        config = AppConfig()
        await router.__init__(ModelTiers.of(config, NeverReady(), NeverReady(), NeverReady()), config)
        return await router._guard(request, full_queue)
    response = asyncio.run(ask())
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["type"] == "overloaded"


# --- the running app ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited(serve_app):
    """A second app on the same cluster: an API key, two requests in flight per router (its
    Router's settings: a Router over the shared app's tiers)."""
    from ray import serve

    from deployments.config import AppConfig
    yield routers_over_the_shared_tiers("limited", AppConfig(max_len=2048, max_images=8, api_key=KEY,
                                                             max_inflight_requests=2))
    serve.delete("limited")


def auth(key=KEY):
    return {"authorization": f"Bearer {key}"}


def test_api_key_guards_every_route_but_liveness(limited):
    body = {"image": page((300, 200)), "max_tokens": 2}
    for headers in ({}, auth("wrong-key-000")):
        response = requests.post(f"{limited}/v1/ocr", json=body, headers=headers, timeout=60)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"
    assert requests.get(f"{limited}/ready", timeout=60).status_code == 401
    for route in ("/v1/files", "/v1/batches", "/v1/batches/batch-x", "/v1/files/file-x/content"):
        assert requests.get(f"{limited}{route}", timeout=60).status_code == 401, route
    assert requests.post(f"{limited}/v1/batches", json={}, timeout=60).status_code == 401
    assert requests.get(f"{limited}/v1/batches", headers=auth(), timeout=60).status_code == 200
    assert requests.get(f"{limited}/health", timeout=60).status_code == 200
    response = requests.post(f"{limited}/v1/ocr", json=body, headers=auth(), timeout=300)
    assert response.status_code == 200, response.text


def test_ready_reports_every_tier(limited):
    response = requests.get(f"{limited}/ready", headers=auth(), timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready" and body["not_ready"] == []
    assert set(body["tiers"]) == {"GlobalEncoder", "LocalEncoder", "Decoder"}
    assert all(tier["ready"] for tier in body["tiers"].values())
    # where each tier's start-up went (the e2e bench records it beside its cold start)
    for tier in body["tiers"].values():
        assert tier["gpu_memory_gb"] is None  # no CUDA here (on a GPU: the allocator's GB and cap)
        phases = tier["startup_s"]
        assert phases["weights"] >= 0 and phases["graphs"] >= 0
        assert phases["cuda"] == 0.0  # no CUDA context on CPU (on a GPU: its creation, timed apart)
        # each phase rounded to 10 ms on its own
        assert phases["process"] + 0.02 >= phases["constructor"]
        assert phases["constructor"] >= phases["cuda"] + phases["weights"] + phases["graphs"] - 0.03
        # the weights' phase split: finding and opening the files, reading them, copying to the
        # device, building the module (each rounded to 10 ms)
        split = [phases[f"weights_{k}"] for k in ("open", "read", "to_device", "build")]
        assert min(split) >= 0 and sum(split) <= phases["weights"] + 0.03


def test_four_times_capacity_is_answered_or_refused_never_lost(limited):
    """8 clients against a capacity of 2, for a bounded number of rounds: every request gets
    200 or a 503 JSON refusal with Retry-After; none hangs; the app serves afterwards."""
    body = {"image": page(), "max_tokens": 24}

    def client(_):
        answers = []
        for _ in range(3):
            response = requests.post(f"{limited}/v1/ocr", json=body, headers=auth(), timeout=300)
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["type"] == "overloaded"
            else:
                assert response.status_code == 200, response.text
            answers.append(response.status_code)
        return answers

    with ThreadPoolExecutor(8) as pool:
        statuses = [s for answers in pool.map(client, range(8)) for s in answers]
    print(f"\n4x capacity: {statuses.count(200)} answered 200, {statuses.count(503)} refused 503")
    assert len(statuses) == 24 and set(statuses) <= {200, 503}
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
    response = requests.post(f"{limited}/v1/ocr", json=body, headers=auth(), timeout=300)
    assert response.status_code == 200


def decoder_stats(app: str) -> dict:
    from ray import serve
    return serve.get_deployment_handle("Decoder", app).stats.remote().result(timeout_s=60)


def decoder_running(app: str) -> int:
    return decoder_stats(app)["running"]


def wait_until_idle(app: str, seconds: float = 30) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if decoder_running(app) == 0:
            return True
        time.sleep(0.5)
    return False


# A generation of LONG tokens takes ~30 s on 2 CPU cores; freed within FREED_WITHIN_S of the
# time limit, it was aborted, not left to end by itself.
LONG = {"max_tokens": 2000, "ngram": {"enabled": False}}
FREED_WITHIN_S = 3.0


def assert_decoder_freed_soon(app: str) -> None:
    """Within FREED_WITHIN_S: no sequence running or waiting and no KV page held; then, a
    second later, still none (no queued work of the request started afterwards)."""
    deadline, stats = time.time() + FREED_WITHIN_S, None
    while time.time() < deadline:
        stats = decoder_stats(app)
        if stats["running"] == stats["waiting"] == stats["kv_cache_pages_in_use"] == 0:
            break
        time.sleep(0.1)
    assert stats["running"] == stats["waiting"] == stats["kv_cache_pages_in_use"] == 0, \
        f"the request's generation went on after its time limit: {stats}"
    time.sleep(1.0)
    stats = decoder_stats(app)
    assert stats["running"] == stats["waiting"] == 0, f"work of the request started later: {stats}"


def test_time_limit_answers_408_and_aborts_the_decode(serve_app):
    body = {"image": page((300, 200)), **LONG, "timeout_s": 1.5}
    response = requests.post(f"{SERVE_URL}/v1/ocr", json=body, timeout=120)
    assert response.status_code == 408, response.text
    assert "timeout_s" in response.json()["error"]["message"]
    assert_decoder_freed_soon(SERVE_APP)


def test_stream_out_of_time_sends_an_error_event_then_done(serve_app):
    body = {"image": page((300, 200)), **LONG, "stream": True, "timeout_s": 3}
    response = requests.post(f"{SERVE_URL}/v1/ocr", json=body, timeout=120, stream=True)
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "timeout"
    assert any("text" in json.loads(e) for e in events[:-2])  # it had begun
    assert_decoder_freed_soon(SERVE_APP)


def test_document_out_of_time_cancels_its_pages(serve_app):
    """A 6-page PDF whose pages each generate for ~30 s: at the time limit the pages being
    generated are aborted and those still queued never start."""
    from tests.pdfs import make_pdf
    document = base64.b64encode(make_pdf(6, size=(200, 300))).decode()
    body = {"document": document, **LONG, "timeout_s": 2, "dpi": 72}
    response = requests.post(f"{SERVE_URL}/v1/ocr", json=body, timeout=120)
    assert response.status_code == 408, response.text
    assert_decoder_freed_soon(SERVE_APP)


def test_total_ms_is_the_whole_request_and_holds_every_stage(serve_app):
    body = {"image": page((900, 700)), "max_tokens": 8}
    timings = requests.post(f"{SERVE_URL}/v1/ocr", json=body, timeout=300).json()["timings"]
    assert timings["total_ms"] >= timings["encoding_ms"] + timings["decode_ms"], timings
    stages = ("preprocess_ms", "encode_ms", "assemble_ms", "decode_ms", "prefill_ms", "generate_ms")
    assert all(0 <= timings[stage] <= timings["total_ms"] for stage in stages), timings


def test_dropped_stream_frees_its_decoder_slot(serve_app):
    body = {"image": page((300, 200)), "max_tokens": 2000, "stream": True, "ngram": {"enabled": False}}
    with requests.post(f"{SERVE_URL}/v1/ocr", json=body, timeout=120, stream=True) as response:
        assert response.status_code == 200
        events = response.iter_lines()
        seen = [next(events) for _ in range(6)]  # a few deltas (and blank separator lines)
        assert any(line.startswith(b"data: {") for line in seen)
        assert decoder_running(SERVE_APP) == 1
    assert wait_until_idle(SERVE_APP), "the dropped stream kept its slot"


# --- metrics -------------------------------------------------------------------------------------------
def scrape() -> str:
    return requests.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text


def test_metrics_are_exported_and_the_dashboard_plots_them(serve_app):
    """After real traffic (a page, a bad request), every series the Grafana dashboard queries is
    on Ray's metrics port, with the app's own values in it."""
    requests.post(f"{SERVE_URL}/v1/ocr", json={"image": page(), "max_tokens": 3}, timeout=300)
    requests.post(f"{SERVE_URL}/v1/ocr", json={"image": page(), "mode": "huge"}, timeout=60)
    with open(os.path.join(ROOT, "deployments", "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    queried = {re.sub(r"_(bucket|total)$", "", name)
               for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"ray_[a-z_]+", target["expr"])}
    assert len(queried) >= 12
    expected = [r'^ray_ocr_requests_total\{.*status="400".*\} [1-9]',
                r'^ray_ocr_tokens_total\{.*kind="image".*\} [1-9]',
                r'^ray_ocr_tokens_total\{.*model="tiny-random".*\} [1-9]',  # the model's name
                r'^ray_ocr_decoder_kv_cache_usage\{.*model="tiny-random".*\} ',
                r'^ray_ocr_decoder_generated_tokens_total\{.*model="tiny-random".*\} [1-9]',
                r'^ray_ocr_encoder_graph_batches_total\{.*result="miss".*\} [1-9]']  # CPU: eager
    deadline = time.time() + 90
    while True:  # custom metrics reach the export port every few seconds
        text = scrape()
        missing = {name for name in queried if not re.search(rf"^{name}(_bucket|_total)?{{", text, re.M)}
        absent = [pattern for pattern in expected if not re.search(pattern, text, re.M)]
        if not (missing or absent) or time.time() > deadline:
            break
        time.sleep(3)
    assert not missing, f"not exported: {sorted(missing)}"
    assert not absent, f"no values yet for {absent}"


# --- lost replicas (last: it replaces this module's replicas) --------------------------------------
@pytest.mark.slow
def test_killed_replicas_are_replaced_and_requests_complete(serve_app):
    """100 tiled pages at 8 in flight; the LocalEncoder's process is killed after 20 answers,
    the Decoder's after 60. The router retries calls that a lost replica dropped (a generation
    only when nothing was streamed yet): at least 99% complete; any other answer is a retryable
    503 JSON. Prints the completion rate and how long Serve took to replace each replica."""
    import signal

    from ray import serve
    body = {"image": page((1000, 500)), "max_tokens": 8}  # 2x1 crops: both encoders, then decoding
    done, kills, lock = [], {}, threading.Lock()

    def stats(name):
        return serve.get_deployment_handle(name, SERVE_APP).stats.remote().result(timeout_s=120)

    def kill(name):
        old = stats(name)
        os.kill(old["pid"], signal.SIGKILL)
        killed_at = time.time()
        while stats(name)["replica"] == old["replica"]:
            time.sleep(0.2)
        kills[name] = time.time() - killed_at

    def client(i):
        response = requests.post(f"{SERVE_URL}/v1/ocr", json=body, timeout=300)
        if response.status_code != 200:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "overloaded" and response.headers["retry-after"]
        with lock:
            done.append(response.status_code)
            count = len(done)
        if count in (20, 60):  # from this client's thread: the other 7 keep the load on
            kill("LocalEncoder" if count == 20 else "Decoder")
        return response.status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(client, range(100)))
    rate = statuses.count(200) / len(statuses)
    print(f"\ncompleted {rate:.0%} of {len(statuses)}; replaced in "
          + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in kills.items()))
    assert set(kills) == {"LocalEncoder", "Decoder"}
    assert rate >= 0.99, statuses
