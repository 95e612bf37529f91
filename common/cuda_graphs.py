"""CUDA-graph capture shared by the encoder's path graphs and the decoder's decode-step graphs."""
from __future__ import annotations

import torch


def capture_graph(fn, pool=None, warmup: int = 1, device=None, stream=None):
    """Run `fn` `warmup` times on a side stream (handles, Triton compilation, allocator pool),
    then capture it on that same stream: (graph, fn's output, which every replay rewrites).

    cuBLAS keeps one workspace per stream and a graph bakes in the workspace of the stream it
    was captured on; torch.cuda.graph's default capture stream is one for the whole process.
    Graphs that may replay at the same time (the two encoder paths) must therefore be captured
    on different streams: pass one `stream` per group of graphs that never overlap."""
    side = stream or torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        out = fn()
    return graph, out
