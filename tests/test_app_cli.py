"""`serve run deployments.app:app` as a user runs it: start, POST an image, shut down cleanly."""
import base64
import io
import os
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

requests = pytest.importorskip("requests")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_run_subprocess(tmp_path):
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    log = open(tmp_path / "serve.log", "w")
    # SIGINT back to its default: a test runner started in the background ignores it, and its
    # children would inherit that, so Ctrl-C below would do nothing.
    proc = subprocess.Popen([serve_cli, "run", "deployments.app:app"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()[-3000:]
            try:
                if requests.get("http://127.0.0.1:8000/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # not up yet
                pass
            time.sleep(2)
        else:
            pytest.fail("serve run did not come up in 300 s")
        buf = io.BytesIO()
        Image.new("RGB", (1400, 700), (10, 200, 30)).save(buf, "PNG")
        response = requests.post("http://127.0.0.1:8000/v1/ocr", timeout=300, json={
            "image": base64.b64encode(buf.getvalue()).decode(), "max_tokens": 4})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["image_tokens"] == 483 and body["usage"]["completion_tokens"] == 4
        assert body["model"] == "tiny-random" and "RANDOM" in body["warning"]
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: Serve shuts the app down and exits
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = "killed"
        log.close()
    assert code == 0, (code, open(tmp_path / "serve.log").read()[-3000:])


def test_serve_run_of_a_missing_checkpoint_fails_with_one_clear_message(tmp_path):
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([serve_cli, "run", "deployments.app:build", f"checkpoint={tmp_path}/nope"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert "has no config.json" in done.stdout + done.stderr
