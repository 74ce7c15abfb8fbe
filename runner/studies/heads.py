"""`make study-heads`: the HET-XL paper's comparison of classifier heads on the embedded data;
docs/heads.md states its stages, settings and results."""
from __future__ import annotations

import json
import pathlib
import sys

from runner.report import summarize
from runner.report.summarize import Column
from runner.studies import driver

ROOT = pathlib.Path("runs/studies/heads")
MODELS = ("vit_tiny", "vmoe_tiny")
HEADS = [  # (experiment overlay, row label)
    ("head_det", "DET"),
    ("head_het_fixed", "HET, τ = 1.5"),
    ("head_het_learned", "HET, τ learned"),
    ("head_hetxl_fixed", "HET-XL, τ = 1.5"),
    ("head_hetxl_learned", "HET-XL, τ learned"),
]
NOISE = ("0.0", "0.3")


def _dir(stage: str, model: str, head: str, noise: str) -> pathlib.Path:
  """A run's folder: the sweep's below pretrain/, or its evaluation's below evals/."""
  return ROOT / stage / model / head / f"noise_{noise}"


def stages(extra: list[str]) -> None:
  driver.vmoe("study-heads", "pretrain", ["-cd", "sweeps", "-cn", "heads"], extra)
  for model in MODELS:
    for head, _ in HEADS:
      for noise in NOISE:
        workdir, run = _dir("evals", model, head, noise), _dir("pretrain", model, head, noise)
        if (workdir / "summary.json").exists():
          continue  # evaluated by an earlier run of the study
        driver.vmoe("study-heads", "eval", [f"workdir={workdir}", f"init.checkpoint={run}"], extra)


def table() -> str:
  out = []
  for noise in NOISE:
    title = "clean labels" if float(noise) == 0 else f"{float(noise):.0%} of the training labels random"
    rows = []
    for model in MODELS:
      for head, label in HEADS:
        ev = json.loads((_dir("evals", model, head, noise) / "summary.json").read_text())
        run = json.loads((_dir("pretrain", model, head, noise) / "summary.json").read_text())
        rows.append(((model, label), [{**ev, "tau": run.get("train/temperature")}]))
    header, body = summarize.grouped(rows, [
        Column("prec@1", "mnist5k/prec@1"), Column("NLL", "mnist5k/nll"),
        Column("ECE", "mnist5k/ece"), Column("τ", "tau", 3),
        Column("parameters", lambda s: f"{s['compute/params_total']:,}")], label=("model", "head"))
    one_seed = summarize.markdown(header[:-1], [row[:-1] for row in body])  # n is 1
    out += [f"MNIST-5k test (clean), models trained with {title}:", "", one_seed, ""]
  return "\n".join(out)


if __name__ == "__main__":
  sys.exit(driver.main(ROOT, stages, table, sys.argv[1:]))
