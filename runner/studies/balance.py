"""`make study-balance`: load balancing and DeepSeek-style routing at matched compute;
docs/routers.md states its stages, settings and results."""
from __future__ import annotations

import pathlib
import sys

from runner.report import summarize
from runner.report.summarize import Column
from runner.studies import driver

ROOT = pathlib.Path("runs/studies/balance")
SWEEP = driver.Sweep("study-balance", ROOT)
SEEDS = (0, 1, 2)
ROWS = [  # (experiment overlay, row label)
    ("router_tc_k2", "token-choice k=2, auxiliary loss"),
    ("balance_bias", "token-choice k=2, loss-free bias"),
    ("balance_sigmoid", "token-choice k=2, sigmoid gates"),
    ("balance_dropless", "token-choice k=2, dropless"),
    ("balance_shared_fine", "2 shared + 2 of 16 half-width experts"),
    ("router_ec", "experts-choice, C=1"),
    ("router_soft", "Soft MoE, P=8"),
]


def stages(extra: list[str]) -> None:
  SWEEP.vmoe("pretrain", ["-cd", "sweeps", "-cn", "balance"], extra)
  for experiment, _ in ROWS:
    for seed in SEEDS:
      SWEEP.stage("finetune", experiment, seed, [
          f"init.checkpoint={SWEEP.dir('pretrain', experiment, seed)}",
          f"experiment={experiment}", f"seed={seed}"], extra)
      SWEEP.stage("eval", experiment, seed,
                  [f"init.checkpoint={SWEEP.dir('finetune', experiment, seed)}"], extra)


def _balance(name: str, reduce):
  """The upstream run's balance measure over its MoE layers at the last logged step (None for a
  router family that logs none: experts-choice and Soft MoE)."""
  def read(summary: dict):
    values = [v for k, v in summary.items()
              if k.startswith("upstream/moe/") and k.endswith("/" + name)]
    return reduce(values) if values else None
  return read


def table() -> str:
  def replicate(experiment: str, seed: int) -> dict:
    up, ev = (SWEEP.summary(stage, experiment, seed) for stage in ("pretrain", "eval"))
    return {**ev, **{f"upstream/{k}": v for k, v in up.items()}}
  rows = [(label, [replicate(experiment, seed) for seed in SEEDS]) for experiment, label in ROWS]
  return summarize.markdown(*summarize.grouped(rows, [
      Column("MFLOPs/image", lambda s: s["compute/gflops_per_image_analytic"] * 1e3, 1),
      Column("upstream val prec@1", "upstream/val/prec@1", 3),
      Column("upstream val NLL", "upstream/val/nll", 3),
      Column("MaxVio (worst layer)", _balance("max_violation", max), 2),
      Column("dead experts", _balance("dead_experts", sum), 1),
      Column("train images/s", "upstream/train/images_per_s", 0),
      Column("fine-tuned prec@1", "uci_digits/prec@1", 3),
      Column("NLL", "uci_digits/nll", 3)], label="routing"))


if __name__ == "__main__":
  sys.exit(driver.main(ROOT, stages, table, sys.argv[1:], sweep_page=ROOT / "pretrain"))
