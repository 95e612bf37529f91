"""`deepseek-ocr serve` of a config, as the README starts one (`serve run` in the app's start-up
environment): a config naming `deployments.app:app`, the README's first command, with the
workers' preload on a thread (`DEEPSEEK_OCR_BACKGROUND_PRELOAD=1`; its default, the preload
before they take work, is what the e2e bench's smoke run starts, tests/test_bench_scripts.py).
While it starts, every probe is answered at once; once up, it serves its model; Ctrl-C
mid-generation shuts it down cleanly and soon. (One start, its tests in order: a start costs 2
cores 20-40 s; an app of two models, tests/test_models.py.)"""
import base64
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
from PIL import Image

from deployments import STARTUP_ENVIRONMENT
from tests.helpers import free_port

requests = pytest.importorskip("requests")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOPS_WITHIN_S = 20  # measured ~8 s on 2 cores (Serve's own teardown ~4 of them); ~28 s before


def serve_run(tmp_path, application: str, env_set: dict) -> tuple:
    """`deepseek-ocr serve` of a config holding `application` (YAML of one application, beside
    a free port) as a user runs it, with `env_set` added to the environment: (the process, its
    URL, its log's path). An import path always takes port 8000, which another copy of the
    suite may hold."""
    serve_cli = [os.path.join(os.path.dirname(sys.executable), "deepseek-ocr"), "serve"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | env_set
    port = free_port()
    config = tmp_path / "app.yaml"
    config.write_text(f"http_options: {{host: 127.0.0.1, port: {port}}}\napplications:\n{application}")
    log = tmp_path / "serve.log"
    # SIGINT back to its default: a test runner started in the background ignores it, and its
    # children would inherit that, so Ctrl-C would do nothing.
    proc = subprocess.Popen([*serve_cli, str(config)], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, f"http://127.0.0.1:{port}", log


def interrupt(proc) -> tuple[object, float]:
    """Ctrl-C: Serve shuts the app down and exits; (its exit code, seconds it took)."""
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = "killed"
    return code, time.monotonic() - interrupted


def page() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (1400, 700), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


@dataclass
class Start:
    """A way of starting the app: the application's YAML, the environment added, and the models
    it serves (id -> the page's image tokens, from the page)."""
    application: str
    env_set: dict
    models: dict = field(default_factory=dict)


STARTS = {
    "one-model": Start("- {name: default, route_prefix: /, import_path: deployments.app:app}\n",
                       {"DEEPSEEK_OCR_BACKGROUND_PRELOAD": "1"}, {"tiny-random": lambda png: 483}),
}


@dataclass
class Started:
    start: Start
    proc: subprocess.Popen
    url: str
    log: object
    answers: list  # the probes while it started: (path, status, body's "status", seconds it took)
    startup_s: float  # from the port accepting to /ready's 200


def probe_until_ready(proc, url: str, log, limit_s: float = 300) -> tuple[list, float]:
    """From the moment the port accepts, /health and /ready in turn every 0.1 s until /ready
    answers 200: (every answer, seconds from accepting to ready)."""
    port = int(url.rsplit(":", 1)[1])
    answers = []
    deadline = time.monotonic() + limit_s
    while True:  # until the port accepts
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    accepting = time.monotonic()
    while not answers or answers[-1][:2] != ("/ready", 200):
        assert proc.poll() is None and time.monotonic() < deadline, (answers[-6:], log.read_text()[-3000:])
        for path in ("/health", "/ready"):
            sent = time.monotonic()
            response = requests.get(url + path, timeout=30)
            said = (response.json()["status"] if response.headers.get("content-type") ==
                    "application/json" else response.text[:40])  # Serve's own text: "not found"
            answers.append((path, response.status_code, said, time.monotonic() - sent))
        time.sleep(0.1)
    return answers, time.monotonic() - accepting


@pytest.fixture(scope="module", params=list(STARTS))
def started(request, tmp_path_factory):
    """The app started the param's way, its start-up probed; Ctrl-C'd after the module's tests
    (by the last of them, which times it)."""
    start = STARTS[request.param]
    proc, url, log = serve_run(tmp_path_factory.mktemp(request.param), start.application, start.env_set)
    try:
        answers, startup_s = probe_until_ready(proc, url, log)
        yield Started(start, proc, url, log, answers, startup_s)
    finally:
        if proc.poll() is None:
            interrupt(proc)


@pytest.mark.slow
def test_health_and_ready_answer_at_once_while_the_app_starts(started):
    """From the moment the port accepts, every probe is answered at once, not held until the
    app is up: 503 "starting" (Serve's proxy, deployments/probes.py) until a Router is up, then
    the Router's own answers, until /ready says ready. "At once": each in under a fifth of the
    start-up (a held probe waits for most of it; ~0.1 s each on 2 idle cores, a start-up of
    15-20 s there; no fixed bound, since a second worker of the suite shares the cores)."""
    answers, log = started.answers, started.log.read_text()
    held = [a for a in answers if a[3] > started.startup_s / 5]
    assert not held, (held, started.startup_s)
    # Held probe calls finish in the proxy: none cancelled, so no RequestCancelledError tracebacks
    # in the log (one per probe of the start-up when they were cancelled).
    assert "RequestCancelledError" not in log
    assert "preloading" not in log  # no preload failed (deployments/preload.py)
    statuses = {a[:3] for a in answers}
    assert ("/health", 503, "starting") in statuses and ("/ready", 503, "starting") in statuses
    assert statuses <= {("/health", 503, "starting"), ("/ready", 503, "starting"),
                        ("/health", 200, "ok"), ("/ready", 503, "not ready"), ("/ready", 200, "ready")}


@pytest.mark.slow
def test_the_started_app_serves_its_models(started):
    """/v1/models lists the config's models in order; a page to each is read with its own
    tiling (its image tokens); the tiny random model says so."""
    url, models = started.url, started.start.models
    assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]] == list(models)
    png = page()
    for model, tokens in models.items():
        response = requests.post(f"{url}/v1/ocr", timeout=300, json={
            "image": base64.b64encode(png).decode(), "max_tokens": 4, "model": model})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == model and body["usage"]["image_tokens"] == tokens(png)
        assert body["usage"]["completion_tokens"] == 4 and "RANDOM" in body["warning"]


