"""`make study-experts`: where a V-MoE's experts come from and how few it can keep, at the demo's
scale over three seeds; docs/compression.md states its stages, settings and results.

Part 1 fine-tunes a V-MoE on the UCI digits from scratch, from one pretrained dense ViT by sparse
upcycling (every expert a copy of its MLP) and by Drop-Upcycling (r = 0.5), the same steps each.
Part 2 compresses the demo's fine-tuned V-MoE from 8 experts to 6, 4 and 2 by pruning and by
merging (`vmoe compress`), evaluates each before and after a short fine-tune, and compares it with
a V-MoE trained with that many experts from the start.

`VMOE_STUDY_SMOKE=1` runs every stage for 2 steps with one seed into runs/studies/experts_smoke
(a check that the chain runs end to end, not a result; the real study never reuses its runs)."""
from __future__ import annotations

import os
import pathlib
import statistics
import sys

from runner import demo
from runner.report import summarize
from runner.report.summarize import Column
from runner.studies import driver

SMOKE = os.environ.get("VMOE_STUDY_SMOKE") == "1"
ROOT = pathlib.Path("runs/studies/experts_smoke" if SMOKE else "runs/studies/experts")
SWEEP = driver.Sweep("study-experts", ROOT)
SEEDS = (0,) if SMOKE else (0, 1, 2)
# The demo's budget (runner/demo.py): MNIST at its own 28 px, 160 upstream steps of 128 images and
# 80 downstream steps of 64; a V-MoE upcycled from the ViT keeps the ViT's 28 px.
UPSTREAM, DOWNSTREAM = demo.UPSTREAM, demo.DOWNSTREAM
# The short fine-tune of a compressed model: a quarter of DOWNSTREAM's steps, enough for the kept
# or merged experts and the router to settle on the task again without training a new model; its
# warm-up a fifth of it (finetune's 20 would be the whole run, which the config refuses).
SHORT = ["model.image_size=28", "train.steps=20", "eval.every_steps=20",
         "checkpoint.every_steps=20", "schedule.warmup_steps=4"]
if SMOKE:
  UPSTREAM = DOWNSTREAM = SHORT = ["model.image_size=28", "train.steps=2", "eval.every_steps=2",
                                   "checkpoint.every_steps=2", "schedule.warmup_steps=0"]
INITS = [  # (experiment, finetune overrides beyond the ViT's checkpoint, row label)
    ("scratch", None, "from scratch"),
    ("upcycle", ["init.dense_to_experts=true"], "sparse upcycling"),
    ("drop_upcycle", ["init.dense_to_experts=true", "init.drop_upcycling_ratio=0.5"],
     "Drop-Upcycling, r = 0.5"),
]
EXPERTS = 8  # vmoe_tiny's
KEPT = (6, 4, 2)
METHODS = ("prune", "merge")
DATASET = "uci_digits"


def _trained(experiment: str, seed: int, model: list[str], extra: list[str]) -> None:
  """The demo's chain: pretrain, fine-tune from it, evaluate."""
  SWEEP.stage("pretrain", experiment, seed, [*model, f"seed={seed}", *UPSTREAM], extra)
  SWEEP.stage("finetune", experiment, seed, [
      f"init.checkpoint={SWEEP.dir('pretrain', experiment, seed)}", *model, f"seed={seed}",
      *DOWNSTREAM], extra)
  SWEEP.stage("eval", experiment, seed,
              [f"init.checkpoint={SWEEP.dir('finetune', experiment, seed)}"], extra)


def stages(extra: list[str]) -> None:
  # Part 1: one dense ViT for every seed's fine-tunes ("from one pretrained dense ViT").
  SWEEP.stage("pretrain", "vit", 0, ["model=vit_tiny", "seed=0", *UPSTREAM], extra)
  vit = f"init.checkpoint={SWEEP.dir('pretrain', 'vit', 0)}"
  for seed in SEEDS:
    for experiment, init, _ in INITS:
      start = ["init.checkpoint=null"] if init is None else [vit, *init]
      SWEEP.stage("finetune", experiment, seed,
                  ["model=vmoe_tiny", f"seed={seed}", *start, *DOWNSTREAM], extra)
      SWEEP.stage("eval", experiment, seed,
                  [f"init.checkpoint={SWEEP.dir('finetune', experiment, seed)}"], extra)
  # Part 2: the demo's fine-tuned V-MoE, compressed; the same chain with fewer experts throughout.
  for seed in SEEDS:
    _trained(f"vmoe_e{EXPERTS}", seed, [], extra)
    for kept in KEPT:
      for method in METHODS:
        name = f"{method}_e{kept}"
        SWEEP.stage("compress", name, seed, [
            f"init.checkpoint={SWEEP.dir('finetune', f'vmoe_e{EXPERTS}', seed)}",
            f"compress.method={method}", f"compress.experts={kept}"], extra)
        compressed = f"init.checkpoint={SWEEP.dir('compress', name, seed)}"
        SWEEP.stage("eval", name, seed, [compressed], extra)
        # vmoe_tiny's k=2 fits every E' here: no compress/k, so no model.router.k to give.
        SWEEP.stage("finetune", name, seed, [
            compressed, f"model.moe.num_experts={kept}", "init.reinit_head=false",
            f"seed={seed}", *SHORT], extra, folder="short_finetune")
        SWEEP.stage("eval", name, seed,
                    [f"init.checkpoint={SWEEP.dir('short_finetune', name, seed)}"], extra,
                    folder="eval_short")
      _trained(f"from_start_e{kept}", seed, [f"model.moe.num_experts={kept}"], extra)


