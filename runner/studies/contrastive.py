"""`make study-contrastive`: DET vs HET-XL contrastive learning (LiT) on the embedded captions;
docs/contrastive.md states its stages, settings and results. The image model is the demo's
pretrained V-MoE when `make demo` has finished it, else one pretrained here with the demo's own
settings."""
from __future__ import annotations

import json
import pathlib
import sys
import time

import yaml

from runner import demo
from runner.report import summarize
from runner.report.summarize import Column
from runner.studies import driver

ROOT = pathlib.Path("runs/studies/contrastive")
SWEEP = driver.Sweep("study-contrastive", ROOT)
SEEDS = (0, 1)
ROWS = [  # (experiment overlay, row label)
    ("lit_det", "DET (Eq. 6), t₀ = 10"),
    ("lit_hetxl", "HET-XL (Eq. 8), R = 15, S = 1, t₀ = 3"),
]
DATASET = "mnist5k_captions"
SECONDS: dict[str, float] = {}  # stage -> seconds, in this invocation


def _vmoe(stage: str, sub: str, args: list[str], extra: list[str]) -> None:
  start = time.perf_counter()
  SWEEP.vmoe(sub, args, extra)
  SECONDS[stage] = SECONDS.get(stage, 0.0) + time.perf_counter() - start


def _read(path: pathlib.Path) -> dict:
  return json.loads(path.read_text())


def _finished(workdir: pathlib.Path, overrides: list[str]) -> bool:
  """A pretraining run that reached the demo's last step (its final summary is written)."""
  steps = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("train.steps=")]
  summary = workdir / "summary.json"
  return summary.exists() and (not steps or _read(summary).get("step") == steps[0])


def upstream(extra: list[str]) -> pathlib.Path:
  """The image model to lock: the demo's, else one pretrained here with the demo's settings."""
  (_, _, overrides), = [s for s in demo.STAGES if s[0] == "pretrain"]
  overrides = [o for o in overrides if not o.startswith("workdir=")]  # the demo's, but its workdir
  if _finished(demo.ROOT / "pretrain", overrides):
    return demo.ROOT / "pretrain"
  own = ROOT / "pretrain"
  if not _finished(own, overrides):
    _vmoe("image model", "pretrain", [f"workdir={own}", *overrides], extra)
  return own


def _evaluated(experiment: str, seed: int) -> bool:
  return (SWEEP.dir("eval", experiment, seed) / "summary.json").exists()


def stages(extra: list[str]) -> None:
  image = upstream(extra)
  ROOT.mkdir(parents=True, exist_ok=True)
  (ROOT / "upstream.txt").write_text(f"{image}\n")
  stored = yaml.safe_load((image / "config.yaml").read_text())["model"]
  if not all(_evaluated(experiment, seed) for experiment, _ in ROWS for seed in SEEDS):
    # The locked tower at the resolution and with the model it was trained with. (Skipped once
    # every run is evaluated: resuming a finished run rewrites its summary without train/*.)
    _vmoe("LiT", "pretrain", ["-cd", "sweeps", "-cn", "contrastive", f"init.checkpoint={image}",
                              f"model={stored['name']}",
                              f"model.image_size={stored['image_size']}"], extra)
  for experiment, _ in ROWS:
    for seed in SEEDS:
      if _evaluated(experiment, seed):
        continue  # evaluated by an earlier run of the study
      _vmoe("zero-shot eval", "eval", [f"workdir={SWEEP.dir('eval', experiment, seed)}",
                                       f"init.checkpoint={SWEEP.dir('lit', experiment, seed)}"],
            extra)


def _replicate(experiment: str, seed: int) -> dict:
  run, ev = SWEEP.summary("lit", experiment, seed), SWEEP.summary("eval", experiment, seed)
  # The learned scale as evaluation read it from the final checkpoint.
  return {**ev, "seed": seed, "steps": run["step"], "t": ev["zero_shot/temperature"],
          "val_zero_shot": run.get("val/zero_shot_prec@1"), "params": run.get("params/total")}


COLUMNS = [
    Column("zero-shot prec@1", f"{DATASET}/prec@1", 3), Column("NLL", f"{DATASET}/nll", 3),
    Column("ECE", f"{DATASET}/ece", 3), Column("Brier", f"{DATASET}/brier", 3),
    Column("learned t", "t", 2), Column("val zero-shot (training)", "val_zero_shot", 3),
]


def table() -> str:
  image = pathlib.Path((ROOT / "upstream.txt").read_text().strip())
  up = _read(image / "summary.json")
  rows = [(label, [_replicate(experiment, seed) for seed in SEEDS]) for experiment, label in ROWS]
  runs = [[label, str(r["seed"]), f"{r[f'{DATASET}/prec@1']:.3f}", f"{r[f'{DATASET}/nll']:.3f}",
           f"{r[f'{DATASET}/ece']:.3f}", f"{r['t']:.2f}", f"{r['params']:,}"]
          for label, replicates in rows for r in replicates]
  steps = rows[0][1][0]["steps"]
  timing = ", ".join(f"{sub} {s:.0f} s" for sub, s in SECONDS.items())
  return "\n".join([
      f"LiT from {image} (vmoe_tiny, MNIST-5k, {up['step']} steps, test prec@1 "
      f"{up.get('test/prec@1', float('nan')):.3f} as a classifier), image tower locked, "
      f"text_tiny, {steps} steps of 128 pairs; zero-shot on the MNIST-5k test split (500 "
      "images) with the 4 held-out templates (`vmoe eval`), mean ± std over seeds "
      f"{', '.join(map(str, SEEDS))}:", "",
      summarize.markdown(*summarize.grouped(rows, COLUMNS, label="contrastive loss")), "",
      "Every run:", "",
      summarize.markdown(["contrastive loss", "seed", "zero-shot prec@1", "NLL", "ECE",
                          "learned t", "parameters"], runs), "",
      f"Stage time in this invocation: {timing or 'none (every stage was finished)'}."])


if __name__ == "__main__":
  sys.exit(driver.main(ROOT, stages, table, sys.argv[1:]))
