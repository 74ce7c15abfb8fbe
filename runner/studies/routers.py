"""`make study-routers`: router families at matched compute on the embedded data.

The Soft MoE paper (Puigcerver et al. 2023) finds Soft MoE > experts-choice > token-choice at
matched compute. Stages, each a real `vmoe` command run in this process (rerunning resumes or
skips finished ones):
1. `vmoe pretrain -cd sweeps -cn routers`: a dense ViT, token-choice V-MoE (k = 1, k = 2),
   experts-choice and Soft MoE, vmoe_tiny-shaped with a GAP head, on MNIST-5k, seeds 0 and 1;
2. `vmoe fewshot` of every pretrained run on the UCI digits (1, 5, 10, 25 shots);
3. `vmoe finetune` of every run on the UCI digits (the same router family), then `vmoe eval`;
4. a Markdown table (mean ± standard deviation over the seeds) in results.md.
Extra arguments go to every stage (e.g. `logger.wandb.mode=disabled`).
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys

from runner.studies import driver

ROOT = pathlib.Path("runs/studies/routers")
SEEDS = (0, 1)
ROWS = [  # (experiment overlay, row label)
    ("router_vit", "ViT (dense)"),
    ("router_tc_k1", "token-choice, k=1"),
    ("router_tc_k2", "token-choice, k=2"),
    ("router_ec", "experts-choice, C=1"),
    ("router_soft", "Soft MoE, P=8"),
]
SHOTS = (1, 5, 10, 25)


def _vmoe(sub: str, args: list[str], extra: list[str]) -> None:
  driver.vmoe("study-routers", sub, args, extra)


def _dir(stage: str, experiment: str, seed: int) -> pathlib.Path:
  return ROOT / stage / experiment / f"seed_{seed}"


def _done(workdir: pathlib.Path) -> bool:
  return (workdir / "summary.json").exists()


def stages(extra: list[str]) -> None:
  _vmoe("pretrain", ["-cd", "sweeps", "-cn", "routers"], extra)
  for experiment, _ in ROWS:
    for seed in SEEDS:
      upstream = _dir("pretrain", experiment, seed)
      if not _done(_dir("fewshot", experiment, seed)):
        _vmoe("fewshot", [f"workdir={_dir('fewshot', experiment, seed)}",
                          f"init.checkpoint={upstream}", "fewshot.datasets=[uci_digits]",
                          f"fewshot.shots=[{','.join(map(str, SHOTS))}]"], extra)
      if not _done(_dir("finetune", experiment, seed)):
        _vmoe("finetune", [f"workdir={_dir('finetune', experiment, seed)}",
                           f"init.checkpoint={upstream}", f"experiment={experiment}",
                           f"seed={seed}"], extra)
      if not _done(_dir("eval", experiment, seed)):
        _vmoe("eval", [f"workdir={_dir('eval', experiment, seed)}",
                       f"init.checkpoint={_dir('finetune', experiment, seed)}"], extra)


def _mean_std(values: list[float], digits: int = 3) -> str:
  std = statistics.stdev(values) if len(values) > 1 else 0.0
  return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def table() -> str:
  header = ("| model | MFLOPs/image | upstream val prec@1 | 10-shot | 25-shot | fine-tuned "
            "prec@1 | NLL | ECE |")
  out = [header, "|---|---|---|---|---|---|---|---|"]
  for experiment, label in ROWS:
    rows = []
    for seed in SEEDS:
      read = lambda stage: json.loads((_dir(stage, experiment, seed) / "summary.json").read_text())
      up, shots, ev = read("pretrain"), read("fewshot"), read("eval")
      rows.append({"flops": ev["compute/gflops_per_image"] * 1e3, "up": up["val/prec@1"],
                   "10": shots["uci_digits/10shot/accuracy"],
                   "25": shots["uci_digits/25shot/accuracy"], "prec": ev["uci_digits/prec@1"],
                   "nll": ev["uci_digits/nll"], "ece": ev["uci_digits/ece"]})
    col = lambda k, d=3: _mean_std([r[k] for r in rows], d)
    out.append(f"| {label} | {statistics.mean(r['flops'] for r in rows):.1f} | {col('up')} | "
               f"{col('10')} | {col('25')} | {col('prec')} | {col('nll')} | {col('ece')} |")
  return "\n".join(out)


def main(extra: list[str]) -> int:
  return driver.main(ROOT, stages, table, extra)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
