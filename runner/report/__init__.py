"""`vmoe report`: one self-contained HTML page for a run or a sweep, to read offline.

A run's page (run_page) shows what ran and how (workdir), its training and validation curves
and each MoE layer's expert load over training (curves, plots), its final metrics
(final_metrics), the evaluators' pictures and its checkpoints; a sweep's page (sweep_page) a
row per job, the best one and the swept keys against the main metric; a chain's (chain_page) a
row per stage, linked to the stage it started from. Everything is inlined
(markup): a page opens from a file with no network and no script it needs. Evaluators may add
sections of their own (evaluator_sections). `vmoe report` is command.main; other code calls
`write_run_page(workdir)`, which is fast enough to call at the end of every stage, and
`publish_to_wandb(workdir)` (wandb_media), which gives the run's W&B run the same heat maps and
tables.
"""
from __future__ import annotations

from runner.report.chain_page import write_chain_page
from runner.report.run_page import write_run_page
from runner.report.sweep_page import write_sweep_page
from runner.report.wandb_media import publish as publish_to_wandb
from runner.report.workdir import read as read_run

__all__ = ["publish_to_wandb", "read_run", "write_chain_page", "write_run_page",
           "write_sweep_page"]
