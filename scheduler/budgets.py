"""Token budgets per encoder path: the batch sizes CUDA graphs are captured at.

A budget is a token count that is a whole number of units (272 tokens per global view: a 16x16
grid plus its newline column; 100 per 640² crop), so a graph for budget B holds B / unit views.
The local path also has the implicit budget 0: a batch with no crops skips the path.

Budgets grow geometrically from one unit: next = max(prev + 1, floor(prev * growth)) units, so
the step is at most `growth` (1.5 by default) except where one unit is already a bigger step
(1 -> 2), and the last budget is exactly the maximum. vLLM's PR doubles (2x; bench/baselines.py)
and pads up to half of a batch; 1.5x bounds the padding at a third, at the cost of a few more
graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

GLOBAL_UNIT_TOKENS = 272  # 16 * (16 + 1): global view with a newline after each row
LOCAL_UNIT_TOKENS = 100  # 10 * 10: one 640² crop (newlines are added when stitching)


def geometric_units(max_units: int, growth: float = 1.5) -> list[int]:
    """1, 2, 3, 4, 6, 9, 13, 19, ... up to and including max_units."""
    if max_units < 1:
        raise ValueError(f"max_units must be >= 1, got {max_units}")
    if growth <= 1.0:
        raise ValueError(f"growth must be > 1, got {growth}")
    units = [1]
    while units[-1] < max_units:
        units.append(min(max_units, max(units[-1] + 1, int(units[-1] * growth))))
    return units


@dataclass(frozen=True)
class PathBudgets:
    """The token budgets of one path, ascending, each a multiple of `unit` tokens."""

    name: str
    unit: int
    budgets: tuple[int, ...]

    def __post_init__(self):
        if not self.budgets:
            raise ValueError(f"{self.name}: no budgets")
        if list(self.budgets) != sorted(set(self.budgets)):
            raise ValueError(f"{self.name}: budgets must be strictly ascending: {self.budgets}")
        bad = [b for b in self.budgets if b <= 0 or b % self.unit]
        if bad:
            raise ValueError(f"{self.name}: budgets {bad} are not positive multiples of {self.unit}")

    @classmethod
    def geometric(cls, name: str, unit: int, max_units: int, growth: float = 1.5) -> "PathBudgets":
        return cls(name, unit, tuple(u * unit for u in geometric_units(max_units, growth)))

    @classmethod
    def explicit(cls, name: str, unit: int, budgets) -> "PathBudgets":
        return cls(name, unit, tuple(sorted(budgets)))

    @property
    def max_tokens(self) -> int:
        return self.budgets[-1]

    @property
    def max_units(self) -> int:
        return self.budgets[-1] // self.unit

    @property
    def capacities(self) -> tuple[int, ...]:
        """Views per budget (graph batch sizes)."""
        return tuple(b // self.unit for b in self.budgets)

    def smallest_fitting(self, units: int) -> int | None:
        """The smallest budget holding `units` views; None when none does (run eagerly)."""
        tokens = units * self.unit
        for budget in self.budgets:
            if budget >= tokens:
                return budget
        return None

    def replays(self, units: int) -> tuple[int, ...]:
        """The budgets to replay, one after another, for `units` views: the smallest that holds
        them all, or two (the largest not above them, then the smallest holding the rest) where
        those compute less by more than one view's tokens, the price put on a second replay.
        Past a few views a batch keeps the GPU busy either way, and padding is pure cost: 16
        global views pad 19 (13 + 3 do not), 48 crops 54 (36 + 12). () when none holds them."""
        single = self.smallest_fitting(units)
        if single is None:
            return ()
        first = max((b for b in self.budgets if b <= units * self.unit), default=None)
        if first is None or first == units * self.unit:
            return (single,)
        second = self.smallest_fitting(units - first // self.unit)
        return (first, second) if first + second + self.unit < single else (single,)


def fill_gaps(units: list[int], growth: float) -> list[int]:
    """Insert steps wherever consecutive sizes grow by more than `growth` (and more than 1)."""
    out = [units[0]]
    for u in units[1:]:
        while u > max(out[-1] + 1, int(out[-1] * growth)):
            out.append(max(out[-1] + 1, int(out[-1] * growth)))
        out.append(u)
    return out


def default_budgets(max_images: int = 32, max_crops_per_image: int = 6, growth: float = 1.5,
                    global_unit: int = GLOBAL_UNIT_TOKENS,
                    local_unit: int = LOCAL_UNIT_TOKENS) -> tuple[PathBudgets, PathBudgets]:
    """Global path: geometric up to `max_images` views. Local path: aligned to pages, i.e. the
    small geometric steps up to one image's crops plus `max_crops_per_image` times every global
    capacity (a batch of k fully tiled pages fits exactly when k is a global capacity), with
    gaps filled so no step exceeds `growth`. Units: DeepSeek-OCR's by default (DeepSeek-OCR-2:
    256 per global view, 144 per 768² crop)."""
    global_units = geometric_units(max_images, growth)
    local_units = sorted(set(geometric_units(max_crops_per_image, growth))
                         | {max_crops_per_image * g for g in global_units})
    return (PathBudgets("global", global_unit, tuple(u * global_unit for u in global_units)),
            PathBudgets("local", local_unit, tuple(u * local_unit for u in fill_gaps(local_units, growth))))
