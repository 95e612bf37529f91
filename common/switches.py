"""Every switch of the encoder's and decoder's fast paths, in one table.

Each is an environment variable read once, when the module that uses it is imported, so it is
set per process: in a Serve YAML per deployment (`ray_actor_options: {runtime_env: {env_vars:
{DEEPSEEK_OCR_TRITON: "0"}}}`), or in the shell for `serve run` and the benchmarks. Turning one
off runs its reference twin, the code the fast path is tested equal to. `DEEPSEEK_OCR_TRITON=0`
turns every Triton kernel of both packages off at once, whatever their own switches say.
docs/switches.md's table is this one (a test keeps them equal).
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str  # the environment variable
    default: str
    choices: tuple[str, ...]
    off: str  # what turning it off runs instead (the reference twin)
    triton: bool = False  # a Triton kernel: DEEPSEEK_OCR_TRITON=0 turns it off too


ON_OFF = ("1", "0")
SWITCHES = {s.name: s for s in (
    Switch("DEEPSEEK_OCR_TRITON", "1", ON_OFF,
           "torch's ops for every Triton kernel of the encoder and the decoder (the fused rel-pos "
           "attention then runs as `augmented`)"),
    Switch("DEEPSEEK_OCR_ATTENTION", "fused", ("fused", "augmented", "blocked", "dense"),
           "`dense`: SAM's attention with the rel-pos bias made dense, then SDPA (encoder); "
           "`augmented`: the bias as extra q/k columns in SDPA, as `fused` does on CUDA without Triton; "
           "`blocked`: the dense bias a block of queries at a time, as `fused` does on CPUs"),
    Switch("DEEPSEEK_OCR_WINDOW_KERNEL", "1", ON_OFF,
           "SAM's windows padded and partitioned before the attention kernel, not read in place", triton=True),
    Switch("DEEPSEEK_OCR_NORM_KERNEL", "1", ON_OFF,
           "torch's norms and residual adds (encoder's LayerNorm and Qwen2 RMSNorm, decoder's RMSNorm: "
           "triton_norm.py in each)", triton=True),
    Switch("DEEPSEEK_OCR_ACTIVATION_KERNEL", "1", ON_OFF,
           "torch's quick_gelu in CLIP and SiLU(gate) * up in DeepSeek-OCR 2's Qwen2 MLP "
           "(encoder/triton_activation.py)",
           triton=True),
    Switch("DEEPSEEK_OCR_PATCH_KERNEL", "1", ON_OFF,
           "torch's normalise and unfold of the pixels into SAM's patches (encoder/triton_pixels.py)", triton=True),
    Switch("DEEPSEEK_OCR_FUSED_RESIZE", "1", ON_OFF,
           "torch's ops for each pass of the views' exact bicubic resize on a GPU (encoder/triton_resize.py)",
           triton=True),
    Switch("DEEPSEEK_OCR_GELU_EPILOGUE", "1", ON_OFF, "SAM's MLP as nn.Linear + GELU, not one cuBLASLt matmul"),
    Switch("DEEPSEEK_OCR_RESIDUAL_EPILOGUE", "1", ON_OFF,
           "the residual add after each encoder MLP as its own op, not in the matmul"),
    Switch("DEEPSEEK_OCR_CACHE_TABLES", "1", ON_OFF, "the rel-pos tables made again in every forward (encoder/derived.py)"),
    Switch("DEEPSEEK_OCR_PIN_HOST_VIEWS", "1", ON_OFF, "views copied to the GPU from pageable memory"),
    Switch("DEEPSEEK_OCR_COMPILE_AHEAD", "1", ON_OFF,
           "each Triton kernel compiled at its first launch, not all at once on threads before capture"),
    Switch("DEEPSEEK_OCR_ROPE_KERNEL", "auto", ("auto", "triton", "torch"),
           "`torch`: apply_rope and the KV-cache writes (decoder), apply_rope in DeepSeek-OCR 2's "
           "Qwen2 stage (encoder); `auto`: Triton on CUDA", triton=True),
    Switch("DEEPSEEK_OCR_MOE_KERNEL", "auto", ("auto", "triton", "grouped_mm"),
           "`grouped_mm`: gather, grouped matmuls, index-add (decoder); `auto`: Triton on CUDA in half precision",
           triton=True),
    Switch("DEEPSEEK_OCR_MOE_FUSED_ROUTING", "1", ON_OFF,
           "the shared experts as their own MLP and the routing (softmax, top-k, sort) in torch's ops, "
           "where the Triton MoE kernels run (decoder)", triton=True),
    Switch("DEEPSEEK_OCR_PAGED_ATTENTION", "auto", ("auto", "triton", "gather"),
           "`gather`: each sequence's KV pages gathered, then SDPA (decoder); `auto`: Triton on CUDA", triton=True),
    Switch("DEEPSEEK_OCR_FUSED_PROJECTIONS", "1", ON_OFF,
           "the decoder's released separate q/k/v and gate/up matmuls, and DeepSeek-OCR 2's "
           "Qwen2 q/k/v (encoder), not one packed matmul each"),
    Switch("DEEPSEEK_OCR_SPLIT_FLOW_ATTENTION", "0", ON_OFF,
           "DeepSeek-OCR 2's Qwen2 attention in one SDPA with its boolean mask; 1: two mask-free "
           "SDPAs (image rows; query rows causal lower-right), slower on an H100 (one page 17.4 "
           "against 16.2 ms)"),
    Switch("DEEPSEEK_OCR_SPLIT_REPLAYS", "1", ON_OFF,
           "an encoder path's batch replays the smallest budget holding it, not two smaller budgets "
           "one after the other where they pad less by more than a view"),
    Switch("DEEPSEEK_OCR_PREFILL_BEHIND_DECODE", "1", ON_OFF,
           "while sequences decode, a new prefill runs first and its first tokens are picked at "
           "once, then the decode step (decoder), instead of behind the decode step, picked a step later"),
    Switch("DEEPSEEK_OCR_OVERLAP_PICKS", "1", ON_OFF,
           "every decode step's tokens read on the host before the next step is launched (decoder), "
           "not the next step launched from them on the device and read while it runs"),
    Switch("DEEPSEEK_OCR_STAGED_COPIES", "1", ON_OFF,
           "every small host list a decode step sends the device (n-gram bans, row orders, held "
           "tokens) pinned as a tensor of its own (decoder), not written into one pinned ring "
           "reused step after step (decoder/staging.py)"),
    Switch("DEEPSEEK_OCR_PREFILL_GRAPHS", "1", ON_OFF,
           "every prefill launched eagerly, kernel by kernel (decoder), not a one-sequence prefill "
           "replayed from a CUDA graph at its token bucket"),
    Switch("DEEPSEEK_OCR_SPLIT_ARGMAX", "1", ON_OFF,
           "a decode step's greedy pick of few rows as one argmax over the vocabulary (decoder), "
           "not a max per chunk of it, then the chunks' argmax"),
    Switch("DEEPSEEK_OCR_RSWA_FREE_PAGES", "1", ON_OFF,
           "Unlimited-OCR's R-SWA gap (past the prompt, before the window) kept in its KV pages "
           "until the sequence leaves (the kernel skips it, the reference masks it)"),
    Switch("DEEPSEEK_OCR_STREAM_WEIGHTS", "1", ON_OFF,
           "each weight read through safetensors' file mapping and copied to its device from "
           "pageable memory, tensor by tensor, not by large reads into pinned buffers"),
    Switch("DEEPSEEK_OCR_KEEP_FREED_MEMORY", "1", ON_OFF,
           "glibc's default allocator settings in the replicas (freed buffers go back to the OS)"),
    Switch("DEEPSEEK_OCR_PREFETCH_CHECKPOINT", "1", ON_OFF,
           "each replica reads its weights from the disk, not `deepseek-ocr serve` reading the "
           "checkpoints into the page cache while Ray and Serve start (deployments/prefetch.py)"),
    Switch("DEEPSEEK_OCR_BACKGROUND_PRELOAD", "0", ON_OFF,
           "each Ray worker imports the deployment modules before it takes work "
           "(deployments/preload.py); 1: torch and the model packages on a thread, the worker "
           "taking work at once (measured no faster to start: off)"),
)}


def value(name: str) -> str:
    """The switch's setting: its variable if set (checked against its choices), else its default."""
    switch = SWITCHES[name]
    setting = os.environ.get(name, switch.default)
    if setting not in switch.choices:
        raise ValueError(f"{name}={setting!r}; expected one of {', '.join(switch.choices)}")
    return setting


def triton() -> bool:
    """Triton kernels are allowed at all (DEEPSEEK_OCR_TRITON)."""
    return value("DEEPSEEK_OCR_TRITON") == "1"


def on(name: str) -> bool:
    """An on/off switch is on (and, for a Triton kernel, Triton is allowed)."""
    return value(name) == "1" and (triton() or not SWITCHES[name].triton)


def kernel(name: str) -> str:
    """A kernel choice (`auto`, `triton` or the twin's name); `auto` when Triton is off
    everywhere becomes the twin (the last choice)."""
    setting = value(name)
    if setting in ("auto", "triton") and not triton():
        return SWITCHES[name].choices[-1]
    return setting
