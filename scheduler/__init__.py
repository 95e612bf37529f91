"""Token budgets, batch planning, padding accounting and the replicas' batch queue (plain Python:
no torch, no Ray)."""
from .batching import BatchQueue
from .budgets import (GLOBAL_UNIT_TOKENS, LOCAL_UNIT_TOKENS, PathBudgets, default_budgets,
                      fill_gaps, geometric_units)
from .planner import Batch, Item, PathPlan, Plan, Planner, path_plan
from .stats import PathStats

__all__ = ["GLOBAL_UNIT_TOKENS", "LOCAL_UNIT_TOKENS", "Batch", "BatchQueue", "Item", "PathBudgets",
           "PathPlan", "PathStats", "Plan", "Planner", "default_budgets", "fill_gaps",
           "geometric_units", "path_plan"]
