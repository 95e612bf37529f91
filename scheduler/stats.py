"""Per-path counters: graph hits and misses, padding, batch sizes."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .planner import PathPlan


@dataclass
class PathStats:
    graph_hits: int = 0  # batches that replayed a captured graph
    graph_misses: int = 0  # batches that ran eagerly (no budget fits, or graphs off)
    skipped: int = 0  # batches with nothing for this path
    real_tokens: int = 0
    padded_tokens: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # views per batch -> count

    def record(self, plan: PathPlan, replayed: bool) -> None:
        if plan.skipped:
            self.skipped += 1
            return
        if replayed:
            self.graph_hits += 1
            self.padded_tokens += plan.padding
        else:
            self.graph_misses += 1
        self.real_tokens += plan.tokens
        self.batch_sizes[plan.units] += 1

    @property
    def padding_fraction(self) -> float:
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    def as_dict(self) -> dict:
        return {"graph_hits": self.graph_hits, "graph_misses": self.graph_misses,
                "skipped": self.skipped, "real_tokens": self.real_tokens,
                "padded_tokens": self.padded_tokens, "padding_fraction": self.padding_fraction,
                "batch_sizes": dict(sorted(self.batch_sizes.items()))}
