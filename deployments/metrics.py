"""The app's own Prometheus metrics, through `ray.serve.metrics` (README: "Metrics").

Serve adds the `deployment`, `replica` and `application` tags and exports every series on Ray's
metrics port as `ray_<name>` (counters with a `_total` suffix), beside Serve's own request,
latency and queue series. Each deployment creates the metrics it records, once per process;
the series of a model's work carry its name (`model`): the router's stages, tokens and finish
reasons, and every encoder and decoder series (a replica serves one model).
"""
from __future__ import annotations

import statistics
from functools import cache

from ray.serve.metrics import Counter, Gauge, Histogram

MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000, 60_000, 300_000]
VIEW_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def medians(recent, keys: tuple[str, ...]) -> dict:
    """The median of each `key` over a replica's `recent` stage timings (dicts); None while
    there are none."""
    return {k: statistics.median(t[k] for t in recent) if recent else None for k in keys}


@cache
def router_metrics() -> dict:
    return {
        "requests": Counter("ocr_requests", "HTTP requests answered, by endpoint and status",
                            tag_keys=("endpoint", "status")),
        "rejections": Counter("ocr_rejections", "requests refused, by reason (overloaded, "
                              "backpressure, timeout, invalid, too_large, unauthorized, replica_lost)",
                              tag_keys=("reason",)),
        "latency": Histogram("ocr_request_latency_ms", "whole request, by endpoint",
                             boundaries=MS_BUCKETS, tag_keys=("endpoint",)),
        "stage": Histogram("ocr_stage_latency_ms", "router stages: preprocess (until the crops are "
                           "ready), encode (both paths answered), assemble, decode",
                           boundaries=MS_BUCKETS, tag_keys=("stage", "model")),
        "tokens": Counter("ocr_tokens", "tokens by kind: image, prompt, completion (every attempt's), "
                          "lost_attempts (of attempts that did not answer)", tag_keys=("kind", "model")),
        "finish": Counter("ocr_finish_reasons", "answers by final finish reason (eos, stop, length: "
                          "a page that ran to max_tokens, repetition: it looped, every retry too)",
                          tag_keys=("reason", "model")),
        "repetitions": Counter("ocr_repetition_detections", "attempts the loop detector ended",
                               tag_keys=("model",)),
        "batch_lines": Counter("ocr_batch_lines", "batch jobs' lines answered, by outcome (ok, failed)",
                               tag_keys=("outcome",)),
        "batch_batches": Counter("ocr_batches", "batch jobs ended, by status (completed, failed, "
                                 "cancelled, expired)", tag_keys=("status",)),
        "retries": Counter("ocr_retries", "attempts made again after a loop (or max_tokens, when asked)",
                           tag_keys=("model",)),
        "fallbacks": Counter("ocr_text_layer_fallbacks", "PDF pages answered with their text layer "
                             "after every attempt failed", tag_keys=("model",)),
    }


def _of_model(metrics: dict, model: str) -> dict:
    for metric in metrics.values():
        metric.set_default_tags({"model": model})
    return metrics


@cache
def encoder_metrics(model: str) -> dict:
    """An encoder replica's series, tagged with the model it serves."""
    return _of_model({
        "batch_views": Histogram("ocr_encoder_batch_views", "views per executed batch, by path",
                                 boundaries=VIEW_BUCKETS, tag_keys=("path", "model")),
        "batch_ms": Histogram("ocr_encoder_batch_ms", "encode time of one request batch, by path",
                              boundaries=MS_BUCKETS, tag_keys=("path", "model")),
        "graph_batches": Counter("ocr_encoder_graph_batches", "planned batches by path and result "
                                 "(hit: a captured graph replayed; miss: ran eagerly)",
                                 tag_keys=("path", "result", "model")),
        "tokens": Counter("ocr_encoder_tokens", "tokens computed by path and kind (real, padded: "
                          "padding fraction = padded / (real + padded))",
                          tag_keys=("path", "kind", "model")),
    }, model)


@cache
def decoder_metrics(model: str) -> dict:
    """The decoder replica's series, tagged with the model it serves."""
    model_tag = ("model",)
    return _of_model({
        "generated_tokens": Counter("ocr_decoder_generated_tokens", "tokens the decoder generated "
                                    "(counted every second as they are made)", tag_keys=model_tag),
        "running": Gauge("ocr_decoder_running", "sequences being decoded", tag_keys=model_tag),
        "waiting": Gauge("ocr_decoder_waiting", "requests waiting for a slot", tag_keys=model_tag),
        "batch_held": Gauge("ocr_decoder_batch_held", "batch jobs' requests held back below interactive "
                            "work (not yet let into the queue, or yielded their rows)", tag_keys=model_tag),
        "batch_running": Gauge("ocr_decoder_batch_running", "batch jobs' sequences being decoded",
                               tag_keys=model_tag),
        "preempted": Gauge("ocr_decoder_preempted", "sequences preempted (KV-cache pages ran "
                           "out), waiting to resume", tag_keys=model_tag),
        "kv_cache_usage": Gauge("ocr_decoder_kv_cache_usage",
                                "fraction of the KV cache's pages in use", tag_keys=model_tag),
        "queue_ms": Histogram("ocr_decoder_queue_ms", "from arrival to the start of its prefill",
                              boundaries=MS_BUCKETS, tag_keys=model_tag),
        "prefill_ms": Histogram("ocr_decoder_prefill_ms", "from the start of its prefill to its "
                                "first token", boundaries=MS_BUCKETS, tag_keys=model_tag),
        "ttft_ms": Histogram("ocr_decoder_time_to_first_token_ms", "from arrival to the first "
                             "token (queue + prefill)", boundaries=MS_BUCKETS, tag_keys=model_tag),
        "tpot_ms": Histogram("ocr_decoder_time_per_output_token_ms", "decode time per token after "
                             "the first", boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
                             tag_keys=model_tag),
    }, model)
