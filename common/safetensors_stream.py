"""Tensors of one safetensors file read by large reads, several at once, straight to their device.

safetensors' `get_tensor` maps the file and the copy to the GPU then faults it in page by page
from pageable memory: a cold start read the decoder's 5.9 GB at ~1.3 GB/s that way (4.3-5.4 s
of the Decoder's 9.4-11.4 s constructor on an H100, e2e-shipped-prefill-graphs-h100-2026-12-05).
Here the kept tensors' bytes are read in large pieces, neighbours coalesced into reads of up to
`chunk_bytes`; `threads` readers take the pieces in file order, each reading into its own
staging buffer (pinned for a GPU) and copying out on its own stream, so reads stay in flight
while others copy. One reader with 64 MB reads measured 1.57 against 1.31 GB/s from a cold
page cache on an H100 (decoder-load-h100-2026-12-05); warm, 4.9 against 5.2 GB/s: the reads'
copy out of the page cache bound it, which the readers now share. A tensor larger than a
chunk arrives in pieces into its own bytes on the device; casts (where `dtype` asks) follow on
the device.

The reference twin is `safe_open(...).get_tensor` (DEEPSEEK_OCR_STREAM_WEIGHTS=0); a test reads
the same checkpoints both ways and compares them bit for bit.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CHUNK_BYTES = 64 << 20
READ_THREADS = 4
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


def _pieces(spans: list[tuple[int, int, list]], chunk_bytes: int) -> list[tuple[int, int, list]]:
    """Each read as (file offset, bytes, [(key, first byte, last byte in the tensor, where in
    the read)]): a span is one read unless it is one tensor larger than a chunk."""
    pieces = []
    for begin, end, members in spans:
        for piece in range(begin, end, chunk_bytes):
            piece_end = min(end, piece + chunk_bytes)
            parts = [(key, max(t_begin, piece) - t_begin, min(t_end, piece_end) - t_begin,
                      max(t_begin, piece) - piece)
                     for key, t_begin, t_end in members if max(t_begin, piece) < min(t_end, piece_end)]
            pieces.append((piece, piece_end - piece, parts))
    return pieces


def _read_fully(fd: int, buffer: memoryview, offset: int, file: str) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise SafetensorsFormatError(f"{file}: read {done} of {len(buffer)} bytes at {offset}")
        done += got


def stream_tensors(file: str, keys: list[str], device, dtype: torch.dtype | None = None,
                   chunk_bytes: int | None = None, threads: int | None = None,
                   timings: dict | None = None) -> dict[str, torch.Tensor]:
    """`keys` of `file` on `device` (floating-point ones cast to `dtype` when given), read by
    `threads` readers at once (default READ_THREADS), each with its own staging buffer (pinned
    for a GPU) and, on a GPU, its own stream. `timings` gains `read` (the reads and copies,
    overlapped: wall seconds), `to_device` (the casts, and waiting for the device) and `bytes`."""
    device, chunk_bytes = torch.device(device), chunk_bytes or CHUNK_BYTES
    data_start, header = read_header(file)
    missing = [k for k in keys if k not in header]
    if missing:
        raise KeyError(missing)
    on_gpu = device.type == "cuda"
    out = {k: torch.empty(header[k]["shape"], dtype=DTYPES[header[k]["dtype"]], device=device) for k in keys}
    pieces = _pieces(_spans([(*header[k]["data_offsets"], k) for k in keys], chunk_bytes), chunk_bytes)
    largest = max((length for _, length, _ in pieces), default=0)
    local = threading.local()

    def read(piece: tuple[int, int, list]) -> None:
        offset, length, parts = piece
        if not hasattr(local, "buffer"):  # one per reader thread, reused for each of its reads
            local.buffer = torch.empty(largest, dtype=torch.uint8, pin_memory=on_gpu)
            local.stream = torch.cuda.Stream(device) if on_gpu else None
        _read_fully(fd, memoryview(local.buffer.numpy())[:length], data_start + offset, file)
        with torch.cuda.stream(local.stream) if on_gpu else contextlib.nullcontext():
            for key, lo, hi, at in parts:
                out[key].view(-1).view(torch.uint8)[lo:hi].copy_(local.buffer[at:at + hi - lo], non_blocking=on_gpu)
        if on_gpu:  # the buffer is refilled by this thread's next read: its copies first
            local.stream.synchronize()

    start = time.perf_counter()
    fd = os.open(file, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(threads or READ_THREADS, thread_name_prefix="weights-read") as pool:
            for _ in pool.map(read, pieces):  # in file order; an error stops the load here
                pass
    finally:
        os.close(fd)
    read_s, start = time.perf_counter() - start, time.perf_counter()
    if dtype is not None:  # one tensor at a time: the file's copy of it is freed as it goes
        for key, tensor in out.items():
            if tensor.is_floating_point():
                out[key] = tensor.to(dtype)
    if on_gpu:
        torch.cuda.synchronize(device)
    if timings is not None:
        timings["read"] = timings.get("read", 0.0) + read_s
        timings["to_device"] = timings.get("to_device", 0.0) + time.perf_counter() - start
        timings["bytes"] = timings.get("bytes", 0) + sum(out[k].numel() * DTYPES[header[k]["dtype"]].itemsize
                                                         for k in keys)
    return out
