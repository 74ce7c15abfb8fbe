"""One module per subcommand, each `run(config, placement, checkpoints) -> dict` wiring library
calls, nothing more. `run_task` does what every subcommand does first: join the job, check the
config against the devices, and hold the workdir's lock (no second process writes into a live
run). `main_metric` is the number a stage is judged by (what a hyperparameter search maximises)."""
from __future__ import annotations

import importlib
import re
import sys

MAIN_METRICS = {
    "pretrain": "val/prec@1 (objective=contrastive: val/zero_shot_prec@1, else val/i2t_prec@1)",
    "finetune": "val/prec@1",
    "eval": "<first eval dataset>/prec@1 (retrieval alone: <dataset>/i2t_recall@1)",
    "ensemble": "<first eval dataset>/prec@1",
    "fewshot": "mean/<most shots>shot/accuracy",
    "compress": "calibration/prec@1 (the compressed model's, on the calibration images)",
    "export": "export/max_abs_diff (PyTorch against vmoe; NaN where PyTorch is not installed)",
}


def main_metric(stage: str, summary: dict) -> float:
  """The stage's main metric from its summary (MAIN_METRICS says which)."""
  if stage in ("pretrain", "finetune"):
    for key in ("val/prec@1", "val/zero_shot_prec@1", "val/i2t_prec@1"):
      if key in summary:
        return float(summary[key])
    raise KeyError(f"the {stage} summary has none of val/prec@1, val/zero_shot_prec@1, "
                   "val/i2t_prec@1")
  if stage in ("eval", "ensemble"):  # retrieval alone (captions without labels): i2t recall@1
    return float(next(v for pattern in (r"[^/]+/prec@1", r"[^/]+/i2t_recall@1")
                      for k, v in summary.items() if re.fullmatch(pattern, k)))
  if stage == "fewshot":
    shots = max(int(m[1]) for k in summary if (m := re.fullmatch(r"mean/(\d+)shot/accuracy", k)))
    return float(summary[f"mean/{shots}shot/accuracy"])
  if stage == "compress":
    return float(summary["calibration/prec@1"])
  if stage == "export":
    return float(summary.get("export/max_abs_diff", float("nan")))
  raise ValueError(f"unknown stage {stage!r}; valid: {', '.join(MAIN_METRICS)}")


def run_task(name: str, config, checkpoints, *, devices_checked: bool = False) -> float:
  """Runs subcommand `name`; returns its main metric (its summary is in the workdir). `checkpoints`
  (runner.checkpoints.weights.Checkpoints) opens the job's checkpoint paths, once each;
  `devices_checked`: the CLI checked the config against this process's devices already."""
  # Lazily: these load JAX and TensorFlow, and `vmoe summarize` and the Hydra launcher import this
  # package for main_metric alone.
  import jax

  from runner.stages import common
  from runner.workdirs.workdir_lock import WorkdirLock
  module = importlib.import_module(f"runner.tasks.{name.replace('-', '_')}")
  placement = common.start(config, name, check_devices=not devices_checked)
  with WorkdirLock(config.workdir, " ".join(sys.argv), enabled=jax.process_index() == 0):
    summary = module.run(config, placement, checkpoints)
  return main_metric(name, summary)
