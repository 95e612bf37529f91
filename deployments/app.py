"""The application: Router -> (GlobalEncoder, LocalEncoder) -> Decoder.

    serve run deployments.app:app                        # tiny random model, CPU
    serve run deployments.app:build checkpoint=/path/to/DeepSeek-OCR max_images=32
    serve run deployments/configs/gpu-shared.yaml        # placements and autoscaling

Builder arguments (all optional): checkpoint, encode_only (no decoder: /v1/encode and
`encode` only), max_images (graph budgets / batch limit of the encoders), max_batch and max_len
(decoder), use_graphs (encoder and decode-step CUDA graphs; default: on a GPU),
gpu_memory_fraction_{global,local,decoder} and max_graph_memory_gb. Replica counts, GPUs and
autoscaling belong in the Serve config YAML; the decorators ask for a quarter CPU each (a code
default that lets the four replicas of the tiny CPU app fit on a 2-core machine).
"""
from __future__ import annotations

from ray.serve import Application

from .decoder_server import DecoderServer
from .encoders import PathEncoder
from .router import Router

_BOOLS = {"true": True, "false": False, "1": True, "0": False, "none": None, "auto": None}


def _arg(args: dict, key: str, cast, default=None):
    value = args.get(key, default)
    if value is None or not isinstance(value, str):
        return value
    return _BOOLS[value.lower()] if cast is bool else cast(value)


def build(args: dict | None = None) -> Application:
    args = dict(args or {})
    known = {"checkpoint", "encode_only", "max_images", "max_batch", "max_len", "use_graphs",
             "max_graph_memory_gb",
             "gpu_memory_fraction_global", "gpu_memory_fraction_local", "gpu_memory_fraction_decoder"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown app arguments {sorted(unknown)}; expected some of {sorted(known)}")
    checkpoint = args.get("checkpoint") or None
    max_images = _arg(args, "max_images", int, 32)
    encoders = []
    for path in ("global", "local"):
        deployment = PathEncoder.options(name=f"{path.capitalize()}Encoder")
        encoders.append(deployment.bind(
            path, checkpoint, max_images, _arg(args, "use_graphs", bool),
            _arg(args, f"gpu_memory_fraction_{path}", float), _arg(args, "max_graph_memory_gb", float)))
    if _arg(args, "encode_only", bool, False):  # embeddings for another LM: no decoder at all
        return Router.bind(*encoders, None, checkpoint)
    decoder = DecoderServer.options(name="Decoder").bind(
        checkpoint, _arg(args, "max_batch", int, 64), _arg(args, "max_len", int),
        _arg(args, "gpu_memory_fraction_decoder", float), _arg(args, "use_graphs", bool))
    return Router.bind(*encoders, decoder, checkpoint)


app = build()  # `serve run deployments.app:app`: the tiny random model, on CPU
