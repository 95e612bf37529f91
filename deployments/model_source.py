"""Which weights the replicas serve: a released-layout checkpoint directory, or the tiny random
default (written once per machine, deterministically, so every replica loads the same model).

`write_random_model` is the one writer of a whole random checkpoint (vision + language +
`tokenizer.json`) in the released layout: the tiny default, test checkpoints and real-dims
benchmark checkpoints all come from it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time

import torch

from common import switches
from common.allocator import keep_freed_memory
from common.checkpoint import random_state_dict, read_config, save_checkpoint
from decoder.checkpoint import released_shapes
from decoder.config import DecoderArgs
from decoder.tokenizer import byte_tokenizer_json
from encoder.checkpoint import vision_shapes
from encoder.config import EncoderArgs, EncoderV2Args, is_ocr2_config

from .protocol import send_tensors_out_of_band
from .replica_logs import log_client_errors_in_one_line

TINY_LABEL = "tiny-random"  # the tiny model's id: a plain token, usable in URLs as it is
# Beside the tiny model's id in every response (its own field, `warning`), so nobody mistakes
# its output for OCR.
TINY_WARNING = "RANDOMLY INITIALISED weights: outputs are meaningless"


# The tiny random models, one per family, by the name `checkpoint` takes instead of a directory
# (none: `tiny-random`): each family's real token layout, tiling, prompts and rules at tiny dims,
# to try it without weights. Their names are their model ids. (vision, language) dims makers.
TINY_MODELS = {
    TINY_LABEL: (EncoderArgs.tiny, DecoderArgs.tiny),  # DeepSeek-OCR
    "tiny-random-ocr2": (EncoderV2Args.tiny, DecoderArgs.tiny),  # DeepSeek-OCR 2: DeepEncoder V2
    "tiny-random-unlimited-ocr": (EncoderArgs.tiny, lambda: DecoderArgs.tiny(sliding_window=8)),  # R-SWA
}


def is_tiny(checkpoint: str | None) -> bool:
    """Whether `checkpoint` names a tiny random model (none does: the default one)."""
    return checkpoint is None or checkpoint in TINY_MODELS


def write_random_model(path, vision: EncoderArgs | None = None, language: DecoderArgs | None = None,
                       seed: int = 0, dtype=torch.bfloat16, num_shards: int | None = None) -> str:
    """A whole random DeepSeek-OCR checkpoint in the released layout: `config.json`, the vision
    and language tensors (one file or `num_shards` shards) and a byte-level `tokenizer.json` with
    DeepSeek's special-token ids. Tiny dims by default. Returns the directory."""
    vision, language = vision or EncoderArgs.tiny(), language or DecoderArgs.tiny()
    if vision.n_embed != language.hidden:
        raise ValueError(f"the vision projector's width {vision.n_embed} must be the language "
                         f"model's {language.hidden}")
    tensors = (random_state_dict(vision_shapes(vision), seed)
               | random_state_dict(released_shapes(language), seed + 1))
    save_checkpoint(path, vision.to_config() | language.to_config(),
                    {k: v.to(dtype) for k, v in tensors.items()}, num_shards)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(byte_tokenizer_json())
    return os.fspath(path)


def check_model_config(directory: str) -> None:
    """A checkpoint's config.json read as its encoder and decoder will read it (the family from
    the config), and the two agreeing: the encoder's tokens are the decoder's width. A
    ValueError naming what does not fit, before any replica starts."""
    config = read_config(directory)
    vision = (EncoderV2Args if is_ocr2_config(config) else EncoderArgs).from_config(config)
    language = DecoderArgs.from_config(config)
    if vision.n_embed != language.hidden:
        raise ValueError(f"checkpoint {directory!r}: its vision projector makes {vision.n_embed}-wide "
                         f"tokens but its language model is {language.hidden} wide")


