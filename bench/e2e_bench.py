"""The whole app end to end on one GPU: `serve run` of a GPU config, pages over HTTP.

    python bench/e2e_bench.py [--out bench/results]      # needs ray[serve] and a GPU
    python bench/e2e_bench.py --smoke                     # CPU, tiny model: checks the script

Writes a real-dims random checkpoint in the released layout (vision + DeepSeek-3B-MoE + a
byte-level tokenizer.json with DeepSeek's special-token ids), then `serve run`s
deployments/configs/gpu-shared.yaml (all tiers on one GPU; or --config) with that checkpoint
and the overrides below, and sends A4 document pages (1191 x 1684, text-like, each one
different, so the router's encoder cache never hits) as JSON over HTTP at 1, 16, 64 and 256
requests in flight, each generating 700 tokens (max_tokens 700; the random model does not stop
early). Reports pages/s, generated tokens/s, p50 / p99 latency per concurrency and the cold
start (from `serve run` to the first answered page, sent as soon as a Router answers /health,
and to the first 200 of /ready; `serve run` with RAY_preload_python_modules set, as
cluster.yaml's workers have it, unless --no_preload, and an empty Triton kernel cache, as a fresh
node has, unless --warm_triton_cache). Writes e2e-<date>.json (top-level `summary`),
e2e-<date>.png (pages/s and p50 / p99 against concurrency) and e2e-<date>-startup.log (`serve
run`'s log up to the first answered page: Ray's, Serve's and each replica's start-up, timed).
"""
from __future__ import annotations

import argparse
import base64
import datetime
import io
import os
import random
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
from bench.common import RESULTS, write_result  # noqa: E402
from deployments import PRELOAD_MODULES  # noqa: E402

PORT = 8000  # --port: HTTP on 127.0.0.1
URL = f"http://127.0.0.1:{PORT}"
GENERATED = 700
CONCURRENCY = (1, 16, 64, 256)
TARGETS = {"pages_per_s_best": 20.0, "cold_start_s": 30.0}
# What the bench changes in gpu-shared.yaml so 256 pages can be in flight at once: the router's
# queues (the decoder's defaults already take 256 sequences: its KV cache is paged).
OVERRIDES = {"args": {"max_inflight_requests": 1024},
             "deployments": {"Router": {"max_ongoing_requests": 1024}}}


def page_png(seed: int, size=(1191, 1684)) -> bytes:
    """A white page of text-like lines (random words), as a scanned document looks to a codec."""
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    page = Image.new("L", size, 255)
    draw = ImageDraw.Draw(page)
    for y in range(80, size[1] - 80, 28):
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                         for _ in range(rng.randint(6, 14)))
        draw.text((70, y), words, fill=0)
    buffer = io.BytesIO()
    page.save(buffer, "PNG")
    return buffer.getvalue()


def serve_config(path: str, checkpoint: str | None, smoke: bool, routers: int | None = None,
                 name: str = "gpu-shared.yaml") -> str:
    """The config `name` (gpu-shared.yaml) with the checkpoint and OVERRIDES (smoke:
    cpu-tiny.yaml, the tiny model); `routers`: that many Router replicas from the start
    (autoscaling's minimum)."""
    name = "cpu-tiny.yaml" if smoke else name
    with open(os.path.join(ROOT, "deployments", "configs", name)) as f:
        config = yaml.safe_load(f)
    app = config["applications"][0]
    app.setdefault("args", {}).update(OVERRIDES["args"])
    if checkpoint:
        app["args"]["checkpoint"] = checkpoint
    deployments = {d["name"]: d for d in app.setdefault("deployments", [])}
    for name, fields in OVERRIDES["deployments"].items():
        deployments.setdefault(name, {"name": name}).update(fields)
    if routers:
        router = deployments["Router"]
        router.setdefault("autoscaling_config", {})["min_replicas"] = routers
        router["autoscaling_config"]["max_replicas"] = max(routers, router["autoscaling_config"].get("max_replicas", 1))
    app["deployments"] = list(deployments.values())
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": PORT}
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def ocr(png: bytes, max_tokens: int, timings: dict | None = None) -> tuple[float, int]:
    """(seconds, generated tokens) of one page; `timings` gets the app's stage times (ms)."""
    body = {"image": base64.b64encode(png).decode(), "max_tokens": max_tokens, "timeout_s": 3600}
    start = time.perf_counter()
    response = requests.post(f"{URL}/v1/ocr", json=body, timeout=3700)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    if timings is not None:
        timings.update(response.json()["timings"])
    return elapsed, response.json()["usage"]["completion_tokens"]


