"""Is a page's PNG decode slower in a replica (~10 ms in serve_bench's encoder stages) than in
the bench's process? (On a fresh H200 machine: no, 9.06 ms in process, 8.28 with pages 30 ms
apart.) The same decode (`decode_header` of the e2e bench's text page) timed in this process and in a Ray
actor like a replica (the replicas' allocator settings; on its main thread and on a worker
thread, back to back and 30 ms apart as single pages arrive; before and after CUDA is
initialised there when there is a GPU).

    python bench/decode_probe.py      # needs ray; a GPU is optional

Prints one line per place: median ms of 50 decodes after 5 warm-ups.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def timings(cuda: bool = False) -> dict[str, float]:
    """Median ms of the page's decode here: on this thread and on a worker thread."""
    import torch

    from bench.e2e_bench import page_png
    from common.allocator import keep_freed_memory
    from encoder.preprocess import decode_header, read_header
    keep_freed_memory()
    if cuda:
        torch.zeros(1, device="cuda")
    header = read_header(page_png(0))

    def median_ms(call, gap_s: float = 0.0) -> float:
        for _ in range(5):
            call()
        times = []
        for _ in range(50):
            time.sleep(gap_s)
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        return round(statistics.median(times), 2)
    with ThreadPoolExecutor(4) as pool:
        # "30 ms apart": as one page at a time reaches a replica (an idle core between pages).
        return {"this thread": median_ms(lambda: decode_header(header)),
                "worker thread": median_ms(lambda: pool.submit(decode_header, header).result()),
                "worker thread, 30 ms apart": median_ms(lambda: pool.submit(decode_header, header).result(),
                                                        gap_s=0.03)}


def main():
    import ray
    import torch
    gpu = torch.cuda.is_available()
    print("this process:", timings(), flush=True)
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={
        "env_vars": {"PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}})

    @ray.remote(num_cpus=1, num_gpus=0.1 if gpu else 0)
    class Replica:
        def timings(self, cuda: bool):
            return timings(cuda)
    replica = Replica.remote()
    print("a Ray actor:", ray.get(replica.timings.remote(False)), flush=True)
    if gpu:
        print("a Ray actor, CUDA initialised:", ray.get(replica.timings.remote(True)), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
