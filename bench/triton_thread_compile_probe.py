"""Does Triton compile kernels in parallel on threads? 12 distinct specialisations of one kernel
compiled serially, then another 12 on 12 threads (an empty Triton cache). Needs a CUDA GPU.

    python bench/triton_thread_compile_probe.py

On the H200 machine (Triton 3.6): serial 3.92 s, 12 threads 1.24 s: the reason
`common/triton_compile.py` compiles an encoder path's kernels on threads."""
import os
import sys
import tempfile
import threading
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def kernel(x, y, n, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(x + offs, mask=offs < n)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(8):
        acc += tl.exp(a * SCALE + i) * tl.sin(a)
    tl.store(y + offs, acc, mask=offs < n)


x = torch.randn(4096, device="cuda")
y = torch.empty_like(x)


def compile_one(block, scale):
    kernel.warmup(x, y, 4096, BLOCK=block, SCALE=scale, grid=(1,))


print("triton", triton.__version__, "async compile:", hasattr(triton.runtime, "_async_compile"), flush=True)
start = time.perf_counter()
for s in range(12):
    compile_one(256, float(s) + 0.5)
serial = time.perf_counter() - start
start = time.perf_counter()
threads = [threading.Thread(target=compile_one, args=(512, float(s) + 0.25)) for s in range(12)]
[t.start() for t in threads]
[t.join() for t in threads]
parallel = time.perf_counter() - start
print(f"12 compiles: serial {serial:.2f} s, 12 threads {parallel:.2f} s", flush=True)
sys.exit(0)
