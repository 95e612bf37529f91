"""The GPU benchmark scripts that can run on CPU in a smoke mode do, so they cannot rot unseen.

`bench/scaleout_bench.py --smoke` runs every phase of the scale-out benchmark (a layout at
rising concurrency: on CPU both are one app; the autoscaling load step) with the tiny model on a
local Ray cluster;
`bench/e2e_bench.py --smoke` `serve run`s the CPU config as shipped (only host and port
changed) and sends the realistic workload over HTTP at two concurrencies, reading the Decoder's
metrics; `bench/serve_bench.py --smoke` runs the in-process and Serve encode paths with the tiny
model on CPU; `bench/decoder_bench.py --smoke` runs its realistic mode against the bandwidth
bound with the tiny model on CPU. The benches' own arithmetic (the steady tokens/s, medians over
repetitions, the Prometheus reading, the config's overrides, a decode step's bytes) is checked
on its own, without Ray."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from bench import decoder_bench, e2e_bench
from bench.workload import KIND_SHARES, draw_specs
from tests.conftest import TEST_CLUSTER_ENVIRONMENT
from tests.helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_smoke(script: str, stem: str, out, *args: str, env_set: dict = TEST_CLUSTER_ENVIRONMENT) -> dict:
    """`bench/<script> --smoke` in a fresh interpreter (its own Ray cluster, in the environment
    of the suite's others unless `env_set` says otherwise): the JSON it wrote."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | env_set
    done = subprocess.run([sys.executable, f"bench/{script}", "--smoke", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = list(out.glob(f"{stem}-smoke-*.json"))
    return json.loads(path.read_text())


@pytest.mark.slow
def test_scaleout_bench_smoke(tmp_path):
    result = run_smoke("scaleout_bench.py", "scaleout", tmp_path, "--port", str(free_port()))
    summary = result["summary"]
    assert summary["smoke"] is True and summary["pages_per_s_1gpu"] > 0 and summary["scaling"] == 1.0
    assert result["spread"] == result["squeezed"]  # on CPU one app: swept once
    for layout in ("spread", "squeezed"):
        levels = result[layout]["levels"]
        assert [row["concurrency"] for row in levels] == [1, 4]
        assert all(row["requests"] == 2 * row["concurrency"] and row["p99_s"] >= row["p50_s"] > 0 for row in levels)
    step = result["autoscale"]
    assert step["pages_per_s_low"] > 0 and step["pages_per_s_high"] > 0
    polled = [p for p in step["timeline"] if p["t"] >= step["step_at_s"]]
    assert polled and all(p["LocalEncoder"].get("RUNNING", 0) >= 1 for p in polled)
    assert set(step["scale_up"]) == {"LocalEncoder", "Decoder"}


@pytest.mark.slow
def test_batch_bench_smoke(tmp_path):
    """Offline OCR of the realistic mix's pages on Ray Data, each page capped by its own
    `max_tokens` column (random weights never stop: each generates exactly that), the whole job
    timed; Ray Data's stage report kept."""
    result = run_smoke("batch_bench.py", "batch", tmp_path, "--reps", "1")
    summary, run = result["summary"], result["run"]
    assert summary["runs_tokens_per_s"] == [run["tokens_per_s"]] and result["runs"] == [run]
    assert summary["smoke"] is True and summary["pages"] == 8 and summary["error_count"] == 0
    assert run["generated_tokens"] == result["workload"]["generated_tokens_total"]
    assert summary["tokens_per_s"] == pytest.approx(run["generated_tokens"] / run["seconds"])
    assert 0 < run["until_first_page_s"] < run["seconds"]
    assert "Decode" in run["ray_data_stats"] and result["code"]["python_sources_sha256"]


def test_batch_bench_ratios_read_one_machine_s_runs_and_refuse_others():
    """bench/batch_bench.py's ratios: against the median of the service's runs at 256 and the
    in-process decoder's figure, only from JSONs of the same card and code."""
    from bench.batch_bench import ratios
    code, card = {"python_sources_sha256": "abc"}, "NVIDIA H100 80GB HBM3"
    service = {"setup": {"gpus": [card]}, "code": code,
               "reps": [{"levels": {"256": {"tokens_per_s": t}}} for t in (10000.0, 12000.0)]}
    decoder = {"device": card, "code": code, "summary": {"tokens_per_s_c256": 20000.0}}
    summary = {"gpu": card, "tokens_per_s": 18000.0, "code": code}
    assert ratios(summary, service, decoder) == {"to_service_tokens_per_s": 18000.0 / 11000.0,
                                                 "to_inprocess_tokens_per_s": 0.9,
                                                 "met": {"to_service_tokens_per_s": True,
                                                         "to_inprocess_tokens_per_s": True}}
    assert ratios(summary, None, None) == {"met": {}}
    with pytest.raises(ValueError, match="ran on"):
        ratios({**summary, "gpu": "NVIDIA H200"}, None, decoder)
    with pytest.raises(ValueError, match="different code"):
        ratios({**summary, "code": {"python_sources_sha256": "def"}}, service, None)


def test_batch_bench_adds_the_ratios_to_a_run_of_another_call(tmp_path):
    """`--ratios`: a batch JSON written without the service's and decoder's runs (each ran in its
    own device call, same machine and code) gets their ratios, refused for other code."""
    from bench import batch_bench
    code, card = {"python_sources_sha256": "abc"}, "NVIDIA H100 80GB HBM3"
    files = {"batch": {"date": "2026-12-07", "code": code, "setup": {"inputs": {}},
                       "summary": {"gpu": card, "tokens_per_s": 18000.0, "met": {}, "targets": {}}},
             "service": {"setup": {"gpus": [card]}, "code": code,
                         "reps": [{"levels": {"256": {"tokens_per_s": 12000.0}}}]},
             "decoder": {"device": card, "code": code, "summary": {"tokens_per_s_c256": 20000.0}}}
    for name, result in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    batch_bench.main(["--ratios", str(tmp_path / "batch.json"), "--service", str(tmp_path / "service.json"),
                      "--decoder", str(tmp_path / "decoder.json"), "--name", "joined", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "joined-2026-12-07.json").read_text())["summary"]
    assert summary["to_service_tokens_per_s"] == 1.5 and summary["to_inprocess_tokens_per_s"] == 0.9
    assert summary["met"] == {"to_service_tokens_per_s": True, "to_inprocess_tokens_per_s": True}
    files["decoder"]["code"] = {"python_sources_sha256": "def"}
    (tmp_path / "decoder.json").write_text(json.dumps(files["decoder"]))
    with pytest.raises(ValueError, match="different code"):
        batch_bench.main(["--ratios", str(tmp_path / "batch.json"), "--decoder", str(tmp_path / "decoder.json"),
                          "--out", str(tmp_path)])


@pytest.mark.slow
def test_e2e_bench_smoke(tmp_path):
    """The shipped config with only host and port changed, the README's command, no variable
    set; the realistic mix, each page's own max_tokens; the Decoder's metrics read per level."""
    port = free_port()
    result = run_smoke("e2e_bench.py", "e2e", tmp_path, "--port", str(port), env_set={})
    setup = result["setup"]
    assert setup["config"] == "deployments/configs/cpu-tiny.yaml" and setup["environment_set"] == {}
    assert setup["overrides"] == {"http_options.host": "127.0.0.1", "http_options.port": port}
    assert setup["gpus"] == e2e_bench.gpu_names()  # the machine it ran on ([] without nvidia-smi)
    assert set(result["workload"]["kinds"]) == set(KIND_SHARES)
    summary = result["summary"]
    assert summary["repetitions"] == 1 and summary["cold_start_s"] > 0
    assert summary["ready_s"] > 0  # /ready polled beside the first page answered 200
    phases = result["reps"][0]["startup_phases_s"]  # read off serve run's log, in order
    assert list(phases) == ["serve_run_started", "ray_started", "serve_started", "replicas_started", "ready"]
    assert 0 < phases["serve_run_started"] < phases["ray_started"] < phases["serve_started"] < phases["ready"]
    assert phases["ready"] < summary["cold_start_s"] + 1  # the log's clock has millisecond stamps
    assert summary["first_page_timings_ms"]["decode_ms"] > 0
    # One page's first token split by the app's own timings (a diagnostic of the streamed wait).
    parts = result["reps"][0]["one_page_streamed"]["first_token_parts_ms_p50"]
    assert parts["client_ms"] >= parts["total_ms"] >= parts["encoding_ms"] > 0 and parts["prefill_ms"] > 0
    assert summary["tokens_per_s_without_refusal"] > 0  # the defaults carry 4 in flight
    rows = result["concurrency"]
    assert set(rows) == {"4"}
    # Random weights never stop: every page generated its own max_tokens.
    assert sum(row["generated_tokens"] for row in rows.values()) == result["workload"]["generated_tokens_total"]
    for row in rows.values():
        assert row["p99_s"] >= row["p50_s"] > 0 and row["refusals"] == 0
        assert row["timings_p50_ms"]["generate_ms"] > 0
        # The metrics, waited for until they showed the level's requests.
        assert row["decoder_tpot_ms_mean"] > 0 and row["app_completion_tokens"] == row["generated_tokens"]
        assert row["decoder_generated_tokens"] == row["generated_tokens"] and row["decoder_tokens_per_s"] > 0
    alone = result["reps"][0]["one_page_streamed"]  # one page at a time, streamed
    assert alone["pages"] == 5 and 0 < alone["ttft_s_p50"] < alone["total_s_p50"]
    assert summary["one_page_streamed_ttft_s"] == alone["ttft_s_p50"]
    twin = summary["in_process_first_token"]  # the same pages' first token in the bench's process
    assert twin["pages"] == 5 and twin["first_token_s_p50"] >= twin["encode_s_p50"] > 0 and twin["prefill_s_p50"] > 0
    assert summary["ttft_vs_in_process"] == pytest.approx(alone["ttft_s_p50"] / twin["first_token_s_p50"])
    decoder = result["reps"][0]["tiers"]["Decoder"]
    assert decoder["max_batch"] == 256 and decoder["kv_cache_tokens"] > 0  # the defaults: paged


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    """One of the one-GPU variants (the encoders make the views) runs through Serve and its
    ratios are reported per repetition's median. (The other placements, views made by the
    Router, one Encoder and that Encoder inside the Router, are the same script with another
    config; tests/test_serve.py serves each and checks it equal to the default: each more smoke
    app costs 2 cores about 20 seconds.)"""
    result = run_smoke("serve_bench.py", "serve", tmp_path, "--port", str(free_port()),
                       "--variants", "shared")
    summary = result["summary"]
    assert summary["smoke"] is True
    assert summary["variants_run"] == ["shared"] and set(summary["by_variant"]) == {"shared"}
    assert summary["by_variant"]["shared"]["latency_ratio_p50"] == summary["latency_ratio_p50"] > 0
    assert summary["router_views_throughput_ratio_c64_vs_encode_only"] is None  # not run
    for variant in result["variants"].values():
        assert len(variant["reps"]) == 1 and all(r["p50_ms"] > 0 for r in variant["reps"])
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
    assert [v["views_on_encoder"] for v in result["variants"].values()] == [True]


@pytest.mark.slow
def test_decoder_bench_realistic_smoke(tmp_path):
    """Pages' contexts (their image tokens and lengths) through the engine, n in flight, against
    the bound from the weights touched and the live KV cache at the copy bandwidth measured; the
    same through AsyncEngine with a profile window; the decode-step profiles at batch 1 and each
    level, and one page's prefill profiled."""
    result = run_smoke("decoder_bench.py", "decoder-realistic", tmp_path, "--profile", "--window", "0.3")
    run = result["variants"]["decode_graphs"]
    for n in (2, 4):  # the same pages through AsyncEngine, the Decoder replica's loop
        through = run["async_engine"][str(n)]
        assert through["generated_tokens"] == run[str(n)]["generated_tokens"] and through["window"]["steps"] > 0
        assert result["summary"][f"async_engine_window_tokens_per_s_c{n}"] == through["window"]["tokens_per_s"]
    for n in (2, 4):
        row = run[str(n)]
        specs = draw_specs(3 * n, n)  # the smoke's seed 0 + n; each max_tokens / 100
        assert row["requests"] == 3 * n
        assert row["generated_tokens"] == sum(max(2, spec.max_tokens // 100) for spec in specs)
        assert row["fraction_of_bound"] > 0 and row["bound_tokens_per_s"] > 0 and row["mean_batch"] > 1
        assert result["summary"][f"fraction_of_bound_c{n}"] == row["fraction_of_bound"]
        assert 273 <= result["workload"]["pages"][str(n)]["image_tokens"]["min"]
        assert result["workload"]["pages"][str(n)]["image_tokens"]["max"] <= 933
    assert run["one_page"]["generated_tokens"] == 7 and run["one_page"]["prompt_tokens"] > 903
    for n in (1, 2, 4):
        profile = run["profile"][str(n)]
        assert profile["batch"] == n and profile["wall_ms_per_step"] > 0 and profile["kernel_ms_per_step"] > 0
        assert 0 < sum(k["share"] for k in profile["top"]) <= 1 + 1e-9
    prefill = run["profile_prefill"]  # one page's prefill: on CPU, host ops only
    assert prefill["prompt_tokens"] > 903 and prefill["wall_ms"] > 0 and prefill["top_host_ops"]
    bound = result["bound"]
    weights = bound["weights_bytes"]
    vocab = 129280  # the tiny model keeps the real vocabulary
    assert weights["total"] == (weights["every_step"] + weights["moe_layers"] * weights["n_experts"]
                                * weights["per_expert"] + vocab * weights["embedding_row"])
    assert bound["bandwidth"]["bytes_per_s"] > 0 and bound["kv_bytes_per_token"] == 2 * 3 * 64 * 4


# --- the benches' arithmetic, without Ray ----------------------------------------------------------
def test_decoder_bench_load_smoke(tmp_path):
    """The load workload on CPU: both readers, cold and warm, the same bytes each time."""
    result = run_smoke("decoder_bench.py", "decoder-load", tmp_path, "--workload", "load", "--repeats", "2")
    runs, summary = result["runs"], result["summary"]
    assert set(runs) == {"streamed_cold", "streamed_warm", "mapped_cold", "mapped_warm"}
    assert all(len(rows) == 2 and all(r["gb"] == summary["gb"] > 0 for r in rows) for rows in runs.values())
    assert summary["speedup_cold"] == summary["mapped_cold_s"] / summary["streamed_cold_s"]
    assert result["code"]["switches"]["DEEPSEEK_OCR_STREAM_WEIGHTS"] == "1"  # restored after the loads


def test_e2e_config_changes_only_checkpoint_host_and_port(tmp_path):
    shipped = os.path.join(ROOT, "deployments", "configs", "gpu-shared.yaml")
    written = tmp_path / "serve.yaml"
    overrides = e2e_bench.serve_config(shipped, str(written), "/models/random")
    assert set(overrides) == {"applications[0].args.checkpoint", "http_options.host", "http_options.port"}
    before, after = yaml.safe_load(open(shipped)), yaml.safe_load(written.read_text())
    assert after["applications"][0]["args"]["checkpoint"] == "/models/random"
    assert after["http_options"]["host"] == "127.0.0.1" and after["http_options"]["port"] == e2e_bench.PORT
    for config in (before, after):
        del config["applications"][0]["args"]["checkpoint"]
        del config["http_options"]["host"], config["http_options"]["port"]
    assert before == after


def test_e2e_steady_tokens_count_the_share_decoded_while_every_slot_was_full():
    """Two slots; the span runs from the first answer (t=2) to the last send (t=4): page a
    (decoding 1-2 s) ends on it, b decodes 1-5 s (half its 80 tokens inside), c 2-4 s, all inside."""
    pages = [{"sent": 0, "answered": 2, "tokens": 10, "timings": {"generate_ms": 1000}},
             {"sent": 0, "answered": 5, "tokens": 80, "timings": {"generate_ms": 4000}},
             {"sent": 2, "answered": 4, "tokens": 30, "timings": {"generate_ms": 2000}},
             {"sent": 4, "answered": 6, "tokens": 20, "timings": {"generate_ms": 2000}}]
    assert e2e_bench.steady_tokens_per_s(pages) == pytest.approx((40 + 30) / 2)
    assert e2e_bench.steady_tokens_per_s(pages[:2]) is None  # as many pages as slots: no span


def test_e2e_medians_over_repetitions_keep_every_run():
    reps = [{"tokens_per_s": 3.0, "timings": {"total_ms": 10.0}, "decoder_tokens_per_s": None},
            {"tokens_per_s": 1.0, "timings": {"total_ms": 30.0}, "decoder_tokens_per_s": 5.0},
            {"tokens_per_s": 2.0, "timings": {"total_ms": 20.0}, "decoder_tokens_per_s": 7.0}]
    combined = e2e_bench.medians(reps)
    assert combined["tokens_per_s"] == 2.0 and combined["runs"]["tokens_per_s"] == [3.0, 1.0, 2.0]
    assert combined["timings"]["total_ms"] == 20.0
    assert combined["decoder_tokens_per_s"] == [None, 5.0, 7.0]  # a missing figure: every value shown


def test_e2e_reads_prometheus_series_by_label():
    text = ("# TYPE ray_ocr_tokens_total counter\n"
            'ray_ocr_tokens_total{kind="completion",model="m",replica="a"} 12.0\n'
            'ray_ocr_tokens_total{kind="completion",model="m",replica="b"} 30.0\n'
            'ray_ocr_tokens_total{kind="image",model="m",replica="a"} 903.0\n'
            'ray_ocr_decoder_running{model="m"} 64.0\n')
    assert e2e_bench.metric(text, "ray_ocr_tokens_total", kind="completion") == 42.0
    assert e2e_bench.metric(text, "ray_ocr_decoder_running", max) == 64.0
    assert e2e_bench.metric(text, "ray_ocr_decoder_waiting") is None


def test_decoder_step_bytes_count_the_experts_a_batch_touches():
    weights = {"every_step": 1000, "per_expert": 10, "moe_layers": 2, "n_experts": 64, "top_k": 6,
               "embedding_row": 1}
    alone = decoder_bench.step_bytes(weights, 1, 500, kv_bytes_per_token=2)
    assert alone == {"weights": pytest.approx(1000 + 2 * 6 * 10 + 1), "kv": 1000}
    crowd = decoder_bench.step_bytes(weights, 256, 0, kv_bytes_per_token=2)
    assert crowd["weights"] == pytest.approx(1000 + 2 * 64 * 10 + 256, rel=1e-6)  # every expert


def test_every_result_records_the_switches_and_the_code(tmp_path, monkeypatch):
    """Each JSON a bench writes names every switch's setting in its process (an override
    included) and the code it ran: the commit where git answers, a digest of the sources."""
    from bench.common import write_result
    from common.switches import SWITCHES
    monkeypatch.setenv("DEEPSEEK_OCR_PREFILL_GRAPHS", "0")
    first = json.loads(open(write_result(str(tmp_path), "probe", {"date": "d", "summary": {}})).read())
    code = first["code"]
    assert set(code["switches"]) == set(SWITCHES) and code["switches"]["DEEPSEEK_OCR_PREFILL_GRAPHS"] == "0"
    assert code["switches"]["DEEPSEEK_OCR_SPLIT_ARGMAX"] == SWITCHES["DEEPSEEK_OCR_SPLIT_ARGMAX"].default
    assert len(code["python_sources_sha256"]) == 64
    assert code["commit"] is None or len(code["commit"]) == 40
    again = json.loads(open(write_result(str(tmp_path), "probe2", {"date": "d", "code": {"kept": 1}})).read())
    assert again["code"] == {"kept": 1}  # a result that names its code keeps it


def test_fp8_kv_cache_variant_and_its_logit_error(monkeypatch):
    """decoder_bench's `decode_graphs_fp8_kv`: the engine keeps its KV cache in fp8; the logits'
    error it reports is measured (near, never equal), teacher-forced on the same tokens."""
    import torch

    from decoder.checkpoint import random_decoder
    from decoder.config import DecoderArgs
    from decoder.engine import GenerationEngine, GenerationRequest, SamplingParams
    from decoder.kv_cache import KVCache
    from decoder.model import CacheStep, Experts
    from decoder.tokenizer import ByteTokenizer
    for name, value in (("GenerationEngine", GenerationEngine), ("GenerationRequest", GenerationRequest),
                        ("SamplingParams", SamplingParams), ("KVCache", KVCache), ("CacheStep", CacheStep),
                        ("Experts", Experts)):
        monkeypatch.setattr(decoder_bench, name, value, raising=False)  # main() imports them
    model = random_decoder(DecoderArgs.tiny())
    engine, _ = decoder_bench.make_engine(model, ByteTokenizer(), "decode_graphs_fp8_kv", 2, 512)
    assert engine.cache.k.dtype == torch.float8_e4m3fn and engine.overlap_picks
    plain, _ = decoder_bench.make_engine(model, ByteTokenizer(), "decode_graphs_picks_first", 2, 512)
    assert plain.cache.k.dtype == torch.float32 and not plain.overlap_picks
    error = decoder_bench.fp8_kv_logit_error(model, torch.randn(70, model.args.hidden), steps=8)
    assert error["steps"] == 8 and error["prompt_tokens"] == 70
    assert 0 < error["rel_err_median"] <= error["rel_err_max"] < 0.5 and 0 <= error["greedy_agreement"] <= 1
    assert error["compared"] == 9 and error["greedy_agreement"] == error["agreed"] / 9  # the prefill's pick too
    pooled = decoder_bench.fp8_kv_agreement(model, [torch.randn(40, model.args.hidden), torch.randn(70, model.args.hidden)],
                                            tokens=7)
    assert pooled["contexts"] == 2 and pooled["generated_tokens"] == 8  # 4 steps each
    assert [r["prompt_tokens"] for r in pooled["per_context"]] == [40, 70]
    assert pooled["greedy_agreement"] == sum(r["agreed"] for r in pooled["per_context"]) / 10


def test_side_by_side_reads_one_machine_s_runs_and_refuses_mixed_ones():
    """bench/side_by_side.py: the issue's summary from results of one card and one code (each
    figure the median of its runs, a service's runs pooled over its JSONs), and a refusal naming
    what differs otherwise."""
    from bench import side_by_side as sbs
    code, card = {"python_sources_sha256": "abc"}, "NVIDIA H100 80GB HBM3"

    def service(*tokens_c256: float, one_page_s: float = 0.5) -> dict:
        return {"setup": {"gpus": [card]}, "code": code,
                "reps": [{"levels": {"256": {"tokens_per_s": tokens}}} for tokens in tokens_c256],
                "summary": {"repetitions": len(tokens_c256), "one_page_streamed_total_s": one_page_s}}
    runs = {"256": {"repeats_tokens_per_s": [19000.0, 20000.0, 21000.0]},
            "one_page": {"decode_fraction_of_bound": 0.3}}
    decoder = {"device": card, "code": code, "workload": {"seed": 0}, "variants": {"decode_graphs": runs},
               "summary": {"variant": "decode_graphs", "tokens_per_s_c256": 20000.0, "fraction_of_bound_c64": 0.8,
                           "fraction_of_bound_c256": 0.9, "one_page_s": 0.45}}
    two_calls = [service(17000.0), service(16000.0, 18000.0, one_page_s=0.6)]  # median 17,000
    summary = sbs.side_by_side(two_calls, [service(16150.0)], decoder)["summary"]
    assert summary["gpu"] == card and summary["service_to_inprocess_c256"] == pytest.approx(0.85)
    assert summary["runs"]["service_c256"] == [17000.0, 16000.0, 18000.0]
    assert summary["ocr2_to_ocr1_c256"] == pytest.approx(0.95) and summary["b1_fraction_of_bound"] == 0.3
    assert summary["one_page_s"] == pytest.approx(0.55)  # the median of the two JSONs' figures
    assert summary["met"] == {"service_to_inprocess_c256": True, "fraction_of_bound_c64": False,
                              "fraction_of_bound_c256": True, "b1_fraction_of_bound": False,
                              "ocr2_to_ocr1_c256": True, "one_page_s": False}  # 0.55 s > the H100's 0.45
    assert summary["repetitions"] == {"service": 3, "service_ocr2": 1, "decoder": 3}
    with pytest.raises(ValueError, match="different cards"):
        sbs.side_by_side([service(1.0)], [service(1.0)], {**decoder, "device": "NVIDIA H200"})
    with pytest.raises(ValueError, match="different code"):
        sbs.side_by_side([service(1.0)], [service(1.0)], {**decoder, "code": {"python_sources_sha256": "def"}})


def test_the_loop_detector_s_cost_is_the_default_step_over_the_step_without_it():
    """decoder_bench's summary of issue 57's figure, from the two variants of one run."""
    on = {"64": {"decode_step_ms_p50": 4.5}, "256": {"decode_step_ms_p50": 11.22}}
    off = {"64": {"decode_step_ms_p50": 4.5}, "256": {"decode_step_ms_p50": 11.0}}
    cost = decoder_bench.guard_cost({"decode_graphs": on, "decode_graphs_no_repetition_guard": off}, (64, 256))
    assert cost == {"repetition_guard_step_cost": {"c64": 0.0, "c256": pytest.approx(0.02)}}
    assert decoder_bench.guard_cost({"decode_graphs": on}, (64, 256)) == {}
