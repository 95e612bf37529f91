"""Offline OCR on Ray Data (`deployments.offline.ocr_dataset`, what `deepseek-ocr batch` runs)
on the realistic mix, on one machine: pages/s and output tokens/s, and each Ray Data operator's
share of the run as Ray Data reports it.

    python bench/batch_bench.py --checkpoint /tmp/ckpt                   # one GPU: its shares below
    python bench/batch_bench.py --smoke                                  # CPU, tiny model: checks the script
    python bench/batch_bench.py ... --service bench/results/e2e-<date>.json --decoder bench/results/decoder-<date>.json
    python bench/batch_bench.py --ratios bench/results/batch-<date>.json --service ... --decoder ...  # runs of separate calls

The pages are bench/workload.py's mix (the e2e bench's, seed 0), each with its own `max_tokens`
(a `max_tokens` column: random weights never stop early, so each page generates exactly that),
as bytes in a dataset (`ray.data.from_items`): no HTTP, no admission. The stages are what
`deepseek-ocr batch` runs on a GPU when given no layout (`deployments.offline.default_layout`):
one actor per encoder path at 0.25 of the card each, `--decoders` Decoder actors at 0.5, their
allocators capped as the shipped gpu-shared.yaml caps its tiers' (0.15 / 0.25 / 0.5). The clock runs over the whole job, the actors' start, loading
and graph capture included (what a corpus job takes; rows reach the driver a Decode batch of
hundreds of pages at a time, so no steadier window can be read off them), so the ratios below
are the offline path's lower bound against the service's warm levels. Given the e2e bench's and the in-process decoder's
JSONs of the same machine and code, the summary adds issue 55's ratios of the median job (`--reps`,
default 3, each on a fresh Ray) (targets: >= 1.2x the
service, >= 0.9x the in-process decoder, tokens/s).

Writes bench/results/<name>-<date>.json with a top-level `summary`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, code_state, gpu_names, write_result  # noqa: E402
from bench.workload import describe, make_workload, smoke_lengths  # noqa: E402

TARGETS = {"to_service_tokens_per_s": 1.2, "to_inprocess_tokens_per_s": 0.9}


def pages(n: int, seed: int, smoke: bool) -> list:
    items = make_workload(n, seed, workers=os.cpu_count() or 1)
    return smoke_lengths(items) if smoke else items


def run(items: list, config, stages) -> dict:
    """Every page through `ocr_dataset`, rows counted as they stream out: the timings."""
    import ray

    from deployments.offline import ocr_dataset
    rows = [{"path": f"page-{i}.{item.format}", "bytes": item.image, "max_tokens": item.max_tokens}
            for i, item in enumerate(items)]
    ds = ocr_dataset(ray.data.from_items(rows), config=config, stages=stages)
    start, first, tokens, answered, errors = time.perf_counter(), None, 0, 0, []
    for row in ds.iter_rows():
        first = first or time.perf_counter()
        answered += 1
        tokens += row["completion_tokens"] or 0
        if row["error"]:
            errors.append(row["error"])
    seconds = time.perf_counter() - start
    return {"pages": answered, "generated_tokens": tokens, "errors": errors[:10], "error_count": len(errors),
            "seconds": seconds, "until_first_page_s": first - start, "pages_per_s": answered / seconds,
            "tokens_per_s": tokens / seconds, "ray_data_stats": ds.stats()}


def ratios(summary: dict, service: dict | None, decoder: dict | None) -> dict:
    """Issue 55's ratios against the service's tokens/s at 256 in flight (the median of its
    runs) and the in-process decoder's, where those JSONs ran on this card and code."""
    from bench.side_by_side import runs_c256, same_code
    against = {}
    if service:
        against["to_service_tokens_per_s"] = (service, set(service["setup"]["gpus"]),
                                              statistics.median(runs_c256([service])))
    if decoder:
        against["to_inprocess_tokens_per_s"] = (decoder, {decoder["device"]}, decoder["summary"]["tokens_per_s_c256"])
    out = {}
    for key, (result, cards, tokens_per_s) in against.items():
        if cards != {summary["gpu"]}:
            raise ValueError(f"{key}: the input ran on {sorted(cards)}, this run on {summary['gpu']}")
        same_code(result, {"code": summary["code"]})
        out[key] = summary["tokens_per_s"] / tokens_per_s
    out["met"] = {key: out[key] >= target for key, target in TARGETS.items() if key in out}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=2048, help="enough that the start is a small part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="the real-dims random checkpoint (written here if missing)")
    parser.add_argument("--encoders", type=int, default=1, help="actors per encoder path")
    parser.add_argument("--decoders", type=int, default=1)
    parser.add_argument("--service", help="e2e_bench's JSON of this machine and code (a ratio)")
    parser.add_argument("--decoder", help="decoder_bench --workload realistic's JSON of this machine and code")
    parser.add_argument("--reps", type=int, default=3, help="whole jobs, each on a fresh Ray; medians reported")
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny model, 8 pages: checks the script")
    parser.add_argument("--ratios", metavar="BATCH_JSON", help="no run: add --service's and --decoder's ratios "
                        "to this bench's JSON of the same machine and code (runs made in separate calls)")
    parser.add_argument("--name", default="batch")
    parser.add_argument("--out", default=RESULTS)
    opts = parser.parse_args(argv)
    if opts.ratios:
        with open(opts.ratios) as f:
            result = json.load(f)
        summary = {k: v for k, v in result["summary"].items() if k not in ("met", "targets")}
        summary |= ratios(summary | {"code": result["code"]}, load(opts.service), load(opts.decoder))
        result["summary"] = summary | {"targets": TARGETS}
        result["setup"]["inputs"] = {"service": opts.service, "decoder": opts.decoder}
        write_result(opts.out, opts.name, result)
        return
    import ray

    from deployments.offline import default_layout
    checkpoint = None  # the smoke's: the tiny random model on CPU
    if not opts.smoke:
        import torch

        from decoder.config import DecoderArgs
        from deployments.model_source import write_random_model
        from encoder.config import EncoderArgs
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --smoke)"
        checkpoint = opts.checkpoint or os.path.join(tempfile.mkdtemp(), "ckpt")
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            write_random_model(checkpoint, EncoderArgs(), DecoderArgs())
    n = 8 if opts.smoke else opts.pages
    items = pages(n, opts.seed, opts.smoke)
    # What `deepseek-ocr batch` runs with no layout given: on a GPU, one card shared.
    stages, config = default_layout(checkpoint, 0 if opts.smoke else 1, encoders=opts.encoders,
                                    decoders=opts.decoders)
    gpus, code, runs = gpu_names(), code_state(), []
    service, decoder = load(opts.service), load(opts.decoder)
    for _ in range(opts.reps):
        ray.init(num_cpus=4 if opts.smoke else None, include_dashboard=False, log_to_driver=False)
        try:
            runs.append(run(items, config, stages))
        finally:
            ray.shutdown()
        middle = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]  # a run's own figures
        summary = {"gpu": gpus[0] if gpus else "cpu (smoke)", "pages_per_s": middle["pages_per_s"],
                   "tokens_per_s": middle["tokens_per_s"], "pages": middle["pages"],
                   "error_count": sum(r["error_count"] for r in runs),
                   "until_first_page_s": middle["until_first_page_s"], "smoke": opts.smoke,
                   "runs_tokens_per_s": [r["tokens_per_s"] for r in runs], "repetitions": len(runs)}
        summary |= ratios(summary | {"code": code}, service, decoder)
        summary["targets"] = TARGETS
        write_result(opts.out, f"{opts.name}-smoke" if opts.smoke else opts.name, {
            "benchmark": "offline OCR on Ray Data (issue 55)", "date": datetime.date.today().isoformat(),
            "summary": summary, "code": code,
            "setup": {"gpus": gpus, "stages": dataclasses.asdict(stages), "checkpoint": "tiny random"
                      if opts.smoke else "random, real dims", "reps": opts.reps,
                      "memory_caps": {k: v for k, v in config.model_dump().items()
                                      if k.startswith("gpu_memory_fraction")},
                      "pages": n, "seed": opts.seed, "inputs": {"service": opts.service, "decoder": opts.decoder}},
            "workload": describe(items), "run": middle, "runs": runs})


def load(path: str | None) -> dict | None:
    if path:
        with open(path) as f:
            return json.load(f)


if __name__ == "__main__":
    main()
