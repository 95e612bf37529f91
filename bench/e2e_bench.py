"""The whole app end to end on one GPU, as a user runs it: `serve run` of a shipped config, pages
over HTTP.

    python bench/e2e_bench.py [--out bench/results] [--config gpu-shared.yaml] [--reps 3]
    python bench/e2e_bench.py --smoke      # CPU, tiny model (cpu-tiny.yaml): checks the script

What runs is what a user runs: deployments/configs/<--config> (gpu-shared.yaml: all tiers on
one GPU) with only `checkpoint` and the HTTP host and port changed (the JSON's
`setup.overrides`), started by the README's command, `deepseek-ocr serve <config>` (as `python
-m deployments`, the same command on this interpreter: `serve run` in the app's start-up
environment), in the environment the bench was started in: the bench sets no variable
(`setup.environment_set`; `setup.environment_inherited` lists the Ray, CUDA, Triton, torch and
DEEPSEEK_OCR_* ones it passed on). The checkpoint is a
real-dims random one in the released layout (vision + DeepSeek-3B-MoE + a byte-level
tokenizer.json with DeepSeek's special-token ids), written once (`--checkpoint DIR` reuses one)
and evicted from the page cache before each start (fsync, then posix_fadvise DONTNEED on each
file), so its weights come from the disk as on a node that has not read them.

Each repetition (`--reps`, default 3) starts `serve run`, times the cold start (to the first
answered page, a grey A4 page sent as soon as a Router answers /health; and to the first 200 of
/ready), sends each concurrency level's pages (`--levels`; 5 pages at 1 in flight, 3c at c),
then 5 grey A4 pages alone with stream=true (the client's time to first token and to the end:
`one_page_streamed`), then stops the app. After the last repetition the same pages' first
token is timed in this process (`in_process_first_token`: decoded on the host, views made and
encoded on the GPU by the replicas' engine, prefilled by the decoder's) and compared
(`ttft_vs_in_process`). The pages (`--workload`): `realistic`,
bench/workload.py's mix (grey text, colour scans, photographed pages, slides, receipts, strips;
A4, Letter and odd sizes; PNG and JPEG; max_tokens from its length distribution, median 700),
or `uniform`, the former workload (grey 1191x1684 PNGs, 700 tokens each). Every page of a
repetition differs (the router's encoder cache never hits); every repetition sends the same
pages. A page refused (503 or 429) is counted and sent again after its Retry-After, as clients
do; its latency runs from its first send.

Per level: pages/s and generated tokens/s over the level (first page sent to last answered);
`steady_tokens_per_s`, over the span the client kept all c in flight (from the first answer to
the last send; each page's tokens spread evenly over its decode time, the app's `generate_ms`,
so pages still decoding count their share and the drain of the longest pages does not);
p50 / p99 latency; refusals; the median of each stage time the app returned; and the Decoder's
own figures from its Prometheus metrics on Ray's export port (of the cluster `serve run`
started): `decoder_tokens_per_s`, the tokens it generated in the level
(`ray_ocr_decoder_generated_tokens_total`) over the level's time, the mean running sequences,
mean time per output token and time to first token, the KV cache's peak use, the peak waiting
and preempted. Metrics reach the port every 10 s (Ray's report interval), so after each level the
bench waits until the level's requests show in them before the next one.

Writes <name>-<date>.json after every repetition (top-level `summary`; `concurrency`: each
level's median over repetitions, every repetition's figures in `runs`; `reps`: each
repetition's cold start, levels and tiers: each tier's /ready after the levels, its GPU memory's
peak under load against its share's cap included), <name>-<date>.png (pages/s, tokens/s and p50 / p99
against concurrency) and <name>-<date>-startup.log (`serve run`'s log up to each repetition's
first answered page).
"""
from __future__ import annotations

import argparse
import base64
import datetime
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench.common import RESULTS, evict_from_page_cache, gpu_names, write_result  # noqa: E402
from bench.workload import describe, make_workload, smoke_lengths, uniform_page, uniform_workload  # noqa: E402

PORT = 8000  # --port: HTTP on 127.0.0.1
URL = f"http://127.0.0.1:{PORT}"
FIRST_PAGE_TOKENS = 700
ALONE_PAGES = 5  # one page alone, streamed, after the levels
WINDOW_AFTER_S = 15  # --profile_window: opened this far into a level (its pipeline full)
CONCURRENCY = (1, 16, 64, 256)
# Issue 38: generated tokens/s at the best level without a refusal (≈ 30 pages/s at 700 tokens a
# page), the cold start, and a page alone's time to first token against its in-process twin.
TARGETS = {"tokens_per_s_without_refusal": 22_000, "cold_start_s": 20.0, "ttft_vs_in_process": 1.2}
REFUSED = (429, 503)
# Inherited variables worth recording: what changes how Ray, the GPU, Triton, torch or the app run.
RECORDED_ENV_PREFIXES = ("RAY_", "CUDA_", "TRITON_", "TORCH", "PYTORCH_", "NCCL_", "OMP_", "DEEPSEEK_OCR_")