@pytest.mark.slow
def test_ctrl_c_mid_generation_stops_the_app_cleanly_and_soon(started):
    """Ctrl-C while a generation of ~30 s on 2 cores runs: exit code 0, within STOPS_WITHIN_S
    (the replicas' short graceful shutdown, deployments/config.py SHUTDOWN: seconds, not the ~30 s
    Serve's default grace took with a generation running). The module's last test: it stops
    the app."""
    long = {"image": base64.b64encode(page()).decode(), "max_tokens": 4000, "ngram": {"enabled": False},
            "model": next(iter(started.start.models))}

    def generate():
        try:
            requests.post(f"{started.url}/v1/ocr", json=long, timeout=300)
        except requests.RequestException:  # cut off by the shutdown: expected
            pass
    threading.Thread(target=generate, daemon=True).start()
    time.sleep(3)
    code, stopped_after = interrupt(started.proc)
    assert code == 0, (code, started.log.read_text()[-3000:])
    assert stopped_after < STOPS_WITHIN_S, f"Ctrl-C took {stopped_after:.1f} s"


@pytest.mark.parametrize("background_preload", ["0", "1"])
def test_preload_imports_the_deployments_or_their_ray_free_bulk_on_a_thread(background_preload):
    """A worker's preload (deployments/preload.py): every deployment module before it returns;
    or with DEEPSEEK_OCR_BACKGROUND_PRELOAD=1 torch and the model packages on a thread, and
    none of Ray's modules (which the main thread may be importing). The deployments import
    after it either way (a replica's constructor racing the thread: the Serve test with it)."""
    script = """
import sys
import deployments.preload as preload
if preload.thread is None:
    assert all(m in sys.modules for m in preload.DEPLOYMENT_MODULES)
else:
    preload.thread.join()
    assert all(m in sys.modules for m in preload.RAY_FREE_MODULES)
    assert not [m for m in sys.modules if m == "ray" or m.startswith("ray.")]
import deployments.router, deployments.decoder_server, deployments.encoders
print("imported", preload.thread is not None)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env=env | {"DEEPSEEK_OCR_BACKGROUND_PRELOAD": background_preload})
    assert done.returncode == 0 and "preloading" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.split() == ["imported", str(background_preload == "1")]


def test_the_app_sets_the_start_up_environment_before_ray_starts():
    """`serve run deployments.app:...` (the README's command) imports the app before it starts
    its local cluster, whose proxy and workers inherit these."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    printed = subprocess.run([sys.executable, "-c", "import os, deployments.app; print(*(os.environ[k] "
                              f"for k in {sorted(STARTUP_ENVIRONMENT)!r}))"], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True).stdout.split()
    assert printed == [STARTUP_ENVIRONMENT[k] for k in sorted(STARTUP_ENVIRONMENT)]


def test_serve_run_of_a_missing_checkpoint_fails_with_one_clear_message(tmp_path):
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([serve_cli, "run", "deployments.app:build", f"checkpoint={tmp_path}/nope"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert "has no config.json" in done.stdout + done.stderr
