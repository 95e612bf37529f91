"""What one Serve call costs on this machine with none of the app's code in it, to set against
serve_bench's `hops_one_at_a_time` (on the H200: 7.6 ms driver -> router, 7.1 ms router ->
encoder, each call returning a page's 2.3 MB sequence).

Bare deployments, one call at a time from this driver, p50 of ITERS calls after warm-ups, each
call sending 66 KB of bytes (a page's PNG) and returning either a small value or a page's
sequence in the app's wire format (an int16 [913, 1280] array, bf16 bits): a Ray actor call
(no Serve), one Serve call, and two chained Serve calls (driver -> Middle -> Leaf, Middle
awaiting Leaf and returning its array, as the router returns the encoder's sequence). And
the array by reference: Leaf puts it in the object store and returns the ObjectRef, which
Middle passes on untouched and this driver reads with ray.get; and the sequence as a bf16
torch tensor, as `Router.encode` returns it: with Ray's default torch pickling, and from a
process that sends tensors as raw bytes (`send_tensors_out_of_band`, as every Router does).

    python bench/serve_hop_probe.py [--out bench/results]   # needs ray[serve]; no GPU needed

Writes serve-hops-<date>.json (`summary`: the p50s in ms).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import RESULTS, write_result  # noqa: E402

ITERS, WARMUP = 200, 20
SEQUENCE = (913, 1280)  # a 2x3 page's tokens x the encoder's width
REQUEST_BYTES = 66_000  # a text page's PNG


class Leaf:
    def __init__(self):
        self.sequence = np.zeros(SEQUENCE, dtype=np.int16)

    async def small(self, payload: bytes) -> int:
        return len(payload)

    async def page(self, payload: bytes) -> tuple:
        return self.sequence, "bfloat16"

    async def page_by_reference(self, payload: bytes) -> tuple:
        import ray
        return ray.put(self.sequence), "bfloat16"

    async def page_as_torch(self, payload: bytes):
        import torch
        return torch.from_numpy(self.sequence).view(torch.bfloat16)  # as Router.encode returns it


class LeafOutOfBand(Leaf):
    """Leaf in a process that sends torch tensors as raw bytes, as every Router does."""

    def __init__(self):
        super().__init__()
        from deployments.protocol import send_tensors_out_of_band
        send_tensors_out_of_band()


class Middle:
    def __init__(self, leaf):
        self.leaf = leaf

    async def small(self, payload: bytes) -> int:
        return await self.leaf.small.remote(payload)

    async def page(self, payload: bytes) -> tuple:
        return await self.leaf.page.remote(payload)

    async def page_by_reference(self, payload: bytes) -> tuple:
        return await self.leaf.page_by_reference.remote(payload)  # the reference, not the array


def p50_ms(call) -> float:
    for _ in range(WARMUP):
        call()
    times = []
    for _ in range(ITERS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=RESULTS)
    opts = parser.parse_args(argv)
    import ray
    from ray import serve
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})  # the replicas import deployments
    payload = os.urandom(REQUEST_BYTES)
    rows = {}
    actor = ray.remote(num_cpus=0)(Leaf).remote()
    rows["ray_actor_small"] = p50_ms(lambda: ray.get(actor.small.remote(payload)))
    rows["ray_actor_page"] = p50_ms(lambda: ray.get(actor.page.remote(payload)))
    leaf = serve.deployment(Leaf, ray_actor_options={"num_cpus": 0}).bind()
    middle = serve.deployment(Middle, ray_actor_options={"num_cpus": 0}).bind(leaf)
    handle = serve.run(middle, name="hops", route_prefix=None)
    leaf_handle = serve.get_deployment_handle("Leaf", app_name="hops")
    rows["serve_one_call_small"] = p50_ms(lambda: leaf_handle.small.remote(payload).result())
    rows["serve_one_call_page"] = p50_ms(lambda: leaf_handle.page.remote(payload).result())
    rows["serve_two_calls_small"] = p50_ms(lambda: handle.small.remote(payload).result())
    rows["serve_two_calls_page"] = p50_ms(lambda: handle.page.remote(payload).result())
    rows["serve_one_call_page_as_torch"] = p50_ms(lambda: leaf_handle.page_as_torch.remote(payload).result())
    out_of_band = serve.run(serve.deployment(LeafOutOfBand, ray_actor_options={"num_cpus": 0}).bind(),
                            name="hops-out-of-band", route_prefix=None)
    rows["serve_one_call_page_as_torch_out_of_band"] = p50_ms(
        lambda: out_of_band.page_as_torch.remote(payload).result())
    rows["serve_one_call_page_by_reference"] = p50_ms(
        lambda: ray.get(leaf_handle.page_by_reference.remote(payload).result()[0]))
    rows["serve_two_calls_page_by_reference"] = p50_ms(
        lambda: ray.get(handle.page_by_reference.remote(payload).result()[0]))
    serve.shutdown()
    ray.shutdown()
    for name, ms in rows.items():
        print(f"{name:>42}: {ms:7.3f} ms", flush=True)
    write_result(opts.out, "serve-hops", {
        "benchmark": "bare Serve and Ray calls, one at a time (no app code)",
        "date": datetime.date.today().isoformat(),
        "timing": f"p50 of {ITERS} calls after {WARMUP}; each sends {REQUEST_BYTES} bytes; "
                  f"'page' returns an int16 {list(SEQUENCE)} array",
        "summary": rows})


if __name__ == "__main__":
    main()
