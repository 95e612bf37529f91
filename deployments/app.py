"""The application: Router -> (GlobalEncoder, LocalEncoder; or one Encoder; or the encoder in
the Router's process) -> Decoder.

    serve run deployments.app:app                        # tiny random model, CPU
    serve run deployments.app:build checkpoint=/path/to/DeepSeek-OCR max_images=32
    serve run deployments/configs/gpu-shared.yaml        # placements and autoscaling

The builder's arguments are `AppConfig` (deployments/config.py: every default and limit).
Replica counts, GPUs and autoscaling belong in the Serve config YAMLs; the decorators carry only
code defaults (a quarter CPU each, so the four replicas of the tiny CPU app fit on 2 cores).
"""
# No `from __future__ import annotations`: Serve reads the builder's argument type at runtime.
import os

import ray
from ray.serve import Application

from . import STARTUP_ENVIRONMENT

# `serve run deployments.app:...` imports this module before it starts its local Ray cluster,
# whose processes inherit this environment (deployments/__init__.py says what it does).
if not ray.is_initialized():
    for name, value in STARTUP_ENVIRONMENT.items():
        os.environ.setdefault(name, value)

from .config import AppConfig, ServedModel
from .decoder_server import DecoderServer
from .encoders import PathEncoder
from .model_source import check_model_config, is_tiny
from .placement import ModelTiers
from .router import Router


def build(config: AppConfig) -> Application:
    for model in config.served_models():
        checkpoint = model.config.checkpoint
        if is_tiny(checkpoint):  # a tiny random model, written where its replicas start
            continue
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            # Checked here, where the app is built, so `serve run` stops with this message
            # instead of every replica failing its constructor over and over.
            raise FileNotFoundError(f"checkpoint {checkpoint!r} has no config.json: give the "
                                    f"local directory of DeepSeek-OCR's released files (config.json, "
                                    f"model*.safetensors, tokenizer.json)")
        check_model_config(checkpoint)
    return Router.bind([model_tiers(model) for model in config.served_models()], config)


def model_tiers(model: ServedModel) -> ModelTiers:
    """One model's deployments, named for it when the app serves several (`Decoder-<name>`)."""
    config = model.config
    if config.encoder_in_router:  # both paths in the Router's own process: no encoder deployment
        encoders = [None, None]
    elif config.one_encoder:  # both paths in one deployment; the Router calls it for both
        encoders = [PathEncoder.options(name=model.tier_name("Encoder")).bind("both", config), None]
    else:
        encoders = [PathEncoder.options(name=model.tier_name(f"{path.capitalize()}Encoder")).bind(path, config)
                    for path in ("global", "local")]
    decoder = (None if config.encode_only else
               DecoderServer.options(name=model.tier_name("Decoder")).bind(config))
    return ModelTiers(model, *encoders, decoder)


app = build(AppConfig())  # `serve run deployments.app:app`: the tiny random model, on CPU
