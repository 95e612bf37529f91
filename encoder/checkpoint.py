"""The vision half of a released-layout DeepSeek-OCR checkpoint: load it, or draw it at random.

Reading, validation and writing go through `common.checkpoint` (shared with the decoder). This
module reads only the vision keys; the language keys (`model.embed_tokens`, `model.layers.*`,
`model.norm`, `lm_head`) belong to the decoder.
"""
from __future__ import annotations

import os
import time

import torch

from common.checkpoint import (CheckpointError, build_module, check_state_dict, meta_module,
                               random_state_dict, read_config, read_tensors, save_checkpoint)

from .config import EncoderArgs
from .model import DeepEncoder

VISION_PREFIXES = ("model.sam_model.", "model.vision_model.", "model.projector.",
                   "model.image_newline", "model.view_seperator")
# CLIP's non-learned position-ids buffer: checkpoints re-saved by transformers (every fine-tune)
# carry it. It must be 0..N-1; then it is dropped (the model computes positions itself).
POSITION_IDS = "model.vision_model.embeddings.position_ids"


def _is_vision_key(key: str) -> bool:
    return key.startswith(VISION_PREFIXES)


def load_encoder(path: str | os.PathLike, device="cpu", dtype=torch.float32,
                 timings: dict | None = None) -> DeepEncoder:
    """Build the vision encoder from a checkpoint directory (released layout) in eval mode
    (`timings`: see common.checkpoint.read_tensors; `build` is the rest, checks included)."""
    args = EncoderArgs.from_config(read_config(path))
    # dtype later: position_ids are integers
    tensors = read_tensors(path, _is_vision_key, device, timings=timings)
    start = time.perf_counter()
    position_ids = tensors.pop(POSITION_IDS, None)
    if position_ids is not None and not torch.equal(position_ids.flatten().long().cpu(),
                                                    torch.arange(position_ids.numel())):
        raise CheckpointError(f"checkpoint {os.fspath(path)}: {POSITION_IDS} is not 0..N-1")
    check_state_dict(tensors, vision_shapes(args), os.fspath(path))
    encoder = _build(args, tensors, device, dtype)
    if timings is not None:
        timings["build"] = round(time.perf_counter() - start, 2)
    return encoder


def random_encoder(args: EncoderArgs, device="cpu", dtype=torch.float32, seed: int = 0) -> DeepEncoder:
    """A random encoder without the disk round trip (benchmarks at real dims); on CPU it equals
    write_random_checkpoint + load_encoder of the same seed."""
    return _build(args, random_state_dict(vision_shapes(args), seed, device), device, dtype)


def _build(args: EncoderArgs, tensors: dict[str, torch.Tensor], device, dtype) -> DeepEncoder:
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    return build_module(lambda: DeepEncoder(args), state, device, dtype)


def vision_shapes(args: EncoderArgs) -> dict[str, torch.Size]:
    model = meta_module(lambda: DeepEncoder(args))
    return {f"model.{k}": v.shape for k, v in model.state_dict().items()}


def write_random_checkpoint(path, config: EncoderArgs, seed: int = 0, *,
                            dtype=torch.bfloat16, num_shards: int | None = None,
                            extra_config: dict | None = None,
                            extra_tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write a randomly initialised vision checkpoint in the released layout at `config`'s dims.

    bf16 by default, like the release. `extra_config` / `extra_tensors` add other keys (tests
    check that the loader ignores language keys). A whole model (vision + language +
    tokenizer.json) is `deployments.model_source.write_random_model`. Returns the directory.
    """
    tensors = {k: v.to(dtype) for k, v in random_state_dict(vision_shapes(config), seed).items()}
    tensors.update(extra_tensors or {})
    save_checkpoint(path, config.to_config() | (extra_config or {}), tensors, num_shards)
    return os.fspath(path)
