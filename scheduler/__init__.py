"""Token budgets, batch planning and padding accounting (plain Python: no torch, no Ray)."""
from .budgets import (GLOBAL_UNIT_TOKENS, LOCAL_UNIT_TOKENS, PathBudgets, default_budgets,
                      fill_gaps, geometric_units)
from .planner import Batch, Item, PathPlan, Plan, Planner, path_plan
from .stats import PathStats

__all__ = ["GLOBAL_UNIT_TOKENS", "LOCAL_UNIT_TOKENS", "Batch", "Item", "PathBudgets", "PathPlan",
           "PathStats", "Plan", "Planner", "default_budgets", "fill_gaps", "geometric_units",
           "path_plan"]
