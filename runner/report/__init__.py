"""`vmoe report`: one self-contained HTML page for a run, a sweep or a chain, to read offline
(docs/report.md). Everything is inlined (markup), so a page opens from a file with no network.
`write_run_page(workdir)` is fast enough to call at the end of every stage."""
from __future__ import annotations

from runner.report.chain_page import write_chain_page
from runner.report.run_page import write_run_page
from runner.report.sweep_page import write_sweep_page
from runner.report.wandb_media import publish as publish_to_wandb
from runner.report.workdir import read as read_run

__all__ = ["publish_to_wandb", "read_run", "write_chain_page", "write_run_page", "write_sweep_page"]
