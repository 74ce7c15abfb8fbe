"""Where metrics go: metrics.jsonl, summary.json, a W&B run, and a console progress bar."""
from runner.logging.progress import Progress, say
from runner.logging.writers import MetricWriter

__all__ = ["MetricWriter", "Progress", "say"]
