"""Tensors of one safetensors file read by large sequential reads, straight to their device.

safetensors' `get_tensor` maps the file and the copy to the GPU then faults it in page by page
from pageable memory: a cold start read the decoder's 6.7 GB at ~1.5 GB/s that way (4.3-5.4 s
of the Decoder's 9.4-11.4 s constructor on an H100, e2e-shipped-prefill-graphs-h100-2026-12-05).
Here the kept tensors' bytes are read in file order, neighbours coalesced into reads of up to
`chunk_bytes`, into two pinned buffers in turn: while the GPU copies one buffer out, the next
read fills the other. A tensor larger than a chunk arrives in pieces into its own bytes on the
device. Casting (where `dtype` asks) happens on the device as each tensor is complete.

The reference twin is `safe_open(...).get_tensor` (DEEPSEEK_OCR_STREAM_WEIGHTS=0); a test reads
the same checkpoints both ways and compares them bit for bit.
"""
from __future__ import annotations

import json
import math
import os
import struct
import time

import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CHUNK_BYTES = 64 << 20
GAP_BYTES = 1 << 20  # neighbours at most this far apart share a read (the gap is read and dropped)


class SafetensorsFormatError(ValueError):
    pass


def read_header(file: str) -> tuple[int, dict[str, dict]]:
    """The offset where the data begins and the tensor entries ({dtype, shape, data_offsets})."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsFormatError(f"{file}: {size} bytes, too short for a safetensors header")
        length = struct.unpack("<Q", prefix)[0]
        if length > size - 8:
            raise SafetensorsFormatError(f"{file}: its header claims {length} bytes of {size - 8}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsFormatError(f"{file}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    data_start = 8 + length
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in DTYPES:
            raise SafetensorsFormatError(f"{file}: {key} has dtype {entry['dtype']}, not one this reader knows")
        if end - begin != math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize:
            raise SafetensorsFormatError(f"{file}: {key}'s byte range does not match its shape")
        if data_start + end > size:
            raise SafetensorsFormatError(f"{file} is truncated: {key} ends past its {size} bytes")
    return data_start, header


def _spans(entries: list[tuple[int, int, str]], chunk_bytes: int) -> list[tuple[int, int, list]]:
    """(begin, end, [(key, begin, end)]) reads in file order: neighbours within GAP_BYTES share
    one read up to chunk_bytes; a tensor larger than that is a read of its own (split later)."""
    spans: list[tuple[int, int, list]] = []
    for begin, end, key in sorted(entries):
        if spans and begin - spans[-1][1] <= GAP_BYTES and end - spans[-1][0] <= chunk_bytes:
            spans[-1] = (spans[-1][0], end, spans[-1][2] + [(key, begin, end)])
        else:
            spans.append((begin, end, [(key, begin, end)]))
    return spans


def stream_tensors(file: str, keys: list[str], device, dtype: torch.dtype | None = None,
                   chunk_bytes: int | None = None, timings: dict | None = None) -> dict[str, torch.Tensor]:
    """`keys` of `file` on `device` (floating-point ones cast to `dtype` when given). `timings`
    gains `read` (seconds in the reads), `to_device` (launching the copies and casts, and
    waiting for them) and `bytes` (read from the file)."""
    device, chunk_bytes = torch.device(device), chunk_bytes or CHUNK_BYTES
    data_start, header = read_header(file)
    missing = [k for k in keys if k not in header]
    if missing:
        raise KeyError(missing)
    on_gpu = device.type == "cuda"
    out = {k: torch.empty(header[k]["shape"], dtype=DTYPES[header[k]["dtype"]], device=device) for k in keys}
    spans = _spans([(*header[k]["data_offsets"], k) for k in keys], chunk_bytes)
    largest = min(chunk_bytes, max((end - begin for begin, end, _ in spans), default=0))
    # Two staging buffers, used in turn; a buffer is refilled only once its last copy is done.
    buffers = [torch.empty(largest, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(2 if on_gpu else 1)]
    copied = [None] * len(buffers)
    read_s = copy_s = 0.0
    turn = 0
    with open(file, "rb", buffering=0) as f:
        for begin, end, members in spans:
            for piece in range(begin, end, chunk_bytes):  # one piece unless one tensor exceeds a chunk
                piece_end = min(end, piece + chunk_bytes)
                buffer = buffers[turn % len(buffers)]
                start = time.perf_counter()
                if copied[turn % len(buffers)] is not None:
                    copied[turn % len(buffers)].synchronize()
                waited = time.perf_counter()
                f.seek(data_start + piece)
                got = f.readinto(memoryview(buffer.numpy())[:piece_end - piece])
                if got != piece_end - piece:
                    raise SafetensorsFormatError(f"{file}: read {got} of {piece_end - piece} bytes at {piece}")
                read = time.perf_counter()
                for key, t_begin, t_end in members:
                    lo, hi = max(t_begin, piece), min(t_end, piece_end)
                    if lo < hi:
                        target = out[key].view(-1).view(torch.uint8)
                        target[lo - t_begin:hi - t_begin].copy_(buffer[lo - piece:hi - piece], non_blocking=on_gpu)
                    if t_end <= piece_end and dtype is not None and out[key].is_floating_point():
                        out[key] = out[key].to(dtype)  # whole now; on a GPU queued behind its copy
                if on_gpu:
                    copied[turn % len(buffers)] = torch.cuda.current_stream(device).record_event()
                turn += 1
                read_s += read - waited
                copy_s += waited - start + time.perf_counter() - read
    start = time.perf_counter()
    if dtype is not None:  # what no read completed: empty tensors
        out = {k: t.to(dtype) if t.is_floating_point() else t for k, t in out.items()}
    if on_gpu:
        torch.cuda.synchronize(device)
    if timings is not None:
        timings["read"] = timings.get("read", 0.0) + read_s
        timings["to_device"] = timings.get("to_device", 0.0) + copy_s + time.perf_counter() - start
        timings["bytes"] = timings.get("bytes", 0) + sum(out[k].numel() * DTYPES[header[k]["dtype"]].itemsize
                                                         for k in keys)
    return out
