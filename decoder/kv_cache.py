"""The generation engine's KV cache, in pages, and attention of one new token per sequence over it.

Keys and values live in pages of `PAGE_TOKENS` tokens, `[layer, page, head, PAGE_TOKENS, d]`;
each running sequence owns a row of the page table (its pages in order). Memory is therefore a
budget of pages shared by all sequences, not `max_len` tokens reserved per sequence: 256 pages
of 1,600 tokens fit where 256 x 8,192-token slots (128 GB at real dims) never could.

Page 0 is scratch: unused table entries point at it, so padded prefill positions and the padded
rows of a decode graph write there, and nobody reads it. Rows of the table are compact (running
sequences are rows 0..S-1); a sequence that leaves frees its pages and the last row moves into
its place (a table-row copy: no key or value moves).

Decode attention (one query per row over its own positions 0..p) has two implementations:
`gather` (any device: the row's pages gathered into one [S, H, L, d] block, then the masked SDPA
of the unpaged cache; the reference) and, on CUDA, a Triton kernel that walks each row's pages
and reads only the positions it holds (decoder/triton_paged_attention.py). `KVCache.kernel`
picks ("triton" by default on CUDA; set "gather", before decode graphs are captured, for the
reference). For Unlimited-OCR's R-SWA (`window`), both see only the row's prompt positions and
its last `window` positions; the positions between (the gap) are never read again, so the
scheduler gives their whole pages back (`drop`): their table entries point at the scratch page,
which the kernel never reads there and the reference masks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common import switches

from .pages import FP8, FP8_MAX, PAGE_TOKENS

SCRATCH_PAGE = 0
# The cache's element types (`GenerationEngine(kv_cache_dtype=...)`): the model's own, or 8-bit
# floats (vLLM's kv_cache_dtype="fp8", its default scale 1: keys and values stored as they are),
# half the bytes a decode step reads and twice the tokens a cache holds, at fp8's precision.
KV_CACHE_DTYPES = ("auto", "fp8")


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return FP8 if name == "fp8" else model_dtype


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` keeps it: fp8 saturated at its largest finite value (a GPU's
    conversion in the Triton write does the same; a plain cast would give NaN)."""
    if x.dtype == dtype:
        return x
    if dtype == FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(dtype)


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