def config_path(name: str) -> str:
    """A config of deployments/configs by name, or a path."""
    return name if os.path.isfile(name) else os.path.join(ROOT, "deployments", "configs", name)


def serve_config(shipped: str, path: str, checkpoint: str | None) -> dict:
    """Write the shipped config to `path` with the checkpoint and the bench's host and port; returns
    what was changed, as {dotted key: value}."""
    with open(shipped) as f:
        config = yaml.safe_load(f)
    overrides = {"http_options.host": "127.0.0.1", "http_options.port": PORT}
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": PORT}
    if checkpoint:
        [app] = config["applications"]
        app.setdefault("args", {})["checkpoint"] = checkpoint
        overrides["applications[0].args.checkpoint"] = checkpoint
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return overrides


def triton_cache_files() -> int:
    """Files in the Triton kernel cache `serve run` will use (its default place unless set)."""
    home = os.environ.get("TRITON_HOME", os.path.expanduser("~"))
    directory = os.environ.get("TRITON_CACHE_DIR", os.path.join(home, ".triton", "cache"))
    return sum(len(files) for _, _, files in os.walk(directory))


# --- requests --------------------------------------------------------------------------------------
def ocr(image: bytes, max_tokens: int, give_up_after_s: float = 900) -> dict:
    """One page: its answer's usage and timings, with the client's view: `sent` and `answered`
    (perf_counter), `refusals` (503 / 429 answers, each retried after its Retry-After)."""
    body = {"image": base64.b64encode(image).decode(), "max_tokens": max_tokens, "timeout_s": 3600}
    sent, refusals = time.perf_counter(), 0
    while True:
        response = requests.post(f"{URL}/v1/ocr", json=body, timeout=3700)
        if response.status_code not in REFUSED:
            break
        refusals += 1
        if time.perf_counter() - sent > give_up_after_s:
            raise RuntimeError(f"refused {refusals} times over {give_up_after_s} s: {response.text[:300]}")
        time.sleep(float(response.headers.get("Retry-After", 1)))
    answered = time.perf_counter()
    if response.status_code != 200:
        raise requests.HTTPError(f"HTTP {response.status_code}: {response.text[:500]}", response=response)
    answer = response.json()
    return {"sent": sent, "answered": answered, "refusals": refusals,
            "tokens": answer["usage"]["completion_tokens"], "timings": answer["timings"]}


def streamed(image: bytes, max_tokens: int) -> dict:
    """One page alone with stream=true: the client's time to its first token event and to
    [DONE] (seconds)."""
    body = {"image": base64.b64encode(image).decode(), "max_tokens": max_tokens, "timeout_s": 3600,
            "stream": True}
    sent, first, tokens = time.perf_counter(), None, 0
    with requests.post(f"{URL}/v1/ocr", json=body, timeout=3700, stream=True) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event}")
            if event.get("completion_tokens"):
                first = first or time.perf_counter()
                tokens = event["completion_tokens"]
    return {"ttft_s": first - sent, "total_s": time.perf_counter() - sent, "tokens": tokens}


def alone(count: int, max_tokens: int) -> dict:
    """`count` different grey A4 pages one after another, streamed: the median time to first
    token and to the last (issue 38 compares the first to the in-process encode + prefill)."""
    pages = [streamed(uniform_page(f"alone {i}"), max_tokens) for i in range(count)]
    return {"pages": count, "max_tokens": max_tokens,
            "ttft_s_p50": statistics.median(p["ttft_s"] for p in pages),
            "total_s_p50": statistics.median(p["total_s"] for p in pages),
            "ttft_s": [p["ttft_s"] for p in pages], "total_s": [p["total_s"] for p in pages],
            "first_token_parts_ms_p50": first_token_parts(count)}


def first_token_parts(count: int) -> dict:
    """Where one page's first token goes (a diagnostic): pages like `alone`'s but new to the
    Routers' encoded-sequence cache, unstreamed with max_tokens 1, each answer's own stage
    timings (ms, medians) beside the client's whole wait (`client_ms`); `client_ms` less the
    app's `total_ms` is the HTTP proxy's share."""
    parts = []
    for i in range(count):
        answer = ocr(uniform_page(f"alone, one token {i}"), 1)
        parts.append({"client_ms": (answer["answered"] - answer["sent"]) * 1e3, **answer["timings"]})
    return {key: statistics.median(p[key] for p in parts) for key in parts[0]}


