"""The KV cache's page size and fp8 element type, in a module of their own: the cache
(kv_cache.py) imports the Triton kernels that read and write its pages
(triton_paged_attention.py, triton_rope.py), and those kernels need them too, so they live
below all three (no import circle)."""
import torch

PAGE_TOKENS = 64
FP8 = torch.float8_e4m3fn  # kv_cache_dtype "fp8" (kv_cache.py)
FP8_MAX = float(torch.finfo(FP8).max)  # 448: larger values are stored as this (saturated)
