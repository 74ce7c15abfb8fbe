"""metrics.jsonl (one JSON object per logging step), summary.json and one W&B run per job, written
by process 0. W&B is offline by default (<workdir>/wandb, for `wandb sync`), online falling back to
offline when the server is unreachable (wandb_run.py); a resumed job continues its run id."""
from __future__ import annotations

import json
import math
import os
import pathlib
import uuid

import jax
import numpy as np

from runner.config.schema import WandbConfig, WandbMode
from runner.logging import wandb_run


def _jsonable(value):
  value = np.asarray(value)
  if value.ndim == 0:
    v = value.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v
  return value.tolist()


class MetricWriter:
  def __init__(self, workdir: str, *, run_config: dict, wandb: WandbConfig | None = None,
               job_type: str = "train"):
    self.workdir = pathlib.Path(workdir)
    self.active = jax.process_index() == 0
    self.run = None
    if not self.active:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.jsonl = open(self.workdir / "metrics.jsonl", "a")
    if wandb is not None and wandb.mode != WandbMode.disabled:
      self.run = self._start_wandb(wandb, run_config, job_type)

  def _start_wandb(self, cfg: WandbConfig, run_config: dict, job_type: str):
    id_file = self.workdir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb_run.start_run(
        cfg.mode.value, str(self.workdir), project=cfg.project, entity=cfg.entity,
        name=cfg.name or self.workdir.name, tags=list(cfg.tags), group=cfg.group,
        config={**run_config, **({"overrides": list(cfg.overrides)} if cfg.overrides else {})},
        id=run_id, resume="allow", job_type=job_type, reinit="finish_previous")

  def write(self, step: int, metrics: dict) -> None:
    if not self.active or not metrics:
      return
    record = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
    self.jsonl.write(json.dumps(record) + "\n")
    self.jsonl.flush()
    if self.run is not None:
      import wandb  # lazily: slow to import, and only a live W&B run needs it
      arrays = {k: np.asarray(v) for k, v in metrics.items()}
      self.run.log({k: wandb.Histogram(v) if v.ndim else v.item() for k, v in arrays.items()},
                   step=int(step))

  def last_logged_training(self, up_to_step: int) -> dict:
    """The metrics (`train/`, with the `moe/...` of the same steps) of the latest training record at
    or before `up_to_step`: a resumed run with nothing left to train still reports them all."""
    if not self.active:
      return {}
    latest = {}
    for line in (self.workdir / "metrics.jsonl").read_text().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # a line cut short by a kill
        continue
      if (record.get("step", math.inf) <= up_to_step
          and any(k.startswith("train/") for k in record)):
        latest = {k: v for k, v in record.items() if k != "step"}
    return latest

  def log_image(self, step: int | None, key: str, path: str) -> None:
    """`step` None: W&B's next step (a resumed run takes no step it has passed)."""
    if self.run is not None:
      import wandb  # lazily: slow to import, and only a live W&B run needs it
      self.run.log({key: wandb.Image(path)}, **({} if step is None else {"step": int(step)}))

  def log_table(self, key: str, columns: list[str], rows: list) -> None:
    if self.run is not None:
      import wandb  # lazily: slow to import, and only a live W&B run needs it
      self.run.log({key: wandb.Table(columns=columns, data=[list(r) for r in rows])})

  def summary(self, metrics: dict, filename: str = "summary.json") -> None:
    if not self.active:
      return
    clean = {k: _jsonable(v) for k, v in metrics.items()}
    (self.workdir / filename).write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
    if self.run is not None:
      self.run.summary.update({k: v for k, v in clean.items() if not isinstance(v, list)})

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    if not self.active:
      return
    self.jsonl.close()
    if self.run is not None:
      self.run.finish()
      self.run = None
