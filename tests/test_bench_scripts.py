"""The GPU benchmark scripts that can run on CPU in a smoke mode do, so they cannot rot unseen.

`bench/scaleout_bench.py --smoke` runs every phase of the scale-out benchmark (two layouts at
rising concurrency, the autoscaling load step) with the tiny model on a local Ray cluster;
`bench/e2e_bench.py --smoke` `serve run`s the CPU config with the bench's overrides and sends
pages over HTTP at two concurrencies; `bench/serve_bench.py --smoke` runs the in-process and
Serve encode paths with the tiny model on CPU."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def run_smoke(script: str, stem: str, out) -> dict:
    """`bench/<script> --smoke` in a fresh interpreter (its own Ray cluster): the JSON it wrote."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, f"bench/{script}", "--smoke", "--out", str(out),
                           "--port", str(free_port())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = list(out.glob(f"{stem}-smoke-*.json"))
    return json.loads(path.read_text())


def test_scaleout_bench_smoke(tmp_path):
    result = run_smoke("scaleout_bench.py", "scaleout", tmp_path)
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


def test_e2e_bench_smoke(tmp_path):
    result = run_smoke("e2e_bench.py", "e2e", tmp_path)
    summary = result["summary"]
    assert summary["cold_start_s"] > 0 and summary["pages_per_s_best"] > 0
    assert summary["ready_s"] > 0  # /ready polled beside the first page answered 200
    assert summary["first_page_timings_ms"]["decode_ms"] > 0
    assert set(result["concurrency"]) == {"1", "4"}
    assert all(row["generated_tokens"] == row["pages"] * 8 and row["p99_s"] >= row["p50_s"] > 0
               for row in result["concurrency"].values())
    decoder = result["tiers"]["Decoder"]
    assert decoder["max_batch"] == 256 and decoder["kv_cache_tokens"] > 0  # the defaults: paged


def test_serve_bench_smoke(tmp_path):
    """The four one-GPU variants (encoders make the views; one Encoder makes and encodes
    both paths; that Encoder inside the Router; routers make them with PIL) run through Serve
    and their ratios are reported per repetition's median."""
    result = run_smoke("serve_bench.py", "serve", tmp_path)
    summary = result["summary"]
    assert summary["smoke"] is True
    assert summary["variants_run"] == ["shared", "shared-encoder-in-router", "shared-one-encoder",
                                       "shared-router-views"]
    assert set(summary["by_variant"]) == set(summary["variants_run"])
    assert summary["by_variant"]["shared"]["latency_ratio_p50"] <= summary["latency_ratio_p50"]
    for variant in result["variants"].values():
        assert len(variant["reps"]) == 2 and all(r["p50_ms"] > 0 for r in variant["reps"])
        stages = variant["router_stages_p50_ms_one_at_a_time"]
        assert stages["preprocess_ms"] > 0  # the cache is off: every page encoded
        assert stages["requests"] == 3  # the smoke's 1 warm-up + 2 timed calls, none of the load
        assert stages["handler_ms"] >= stages["encoding_ms"] > 0  # the handler holds the stages
        for encoder in variant["encoder_stages_p50_ms_one_at_a_time"].values():
            assert encoder["batches"] >= 1 and encoder["run_ms"] > 0 and encoder["wait_ms"] >= 0
            assert encoder["handler_ms"] >= encoder["run_ms"]
        # (Differences of medians: on 2 busy cores a slow first call can make them negative.)
        assert {"serve_call_router_ms", "serve_call_encoder_ms", "router_unstaged_ms",
                "encoder_unstaged_ms"} <= set(variant["hops_one_at_a_time"])
    assert [v["views_on_encoder"] for v in result["variants"].values()] == [True, True, True, False]

