"""The GPU benchmark scripts that can run on CPU in a smoke mode do, so they cannot rot unseen.

`bench/scaleout_bench.py --smoke` runs every phase of the scale-out benchmark (two layouts at
rising concurrency, the autoscaling load step) with the tiny model on a local Ray cluster."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scaleout_bench_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, "bench/scaleout_bench.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = list(tmp_path.glob("scaleout-smoke-*.json"))
    result = json.loads(path.read_text())
    summary = result["summary"]
    assert summary["smoke"] is True and summary["pages_per_s_1gpu"] > 0 and summary["scaling"] > 0
    for layout in ("spread", "squeezed"):
        levels = result[layout]["levels"]
        assert [row["concurrency"] for row in levels] == [1, 4]
        assert all(row["requests"] == 8 and row["p99_s"] >= row["p50_s"] > 0 for row in levels)
    step = result["autoscale"]
    assert step["pages_per_s_low"] > 0 and step["pages_per_s_high"] > 0
    polled = [p for p in step["timeline"] if p["t"] >= step["step_at_s"]]
    assert polled and all(p["LocalEncoder"].get("RUNNING", 0) >= 1 for p in polled)
    assert set(step["scale_up"]) == {"LocalEncoder", "Decoder"}
