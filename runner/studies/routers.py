"""`make study-routers`: router families at matched compute on the embedded data; docs/routers.md
states its stages, settings and results."""
from __future__ import annotations

import pathlib
import sys

from runner.report import summarize
from runner.report.summarize import Column
from runner.studies import driver

ROOT = pathlib.Path("runs/studies/routers")
SWEEP = driver.Sweep("study-routers", ROOT)
SEEDS = (0, 1)
ROWS = [  # (experiment overlay, row label)
    ("router_vit", "ViT (dense)"),
    ("router_tc_k1", "token-choice, k=1"),
    ("router_tc_k2", "token-choice, k=2"),
    ("router_ec", "experts-choice, C=1"),
    ("router_soft", "Soft MoE, P=8"),
]
SHOTS = (1, 5, 10, 25)


def stages(extra: list[str]) -> None:
  SWEEP.vmoe("pretrain", ["-cd", "sweeps", "-cn", "routers"], extra)
  for experiment, _ in ROWS:
    for seed in SEEDS:
      upstream = f"init.checkpoint={SWEEP.dir('pretrain', experiment, seed)}"
      SWEEP.stage("fewshot", experiment, seed, [
          upstream, "fewshot.datasets=[uci_digits]",
          f"fewshot.shots=[{','.join(map(str, SHOTS))}]"], extra)
      SWEEP.stage("finetune", experiment, seed,
                  [upstream, f"experiment={experiment}", f"seed={seed}"], extra)
      SWEEP.stage("eval", experiment, seed,
                  [f"init.checkpoint={SWEEP.dir('finetune', experiment, seed)}"], extra)


def table() -> str:
  def replicate(experiment: str, seed: int) -> dict:
    up, shots, ev = (SWEEP.summary(stage, experiment, seed)
                     for stage in ("pretrain", "fewshot", "eval"))
    return {**ev, "upstream": up["val/prec@1"],
            **{f"shots/{k}": shots[f"uci_digits/{k}shot/accuracy"] for k in SHOTS}}
  rows = [(label, [replicate(experiment, seed) for seed in SEEDS]) for experiment, label in ROWS]
  return summarize.markdown(*summarize.grouped(rows, [
      Column("MFLOPs/image", lambda s: s["compute/gflops_per_image"] * 1e3, 1),
      Column("upstream val prec@1", "upstream", 3), Column("10-shot", "shots/10", 3),
      Column("25-shot", "shots/25", 3), Column("fine-tuned prec@1", "uci_digits/prec@1", 3),
      Column("NLL", "uci_digits/nll", 3), Column("ECE", "uci_digits/ece", 3)], label="model"))


if __name__ == "__main__":
  sys.exit(driver.main(ROOT, stages, table, sys.argv[1:], sweep_page=ROOT / "pretrain"))
