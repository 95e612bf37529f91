"""Which weights the replicas serve: a released-layout checkpoint directory, or the tiny random
default (written once per machine, deterministically, so every replica loads the same model)."""
from __future__ import annotations

import os
import tempfile

import torch

from decoder.checkpoint import write_random_model

TINY_LABEL = "tiny-random (RANDOMLY INITIALISED weights: outputs are meaningless)"
_TINY_DIR = os.path.join(tempfile.gettempdir(), "deepseek-ocr-serve-tiny-random-v1")


def resolve_checkpoint(checkpoint: str | None) -> tuple[str, str]:
    """(directory, model label for responses)."""
    if checkpoint:
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            raise FileNotFoundError(f"checkpoint {checkpoint!r} has no config.json")
        return checkpoint, os.path.basename(os.path.normpath(checkpoint))
    if not os.path.isfile(os.path.join(_TINY_DIR, "model.safetensors")):
        # Replicas on one node may race here: each writes its own copy, then renames it in.
        staging = tempfile.mkdtemp(prefix="tiny-", dir=os.path.dirname(_TINY_DIR))
        write_random_model(staging, seed=0, dtype=torch.float32)
        try:
            os.rename(staging, _TINY_DIR)
        except OSError:  # another replica won; its copy is identical
            pass
    return _TINY_DIR, TINY_LABEL


def device_and_dtype() -> tuple[str, torch.dtype]:
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def cap_gpu_memory(fraction: float | None) -> None:
    """Replicas sharing a GPU each cap their allocator (Ray isolates no GPU memory)."""
    if fraction and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)
