"""The KV cache's page size, in a module of its own: the cache (kv_cache.py) imports the Triton
kernels that read and write its pages (triton_paged_attention.py, triton_rope.py), and those
kernels need the size too, so it lives below all three (no import circle)."""

PAGE_TOKENS = 64
