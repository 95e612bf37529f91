"""Pack queued images into batches that fit both paths' token budgets.

Each item (an image) needs `global_views` units on the global path (1) and `crops` units on the
local path (0..9). A batch is feasible when it has at most `max_items` items and each path's
units fit its largest budget; each path then replays the smallest budget that holds its units
and pads the rest. A path with no units in a batch is skipped; an item too big for a path's
largest budget forms a batch of its own in which that path runs eagerly (the other path still
replays its graph).

Algorithm. Items are sorted by token need, largest first (ties keep queue order), as vLLM's
sorted-greedy does. Greedy then closes a batch as soon as the next item does not fit (kept in
bench/baselines.py for comparison). We instead cut the same sorted order into contiguous batches
by dynamic programming, minimising first the number of batches and then the padded tokens:

    best[i] = min over j of best[j] + (1 batch, padding(order[j:i]))   for feasible order[j:i]

Greedy's cut is one feasible solution with the fewest batches (for contiguous cuts of a fixed
order, closing a batch only when forced is optimal in count), so the result never has more batches
and never more padding than greedy on the same order; it costs O(n * max_items).
Results are returned per item in queue order by the caller using `Batch.indices`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .budgets import PathBudgets


@dataclass(frozen=True)
class Item:
    global_views: int = 1
    crops: int = 0


@dataclass(frozen=True)
class PathPlan:
    """What one path does for one batch."""

    units: int
    unit: int
    budget: int | None  # the smallest token budget holding the batch; None: eager (too big) or skipped
    # The budgets replayed one after another, each taking as many views as it holds (in order):
    # `budget` alone (the default), or two that pad less (`PathBudgets.replays`).
    replays: tuple[int, ...] = ()

    def __post_init__(self):
        if self.budget is not None and not self.replays:
            object.__setattr__(self, "replays", (self.budget,))

    @property
    def skipped(self) -> bool:
        return self.units == 0

    @property
    def eager(self) -> bool:
        return self.units > 0 and self.budget is None

    @property
    def tokens(self) -> int:
        return self.units * self.unit

    @property
    def padding(self) -> int:
        return sum(self.replays) - self.tokens if self.budget is not None else 0

    @property
    def capacity(self) -> int | None:
        """Views in the replayed graphs (None when eager or skipped)."""
        return sum(self.replays) // self.unit if self.budget is not None else None


def path_plan(budgets: PathBudgets, units: int, split: bool = False) -> PathPlan:
    """`split=False`: one replay of the smallest budget holding them (the reference twin of
    two replays that pad less)."""
    single = budgets.smallest_fitting(units) if units else None
    return PathPlan(units, budgets.unit, single, budgets.replays(units) if split and single else ())


@dataclass(frozen=True)
class Batch:
    indices: tuple[int, ...]  # positions in the queue
    global_path: PathPlan
    local_path: PathPlan

    @property
    def paths(self) -> tuple[PathPlan, PathPlan]:
        return self.global_path, self.local_path


@dataclass
class Plan:
    batches: list[Batch] = field(default_factory=list)

    @property
    def padded_tokens(self) -> int:
        return sum(p.padding for b in self.batches for p in b.paths)

    @property
    def computed_tokens(self) -> int:
        """Tokens the GPU runs: budgets where a graph replays, real tokens where eager."""
        return sum(p.tokens + p.padding for b in self.batches for p in b.paths)

    @property
    def padding_fraction(self) -> float:
        total = self.computed_tokens
        return self.padded_tokens / total if total else 0.0

    def in_queue_order(self, per_batch: list[list]) -> list:
        """Per-item results given batch by batch (in each batch's index order) -> queue order."""
        out: list = [None] * sum(len(b.indices) for b in self.batches)
        for batch, results in zip(self.batches, per_batch, strict=True):
            if len(results) != len(batch.indices):
                raise ValueError(f"{len(results)} results for a batch of {len(batch.indices)}")
            for index, result in zip(batch.indices, results):
                out[index] = result
        return out


class Planner:
    def __init__(self, global_budgets: PathBudgets, local_budgets: PathBudgets, max_items: int,
                 split_replays: bool = False):
        """`split_replays`: a path may replay two budgets that pad less than one
        (`PathBudgets.replays`); off, one replay of the smallest holding its views."""
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.global_budgets, self.local_budgets = global_budgets, local_budgets
        self.max_items, self.split_replays = max_items, split_replays

    def _oversized(self, item: Item) -> bool:
        return (item.global_views > self.global_budgets.max_units
                or item.crops > self.local_budgets.max_units)

    def _batch(self, items: list[Item], indices) -> Batch:
        g = sum(items[i].global_views for i in indices)
        c = sum(items[i].crops for i in indices)
        return Batch(tuple(indices), path_plan(self.global_budgets, g, self.split_replays),
                     path_plan(self.local_budgets, c, self.split_replays))

    def _segments(self, items: list[Item], order: list[int], end: int):
        """Start positions j of feasible batches order[j:end], longest last."""
        g = c = 0
        for j in range(end - 1, max(-1, end - 1 - self.max_items), -1):
            item = items[order[j]]
            if self._oversized(item):
                if j == end - 1:
                    yield j  # alone in its batch; the path it overflows runs eagerly
                return
            g, c = g + item.global_views, c + item.crops
            if g > self.global_budgets.max_units or c > self.local_budgets.max_units:
                return
            yield j

    def plan(self, items: list[Item]) -> Plan:
        for item in items:
            if item.global_views < 0 or item.crops < 0:
                raise ValueError(f"negative units in {item}")
        order = sorted(range(len(items)),
                       key=lambda i: (-(items[i].global_views * self.global_budgets.unit
                                        + items[i].crops * self.local_budgets.unit), i))
        cuts = self._cuts(items, order)
        return Plan([self._batch(items, order[a:b]) for a, b in zip(cuts, cuts[1:])])

    def _cuts(self, items, order) -> list[int]:
        """Batch boundaries in `order` (0 first, len(order) last), by dynamic programming."""
        n = len(order)
        best: list[tuple[int, int] | None] = [None] * (n + 1)
        prev = [0] * (n + 1)
        best[0] = (0, 0)
        for end in range(1, n + 1):
            for start in self._segments(items, order, end):
                batch = self._batch(items, order[start:end])
                cost = (best[start][0] + 1, best[start][1] + batch.global_path.padding
                        + batch.local_path.padding)
                if best[end] is None or cost < best[end]:
                    best[end], prev[end] = cost, start
        cuts = [n]
        while cuts[-1] > 0:
            cuts.append(prev[cuts[-1]])
        return cuts[::-1]
