"""Tensors across deployment calls: CPU numpy arrays (pickle5 out-of-band buffers, read
zero-copy from the object store on one node). bf16 has no numpy dtype, so it travels as its
int16 bit pattern with the dtype name beside it."""
from __future__ import annotations

import warnings

import numpy as np
import torch

Wire = tuple[np.ndarray, str]


def to_wire(t: torch.Tensor) -> Wire:
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), str(t.dtype).removeprefix("torch.")


def from_wire(w: Wire) -> torch.Tensor:
    array, dtype = w
    # Arrays from the object store are read-only views of shared memory: wrap them without a
    # copy; callers only read them (torch.cat, .to(device) make new tensors).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t
