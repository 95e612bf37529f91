"""Load the released DeepSeek-OCR checkpoint layout; write random checkpoints in that layout.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Key names are the released ones, unchanged. This module reads
only the vision keys; the language keys (`model.embed_tokens`, `model.layers.*`, `model.norm`,
`lm_head`) belong to the decoder.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import EncoderArgs, read_config
from .model import DeepEncoder

VISION_PREFIXES = ("model.sam_model.", "model.vision_model.", "model.projector.",
                   "model.image_newline", "model.view_seperator")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint directory does not hold what the model needs; the message lists it all."""


def _listing(title: str, items: list[str], limit: int = 20) -> str:
    shown = items[:limit] + ([f"... and {len(items) - limit} more"] if len(items) > limit else [])
    return f"{title} ({len(items)}):\n  " + "\n  ".join(shown)


def checkpoint_files(path: str | os.PathLike) -> dict[str, str]:
    """Map every tensor key to the safetensors file (full path) that holds it."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        missing = sorted({f for f in weight_map.values()
                          if not os.path.isfile(os.path.join(path, f))})
        if missing:
            raise CheckpointError(_listing(f"shards named in {INDEX_FILE} are missing", missing))
        return {k: os.path.join(path, f) for k, f in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r}")


def read_tensors(path, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Read the tensors whose keys pass `keep`, opening each shard once."""
    by_file: dict[str, list[str]] = {}
    for key, file in checkpoint_files(path).items():
        if keep(key):
            by_file.setdefault(file, []).append(key)
    tensors = {}
    for file, keys in by_file.items():
        with safe_open(file, "pt") as f:
            present = set(f.keys())
            absent = [k for k in keys if k not in present]
            if absent:
                raise CheckpointError(_listing(f"keys listed in the index are not in {file}", absent))
            tensors.update((k, f.get_tensor(k)) for k in keys)
    return tensors


def check_state_dict(found: dict[str, torch.Tensor], expected: dict[str, torch.Size],
                     where: str) -> None:
    """One error naming every missing, unexpected and mis-shaped key."""
    problems = []
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    shapes = sorted(f"{k}: checkpoint {tuple(found[k].shape)}, model {tuple(expected[k])}"
                    for k in found.keys() & expected.keys() if found[k].shape != expected[k])
    if missing:
        problems.append(_listing("missing keys", missing))
    if unexpected:
        problems.append(_listing("unexpected keys", unexpected))
    if shapes:
        problems.append(_listing("shape mismatches", shapes))
    if problems:
        raise CheckpointError(f"checkpoint {where} does not match the model:\n" + "\n".join(problems))


def _is_vision_key(key: str) -> bool:
    return key.startswith(VISION_PREFIXES)


def load_encoder(path: str | os.PathLike, device="cpu", dtype=torch.float32) -> DeepEncoder:
    """Build the vision encoder from a checkpoint directory (released layout) in eval mode."""
    args = EncoderArgs.from_config(read_config(path))
    tensors = read_tensors(path, _is_vision_key)
    check_state_dict(tensors, vision_shapes(args), os.fspath(path))
    return _build(args, tensors, device, dtype)


def random_encoder(args: EncoderArgs, device="cpu", dtype=torch.float32, seed: int = 0) -> DeepEncoder:
    """A random encoder without the disk round trip (benchmarks at real dims); on CPU it equals
    write_random_checkpoint + load_encoder of the same seed."""
    return _build(args, random_state_dict(vision_shapes(args), seed, device), device, dtype)


def _build(args: EncoderArgs, tensors: dict[str, torch.Tensor], device, dtype) -> DeepEncoder:
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    return build_module(lambda: DeepEncoder(args), state, device, dtype)


def build_module(make, state: dict[str, torch.Tensor], device, dtype):
    """`make()` on the meta device (no init cost), then the given weights, strictly, in eval mode."""
    with torch.device("meta"):
        model = make()
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()},
                          strict=True, assign=True)
    return model.eval().requires_grad_(False)


# --- writing -----------------------------------------------------------------------------------
def random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Random weights that keep activations O(1) and make every parameter matter in tests
    (LayerNorm scales away from 1, non-zero biases and relative-position tables)."""
    noise = torch.randn(shape, generator=gen, device=gen.device)
    if name.endswith(".bias"):
        return 0.02 * noise
    if len(shape) == 1 and name.endswith(".weight"):  # norm scales
        return 1 + 0.1 * noise
    if any(s in name for s in ("pos_embed", "rel_pos", "position_embedding")):
        return 0.1 * noise
    if len(shape) == 1:  # class_embedding, image_newline, view_seperator
        return 0.5 * noise
    return noise / math.sqrt(math.prod(shape[1:]))  # fan-in scaling


def random_state_dict(shapes: dict[str, torch.Size], seed: int = 0,
                      device="cpu") -> dict[str, torch.Tensor]:
    """Random tensors drawn on `device` (a GPU draws the 3.3B real-dim weights in a blink; values
    then differ from a CPU draw of the same seed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {k: random_tensor(k, shape, gen) for k, shape in sorted(shapes.items())}


def vision_shapes(args: EncoderArgs) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = DeepEncoder(args)
    return {f"model.{k}": v.shape for k, v in model.state_dict().items()}


def save_checkpoint(path, config: dict, tensors: dict[str, torch.Tensor],
                    num_shards: int | None = None) -> None:
    """Write `config.json` plus one `model.safetensors`, or `num_shards` shards and an index."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards is None:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    keys = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        name = f"model-{i + 1:05d}-of-{num_shards:06d}.safetensors"
        part = keys[i::num_shards]
        save_file({k: tensors[k] for k in part}, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update((k, name) for k in part)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_random_checkpoint(path, config: EncoderArgs, seed: int = 0, *,
                            dtype=torch.bfloat16, num_shards: int | None = None,
                            extra_config: dict | None = None,
                            extra_tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write a randomly initialised checkpoint in the released layout at `config`'s dims.

    bf16 by default, like the release. `extra_config` / `extra_tensors` carry the language part
    (the decoder package adds its own). Returns the directory.
    """
    tensors = {k: v.to(dtype) for k, v in random_state_dict(vision_shapes(config), seed).items()}
    tensors.update(extra_tensors or {})
    save_checkpoint(path, config.to_config() | (extra_config or {}), tensors, num_shards)
    return os.fspath(path)

