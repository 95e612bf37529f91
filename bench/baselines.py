"""The schemes our scheduler is measured against (bench/graph_bench.py, tests/test_scheduler.py);
not used by the library.

- `doubling_budgets`: vLLM PR #43586's budgets, 1, 2, 4, 8, ... units plus the exact maximum.
- `GreedyPlanner`: sorted-greedy batching, which closes a batch as soon as the next item of the
  sorted queue does not fit (vLLM's way); our `Planner` cuts the same order by dynamic
  programming instead.
"""
from __future__ import annotations

from scheduler import GLOBAL_UNIT_TOKENS, LOCAL_UNIT_TOKENS, PathBudgets, Planner


def doubling_budgets(max_images: int = 32, max_crops_per_image: int = 6) -> tuple[PathBudgets, PathBudgets]:
    def doubling(name, unit, max_units):
        units = sorted({min(1 << i, max_units) for i in range(max_units.bit_length() + 1)})
        return PathBudgets.explicit(name, unit, [u * unit for u in units])
    return (doubling("global", GLOBAL_UNIT_TOKENS, max_images),
            doubling("local", LOCAL_UNIT_TOKENS, max_images * max_crops_per_image))


class GreedyPlanner(Planner):
    def _cuts(self, items, order) -> list[int]:
        """Close a batch as soon as the next item does not fit in it."""
        if not order:
            return [0]
        cuts = [0]
        for end in range(2, len(order) + 1):
            if cuts[-1] not in self._segments(items, order, end):
                cuts.append(end - 1)
        return cuts + [len(order)]