def in_process_first_token(checkpoint: str, count: int, device: str) -> dict:
    """The in-process twin of `alone`'s time to first token: the same pages' file bytes decoded
    on the host, their views made on `device` and encoded by the replicas' engine (graphs on a
    GPU), the default prompt prefilled to its first token by the decoder's engine, one page at a
    time after one page of warm-up; the median seconds, and its two parts'."""
    import torch

    from decoder import DEFAULT_PROMPT, GenerationEngine, GenerationRequest, SamplingParams, build_prompt
    from decoder import load_decoder, load_tokenizer
    from encoder import DualPathEncoder, decode, load_encoder, views_of
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    vision = load_encoder(checkpoint, device=device, dtype=dtype)
    encoder = DualPathEncoder(vision)
    tokenizer = load_tokenizer(checkpoint)
    engine = GenerationEngine(load_decoder(checkpoint, device=device, dtype=dtype), tokenizer, max_batch=1)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def first_token(image: bytes) -> tuple[float, float]:
        start = time.perf_counter()
        [sequence] = encoder.encode([views_of(decode(image, tiling=vision.tiling), device)])
        sync()
        encoded = time.perf_counter()
        ids = build_prompt(tokenizer, DEFAULT_PROMPT, [sequence.shape[0]])
        engine.add(GenerationRequest(ids, [sequence], SamplingParams(max_tokens=1, ignore_eos=True)))
        while engine.has_work():
            engine.step()  # the prefill's step picks the first token (a host sync)
        return encoded - start, time.perf_counter() - encoded

    with torch.inference_mode():
        first_token(uniform_page("alone warm-up"))
        times = [first_token(uniform_page(f"alone {i}")) for i in range(count)]
    return {"pages": count, "device": device, "encode_s_p50": statistics.median(t[0] for t in times),
            "prefill_s_p50": statistics.median(t[1] for t in times),
            "first_token_s_p50": statistics.median(sum(t) for t in times)}


