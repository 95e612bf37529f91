"""What the encoder and the decoder both use: the released checkpoint layout.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`, with the released key names unchanged. `encoder/` reads the vision
keys, `decoder/` the language keys; both go through these helpers, so both halves of a checkpoint
follow the same rules and errors. Random checkpoints (tests, benchmarks, the tiny default app) are
written in the same layout.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import switches
from .safetensors_stream import SafetensorsFormatError, read_header, stream_tensors

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
        return {k: single for k in _header(single)}
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r}")


def read_tensors(path, keep: Callable[[str], bool], device="cpu",
                 dtype: torch.dtype | None = None, timings: dict | None = None) -> dict[str, torch.Tensor]:
    """Read the tensors whose keys pass `keep`, opening each shard once; each goes to `device`
    (floating-point ones to `dtype` too) as it is read, so a GPU load never holds the weights
    on the host and packs them on the device (decoder/checkpoint.py), not in CPU memory. By
    large reads, several at once (common/safetensors_stream.py), or with
    DEEPSEEK_OCR_STREAM_WEIGHTS=0 tensor by tensor from safetensors' mapping (the reference twin).
    `timings` (a dict) receives the seconds spent finding and opening the files (`open`),
    reading from them (`read`) and copying to the device (`to_device`, waited for) and the
    gigabytes read (`gb`): start-up diagnostics."""
    start = time.perf_counter()
    by_file: dict[str, list[str]] = {}
    for key, file in checkpoint_files(path).items():
        if keep(key):
            by_file.setdefault(file, []).append(key)
    open_s = time.perf_counter() - start
    read = _read_streamed if switches.on("DEEPSEEK_OCR_STREAM_WEIGHTS") else _read_mapped
    tensors, spent = read(by_file, device, dtype)
    if timings is not None:
        start = time.perf_counter()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        timings.update(open=round(open_s + spent["open"], 2), read=round(spent["read"], 2),
                       to_device=round(spent["to_device"] + time.perf_counter() - start, 2),
                       gb=round(spent["bytes"] / 1e9, 2))
    return tensors


def _header(file: str) -> dict[str, dict]:
    try:
        return read_header(file)[1]
    except SafetensorsFormatError as e:
        raise CheckpointError(str(e)) from None


def _read_streamed(by_file: dict[str, list[str]], device, dtype) -> tuple[dict, dict]:
    tensors, spent = {}, {"open": 0.0}
    for file, keys in by_file.items():
        try:
            tensors.update(stream_tensors(file, keys, device, dtype, timings=spent))
        except SafetensorsFormatError as e:
            raise CheckpointError(str(e)) from None
        except KeyError as e:
            raise CheckpointError(_listing(f"keys listed in the index are not in {file}", e.args[0])) from None
    return tensors, spent


def _read_mapped(by_file: dict[str, list[str]], device, dtype) -> tuple[dict, dict]:
    tensors, spent = {}, {"open": 0.0, "read": 0.0, "to_device": 0.0, "bytes": 0}
    for file, keys in by_file.items():
        start = time.perf_counter()
        with safe_open(file, "pt") as f:
            present = set(f.keys())
            spent["open"] += time.perf_counter() - start
            absent = [k for k in keys if k not in present]
            if absent:
                raise CheckpointError(_listing(f"keys listed in the index are not in {file}", absent))
            for k in keys:
                start = time.perf_counter()
                t = f.get_tensor(k)
                read = time.perf_counter()
                cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
                tensors[k] = t.to(device=device, dtype=cast)
                spent["read"] += read - start
                spent["to_device"] += time.perf_counter() - read
                spent["bytes"] += t.numel() * t.element_size()
    return tensors, spent


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


def _skipping_meta(initialiser):
    def initialise(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else initialiser(tensor, *args, **kwargs)
    return initialise


@contextlib.contextmanager
def _initialisers_skipped():
    """torch.nn.init's in-place initialisers skip meta tensors while a module is built on the
    meta device, where they compute nothing anyway: nn.Embedding's normal_ on a meta tensor
    imports torch._dynamo (~900 modules, sympy among them: 1.2-1.8 s on a 2-core VM), which every
    GPU replica paid while loading its weights. Real tensors (another thread's) still initialise."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n, initialiser in saved.items():
            setattr(torch.nn.init, n, _skipping_meta(initialiser))
        yield
    finally:
        for n, initialiser in saved.items():
            setattr(torch.nn.init, n, initialiser)


def meta_module(make):
    """`make()` on the meta device: shapes without storage and without initialising."""
    with torch.device("meta"), _initialisers_skipped():
        return make()


def build_module(make, state: dict[str, torch.Tensor], device, dtype):
    """`make()` on the meta device (no init cost), then the given weights, strictly, in eval mode."""
    model = meta_module(make)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()},
                          strict=True, assign=True)
    return model.eval().requires_grad_(False)


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


def read_config(path: str | os.PathLike) -> dict:
    """Load `config.json` from a checkpoint directory, with a clear error when it is absent."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in checkpoint directory {os.fspath(path)!r}")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
