"""The run page's pictures in the run's W&B run, so that online and offline users see the same.

W&B already has the curves and the evaluators' pictures; what only the page had (the expert-load
heat maps and the tables; docs/report.md) is logged when a stage ends, to its W&B run resumed.
Nothing happens for a run without W&B (logger.wandb.mode=disabled, or no run id)."""
from __future__ import annotations

import dataclasses
import pathlib
import tempfile

from runner.config import from_dict
from runner.config.schema import WandbConfig, WandbMode
from runner.logging import MetricWriter
from runner.report import curves as curves_lib
from runner.report import final_metrics, plots, workdir


def publish(path: str | pathlib.Path, run: workdir.Run | None = None) -> list[str]:
  """Logs the pictures and tables of the run in `path` to its W&B run; returns the keys logged
  (none without W&B). `run`: the workdir as the caller read it already."""
  path = pathlib.Path(path)
  if not (path / "wandb_run_id").is_file():
    return []  # W&B never ran here: nothing to read
  run = run or workdir.read(path)
  wandb = from_dict(WandbConfig, (run.config.get("logger") or {}).get("wandb") or {})
  if wandb.mode == WandbMode.disabled:
    return []
  run_id = (path / "wandb_run_id").read_text().strip()
  if wandb.mode == WandbMode.online and list((path / "wandb").glob(f"offline-run-*-{run_id}")):
    # The stage could not reach the server and logged offline: so do its pictures, at once,
    # rather than probing the server again.
    wandb = dataclasses.replace(wandb, mode=WandbMode.offline)
  logged = []
  with MetricWriter(str(path), run_config=run.config, wandb=wandb,
                    job_type=run.stage or "train") as writer:
    with tempfile.TemporaryDirectory() as tmp:  # not in the workdir: the page would show it twice
      for load in curves_lib.load_maps(run.curves):
        figure = plots.heatmap_figure(load.key, load.drawn.steps, load.drawn.values, load.name,
                                      load.fraction)
        image = pathlib.Path(tmp) / f"{len(logged)}.png"
        figure.savefig(image, format="png", dpi=100)  # W&B shows images, not inline SVG
        key = f"{load.key}_map"
        writer.log_image(None, key, str(image))  # W&B's next step: a resumed run's
        logged.append(key)
    if run.summary:
      writer.log_table("report/final_metrics", ["section", "metric", "value"],
                       final_metrics.rows(run.summary))
      logged.append("report/final_metrics")
    if run.checkpoints:
      writer.log_table("report/checkpoints", ["step", "state", "MB"],
                       [[c.step, "complete" if c.complete else "incomplete",
                         round(c.size / 1e6, 1)] for c in run.checkpoints])
      logged.append("report/checkpoints")
  return logged