def load(items, concurrency: int) -> tuple[dict, list[dict]]:
    """All `items` with `concurrency` requests in flight: the level's figures and each page's."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        pages = list(pool.map(lambda item: ocr(item.image, item.max_tokens), items))
    seconds = max(p["answered"] for p in pages) - start
    latencies = sorted(p["answered"] - p["sent"] for p in pages)
    tokens = sum(p["tokens"] for p in pages)
    timings = [p["timings"] for p in pages]
    return {"pages": len(pages), "seconds": seconds, "pages_per_s": len(pages) / seconds,
            "tokens_per_s": tokens / seconds, "generated_tokens": tokens,
            "steady_tokens_per_s": steady_tokens_per_s(pages),
            "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "refusals": sum(p["refusals"] for p in pages),
            "timings_p50_ms": {k: statistics.median(t[k] for t in timings if k in t)
                               for k in sorted({k for t in timings for k in t})}}, pages


def steady_tokens_per_s(pages: list[dict]) -> float | None:
    """Tokens/s while the client kept every slot full: from the first answer to the last send,
    each page's tokens spread evenly over its decode time (the app's generate_ms, up to its
    answer). None where the span is empty (as many pages as slots)."""
    begin, end = min(p["answered"] for p in pages), max(p["sent"] for p in pages)
    if end <= begin:
        return None
    tokens = 0.0
    for page in pages:
        decode_end = page["answered"]
        decode_start = decode_end - page["timings"].get("generate_ms", 0.0) / 1e3
        if decode_end > decode_start:
            overlap = max(0.0, min(end, decode_end) - max(begin, decode_start))
            tokens += page["tokens"] * overlap / (decode_end - decode_start)
        elif begin <= decode_end <= end:
            tokens += page["tokens"]
    return tokens / (end - begin)


# --- the decoder's metrics -------------------------------------------------------------------------
def metrics_url(server_pid: int, timeout_s: float = 120) -> str | None:
    """Ray's Prometheus endpoint of the cluster `serve run` started: Ray names its session folder
    for the process that started it and writes the export port there."""
    from ray._common.utils import get_default_ray_temp_dir
    pattern = os.path.join(get_default_ray_temp_dir(), f"session_*_{server_pid}", "metrics_export_port_*")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in glob.glob(pattern):
            port = open(path).read().strip()
            if port.isdigit():
                return f"http://127.0.0.1:{port}/metrics"
        time.sleep(0.5)
    return None


def metric(text: str, name: str, combine=sum, **labels) -> float | None:
    """`combine` (sum, max) of the series `name` whose labels include `labels`; None if none."""
    values = [float(value) for tags, value in re.findall(rf"^{name}(?:{{(.*?)}})? (\S+)$", text, re.M)
              if all(f'{k}="{v}"' in tags for k, v in labels.items())]
    return combine(values) if values else None


class DecoderMetrics:
    """Scrapes the Decoder's series (and the router's completion-token count) every second on
    a thread, for as long as the app runs."""
    SERIES = {"running": ("ray_ocr_decoder_running", sum, {}),
              "waiting": ("ray_ocr_decoder_waiting", sum, {}),
              "preempted": ("ray_ocr_decoder_preempted", sum, {}),
              "kv_cache_usage": ("ray_ocr_decoder_kv_cache_usage", max, {}),
              "tpot_sum": ("ray_ocr_decoder_time_per_output_token_ms_sum", sum, {}),
              "tpot_count": ("ray_ocr_decoder_time_per_output_token_ms_count", sum, {}),
              "ttft_sum": ("ray_ocr_decoder_time_to_first_token_ms_sum", sum, {}),
              "ttft_count": ("ray_ocr_decoder_time_to_first_token_ms_count", sum, {}),
              "generated": ("ray_ocr_decoder_generated_tokens_total", sum, {}),
              "completion_tokens": ("ray_ocr_tokens_total", sum, {"kind": "completion"})}

    def __init__(self, url: str):
        self.url, self.samples, self.stopped = url, [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stopped.wait(1.0):
            try:
                text = requests.get(self.url, timeout=5).text
            except requests.RequestException:
                continue
            self.samples.append((time.perf_counter(), {key: metric(text, name, combine, **labels)
                                                       for key, (name, combine, labels) in self.SERIES.items()}))

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

    def wait_for(self, answered: int, tokens: int, timeout_s: float = 45) -> tuple[float, dict] | None:
        """The first (time, sample) showing `answered` requests' time per output token and
        `tokens` generated tokens, in the router's count and the decoder's (each series is
        reported on its own); None past timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.samples:
                latest = self.samples[-1]
                if ((latest[1]["tpot_count"] or 0) >= answered and (latest[1]["completion_tokens"] or 0) >= tokens
                        and (latest[1]["generated"] or 0) >= tokens):
                    return latest
            time.sleep(0.5)
        return None

    def level(self, start: float, seconds: float, settled_before: tuple[float, dict],
              settled_after: tuple[float, dict]) -> dict:
        """The Decoder's figures over a level that began at `start` and ran `seconds`: its
        requests' and its generated tokens are those between the samples settled before and
        after it; the gauges', those sampled from its start to the settled sample after it (they
        lag by up to Ray's report interval)."""
        (_, before), (end, after) = settled_before, settled_after
        window = [sample for t, sample in self.samples if start < t <= end]
        running = [s["running"] for s in window if s["running"]]
        def delta(key):
            return (after[key] or 0) - (before[key] or 0)
        tpot_ms = delta("tpot_sum") / delta("tpot_count") if delta("tpot_count") else None
        running_mean = statistics.fmean(running) if running else None
        generated = delta("generated")
        return {"decoder_tokens_per_s": generated / seconds if generated else None,
                "decoder_generated_tokens": generated, "decoder_running_mean": running_mean, "decoder_tpot_ms_mean": tpot_ms,
                "decoder_ttft_ms_mean": delta("ttft_sum") / delta("ttft_count") if delta("ttft_count") else None,
                "decoder_kv_cache_usage_max": max(s["kv_cache_usage"] or 0 for s in window),
                "decoder_waiting_max": max(s["waiting"] or 0 for s in window),
                "decoder_preempted_max": max(s["preempted"] or 0 for s in window),
                "app_completion_tokens": delta("completion_tokens"), "decoder_metric_samples": len(window)}


# --- one repetition --------------------------------------------------------------------------------
def decoder_window(app: str, seconds: float, after_s: float):
    """A profile window of `seconds` on the running app's Decoder (`DecoderServer.profile`),
    opened `after_s` into a level (the pipeline full by then), from this process joined to the
    app's Ray cluster (no GPU work here): a future of the window's dict."""
    def window() -> dict:
        time.sleep(after_s)
        import ray
        from ray import serve
        if not ray.is_initialized():
            ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
        return serve.get_deployment_handle("Decoder", app).profile.remote(seconds).result(timeout_s=seconds + 120)
    return ThreadPoolExecutor(1).submit(window)


