"""The checkpoints' files read into the page cache while Ray and Serve start.

`deepseek-ocr serve` (deployments/__main__.py) starts this as its own process, then becomes
`serve run`: Ray and Serve take ~11-14 s to come up before a replica's constructor reads its
weights, and from a cold page cache the Decoder's 5.9 GB took 3.5-4.5 s of its 7.4-8.5 s
constructor on an H100 machine (four readers at the disk's ~1.5 GB/s; 0.5 s from a warm cache,
e2e-shipped-overlap-picks-h100-2026-12-05). Read here in that time, they are in the cache when
the replicas ask. Best effort: a checkpoint it cannot find, or files larger than half the memory
available, are left for the replicas to read (a run with nothing to read costs nothing).

The switch: DEEPSEEK_OCR_PREFETCH_CHECKPOINT (on; 0: the replicas read the disk themselves, the
reference twin). Measured on an H100 machine (`e2e_bench --levels 4 --reps 2`, the checkpoint
evicted): cold start 14.8 / 14.8 s against 20.3 / 14.7 s without (e2e-startup-prefetch-h100-2026-12-05).

    python -m deployments.prefetch DIRECTORY...   # what the launcher runs
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import yaml

READ_BYTES = 16 << 20
READERS = 4  # files read at once (an NVMe disk serves several reads at its full rate)


def checkpoint_dirs(argv: list[str]) -> list[str]:
    """The checkpoint directories `serve run argv` names: a config file's applications' `args`
    (`checkpoint`, each `models` entry's), or an import path's `checkpoint=...` argument. In
    order, once each; [] where it names none (or its config cannot be read: `serve run`
    reports that)."""
    if not argv:
        return []
    named: list = []
    if argv[0].endswith((".yaml", ".yml")):
        try:
            with open(argv[0]) as f:
                config = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            return []
        for application in config.get("applications") or []:
            args = (application or {}).get("args") or {}
            named += [args.get("checkpoint"), *((m or {}).get("checkpoint") for m in args.get("models") or [])]
    else:
        named += [a.split("=", 1)[1] for a in argv[1:] if a.startswith("checkpoint=")]
    dirs = [os.path.abspath(os.path.expanduser(d)) for d in named if isinstance(d, str) and d]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and os.path.isdir(d)]


def checkpoint_files(directory: str) -> list[str]:
    """The files the replicas read: config, tokenizer and weights (largest first)."""
    names = [n for n in os.listdir(directory) if n.endswith((".safetensors", ".json"))]
    paths = [os.path.join(directory, n) for n in names]
    return sorted((p for p in paths if os.path.isfile(p)), key=os.path.getsize, reverse=True)


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_file(path: str) -> int:
    """Every byte of `path` read once (into the page cache); the bytes read."""
    total, buffer = 0, bytearray(READ_BYTES)
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buffer):
            total += n
    return total


def prefetch(directories: list[str]) -> int:
    """Read the directories' checkpoint files, READERS at once; the bytes read (0 when they
    would not fit half the available memory: they would push each other out)."""
    files = [p for d in directories for p in checkpoint_files(d)]
    available = available_memory_bytes()
    if available is not None and sum(map(os.path.getsize, files)) > available // 2:
        return 0
    with ThreadPoolExecutor(READERS) as pool:
        return sum(pool.map(read_file, files))


def start(directories: list[str]) -> subprocess.Popen | None:
    """`prefetch(directories)` in a process of its own, detached (it outlives the launcher's
    exec into `serve run`, and finishes by itself); None when there is nothing to read."""
    if not directories:
        return None
    return subprocess.Popen([sys.executable, "-m", "deployments.prefetch", *directories],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


if __name__ == "__main__":
    prefetch([d for d in sys.argv[1:] if os.path.isdir(d)])
