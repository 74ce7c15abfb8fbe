"""Accuracy against inference compute over expert capacity ratios (the V-MoE paper's Figure 6).

At inference, lowering the capacity ratio C drops tokens and saves expert FLOPs; Batch Prioritized
Routing chooses which tokens to drop by their routing score, so it degrades more gracefully than
vanilla routing. Each row of a sweep is one (C, routing) evaluation."""
from __future__ import annotations

import dataclasses
import json
from typing import List

import jax

from runner.config import derived, registries
from runner.config.checks import Items, key, positive
from runner.config.relations import relation
from runner.config.schema import EvalSuiteConfig, RunFields
from runner.evaluators import predictions, suite as suite_lib
from runner.evaluators.compute import xla_gflops_per_image
from runner.evaluators.figures import new_figure, save_png
from runner.models.moe import routing


def plot_capacity_sweep(rows: list[dict], path: str, metric: str = "prec@1", title: str = "") -> str:
  """One line per routing (vanilla, BPR): `metric` against GFLOPs per image, points labelled by C."""
  figure = new_figure(6, 4.5)
  axes = figure.add_subplot()
  for bpr, style in ((False, "o--"), (True, "s-")):
    points = sorted((r["gflops_per_image"], r[metric], r["capacity_ratio"]) for r in rows
                    if r["batch_priority"] == bpr)
    if not points:
      continue
    x, y, c = zip(*points)
    axes.plot(x, y, style, label="Batch Prioritized Routing" if bpr else "vanilla routing")
    for xi, yi, ci in points:
      axes.annotate(f"C={ci:g}", (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=8)
  axes.set(xlabel="GFLOPs per image (XLA cost analysis)", ylabel=metric)
  axes.grid(alpha=0.3)
  axes.legend(loc="best")
  axes.set_title(title or f"{metric} vs inference compute")
  return save_png(figure, path)


def _runs_as(members, capacity_ratio: float, batch_priority: bool) -> bool:
  """Whether every member already routes at this inference capacity and priority."""
  routers = [c.config.router for c in members.checkpoints]
  return all(r.batch_priority == batch_priority
             and float(routing.ratio_in_force(r, train=False)) == capacity_ratio for r in routers)


@dataclasses.dataclass
class CapacitySweepKeys:
  capacity_sweep: List[float] = key([], Items(positive(), example="[1.05,0.5,0.25,0.1]"),
                                    "inference capacity ratios, vanilla vs BPR")


@relation
def capacity_sweep_needs_experts(run: RunFields):
  eval, models = getattr(run, "eval", None), derived.held_models(run)
  if not isinstance(eval, EvalSuiteConfig) or not eval.capacity_sweep or not models:
    return None
  sparse = [m for m in models if derived.num_experts(m)]
  if fixed := [m for m in sparse if not derived.router_family(m).capacity_at_inference]:
    family = derived.router_family(fixed[0])
    return (f"eval.capacity_sweep={eval.capacity_sweep} means nothing for "
            f"model.router.type={family.name}: its slots are parameters fixed when the model "
            "is trained, so the capacity cannot change at inference; drop eval.capacity_sweep "
            "(it applies to the routers model.router.type="
            f"{'|'.join(n for n, f in registries.ROUTERS.items() if f.capacity_at_inference)}).")
  for model in sparse:
    if why := derived.router_family(model).without_capacity(model.router):
      return f"eval.capacity_sweep={eval.capacity_sweep} has nothing to sweep: {why}."
  if sparse:
    return None
  if getattr(run, "members", None) is None:
    return (f"eval.capacity_sweep={eval.capacity_sweep} needs a V-MoE checkpoint; model "
            f"{models[0].name} has no MoE layers.")
  return (f"eval.capacity_sweep={eval.capacity_sweep} needs V-MoE members; none of "
          "init.checkpoint has MoE layers.")


class Evaluator(suite_lib.Evaluator):
  """prec@1, NLL and GFLOPs per image of the first dataset at each inference capacity ratio,
  vanilla and (for routers that prioritise, token-choice) with Batch Prioritized Routing. The
  setting the model already runs at reuses the main pass instead of repeating it."""
  name = "capacity_sweep"
  enabling_key = "eval.capacity_sweep"
  in_training = False  # changes the checkpoint's capacity: vmoe eval's (a relation says so)
  Keys = CapacitySweepKeys

  def run(self) -> suite_lib.Result:
    s = self.suite
    ds, members = s.in_distribution, s.members
    example = s.shared.get("example") or s.placement.put(
        predictions.zeros_batch_like(s.batches(ds)))

    def measures(metrics: dict, gflops: float) -> dict:
      return {"prec@1": metrics["/prec@1"], "nll": metrics["/nll"], "gflops_per_image": gflops}

    main = measures(s.shared["metrics"][ds.name], s.shared.get("gflops_per_image")
                    or xla_gflops_per_image(s.step, s.params, example, s.batch_size))
    prioritised = any(derived.router_family(m.config).supports_batch_priority
                      for m in members.checkpoints if derived.num_experts(m.config))
    rows = []
    result = suite_lib.Result()
    for bpr in (False, True) if prioritised else (False,):
      for c in s.config.capacity_sweep:
        changes = dict(eval_capacity_ratio=float(c), batch_priority=bpr)
        analytic = members.analytic_flops(s.batch_size, **changes) / 1e9
        measured = main
        if not _runs_as(members, float(c), bpr):
          step = jax.jit(predictions.make_predict_step(members.model(**changes)))
          stats = predictions.PredictionStats(loss_name=s.loss_name)
          s.evaluate(s.batches(ds), stats, f"{ds.name} C={c:g} {'BPR' if bpr else 'vanilla'}",
                     step=step)
          measured = measures(stats.metrics(""),
                              xla_gflops_per_image(step, s.params, example, s.batch_size))
        rows.append({"capacity_ratio": float(c), "batch_priority": bpr, **measured,
                     "gflops_per_image_analytic": analytic})
        key = f"capacity_sweep/C_{float(c):g}/{'bpr' if bpr else 'vanilla'}"
        result.summary.update({f"{key}/{k}": v for k, v in measured.items()})
    with open(s.path("capacity_sweep.json"), "w") as f:
      json.dump(rows, f, indent=2)
    if s.plots:
      result.images["capacity_sweep"] = plot_capacity_sweep(
          rows, s.path("capacity_sweep.png"), title=f"{ds.name}: prec@1 vs compute")
    return result