def repetition(config: str, levels, pages: dict, first_page: bytes, first_tokens: int, work: str,
               checkpoint: str | None, startup_log, window_s: float = 0) -> dict:
    """`serve run` the config, its cold start, every level, then stop it; `window_s`: a
    profile window on the Decoder in each level."""
    if checkpoint:
        evict_from_page_cache(checkpoint)
    triton_files = triton_cache_files()
    log_path = os.path.join(work, "serve.log")
    log = open(log_path, "w")
    started, started_at = time.perf_counter(), time.time()
    server = serve_run(config, log)
    metrics = None
    try:
        cold_start, ready_s, first = wait_for_first_page(server, started, first_page, first_tokens, log_path)
        print(f"cold start {cold_start:.1f} s (/ready 200 at {ready_s} s)", flush=True)
        startup_text = log_once(log_path, dict(STARTUP_MARKS)["ready"] if ready_s else None)
        startup_log.write(startup_text)
        phases = startup_phases(startup_text, started_at)
        print("start-up:", ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()), flush=True)
        url = metrics_url(server.pid)
        metrics = DecoderMetrics(url) if url else None
        # Requests with a time per output token (more than one token) and tokens, so far.
        answered, tokens, rows = int(first["tokens"] > 1), first["tokens"], {}
        settled = metrics.wait_for(answered, tokens) if metrics else None
        app = yaml.safe_load(open(config))["applications"][0]["name"]
        for c in levels:
            start = time.perf_counter()
            window = decoder_window(app, window_s, WINDOW_AFTER_S) if window_s else None
            row, answers = load(pages[c], c)
            if window is not None:
                try:
                    row["decoder_window"] = window.result()
                except Exception as e:  # noqa: BLE001 - the level's figures stand without it
                    row["decoder_window"] = {"error": f"{type(e).__name__}: {e}"}
            answered += sum(1 for a in answers if a["tokens"] > 1)
            tokens += row["generated_tokens"]
            after = metrics.wait_for(answered, tokens) if settled else None
            if after:
                row.update(metrics.level(start, row["seconds"], settled, after))
            settled = after
            rows[str(c)] = row
            print(f"c{c}: {row['pages_per_s']:.2f} pages/s, {row['tokens_per_s']:.0f} tokens/s "
                  f"(steady {row['steady_tokens_per_s'] or 0:.0f}; decoder {row.get('decoder_tokens_per_s') or 0:.0f}), "
                  f"p50 {row['p50_s']:.2f} s, p99 {row['p99_s']:.2f} s, {row['refusals']} refused", flush=True)
        one_page = alone(ALONE_PAGES, first_tokens)  # after the levels: every graph and kernel warm
        print(f"one page alone, streamed: first token {one_page['ttft_s_p50']:.3f} s, "
              f"all {one_page['total_s_p50']:.3f} s; unstreamed to one token, ms: "
              + ", ".join(f"{k} {v:.1f}" for k, v in one_page["first_token_parts_ms_p50"].items()), flush=True)
        tiers = requests.get(f"{URL}/ready", timeout=30).json()["tiers"]
        memory = {name: tier["gpu_memory_gb"] for name, tier in tiers.items() if tier.get("gpu_memory_gb")}
        if memory:  # after the levels: each tier's peak under load, against its share's cap
            print("GPU memory, GB (peak reserved / cap): "
                  + ", ".join(f"{name} {m['peak_reserved']:.1f} / {m['cap']:.1f}" for name, m in memory.items()),
                  flush=True)
    except Exception:  # the app's side of a failure is in its log (replica logs included)
        log.flush()
        print(log_errors(log_path), flush=True)
        raise
    finally:
        if metrics:
            metrics.stop()
        stop(server)
        if window_s:
            import ray
            ray.shutdown()  # this process's link to the cluster just stopped
    return {"cold_start_s": cold_start, "ready_s": ready_s, "startup_phases_s": phases,
            "first_page_timings_ms": first["timings"],
            "triton_cache_files_before": triton_files, "metrics_url": url, "levels": rows,
            "one_page_streamed": one_page, "tiers": tiers}


# `serve run`'s log lines that mark its start-up, in order: (phase, pattern).
STARTUP_MARKS = (("serve_run_started", r"Running config file"), ("ray_started", r"Started a local Ray instance"),
                 ("serve_started", r"Started Serve in namespace"), ("replicas_started", r"replica started:"),
                 ("ready", r"GET /ready 200"))
