"""Which of `ModelRunner.pick_on_device`'s calls make the host wait for the device (issue 54:
the service's engine thread sits in them)? Each call's host time while ~30 ms of matmuls are
queued ahead of it on the stream: a call that waits shows tens of ms, one that does not a few
microseconds. Needs a GPU.

    python bench/host_waits.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from decoder.sampling import argmax_rows  # noqa: E402
from decoder.staging import StagedCopies, to_device  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(218, 129280, device=dev, dtype=torch.bfloat16)
    staged = StagedCopies(dev)
    neg_inf = torch.tensor(float("-inf"), device=dev, dtype=logits.dtype)
    rows, cols = [3, 3, 7, 9, 100, 150, 200], [11, 12, 13, 14, 15, 16, 17]
    where = staged(rows + cols).view(2, len(rows))
    ops = {
        "nothing": lambda: None,
        "staged(rows+cols)": lambda: staged(rows + cols),
        "to_device(pin)": lambda: to_device(torch.tensor(rows + cols), dev),
        "logits[w0,w1] = float(-inf)": lambda: logits.__setitem__((where[0], where[1]), float("-inf")),
        "index_put_(w, device scalar)": lambda: logits.index_put_((where[0], where[1]), neg_inf),
        "masked via view index": lambda: logits.view(-1).index_fill_(0, where[0] * logits.shape[1] + where[1], float("-inf")),
        "argmax_rows": lambda: argmax_rows(logits),
    }
    torch.cuda.synchronize()
    for name, op in ops.items():
        for _ in range(2):
            op()
        times = []
        for _ in range(5):
            for _ in range(20):  # ~30 ms of work queued ahead of the call
                x @ x
            start = time.perf_counter()
            op()
            times.append(1e3 * (time.perf_counter() - start))
            torch.cuda.synchronize()
        print(f"{name:34s} host ms, median of 5: {sorted(times)[2]:8.3f}  (all {[round(t, 2) for t in times]})",
              flush=True)
    print("torch", torch.__version__, torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
