"""The vision half of a released-layout DeepSeek-OCR or DeepSeek-OCR-2 checkpoint: load it, or
draw it at random.

Reading, validation and writing go through `common.checkpoint` (shared with the decoder). This
module reads only the vision keys; the language keys (`model.embed_tokens`, `model.layers.*`,
`model.norm`, `lm_head`) belong to the decoder. `config.json` says which encoder the checkpoint
holds (`config.is_ocr2_config`): DeepEncoder (`model.sam_model.*`, `model.vision_model.*`,
`model.projector.*`, `model.image_newline`, `model.view_seperator`) or DeepEncoder V2
(`model.sam_model.*`, `model.qwen2_model.*`, `model.projector.*`, `model.view_seperator`).
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch

from common.checkpoint import (CheckpointError, build_module, check_state_dict, meta_module,
                               random_state_dict, read_config, read_tensors, save_checkpoint)

from .config import EncoderArgs, EncoderV2Args, is_ocr2_config
from .model import DeepEncoder, assemble
from .model_v2 import DeepEncoderV2, assemble_v2
from .tiling import DEEPSEEK_OCR, DEEPSEEK_OCR_2, Tiling

VISION_PREFIXES = ("model.sam_model.", "model.vision_model.", "model.projector.",
                   "model.image_newline", "model.view_seperator")
# CLIP's non-learned position-ids buffer: checkpoints re-saved by transformers (every fine-tune)
# carry it. It must be 0..N-1; then it is dropped (the model computes positions itself).
POSITION_IDS = "model.vision_model.embeddings.position_ids"
# DeepSeek-OCR-2's: no CLIP and no image_newline.
V2_VISION_PREFIXES = ("model.sam_model.", "model.qwen2_model.", "model.projector.",
                      "model.view_seperator")


def _is_vision_key(key: str) -> bool:
    return key.startswith(VISION_PREFIXES)


def _is_v2_vision_key(key: str) -> bool:
    return key.startswith(V2_VISION_PREFIXES)


def load_encoder(path: str | os.PathLike, device="cpu", dtype=torch.float32,
                 timings: dict | None = None) -> DeepEncoder | DeepEncoderV2:
    """Build the vision encoder from a checkpoint directory (released layout) in eval mode
    (`timings`: see common.checkpoint.read_tensors; `build` is the rest, checks included):
    DeepEncoderV2 where config.json is DeepSeek-OCR-2's (`load_encoder_v2`), else DeepEncoder."""
    config = read_config(path)
    if is_ocr2_config(config):
        return load_encoder_v2(path, device, dtype, timings)
    args = EncoderArgs.from_config(config)
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


def load_encoder_v2(path: str | os.PathLike, device="cpu", dtype=torch.float32,
                    timings: dict | None = None) -> DeepEncoderV2:
    """Build DeepEncoder V2 from a DeepSeek-OCR-2 checkpoint directory (released layout, keys
    unchanged) in eval mode; one CheckpointError names every missing, unexpected or mis-shaped
    vision key. `timings` as `load_encoder`."""
    args = EncoderV2Args.from_config(read_config(path))
    tensors = read_tensors(path, _is_v2_vision_key, device, timings=timings)
    start = time.perf_counter()
    # RoPE's inv_freq is a non-persistent buffer in the transformers DeepSeek-OCR-2 was written
    # with: not in the release, and the model computes it (a re-save carrying it is "unexpected").
    check_state_dict(tensors, vision_shapes(args), os.fspath(path))
    encoder = _build(args, tensors, device, dtype)
    if timings is not None:
        timings["build"] = round(time.perf_counter() - start, 2)
    return encoder


def random_encoder(args: EncoderArgs | EncoderV2Args, device="cpu", dtype=torch.float32,
                   seed: int = 0) -> DeepEncoder | DeepEncoderV2:
    """A random encoder without the disk round trip (benchmarks at real dims); on CPU it equals
    write_random_checkpoint + load_encoder of the same seed. EncoderV2Args: DeepEncoderV2."""
    return _build(args, random_state_dict(vision_shapes(args), seed, device), device, dtype)


def _encoder_class(args: EncoderArgs | EncoderV2Args) -> type[DeepEncoder] | type[DeepEncoderV2]:
    return DeepEncoderV2 if isinstance(args, EncoderV2Args) else DeepEncoder


def _build(args: EncoderArgs | EncoderV2Args, tensors: dict[str, torch.Tensor], device,
           dtype) -> DeepEncoder | DeepEncoderV2:
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    return build_module(lambda: _encoder_class(args)(args), state, device, dtype)


def vision_shapes(args: EncoderArgs | EncoderV2Args) -> dict[str, torch.Size]:
    """Every vision key of the released layout at `args`'s dims and its shape (no allocation)."""
    model = meta_module(lambda: _encoder_class(args)(args))
    return {f"model.{k}": v.shape for k, v in model.state_dict().items()}


def write_random_checkpoint(path, config: EncoderArgs | EncoderV2Args, seed: int = 0, *,
                            dtype=torch.bfloat16, num_shards: int | None = None,
                            extra_config: dict | None = None,
                            extra_tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write a randomly initialised vision checkpoint in the released layout at `config`'s dims
    (DeepSeek-OCR's for EncoderArgs, DeepSeek-OCR-2's for EncoderV2Args).

    bf16 by default, like the release. `extra_config` / `extra_tensors` add other keys (tests
    check that the loader ignores language keys). A whole model (vision + language +
    tokenizer.json) is `deployments.model_source.write_random_model`. Returns the directory.
    """
    tensors = {k: v.to(dtype) for k, v in random_state_dict(vision_shapes(config), seed).items()}
    tensors.update(extra_tensors or {})
    save_checkpoint(path, config.to_config() | (extra_config or {}), tensors, num_shards)
    return os.fspath(path)


def load_sequence_layout(path: str | os.PathLike) -> tuple[Tiling, Callable]:
    """What a router needs of a checkpoint's encoder without loading it: its family's tiling,
    and `sequence(global_tokens, crop_tokens, grid)` laying an image's tokens out as the
    encoder's own `sequence` does (the view separator, and DeepSeek-OCR's newline, read from
    the checkpoint)."""
    if is_ocr2_config(read_config(path)):
        specials = read_tensors(path, lambda k: k == "model.view_seperator")
        return DEEPSEEK_OCR_2, functools.partial(assemble_v2, separator=specials["model.view_seperator"])
    specials = read_tensors(path, lambda k: k in ("model.image_newline", "model.view_seperator"))
    return DEEPSEEK_OCR, functools.partial(assemble, newline=specials["model.image_newline"],
                                           separator=specials["model.view_seperator"])
