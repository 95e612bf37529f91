"""Tables derived from a weight for one view size, made once instead of in every forward.

SAM's position embedding resized to a crop's 40x40 grid, CLIP's to its 10x10, and SAM's
relative-position tables resized for a global block on a crop: each forward made them again
(bicubic and linear interpolations in fp32 and their casts: 42 of the 447 GPU operations of a
2x3 page's crop path at batch 1 and 0.31 ms of its kernel time, replayed inside every graph). They depend only on the weight and
the size, so each is kept on its weight, keyed by the size and the weight's address and version
(an in-place update of the weight bumps its version and so remakes the table; a CUDA graph
captured before the update goes on reading the table it was captured with). A table that is a
view of its weight (the size it was stored for) is not kept: it costs nothing to make.

Made in every forward instead (the reference twin): with DEEPSEEK_OCR_CACHE_TABLES=0 (or this
module's ENABLED); under torch.compile; in `compile_ahead`'s forward, whose kernels do not run;
while a CUDA graph is being captured, unless it was kept before (one made then would live in
the graph's memory pool; the captures' warm-up runs make and keep them first); where autograd
records (a kept table would carry no gradient to the weight); and for weights made under
inference mode, whose in-place updates no version counter sees.
"""
from __future__ import annotations

from typing import Callable

import torch

from common import switches
from common.triton_compile import compiling_only

ENABLED = switches.on("DEEPSEEK_OCR_CACHE_TABLES")


def derived_table(weight: torch.Tensor, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()`, a table derived from `weight` alone for `key` (the size, the dtype wanted),
    kept on `weight` for the next call with the same key and the weight unchanged."""
    if (not ENABLED or torch.compiler.is_compiling() or compiling_only() or weight.is_inference()
            or (torch.is_grad_enabled() and weight.requires_grad)):
        return make()
    tables = weight.__dict__.setdefault("_derived_tables", {})
    stamp = (weight.data_ptr(), weight._version)
    kept = tables.get(key)
    if kept is not None and kept[0] == stamp:
        return kept[1]  # a graph being captured reads it where it is
    table = make()
    # A view of the weight itself (a size it was stored for) costs nothing to make, and kept on
    # the weight it would be a reference cycle that the garbage collector does not see through
    # (the weight would never be freed).
    shares_storage = table.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    if not (shares_storage or (weight.is_cuda and torch.cuda.is_current_stream_capturing())):
        tables[key] = (stamp, table)
    return table
