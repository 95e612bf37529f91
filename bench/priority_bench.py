"""Batch jobs below interactive traffic (issue 56), through the app as a user runs it: a shipped
config started by the README's command, pages over HTTP and batch jobs over the Batch API.

    python bench/priority_bench.py --checkpoint /tmp/ckpt      # one GPU: gpu-shared.yaml
    python bench/priority_bench.py --tiny --interactive 16 --in_flight 2 --lines 64   # CPU, tiny model
    python bench/priority_bench.py --smoke                     # CPU, a few pages: checks the script
    python bench/priority_bench.py --url http://host:8000      # an app already running (its config)

One `serve run` (e2e_bench's start and stop; only host, port, checkpoint and the batch store's
place changed), or the app at `--url` (the suite's smoke: its shared app), then, each `--reps`
times (medians reported), every phase on pages of its own (the Router's encoder cache never
hits: a phase after another on the same pages would skip their encoding):
1. `interactive`: `--interactive` pages with `--in_flight` requests in flight (a moderate load):
   p50 / p99 latency;
2. `batch`: `--lines` pages as one batch job (uploaded once; created, polled to `completed`):
   its lines/s from creation to completion;
3. `plain`: the same pages as plain requests, `batch_lines_in_flight` in flight: lines/s;
4. `beside`: two batch jobs of those lines created, and once their lines are in the app, phase 1
   again beside them; then both cancelled (and waited out).
Targets: interactive p50 beside the batch <= 1.1x alone; the batch's lines/s >= 0.9x plain.
Pages: bench/workload.py's mix (seed 0), each its own max_tokens (random weights never stop);
with `--tiny` (cpu-tiny.yaml, the tiny random model on CPU) a tenth of it, `--smoke` a hundredth.

Writes bench/results/<name>-<date>.json with a top-level `summary`.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import requests
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import e2e_bench  # noqa: E402
from bench.common import RESULTS, code_state, gpu_names, write_result  # noqa: E402
from bench.workload import describe, make_workload, smoke_lengths, uniform_page  # noqa: E402

TARGETS = {"interactive_p50_beside_batch": 1.1, "batch_to_plain_lines_per_s": 0.9}


def interactive(items, in_flight: int) -> dict:
    """Every item as a plain request, `in_flight` at a time (e2e_bench's level): latencies and
    pages/s."""
    row, _ = e2e_bench.load(items, in_flight)
    return {**row, "in_flight": in_flight}


def upload(items) -> str:
    """The items as a batch input file of /v1/ocr lines; its id."""
    lines = "".join(json.dumps({"custom_id": f"page-{i}", "method": "POST", "url": "/v1/ocr",
                                "body": {"image": base64.b64encode(item.image).decode(),
                                         "max_tokens": item.max_tokens}}) + "\n"
                    for i, item in enumerate(items))
    response = requests.post(f"{e2e_bench.URL}/v1/files", data={"purpose": "batch"},
                             files={"file": ("pages.jsonl", lines.encode())}, timeout=600)
    response.raise_for_status()
    return response.json()["id"]


def create(file_id: str) -> str:
    response = requests.post(f"{e2e_bench.URL}/v1/batches", timeout=60, json={
        "input_file_id": file_id, "endpoint": "/v1/ocr", "completion_window": "24h"})
    response.raise_for_status()
    return response.json()["id"]


def batch_state(batch_id: str) -> dict:
    response = requests.get(f"{e2e_bench.URL}/v1/batches/{batch_id}", timeout=60)
    response.raise_for_status()
    return response.json()


def until(batch_id: str, done, poll_s: float = 0.2, give_up_s: float = 3600) -> dict:
    start = time.perf_counter()
    while time.perf_counter() - start < give_up_s:
        state = batch_state(batch_id)
        if done(state):
            return state
        time.sleep(poll_s)
    raise RuntimeError(f"batch {batch_id} still {state['status']} after {give_up_s} s")


ENDED = ("completed", "failed", "cancelled", "expired")


def batch_alone(file_id: str, lines: int) -> dict:
    start = time.perf_counter()
    state = until(create(file_id), lambda s: s["status"] in ENDED)
    seconds = time.perf_counter() - start
    assert state["status"] == "completed", state
    return {"pages": lines, "seconds": seconds, "pages_per_s": lines / seconds,
            "request_counts": state["request_counts"]}


def beside_batch(file_ids: list[str], items, in_flight: int) -> dict:
    """Two batch jobs running, then the interactive phase beside them; both cancelled after
    (waited out, so the next repetition starts on an idle app)."""
    batches = [create(file_id) for file_id in file_ids]
    until(batches[0], lambda s: s["request_counts"]["completed"] > 0 or s["status"] in ENDED)
    before = [batch_state(b)["request_counts"]["completed"] for b in batches]
    row = interactive(items, in_flight)
    after = [batch_state(b)["request_counts"]["completed"] for b in batches]
    for b in batches:
        requests.post(f"{e2e_bench.URL}/v1/batches/{b}/cancel", timeout=60)
    ended = [until(b, lambda s: s["status"] in ENDED) for b in batches]
    row["batch_lines_done_meanwhile"] = sum(after) - sum(before)
    row["batches_cancelled"] = sum(s["status"] == "cancelled" for s in ended)  # others had ended
    return row


def serve_config(opts, shipped: str, work: str) -> tuple[str, dict]:
    """The shipped config as `serve run` takes it here (the checkpoint, written if missing, and
    the batch store in the bench's folder, not the user's home): its path and what changed."""
    checkpoint = None
    if not opts.tiny:
        from decoder.config import DecoderArgs
        from deployments.model_source import write_random_model
        from encoder.config import EncoderArgs
        checkpoint = opts.checkpoint or os.path.join(work, "ckpt")
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            write_random_model(checkpoint, EncoderArgs(), DecoderArgs())
    config = os.path.join(work, "serve.yaml")
    overrides = e2e_bench.serve_config(shipped, config, checkpoint)
    with open(config) as f:
        serve = yaml.safe_load(f)
    args = serve["applications"][0].setdefault("args", {})
    args.update(batch_store=os.path.join(work, "batches.db"), batch_files=os.path.join(work, "batch-files"))
    with open(config, "w") as f:
        yaml.safe_dump(serve, f)
    return config, overrides | {f"applications[0].args.{k}": args[k] for k in ("batch_store", "batch_files")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="the real-dims random checkpoint (written here if missing)")
    parser.add_argument("--config", default="gpu-shared.yaml")
    parser.add_argument("--interactive", type=int, default=64, help="pages of the interactive phase")
    parser.add_argument("--in_flight", type=int, default=16, help="interactive requests in flight")
    parser.add_argument("--lines", type=int, default=256, help="pages of a batch job (256 of the mix: "
                        "~160 MB, within batch_file_mb)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU: cpu-tiny.yaml, a tenth of each page's tokens")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few pages: checks the script")
    parser.add_argument("--url", help="measure the app running at this address (its own config and batch "
                        "store) instead of starting --config")
    parser.add_argument("--name", default="priority")
    parser.add_argument("--out", default=RESULTS)
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.tiny, opts.interactive, opts.in_flight, opts.lines, opts.reps = True, 4, 2, 6, 1
    if opts.tiny:
        opts.config = "cpu-tiny.yaml"
    e2e_bench.PORT, e2e_bench.URL = opts.port, opts.url or f"http://127.0.0.1:{opts.port}"
    work = tempfile.mkdtemp(prefix="priority-")
    shipped = e2e_bench.config_path(opts.config)
    config, overrides = (None, None) if opts.url else serve_config(opts, shipped, work)
    # Each repetition's pages: interactive alone, interactive beside, batch, plain, two beside batches.
    sizes = [opts.interactive, opts.interactive, opts.lines, opts.lines, opts.lines, opts.lines]
    items = make_workload(opts.reps * sum(sizes), opts.seed, workers=os.cpu_count() or 1)
    if opts.tiny:
        items = smoke_lengths(items, 100 if opts.smoke else 10)
    phases, at = [], 0
    for _ in range(opts.reps):
        phases.append([])
        for n in sizes:
            phases[-1].append(items[at:at + n])
            at += n
    in_flight_lines = yaml.safe_load(open(shipped))["applications"][0].get("args", {}).get(
        "batch_lines_in_flight", 256)

    def repetitions() -> list[dict]:
        reps = []
        for alone, beside, lines, plain, *background in phases:
            files = [upload(lines)] + [upload(more) for more in background]
            rep = {"interactive": interactive(alone, opts.in_flight), "batch": batch_alone(files[0], len(lines)),
                   "plain": interactive(plain, in_flight_lines)}
            rep["beside"] = beside_batch(files[1:], beside, opts.in_flight)
            reps.append(rep)
            print(json.dumps({k: {m: v[m] for m in ("p50_s", "pages_per_s") if m in v} for k, v in rep.items()}),
                  flush=True)
        return reps
    if opts.url:
        reps = repetitions()
    else:
        log = open(os.path.join(work, "serve.log"), "w")
        server = e2e_bench.serve_run(config, log)
        try:
            e2e_bench.wait_for_first_page(server, time.perf_counter(), uniform_page("first page"), 4, log.name)
            reps = repetitions()
        finally:
            e2e_bench.stop(server)

    def median(phase: str, key: str) -> float:
        return statistics.median(r[phase][key] for r in reps)
    gpus = gpu_names()
    summary = {"gpu": gpus[0] if gpus and not opts.tiny else "cpu (smoke)" if opts.smoke else "cpu",
               "interactive_p50_s": median("interactive", "p50_s"), "beside_p50_s": median("beside", "p50_s"),
               "batch_lines_per_s": median("batch", "pages_per_s"), "plain_lines_per_s": median("plain", "pages_per_s"),
               "batch_lines_done_beside": median("beside", "batch_lines_done_meanwhile"), "repetitions": len(reps)}
    summary["interactive_p50_beside_batch"] = summary["beside_p50_s"] / summary["interactive_p50_s"]
    summary["batch_to_plain_lines_per_s"] = summary["batch_lines_per_s"] / summary["plain_lines_per_s"]
    summary["met"] = {"interactive_p50_beside_batch": summary["interactive_p50_beside_batch"]
                      <= TARGETS["interactive_p50_beside_batch"],
                      "batch_to_plain_lines_per_s": summary["batch_to_plain_lines_per_s"]
                      >= TARGETS["batch_to_plain_lines_per_s"]}
    summary["targets"] = TARGETS
    write_result(opts.out, f"{opts.name}-smoke" if opts.smoke else opts.name, {
        "benchmark": "batch jobs below interactive traffic (issue 56)",
        "date": datetime.date.today().isoformat(), "summary": summary, "code": code_state(),
        "setup": {"config": None if opts.url else os.path.relpath(shipped, e2e_bench.ROOT), "url": opts.url,
                  "overrides": overrides, "gpus": gpus,
                  "command": None if opts.url else "deepseek-ocr serve <config> (python -m deployments)",
                  "interactive_pages": opts.interactive, "in_flight": opts.in_flight, "batch_lines": opts.lines,
                  "plain_in_flight": in_flight_lines, "reps": opts.reps, "seed": opts.seed,
                  "weights": "tiny random" if opts.tiny else "random, real dims",
                  "max_tokens": "each page's own" + (", /100" if opts.smoke else ", /10" if opts.tiny else "")},
        "workload": describe(items), "reps": reps})


if __name__ == "__main__":
    main()
