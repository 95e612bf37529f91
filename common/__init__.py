"""Plain-PyTorch helpers that `encoder/` and `decoder/` both use (neither imports the other):
the released checkpoint layout (`common.checkpoint`) and CUDA-graph capture
(`common.cuda_graphs`). No Ray here."""