class KVCache:
    def __init__(self, n_layers: int, n_heads: int, head_dim: int, num_pages: int,
                 max_seqs: int, max_len: int, device, dtype):
        if num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page, got {num_pages}")
        self.device = torch.device(device)
        shape = (n_layers, num_pages + 1, n_heads, PAGE_TOKENS, head_dim)  # +1: the scratch page
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_pages, self.max_seqs = num_pages, max_seqs
        # The table lives on the host (pinned on CUDA, so its copy to the device is
        # asynchronous) and is copied to the device table, which graphs read, when it changed.
        self.table = torch.zeros(max_seqs, pages_for(max_len), dtype=torch.int32, device=device)
        pinned = self.device.type == "cuda"
        self._host_table = torch.zeros(self.table.shape, dtype=torch.int32, pin_memory=pinned) \
            if pinned else self.table
        self._pages: list[list[int]] = [[] for _ in range(max_seqs)]
        self._free = list(range(num_pages, SCRATCH_PAGE, -1))  # pop() hands out low pages first
        self._dirty = False
        self._copied = None  # the event after the last copy out of the pinned table
        setting = switches.kernel("DEEPSEEK_OCR_PAGED_ATTENTION")  # "triton" on CUDA by default
        self.kernel = "triton" if setting == "triton" or (setting == "auto" and self.device.type == "cuda") \
            else "gather"

    @staticmethod
    def bytes_per_token(n_layers: int, n_heads: int, head_dim: int, dtype) -> int:
        return 2 * n_layers * n_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * PAGE_TOKENS

    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def pages_short(self, row: int, tokens: int) -> int:
        """Pages `row` lacks for its first `tokens` positions (what `reserve` would take)."""
        return max(0, pages_for(tokens) - len(self._pages[row]))

    def pages_held(self, row: int) -> int:
        """Pages `release` would give back."""
        return sum(page != SCRATCH_PAGE for page in self._pages[row])

    def holds(self, row: int, tokens: int) -> bool:
        """Whether `row` already has pages for its first `tokens` positions."""
        return pages_for(tokens) <= len(self._pages[row])

    def reserve(self, row: int, tokens: int) -> bool:
        """Give `row` pages for its first `tokens` positions; False (nothing taken) when the free
        pages do not suffice."""
        pages = self._pages[row]
        need = pages_for(tokens) - len(pages)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        self._writable()
        for _ in range(need):
            page = self._free.pop()
            self._host_table[row, len(pages)] = page
            pages.append(page)
        self._dirty = True
        return True

    def release(self, row: int) -> None:
        self._writable()
        self._free += [page for page in reversed(self._pages[row]) if page != SCRATCH_PAGE]
        self._pages[row] = []
        self._host_table[row] = SCRATCH_PAGE
        self._dirty = True

    def drop(self, row: int, first_page: int, end_page: int) -> None:
        """Give back `row`'s pages first_page..end_page-1 (positions no query reads again: an
        R-SWA gap); their entries point at the scratch page, and the row keeps its length."""
        pages = self._pages[row]
        self._writable()
        for index in range(first_page, min(end_page, len(pages))):
            if pages[index] != SCRATCH_PAGE:
                self._free.append(pages[index])
                pages[index] = SCRATCH_PAGE
                self._host_table[row, index] = SCRATCH_PAGE
                self._dirty = True

    def move(self, src: int, dst: int) -> None:
        """Row src's pages become row dst's (dst free); src is left free."""
        assert not self._pages[dst], "move into a row that holds pages"
        self._writable()
        self._pages[dst], self._pages[src] = self._pages[src], []
        self._host_table[dst] = self._host_table[src]
        self._host_table[src] = SCRATCH_PAGE
        self._dirty = True

    def clear(self) -> None:
        for row in range(self.max_seqs):
            if self._pages[row]:
                self.release(row)

    def sync(self) -> None:
        """Copy the table to the device when it changed (before a forward that uses it)."""
        if self._dirty and self._host_table is not self.table:
            self.table.copy_(self._host_table, non_blocking=True)
            self._copied = torch.cuda.current_stream(self.device).record_event()
        self._dirty = False

    def _writable(self) -> None:
        """Before the pinned table changes: its last copy to the device is done. (A step that
        read its picks has waited for it; one that launches the next decode step before reading
        them, `GenerationEngine.overlap_picks`, may not have.)"""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    # -- used by the model's attention -------------------------------------------------------
    def write_prefill(self, layer: int, first_row: int, k, v, table=None) -> None:
        """k, v [B, H, T, d] of rows first_row.. at positions 0..T-1 (right-padded rows: the
        positions past a row's pages go to the scratch page); `table`: those rows' table rows
        given (a prefill graph's copy), not read from the cache's."""
        b, h, t, d = k.shape
        n = pages_for(t)
        rows = self.table[first_row:first_row + b] if table is None else table
        pages = rows[:, :n].reshape(-1).long()
        for cache, new in ((self.k, k), (self.v, v)):
            paged = F.pad(new, (0, 0, 0, n * PAGE_TOKENS - t)).view(b, h, n, PAGE_TOKENS, d)
            cache[layer][pages] = stored(paged.transpose(1, 2).reshape(b * n, h, PAGE_TOKENS, d), cache.dtype)

    def rope_and_write(self, layer: int, qkv, cos, sin, n_heads: int, first_row: int = 0,
                       positions=None, table=None):
        """RoPE and `write_prefill` (rows first_row.., positions 0..T-1; or the rows of `table`)
        or `write_decode` (rows 0..S-1 at `positions`) in one kernel (decoder/triton_rope.py):
        qkv [B, T, 3 n d] the packed projection -> rotated q and k [B, T, 2n, d], with k and v
        in the rows' pages."""
        from .triton_rope import rope_and_write_cache
        rows = self.table[first_row:first_row + qkv.shape[0]] if table is None else table
        return rope_and_write_cache(qkv, cos, sin, self.k[layer], self.v[layer], rows, n_heads, positions)

    def write_decode(self, layer: int, positions, k, v) -> None:
        """k, v [S, H, d]: rows 0..S-1's new token at `positions` [S]."""
        rows = self.table[:positions.shape[0]]
        pages = rows.gather(1, (positions // PAGE_TOKENS)[:, None].long())[:, 0].long()
        offsets = positions % PAGE_TOKENS
        self.k[layer][pages, :, offsets] = stored(k, self.k.dtype)
        self.v[layer][pages, :, offsets] = stored(v, self.v.dtype)

    def attend(self, layer: int, q, positions, kv_len: int, prompt_lens=None, window: int | None = None):
        """q [S, H, 1, d] of rows 0..S-1, each at `positions`; keys and values at positions
        0..p of the row, p < kv_len (a static bound: the graph's context bucket) -> [S, 1, H*d].
        R-SWA (`window`, with `prompt_lens` [S]): only a row's prompt and its last `window`
        positions (decoder/model.py)."""
        s, h, _, d = q.shape
        rows = self.table[:s]
        if self.kernel == "triton":
            from .triton_paged_attention import paged_decode_attention
            return paged_decode_attention(q[:, :, 0], self.k[layer], self.v[layer], rows,
                                          positions, kv_len, prompt_lens=prompt_lens,
                                          window=window).view(s, 1, h * d)
        return gathered_decode_attention(q, self.k[layer], self.v[layer], rows, positions, kv_len,
                                         prompt_lens, window)


def gathered_decode_attention(q, k_pages, v_pages, rows, positions, kv_len: int, prompt_lens=None,
                              window: int | None = None):
    """The reference: each row's first pages_for(kv_len) pages gathered into one block, then SDPA
    with positions past the row's own masked (what attention over an unpaged cache computes),
    and for R-SWA (`window`) those between the row's prompt and its last `window` too."""
    s, h, _, d = q.shape
    n = pages_for(kv_len)
    keys, values = (pages[rows[:, :n].long()].transpose(1, 2).reshape(s, h, n * PAGE_TOKENS, d).to(q.dtype)
                    for pages in (k_pages, v_pages))
    j, p = torch.arange(n * PAGE_TOKENS, device=q.device)[None], positions[:, None]
    visible = j <= p
    if window is not None:
        visible &= (j < prompt_lens[:, None]) | (j > p - window)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None])
    return out.transpose(1, 2).reshape(s, 1, h * d)