_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def log_once(path: str, pattern: str | None, timeout_s: float = 30) -> str:
    """The log's text once `pattern` is in it, or as it is after `timeout_s`: Ray forwards a
    replica's lines (the /ready answer's) to `serve run`'s output a moment after they are
    written, and on a loaded machine seconds after (a 2-core run of the suite read the log
    before that line came)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = open(path, errors="replace").read()
        if pattern is None or re.search(pattern, text) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def startup_phases(log: str, started_at: float) -> dict[str, float]:
    """Seconds from the command to each start-up mark of `serve run`'s log (its last line for
    `replicas_started`: the last replica up; its first for the rest), by the lines' timestamps
    (this machine's local time, as Ray writes them)."""
    found = {}
    for line in log.splitlines():
        for phase, pattern in STARTUP_MARKS:
            stamp = _LOG_TIME.search(line) if re.search(pattern, line) else None
            if stamp and (phase == "replicas_started" or phase not in found):
                at = time.mktime(time.strptime(stamp[1], "%Y-%m-%d %H:%M:%S")) + int(stamp[2]) / 1e3
                found[phase] = at - started_at
    return {phase: found[phase] for phase, _ in STARTUP_MARKS if phase in found}


def serve_run(config: str, log) -> subprocess.Popen:
    """`deepseek-ocr serve <config>` as this interpreter runs it (a carried Ray's console
    scripts may name another), its output into `log`, in a session of its own (`stop`)."""
    # SIGINT at its default in `serve run` (stop() sends it, as Ctrl-C): a bench started in the
    # background of a shell ignores it, and the ignoring is inherited (`serve run` then waited
    # out stop()'s 60 s every repetition).
    return subprocess.Popen([sys.executable, "-m", "deployments", config], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stop(server) -> None:
    """Ctrl-C to `serve run`, as a user stops it; then whatever of its cluster is left, killed, so
    the next repetition starts on a free GPU (Ray's processes stay in `serve run`'s session, each
    in a process group of its own)."""
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            if os.getsid(pid) == server.pid:
                os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to ask about
            pass


# --- results ---------------------------------------------------------------------------------------
def medians(rows: list[dict]) -> dict:
    """Each figure's median over the rows (repetitions), nested dicts alike; `runs`: each
    figure's values in order, where there are several rows."""
    combined, runs = {}, {}
    for key in dict.fromkeys(key for row in rows for key in row):
        values = [row.get(key) for row in rows]
        if all(isinstance(v, dict) for v in values):
            combined[key] = medians(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            combined[key], runs[key] = statistics.median(values), values
        else:
            combined[key] = values[0] if len(set(map(repr, values))) == 1 else values
    if len(rows) > 1 and runs:
        combined["runs"] = runs
    return combined


def summarize(reps: list[dict], levels) -> tuple[dict, dict]:
    """(the summary, each level's medians over the repetitions)."""
    rows = {str(c): medians([rep["levels"][str(c)] for rep in reps]) for c in levels}
    cold = [rep["cold_start_s"] for rep in reps]
    ready = [rep["ready_s"] for rep in reps if rep["ready_s"] is not None]
    best = max(rows, key=lambda c: rows[c]["tokens_per_s"])
    # The level the defaults carry: no page refused in any repetition.
    clean = [c for c in rows if all(rep["levels"][c]["refusals"] == 0 for rep in reps)]
    admitted = max(clean, key=lambda c: rows[c]["tokens_per_s"]) if clean else None
    at_admitted = rows[admitted] if admitted else {}
    summary = {"repetitions": len(reps),
               "tokens_per_s_without_refusal": at_admitted.get("tokens_per_s"),
               "tokens_per_s_without_refusal_runs": at_admitted.get("runs", {}).get("tokens_per_s"),
               "concurrency_without_refusal": int(admitted) if admitted else None,
               "steady_tokens_per_s_without_refusal": at_admitted.get("steady_tokens_per_s"),
               "pages_per_s_without_refusal": at_admitted.get("pages_per_s"),
               "decoder_tokens_per_s_without_refusal": at_admitted.get("decoder_tokens_per_s"),
               "tokens_per_s_best": rows[best]["tokens_per_s"], "best_concurrency": int(best),
               "pages_per_s_best": rows[best]["pages_per_s"],
               "refusals": {c: [rep["levels"][c]["refusals"] for rep in reps] for c in rows},
               "p50_s_c1": rows.get("1", {}).get("p50_s"),
               **{f"one_page_streamed_{key}": statistics.median(rep["one_page_streamed"][f"{key}_p50"]
                                                                for rep in reps) for key in ("ttft_s", "total_s")},
               "cold_start_s": statistics.median(cold), "cold_start_s_runs": cold,
               "startup_phases_s": medians([rep["startup_phases_s"] for rep in reps]),
               "ready_s": statistics.median(ready) if ready else None, "ready_s_runs": ready,
               "first_page_timings_ms": reps[0]["first_page_timings_ms"], "targets": TARGETS}
    summary["met"] = {"tokens_per_s_without_refusal": (summary["tokens_per_s_without_refusal"] or 0)
                      >= TARGETS["tokens_per_s_without_refusal"],
                      "cold_start_s": summary["cold_start_s"] <= TARGETS["cold_start_s"]}
    return summary, rows


def plot(rows: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = [int(c) for c in rows]
    fig, (pages, tokens, latency) = plt.subplots(1, 3, figsize=(14, 4))
    pages.plot(levels, [rows[str(c)]["pages_per_s"] for c in levels], "o-")
    pages.set(xscale="log", xlabel="requests in flight", ylabel="pages/s", title="throughput (median)")
    for key, label in (("tokens_per_s", "level"), ("steady_tokens_per_s", "steady"),
                       ("decoder_tokens_per_s", "decoder (metrics)")):
        tokens.plot(levels, [rows[str(c)].get(key) or float("nan") for c in levels], "o-", label=label)
    tokens.set(xscale="log", xlabel="requests in flight", ylabel="generated tokens/s", title="tokens/s (median)")
    tokens.legend()
    for key in ("p50_s", "p99_s"):
        latency.plot(levels, [rows[str(c)][key] for c in levels], "o-", label=key[:3])
    latency.set(xscale="log", xlabel="requests in flight", ylabel="seconds", title="latency (median)")
    latency.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model (cpu-tiny.yaml), a few "
                        "pages, each asking for 1/100 of its tokens")
    parser.add_argument("--port", type=int, default=8000, help="the app's HTTP port on 127.0.0.1")
    parser.add_argument("--levels", default=",".join(map(str, CONCURRENCY)),
                        help="requests in flight to measure, e.g. 64,256")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions, each a fresh `serve run` (default 3; --smoke 1)")
    parser.add_argument("--workload", default="realistic", choices=("realistic", "uniform"),
                        help="bench/workload.py's mix, or the former grey 1191x1684 PNGs of 700 tokens")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--name", default="e2e")
    parser.add_argument("--config", default="gpu-shared.yaml",
                        help="a one-GPU config of deployments/configs, or a path (gpu-shared-one-encoder.yaml: "
                        "both encoder paths in one process)")
    parser.add_argument("--family", default="deepseek-ocr", choices=("deepseek-ocr", "deepseek-ocr-2"),
                        help="the random checkpoint's vision encoder (DeepSeek-OCR 2: DeepEncoder V2)")
    parser.add_argument("--checkpoint", help="the real-dims random checkpoint's directory: "
                        "written there unless it has one already (runs in one session share it)")
    parser.add_argument("--profile_window", type=float, default=0, metavar="SECONDS",
                        help=f"a profile window of SECONDS on the Decoder {WINDOW_AFTER_S} s into each level "
                        "(DecoderServer.profile: its engine thread's steps and stack samples)")
    opts = parser.parse_args(argv)
    global PORT, URL  # the helpers above read them
    PORT, URL = opts.port, f"http://127.0.0.1:{opts.port}"
    work = tempfile.mkdtemp(prefix="e2e-")
    levels = (4,) if opts.smoke else tuple(int(c) for c in opts.levels.split(","))
    reps = opts.reps or (1 if opts.smoke else 3)
    config_name = "cpu-tiny.yaml" if opts.smoke else opts.config
    checkpoint = None
    if not opts.smoke:
        import torch

        from decoder.config import DecoderArgs
        from deployments.model_source import write_random_model
        from encoder.config import EncoderArgs, EncoderV2Args
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --smoke)"
        checkpoint = opts.checkpoint or os.path.join(work, "ckpt")
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            start = time.perf_counter()
            vision = EncoderV2Args() if opts.family == "deepseek-ocr-2" else EncoderArgs()
            write_random_model(checkpoint, vision, DecoderArgs())
            print(f"checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
    shipped = config_path(config_name)
    config = os.path.join(work, "serve.yaml")
    overrides = serve_config(shipped, config, checkpoint)

    counts = {c: (5 if c == 1 else 3 * c) for c in levels}
    start = time.perf_counter()
    if opts.workload == "realistic":
        items = make_workload(sum(counts.values()), opts.seed, workers=os.cpu_count() or 1)
    else:
        items = uniform_workload(sum(counts.values()), opts.seed)
    if opts.smoke:
        items = smoke_lengths(items)
    print(f"{len(items)} pages made in {time.perf_counter() - start:.0f} s", flush=True)
    pages, at = {}, 0
    for c in levels:
        pages[c], at = items[at:at + counts[c]], at + counts[c]
    first_tokens = max(2, FIRST_PAGE_TOKENS // 100) if opts.smoke else FIRST_PAGE_TOKENS

    date = datetime.date.today().isoformat()
    name = f"{opts.name}-smoke" if opts.smoke else opts.name
    inherited = {k: v for k, v in os.environ.items() if k.startswith(RECORDED_ENV_PREFIXES)}
    setup = {"config": os.path.relpath(shipped, ROOT), "overrides": overrides,
             "command": "deepseek-ocr serve <config> (python -m deployments)",
             "environment_set": {}, "environment_inherited": inherited, "gpus": gpu_names(),
             "weights": "tiny random" if opts.smoke else "random, real dims", "family": opts.family,
             "checkpoint_page_cache": "evicted before each start (fsync, posix_fadvise DONTNEED)"
             if checkpoint else None,
             "workload": opts.workload, "seed": opts.seed, "pages_per_level": counts, "levels": list(levels),
             "first_page": f"grey 1191x1684 PNG, max_tokens {first_tokens}",
             "max_tokens": "each page's own (bench/workload.py)" + (", /100 (smoke)" if opts.smoke else ""),
             "repetitions": reps, "decoder_profile_window_s": opts.profile_window or None}
    done = []

    def write(summary: dict, rows: dict) -> None:
        write_result(opts.out, name, {
            "benchmark": f"end to end over HTTP, one GPU ({config_name}), as a user runs it",
            "date": date, "setup": setup, "workload": describe(items), "summary": summary,
            "concurrency": rows, "reps": done})
    with open(os.path.join(work, "startup.log"), "w") as startup_log:
        for rep in range(reps):
            startup_log.write(f"=== repetition {rep + 1} ===\n")
            done.append(repetition(config, levels, pages, uniform_page("first page"), first_tokens, work,
                                   checkpoint, startup_log, opts.profile_window))
            summary, rows = summarize(done, levels)
            write(summary, rows)
    # The in-process twin of a page alone's first token, once the app has let go of the device.
    from deployments.model_source import resolve_checkpoint
    twin = in_process_first_token(checkpoint or resolve_checkpoint(None)[0], ALONE_PAGES,
                                  "cpu" if opts.smoke else "cuda")
    ratio = summary["one_page_streamed_ttft_s"] / twin["first_token_s_p50"]
    summary.update(in_process_first_token=twin, ttft_vs_in_process=ratio)
    summary["met"]["ttft_vs_in_process"] = ratio <= TARGETS["ttft_vs_in_process"]
    print(f"first token in process {twin['first_token_s_p50']:.3f} s: served {ratio:.2f}x", flush=True)
    write(summary, rows)
    if not opts.smoke:  # Ray's and the replicas' start-up lines, timestamped: where it went
        shutil.copy(startup_log.name, os.path.join(opts.out, f"{name}-{date}-startup.log"))
        plot(rows, os.path.join(opts.out, f"{name}-{date}.png"))  # matplotlib: the bench extra


def log_errors(path: str, lines: int = 120) -> str:
    """The last tracebacks and error lines of the `serve run` log."""
    marks = ("Traceback", "Error", "error", "Exception", '  File "', "raise ")
    found = [line.rstrip() for line in open(path, errors="replace") if any(m in line for m in marks)]
    return "\n".join(["--- serve run log, error lines:"] + found[-lines:])


def wait_for_first_page(server, started: float, png: bytes, max_tokens: int,
                        log_path: str) -> tuple[float, float | None, dict]:
    """(seconds from `serve run` to the first page answered, to the first 200 of /ready, the
    page's `ocr` answer: its stage times in the app, its first prefill and decode steps
    included). The page goes out as soon as a Router answers /health and waits in the app for
    the tiers still starting, as a client's first request does (refusals are retried); /ready is
    polled beside it, as a load balancer would (200 once every tier is up)."""
    ready_at: list[float] = []

    def poll_ready():
        while not ready_at and server.poll() is None:
            try:
                if requests.get(f"{URL}/ready", timeout=5).status_code == 200:
                    ready_at.append(time.perf_counter() - started)
            except requests.RequestException:
                pass
            time.sleep(0.2)
    poller = threading.Thread(target=poll_ready, daemon=True)
    poller.start()
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"serve run exited with {server.returncode}: see {log_path}\n"
                               + open(log_path).read()[-3000:])
        try:
            if requests.get(f"{URL}/health", timeout=5).status_code == 200:
                answer = ocr(png, max_tokens)
                answered = time.perf_counter() - started
                poller.join(timeout=30)
                return answered, (ready_at or [None])[0], answer
        except requests.RequestException:
            pass
        time.sleep(0.2)


if __name__ == "__main__":
    main()
