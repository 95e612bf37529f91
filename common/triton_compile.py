"""A model's Triton kernels compiled on several threads at once, before their first launch.

A replica's first forward compiles each Triton kernel specialisation it meets, one after the
other, when it is first launched: 13 in an encoder path's first capture, ~8.6 s of a fresh node's
start-up (startup-profile-2026-12-03.txt; the same phase takes 2.8-4.6 s with a warm Triton
cache); the decoder's MoE, paged-attention and RoPE kernels likewise before its decode graphs.
Triton compiles on threads in parallel (its passes release the GIL: 12 kernels took 3.9 s one
after the other and 1.2 s on 12 threads on the H200 machine). `compile_ahead(forward)` runs
the forward once with every launch made through `launch_kernel` only compiled, in Triton's async
compile mode on a thread pool; the kernels then wait in Triton's in-memory cache for the real
first launch. Outputs of that one forward are garbage (no kernel ran): it is for compiling only.

The switch: DEEPSEEK_OCR_COMPILE_AHEAD=0 (then each kernel compiles at its first launch, the
reference twin); without Triton's async compile (Triton < 3.5) compile_ahead does nothing.
"""
from __future__ import annotations

import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from . import switches

log = logging.getLogger(__name__)
_compile_only: contextvars.ContextVar[bool] = contextvars.ContextVar("triton_compile_only", default=False)


def launch_kernel(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; inside `compile_ahead`, only its compile is queued."""
    if _compile_only.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def compiling_only() -> bool:
    """Whether this thread is inside `compile_ahead` (kernels launched now do not run)."""
    return _compile_only.get()


def enabled() -> bool:
    return switches.on("DEEPSEEK_OCR_COMPILE_AHEAD")


def compile_ahead(forward, threads: int = 16) -> float:
    """Run `forward()` with the kernels it launches through `launch_kernel` compiled (on `threads`
    threads at once) instead of run; returns the seconds it took (0.0 when switched off or
    when this Triton has no async compile mode)."""
    if not enabled():
        return 0.0
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return 0.0
    start = time.perf_counter()
    token = _compile_only.set(True)
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, AsyncCompileMode(pool):
            forward()
    except Exception:  # a speed-up only: what did not compile here compiles at its first launch
        log.exception("compiling the Triton kernels ahead failed; they compile at first launch")
    finally:
        _compile_only.reset(token)
    return time.perf_counter() - start
