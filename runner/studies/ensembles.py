"""`make study-ensembles`: the efficient-ensembles paper's comparison on the embedded data;
docs/ensembles.md states its stages, settings and results."""
from __future__ import annotations

import json
import pathlib
import sys

from runner.report import summarize
from runner.report.summarize import Column
from runner.studies import driver

ROOT = pathlib.Path("runs/studies/ensembles")
SWEEP = driver.Sweep("study-ensembles", ROOT)  # finetune/<variant>/seed_<seed>
UPSTREAM = ROOT / "upstream"
SEEDS = (0, 1, 2, 3)
VARIANTS = ("e3_vmoe_k1", "e3_vmoe_k2", "e3_pbe", "e3_tiling_only", "e3_partition_only")
EVAL = ["eval.ood_datasets=[lfw_faces]"]
FEWSHOT = ["fewshot.datasets=[mnist5k]", "fewshot.shots=[1,5,10]", "fewshot.seeds=[0,1,2]"]
ROWS = [  # (row of the table, variant or ensemble name)
    ("V-MoE, K=1", "e3_vmoe_k1"),
    ("V-MoE, K=2", "e3_vmoe_k2"),
    ("pBE, (K, M) = (1, 2)", "e3_pbe"),
    ("only tiling, (1, 2)", "e3_tiling_only"),
    ("only partitioning, (1, 2)", "e3_partition_only"),
    ("down-DE, 2 x V-MoE K=1", "down_de"),
    ("MC-dropout, 2 samples of V-MoE K=1", "mc_dropout"),
]


def _replicates(name: str) -> list[tuple[str, list[str]]]:
  """(output name, checkpoints) of each replicate of a table row."""
  k1 = [SWEEP.dir("finetune", "e3_vmoe_k1", s) for s in SEEDS]
  if name == "down_de":
    return [(f"down_de_{i}", [str(k1[i]), str(k1[i + 1])]) for i in range(0, len(k1), 2)]
  if name == "mc_dropout":
    return [(f"mc_dropout_{s}", [str(k1[s])]) for s in SEEDS]
  return [(f"{name}_{s}", [str(SWEEP.dir("finetune", name, s))]) for s in SEEDS]


def stages(extra: list[str]) -> None:
  SWEEP.vmoe("pretrain", [f"workdir={UPSTREAM}"], extra)
  SWEEP.vmoe("finetune", ["-cd", "sweeps", "-cn", "ensembles", f"init.checkpoint={UPSTREAM}"],
             extra)
  for _, name in ROWS:
    for out, checkpoints in _replicates(name):
      listed = f"init.checkpoint=[{','.join(checkpoints)}]"
      if (ROOT / "evals" / out / "summary.json").exists():
        continue  # evaluated by an earlier run of the study
      workdir = f"workdir={ROOT / 'evals' / out}"
      if name in VARIANTS:
        SWEEP.vmoe("eval", [workdir, f"init.checkpoint={checkpoints[0]}", *EVAL], extra)
      else:
        mc = ["ensemble.mc_dropout=2"] if name == "mc_dropout" else []
        SWEEP.vmoe("ensemble", [workdir, listed, *EVAL, *mc], extra)
  for _, name in ROWS:
    if name == "mc_dropout":  # its features are its model's (few-shot is deterministic)
      continue
    for out, checkpoints in _replicates(name):
      if not (ROOT / "fewshot" / out / "summary.json").exists():
        SWEEP.vmoe("fewshot", [f"workdir={ROOT / 'fewshot' / out}",
                              f"init.checkpoint=[{','.join(checkpoints)}]", *FEWSHOT], extra)


def table() -> str:
  ds, ood = "uci_digits", "uci_digits_vs_lfw_faces"
  def replicate(name: str, out: str) -> dict:
    # MC-dropout samples have the features of the V-MoE K=1 runs they sample.
    features = f"e3_vmoe_k1_{out.rsplit('_', 1)[1]}" if name == "mc_dropout" else out
    fewshot = ROOT / "fewshot" / features / "summary.json"
    shots = json.loads(fewshot.read_text()) if fewshot.exists() else {}
    evaluated = json.loads((ROOT / "evals" / out / "summary.json").read_text())
    return {**evaluated, "fewshot/10shot": shots.get("mnist5k/10shot/accuracy")}
  rows = [(row, [replicate(name, out) for out, _ in _replicates(name)]) for row, name in ROWS]
  mflops = lambda s: s["compute/gflops_per_image"] * 1e3  # noqa: E731
  main = summarize.grouped(rows, [
      Column("prec@1", f"{ds}/prec@1", 3), Column("NLL", f"{ds}/nll", 3),
      Column("ECE", f"{ds}/ece", 3), Column("KL", f"{ds}/diversity/kl", 4),
      Column("disagreement", f"{ds}/diversity/disagreement", 3),
      Column("MFLOPs/image", mflops, 1), Column("10-shot MNIST", "fewshot/10shot", 3)],
      label="model")
  ood_table = summarize.grouped(rows, [
      Column("far-OOD AUROC (MSP) vs LFW", f"{ood}/msp/auroc", 3),
      Column("Mahalanobis", f"{ood}/mahalanobis/auroc", 3)], label="model")
  return summarize.markdown(*main) + "\n\n" + summarize.markdown(*ood_table)


if __name__ == "__main__":
  sys.exit(driver.main(ROOT, stages, table, sys.argv[1:]))
