"""Evaluators: each shared by in-training evaluation and `vmoe eval`."""
