"""vmoe: an experiment runner for sparse Vision Mixture-of-Experts research."""
