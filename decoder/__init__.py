"""DeepSeek-3B-MoE language model and its generation engine (plain PyTorch); see issue 4."""