def resolve_checkpoint(checkpoint: str | None) -> tuple[str, str]:
    """(directory, model label for responses: the directory's name, or the tiny model's)."""
    if not is_tiny(checkpoint):
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            raise FileNotFoundError(f"checkpoint {checkpoint!r} has no config.json")
        return checkpoint, os.path.basename(os.path.normpath(checkpoint))
    name = checkpoint or TINY_LABEL
    directory = os.path.join(tempfile.gettempdir(), f"deepseek-ocr-serve-{name}-v2")
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        # Replicas on one node may race here: each writes its own copy, then renames it in.
        staging = tempfile.mkdtemp(prefix="tiny-", dir=os.path.dirname(directory))
        vision, language = (make() for make in TINY_MODELS[name])
        vision = dataclasses.replace(vision, n_embed=language.hidden)  # its tokens: the decoder's width
        write_random_model(staging, vision, language, seed=0, dtype=torch.float32)
        try:
            os.rename(staging, directory)
        except OSError:  # another replica won; its copy is identical, and this one is not kept
            shutil.rmtree(staging, ignore_errors=True)
    return directory, name


def replica_id() -> str | None:
    """This Serve replica's id (a replaced replica gets a new one); None outside Serve."""
    from ray import serve
    from ray.serve.exceptions import RayServeException
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return None


def gpu_ids() -> list:
    """The GPUs Ray gave this replica; [] outside Ray. (`ray.get_gpu_ids()` itself starts a
    local Ray cluster in a process that has none: a replica built in process, as tests and
    benches build one, would leave a whole cluster idling beside it.)"""
    import ray
    return ray.get_gpu_ids() if ray.is_initialized() else []


def device_and_dtype() -> tuple[str, torch.dtype]:
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def use_assigned_cpu_threads() -> None:
    """torch's CPU thread pool at the size Ray assigned this replica: Ray sets OMP_NUM_THREADS
    (its CPUs, at least 1) when it gives a worker the replica, but a worker that imported torch
    before that (deployments.PRELOAD_MODULES) sized the pool from all the machine's cores, and
    seven replicas with a thread per core each oversubscribe the host."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def prepare_replica_process() -> None:
    """What every replica does first: torch's threads at Ray's number, and freed multi-MB
    buffers kept for the next request (`common.allocator`: each request decodes a page, copies
    tokens to the host and serialises them, and fresh memory faults in page by page);
    DEEPSEEK_OCR_KEEP_FREED_MEMORY=0 leaves glibc's defaults; and the tensors it sends (views,
    tokens, sequences) travel as raw bytes out of band (`protocol.send_tensors_out_of_band`); a
    caller's bad input is logged as one line, not as this replica's failure (`replica_logs`)."""
    use_assigned_cpu_threads()
    send_tensors_out_of_band()
    log_client_errors_in_one_line()
    if switches.on("DEEPSEEK_OCR_KEEP_FREED_MEMORY"):
        keep_freed_memory()


def start_cuda(fraction: float | None) -> float:
    """Cap this replica's allocator to its share of a shared GPU (Ray isolates no GPU memory)
    and create its CUDA context now: the seconds that took (0.0 without CUDA), a start-up phase
    of its own, where the first weight copy would otherwise absorb it."""
    if not torch.cuda.is_available():
        return 0.0
    start = time.perf_counter()
    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    return time.perf_counter() - start


def gpu_memory_gb() -> dict[str, float] | None:
    """This replica's GPU memory for /ready, in GB: what torch's allocator holds now, the most
    it held since the start (graph pools, KV pages and peaks under load included; the CUDA
    context's ~0.5 GB is not), and its cap (the replica's share of the card). None without
    CUDA. What each tier really takes is what sizing a shared GPU's shares needs."""
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return {"reserved": round(torch.cuda.memory_reserved() / 1e9, 2),
            "peak_reserved": round(torch.cuda.max_memory_reserved() / 1e9, 2),
            "cap": round(torch.cuda.get_per_process_memory_fraction() * total / 1e9, 2)}


def startup_phases(constructor_start: float, **seconds: float) -> dict[str, float]:
    """A replica's start-up, for /ready and its log (timestamped, beside Serve's "Adding
    replica" line: the gap before is the actor's start and imports): the phases it timed,
    `constructor` (from `constructor_start`, a perf_counter, to now: CUDA's start-up included)
    and `process`, the seconds from its process's start (a worker Ray started ahead waits in
    it) to now; `process` is left out where /proc cannot tell."""
    phases = {name: round(s, 2) for name, s in seconds.items()}
    phases["constructor"] = round(time.perf_counter() - constructor_start, 2)
    try:  # field 22 of /proc/self/stat: the start, in clock ticks after boot
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            phases["process"] = round(float(f.read().split()[0]) - started, 2)
    except (OSError, ValueError, IndexError):
        pass
    logging.getLogger("ray.serve").info("replica started: %s", phases)
    return phases