CPU_DEFAULT_BYTES = 256 * 10 ** 6  # a CPU run (tests, the tiny app) needs no more
WORKING_RESERVE_BYTES = 4 * 10 ** 9  # prefill activations, graph pools, sampling (real dims)


def cache_pages(budget_gb: float | None, bytes_per_token: int, max_seqs: int, max_len: int,
                device) -> int:
    """Pages of `budget_gb` GB; none given: enough for every sequence at `max_len` when memory
    allows, else what the device leaves (on CUDA: 70% of the memory this process may still
    take, its per-process cap included, less a working reserve; on CPU: at most 256 MB)."""
    page_bytes = bytes_per_token * PAGE_TOKENS
    if budget_gb is not None:
        return max(1, int(budget_gb * 1e9 / page_bytes + 1e-6))  # 1e-6: decimal GB of whole pages
    pages = max_seqs * pages_for(max_len)
    device = torch.device(device)
    if device.type == "cuda":
        # Blocks freed since the load (the released tensors packed into fewer, ~5 GB at real
        # dims) are still reserved by torch's allocator and would count as taken: the e2e runs
        # of a loader that packs on the GPU sized 666,176 tokens where 722,752 fit before.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        allowed = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
        # 0.7: decode-graph pools, prefill activations and allocator slack took ~9.5 GB next
        # to weights and a 0.9 share on an H200 (a CUDA OOM under load, bench/e2e_bench.py).
        available = 0.7 * min(free, allowed) - WORKING_RESERVE_BYTES
    else:
        available = CPU_DEFAULT_BYTES
    return max(1, min(pages, int(available // page_bytes)))
