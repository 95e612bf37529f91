"""Token budgets, batch planning, padding accounting, the replicas' batch queue and the decoder's
admission (plain Python: no torch, no Ray)."""
from .admission import DecoderAdmission
from .batching import BatchQueue
from .budgets import (GLOBAL_UNIT_TOKENS, LOCAL_UNIT_TOKENS, PathBudgets, default_budgets,
                      fill_gaps, geometric_units)
from .planner import Batch, Item, PathPlan, Plan, Planner, path_plan
from .stats import PathStats

__all__ = ["GLOBAL_UNIT_TOKENS", "LOCAL_UNIT_TOKENS", "Batch", "BatchQueue", "DecoderAdmission", "Item",
           "PathBudgets", "PathPlan", "PathStats", "Plan", "Planner", "default_budgets", "fill_gaps",
           "geometric_units", "path_plan"]
