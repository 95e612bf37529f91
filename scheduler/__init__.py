"""Token budgets, batch planning and padding accounting (plain Python: no torch, no Ray)."""
