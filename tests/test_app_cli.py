"""`serve run` of the app as a user runs it: start, POST an image, Ctrl-C mid-generation: it
shuts down cleanly and soon."""
import base64
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from PIL import Image

from tests.helpers import free_port

requests = pytest.importorskip("requests")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOPS_WITHIN_S = 20  # measured ~8 s on 2 cores (Serve's own teardown ~4 of them); ~28 s before


@pytest.mark.slow
def test_serve_run_subprocess(tmp_path):
    """`serve run` of the app (`deployments.app:app`, the README's command), through a config
    that names it and a free port (an import path always takes port 8000, which another copy
    of the suite may hold)."""
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    url = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "app.yaml"
    config.write_text(f"http_options: {{host: 127.0.0.1, port: {url.rsplit(':', 1)[1]}}}\n"
                      "applications:\n- {name: default, route_prefix: /, import_path: deployments.app:app}\n")
    log = open(tmp_path / "serve.log", "w")
    # SIGINT back to its default: a test runner started in the background ignores it, and its
    # children would inherit that, so Ctrl-C below would do nothing.
    proc = subprocess.Popen([serve_cli, "run", str(config)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()[-3000:]
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # not up yet
                pass
            time.sleep(2)
        else:
            pytest.fail("serve run did not come up in 300 s")
        buf = io.BytesIO()
        Image.new("RGB", (1400, 700), (10, 200, 30)).save(buf, "PNG")
        response = requests.post(f"{url}/v1/ocr", timeout=300, json={
            "image": base64.b64encode(buf.getvalue()).decode(), "max_tokens": 4})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["image_tokens"] == 483 and body["usage"]["completion_tokens"] == 4
        assert body["model"] == "tiny-random" and "RANDOM" in body["warning"]
        # A generation of ~30 s on 2 cores is running when Ctrl-C comes.
        long = {"image": base64.b64encode(buf.getvalue()).decode(), "max_tokens": 4000,
                "ngram": {"enabled": False}}

        def generate():
            try:
                requests.post(f"{url}/v1/ocr", json=long, timeout=300)
            except requests.RequestException:  # cut off by the shutdown: expected
                pass
        threading.Thread(target=generate, daemon=True).start()
        time.sleep(3)
    finally:
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C: Serve shuts the app down and exits
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = "killed"
        log.close()
    stopped_after = time.monotonic() - interrupted
    assert code == 0, (code, open(tmp_path / "serve.log").read()[-3000:])
    # The replicas' short graceful shutdown (deployments/config.py SHUTDOWN): seconds, not the
    # ~30 s Serve's default grace took with a generation running.
    assert stopped_after < STOPS_WITHIN_S, f"Ctrl-C took {stopped_after:.1f} s"


def test_serve_run_of_a_missing_checkpoint_fails_with_one_clear_message(tmp_path):
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([serve_cli, "run", "deployments.app:build", f"checkpoint={tmp_path}/nope"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert "has no config.json" in done.stdout + done.stderr