def _rows() -> list[tuple[str, str, str]]:
  """Part 2's rows: (label, experiment, how its replicate reads): `compressed` rows pair the eval
  before the short fine-tune with the one after it."""
  rows = [(f"{EXPERTS} experts (the fine-tuned V-MoE)", f"vmoe_e{EXPERTS}", "trained")]
  for kept in KEPT:
    rows += [(f"{method} to {kept}", f"{method}_e{kept}", "compressed") for method in METHODS]
    rows.append((f"trained with {kept} from the start", f"from_start_e{kept}", "trained"))
  return rows


def _replicate(experiment: str, kind: str, seed: int) -> dict:
  if kind == "trained":
    return SWEEP.summary("eval", experiment, seed)
  before = SWEEP.summary("eval", experiment, seed)
  return {**SWEEP.summary("eval_short", experiment, seed),
          **{f"before/{m}": before[f"{DATASET}/{m}"] for m in ("prec@1", "nll", "ece")}}


def _mean_spread(values: list) -> tuple[float, float]:
  """The picture's point and error bar: the table's mean and standard deviation (0: one seed)."""
  values = [float(v) for v in values if v is not None]
  return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def picture(path: pathlib.Path) -> str:
  """prec@1 against the experts kept: pruning and merging before and after the short fine-tune,
  and training with that many experts from the start; every line starts at the 8-expert model."""
  from runner.evaluators.figures import new_figure, save_png  # lazily: only the table's step draws
  figure = new_figure(6.4, 4.2)
  axes = figure.add_subplot()
  prec = lambda stage, experiment: [SWEEP.summary(stage, experiment, s).get(f"{DATASET}/prec@1")
                                    for s in SEEDS]
  series = [  # (label, stage, experiment prefix, style)
      ("prune, before fine-tune", "eval", "prune", "o--"),
      ("prune, after short fine-tune", "eval_short", "prune", "o-"),
      ("merge, before fine-tune", "eval", "merge", "s--"),
      ("merge, after short fine-tune", "eval_short", "merge", "s-"),
      ("trained from the start", "eval", "from_start", "^-"),
  ]
  full = _mean_spread(prec("eval", f"vmoe_e{EXPERTS}"))
  for i, (label, stage, prefix, style) in enumerate(series):
    points = [full] + [_mean_spread(prec(stage, f"{prefix}_e{kept}")) for kept in KEPT]
    shift = (i - (len(series) - 1) / 2) * 0.06  # the error bars side by side, not on top
    axes.errorbar([e + shift for e in (EXPERTS, *KEPT)], [m for m, _ in points],
                  yerr=[s for _, s in points], fmt=style, capsize=3, label=label)
  axes.set_xticks([EXPERTS, *KEPT])
  axes.invert_xaxis()  # fewer experts to the right
  axes.set_xlabel("experts per MoE layer")
  seeds = f"{len(SEEDS)} seed{'s' if len(SEEDS) > 1 else ''}"
  axes.set_ylabel(f"{DATASET} test prec@1 (mean ± std, {seeds})")
  axes.grid(alpha=0.3)
  axes.legend(fontsize=8)
  return save_png(figure, str(path))


def table() -> str:
  rows = [(label, [SWEEP.summary("eval", experiment, seed) for seed in SEEDS])
          for experiment, _, label in INITS]
  upcycling = summarize.markdown(*summarize.grouped(rows, [
      Column("prec@1", f"{DATASET}/prec@1", 3), Column("NLL", f"{DATASET}/nll", 3),
      Column("ECE", f"{DATASET}/ece", 3)], label="V-MoE initialisation"))
  rows = [(label, [_replicate(experiment, kind, seed) for seed in SEEDS])
          for label, experiment, kind in _rows()]
  compression = summarize.markdown(*summarize.grouped(rows, [
      Column("prec@1 before fine-tune", "before/prec@1", 3), Column("NLL before", "before/nll", 3),
      Column("ECE before", "before/ece", 3), Column("prec@1", f"{DATASET}/prec@1", 3),
      Column("NLL", f"{DATASET}/nll", 3), Column("ECE", f"{DATASET}/ece", 3),
      Column("GFLOPs/image", "compute/gflops_per_image_analytic", 4),
      Column("parameters", lambda s: f"{s['compute/params_total']:,}")], label="model"))
  path = picture(ROOT / "accuracy_vs_experts.png")
  return "\n".join([
      f"{DATASET} test, V-MoEs fine-tuned the same steps from scratch and from one dense ViT "
      "pretrained on MNIST:", "", upcycling, "",
      f"{DATASET} test, the fine-tuned {EXPERTS}-expert V-MoE compressed without training (prec@1 "
      "before fine-tune), then fine-tuned briefly (the other columns), against V-MoEs pretrained "
      "and fine-tuned with that many experts:", "", compression, "",
      f"prec@1 against the experts kept: {path}"])


if __name__ == "__main__":
  sys.exit(driver.main(ROOT, stages, table, sys.argv[1:]))