def load(pages: list[bytes], concurrency: int, max_tokens: int) -> dict:
    """All `pages` with `concurrency` requests in flight."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda png: ocr(png, max_tokens), pages))
    seconds = time.perf_counter() - start
    latencies = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    return {"pages": len(pages), "seconds": seconds, "pages_per_s": len(pages) / seconds,
            "tokens_per_s": tokens / seconds, "generated_tokens": tokens,
            "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def plot(rows: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = [int(c) for c in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [rows[str(c)]["pages_per_s"] for c in levels], "o-")
    left.set(xscale="log", xlabel="requests in flight", ylabel="pages/s", title="throughput")
    for key in ("p50_s", "p99_s"):
        right.plot(levels, [rows[str(c)][key] for c in levels], "o-", label=key[:3])
    right.set(xscale="log", xlabel="requests in flight", ylabel="seconds", title="latency")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few pages")
    parser.add_argument("--port", type=int, default=8000, help="the app's HTTP port on 127.0.0.1")
    parser.add_argument("--levels", default=",".join(map(str, CONCURRENCY)),
                        help="requests in flight to measure, e.g. 64,256")
    parser.add_argument("--routers", type=int, default=None,
                        help="Router replicas from the start (default: the config's autoscaling)")
    parser.add_argument("--name", default="e2e")
    parser.add_argument("--config", default="gpu-shared.yaml",
                        help="a one-GPU config of deployments/configs (gpu-shared-one-encoder.yaml: "
                        "both encoder paths in one process)")
    parser.add_argument("--family", default="deepseek-ocr", choices=("deepseek-ocr", "deepseek-ocr-2"),
                        help="the random checkpoint's vision encoder (DeepSeek-OCR 2: DeepEncoder V2)")
    parser.add_argument("--checkpoint", help="the real-dims random checkpoint's directory: "
                        "written there unless it has one already (runs in one session share it)")
    parser.add_argument("--no_preload", action="store_true", help="Ray's workers do not import "
                        "the app's modules ahead (RAY_preload_python_modules unset)")
    parser.add_argument("--warm_triton_cache", action="store_true", help="`serve run` keeps this "
                        "machine's Triton kernel cache (default: an empty one, as on a fresh node, so "
                        "the cold start includes compiling the app's kernels)")
    opts = parser.parse_args(argv)
    global PORT, URL  # the helpers above read them
    PORT, URL = opts.port, f"http://127.0.0.1:{opts.port}"
    work = tempfile.mkdtemp(prefix="e2e-")
    checkpoint, levels, max_tokens = None, tuple(int(c) for c in opts.levels.split(",")), GENERATED
    if opts.smoke:
        levels, max_tokens = (1, 4), 8
    else:
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
    config = serve_config(os.path.join(work, "serve.yaml"), checkpoint, opts.smoke, opts.routers,
                          opts.config)
    counts = {c: (5 if c == 1 else 2 * c) for c in levels}
    pages = {c: [page_png(1000 * c + i) for i in range(n)] for c, n in counts.items()}
    first_page = page_png(7)
    # `serve run` as this interpreter runs it (a carried Ray's console scripts may name another)
    serve_run = [sys.executable, "-m", "ray.serve.scripts", "run", config]
    log = open(os.path.join(work, "serve.log"), "w")
    env = dict(os.environ)
    env.pop("RAY_preload_python_modules", None)
    if not opts.no_preload:
        env["RAY_preload_python_modules"] = PRELOAD_MODULES
    if not opts.warm_triton_cache:
        env["TRITON_CACHE_DIR"] = os.path.join(work, "triton-cache")
    started = time.perf_counter()
    server = subprocess.Popen(serve_run, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        first_page_ms: dict = {}
        cold_start, ready_s = wait_for_first_page(server, started, first_page, max_tokens, log.name,
                                                  first_page_ms)
        print(f"cold start {cold_start:.1f} s (/ready 200 at {ready_s} s)", flush=True)
        if not opts.smoke:  # Ray's and the replicas' start-up lines, timestamped: where it went
            log.flush()
            shutil.copy(log.name, os.path.join(
                opts.out, f"{opts.name}-{datetime.date.today().isoformat()}-startup.log"))
        rows = {}
        for c in levels:
            rows[str(c)] = load(pages[c], c, max_tokens)
            print(f"c{c}: {rows[str(c)]['pages_per_s']:.2f} pages/s, {rows[str(c)]['tokens_per_s']:.0f} "
                  f"tokens/s, p50 {rows[str(c)]['p50_s']:.2f} s, p99 {rows[str(c)]['p99_s']:.2f} s", flush=True)
        stats = requests.get(f"{URL}/ready", timeout=30).json()["tiers"]
    except Exception:  # the app's side of a failure is in its log (replica logs included)
        log.flush()
        print(log_errors(log.name), flush=True)
        raise
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    best = max(rows.values(), key=lambda r: r["pages_per_s"])
    summary = {"pages_per_s_c64": rows.get("64", {}).get("pages_per_s"),
               "pages_per_s_best": best["pages_per_s"],
               "best_concurrency": int(max(rows, key=lambda c: rows[c]["pages_per_s"])),
               "p50_s_c1": rows.get("1", {}).get("p50_s"),
               "tokens_per_s_best": max(r["tokens_per_s"] for r in rows.values()),
               "cold_start_s": cold_start, "ready_s": ready_s,
               "first_page_timings_ms": first_page_ms, "targets": TARGETS,
               "met": {"pages_per_s_best": best["pages_per_s"] >= TARGETS["pages_per_s_best"],
                       "cold_start_s": cold_start <= TARGETS["cold_start_s"]}}
    date = datetime.date.today().isoformat()
    name = f"{opts.name}-smoke" if opts.smoke else opts.name
    write_result(opts.out, name, {
        "benchmark": f"end to end over HTTP, one GPU ({opts.config})", "date": date,
        "setup": {"config": f"deployments/configs/{opts.config}" if not opts.smoke else "cpu-tiny.yaml",
                  "overrides": OVERRIDES, "routers": opts.routers, "page": "1191x1684 PNG (text-like, distinct)",
                  "preload_modules": None if opts.no_preload else PRELOAD_MODULES,
                  "triton_cache": "this machine's" if opts.warm_triton_cache else "empty (a fresh node's)",
                  "max_tokens": max_tokens, "requests_per_level": counts, "family": opts.family,
                  "weights": "random, real dims" if not opts.smoke else "tiny random"},
        "summary": summary, "concurrency": rows, "tiers": stats})
    if not opts.smoke:  # matplotlib is the bench extra, not on CI's machine
        plot(rows, os.path.join(opts.out, f"{name}-{date}.png"))


def log_errors(path: str, lines: int = 120) -> str:
    """The last tracebacks and error lines of the `serve run` log."""
    marks = ("Traceback", "Error", "error", "Exception", '  File "', "raise ")
    found = [line.rstrip() for line in open(path, errors="replace") if any(m in line for m in marks)]
    return "\n".join(["--- serve run log, error lines:"] + found[-lines:])


def wait_for_first_page(server, started: float, png: bytes, max_tokens: int, log_path: str,
                        timings: dict) -> tuple[float, float | None]:
    """(seconds from `serve run` to the first page answered, to the first 200 of /ready). The
    page goes out as soon as a Router answers /health and waits in the app for the tiers still
    starting, as a client's first request does (refusals are retried); /ready is polled beside
    it, as a load balancer would (200 once every tier is up). `timings` gets the first page's
    stage times in the app (its first prefill and decode steps included)."""
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
                ocr(png, max_tokens, timings)
                answered = time.perf_counter() - started
                poller.join(timeout=30)
                return answered, (ready_at or [None])[0]
        except requests.RequestException:
            pass
        time.sleep(0.2)


if __name__ == "__main__":
    main()
