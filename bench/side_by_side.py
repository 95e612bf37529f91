"""Issue 54's figures from one machine, side by side: the service end to end (DeepSeek-OCR and
DeepSeek-OCR 2, `bench/e2e_bench.py`) against its in-process decoder (`bench/decoder_bench.py
--workload realistic`), from the JSONs those wrote on the same card and the same code; no new
timing here. A service's runs may come from several JSONs of that card and code (one call of
the device's 10 minutes holds two repetitions): their repetitions are pooled.

    python bench/e2e_bench.py --levels 64,256 --name e2e                        # the shipped config
    python bench/e2e_bench.py --levels 256 --family deepseek-ocr-2 --name e2e-ocr2
    python bench/decoder_bench.py --workload realistic --levels 64,256 --name decoder
    python bench/side_by_side.py --service bench/results/e2e-<date>.json [more e2e JSONs] \\
        --service_ocr2 bench/results/e2e-ocr2-<date>.json --decoder bench/results/decoder-<date>.json

Writes bench/results/<name>-<date>.json: its `summary` holds every figure the issue names, each
a median over the repetitions its bench ran, the card, and which targets were met."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, write_result  # noqa: E402

TARGETS = {"service_to_inprocess_c256": 0.85, "fraction_of_bound_c64": 0.85, "fraction_of_bound_c256": 0.85,
           "b1_fraction_of_bound": 0.6, "ocr2_to_ocr1_c256": 0.95,
           "one_page_s": {"H100": 0.45, "H200": 0.35}}  # a page of 700 tokens alone, through the service


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def card_of(service: dict, decoder: dict) -> str:
    """The one card every input ran on (each names its own); refuses inputs from different
    cards or code."""
    cards = {*service["setup"]["gpus"], decoder["device"]}
    if len(cards) != 1:
        raise ValueError(f"the inputs ran on different cards: {sorted(cards)}")
    return cards.pop()


def same_code(*results: dict) -> str:
    digests = {r["code"]["python_sources_sha256"] for r in results}
    if len(digests) != 1:
        raise ValueError(f"the inputs ran different code: {sorted(digests)}")
    return digests.pop()


def runs_c256(results: list[dict]) -> list[float]:
    """Every repetition's tokens/s at 256 in flight, over one or more e2e_bench results."""
    return [rep["levels"]["256"]["tokens_per_s"] for result in results for rep in result["reps"]]


def side_by_side(service: list[dict], service_ocr2: list[dict], decoder: dict) -> dict:
    """The summary (and what it was read from) of results of one machine: the service's runs
    (DeepSeek-OCR, then DeepSeek-OCR 2), each list one or more e2e_bench JSONs, and the decoder's."""
    gpu = card_of(service[0], decoder)
    if any(card_of(result, decoder) != gpu for result in service + service_ocr2):
        raise ValueError("the service's runs were on another card")
    code = same_code(*service, *service_ocr2, decoder)
    runs, runs_ocr2 = runs_c256(service), runs_c256(service_ocr2)
    served, ocr2 = statistics.median(runs), statistics.median(runs_ocr2)
    inprocess = decoder["summary"]["tokens_per_s_c256"]
    one_page = decoder["variants"][decoder["summary"]["variant"]]["one_page"]
    summary = {
        "gpu": gpu, "service_tokens_per_s_c256": served, "inprocess_tokens_per_s_c256": inprocess,
        "service_to_inprocess_c256": served / inprocess,
        "fraction_of_bound_c64": decoder["summary"].get("fraction_of_bound_c64"),
        "fraction_of_bound_c256": decoder["summary"]["fraction_of_bound_c256"],
        "b1_fraction_of_bound": one_page["decode_fraction_of_bound"],
        "one_page_s": statistics.median(r["summary"]["one_page_streamed_total_s"] for r in service),
        "one_page_inprocess_s": decoder["summary"]["one_page_s"],
        "ocr2_tokens_per_s_c256": ocr2, "ocr2_to_ocr1_c256": ocr2 / served,
        "runs": {"service_c256": runs, "service_ocr2_c256": runs_ocr2,
                 "decoder_c256": decoder["variants"][decoder["summary"]["variant"]]["256"]["repeats_tokens_per_s"]},
    }
    summary["repetitions"] = {name: len(values) for name, values in
                              zip(("service", "service_ocr2", "decoder"), summary["runs"].values())}
    page_target = next((s for card, s in TARGETS["one_page_s"].items() if card in gpu), None)
    summary["met"] = {key: summary[key] is not None and summary[key] >= target
                      for key, target in TARGETS.items() if key != "one_page_s"}
    summary["met"]["one_page_s"] = page_target is not None and summary["one_page_s"] <= page_target
    summary["targets"] = {**TARGETS, "one_page_s": page_target}
    return {"summary": summary, "code_sources_sha256": code,
            "setup": {"service": service[0]["setup"], "service_ocr2": service_ocr2[0]["setup"],
                      "decoder": {"workload": decoder["workload"], "variant": decoder["summary"]["variant"]}}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service", required=True, nargs="+", help="e2e_bench's JSONs, DeepSeek-OCR")
    parser.add_argument("--service_ocr2", required=True, nargs="+",
                        help="e2e_bench's JSONs, --family deepseek-ocr-2")
    parser.add_argument("--decoder", required=True, help="decoder_bench --workload realistic's JSON")
    parser.add_argument("--name", default="side-by-side")
    parser.add_argument("--out", default=RESULTS)
    opts = parser.parse_args(argv)
    paths = {"service": opts.service, "service_ocr2": opts.service_ocr2, "decoder": opts.decoder}
    result = side_by_side([load(p) for p in opts.service], [load(p) for p in opts.service_ocr2], load(opts.decoder))
    names = {key: [os.path.basename(p) for p in value] if isinstance(value, list) else os.path.basename(value)
             for key, value in paths.items()}
    result = {"benchmark": "the service against its in-process decoder, one machine (issue 54)",
              "date": datetime.date.today().isoformat(), "inputs": names,
              **result}
    write_result(opts.out, opts.name, result)


if __name__ == "__main__":
    main()
