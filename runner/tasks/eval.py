"""`vmoe eval init.checkpoint=<run>`: every measurement of the papers on one checkpoint.

The model and data configs come from the checkpoint; model.* / data.* keys given on the command
line override them (inference-time k, capacity ratio, Batch Prioritized Routing). The eval.* keys
choose the measurements: classification and calibration on eval.datasets, OOD detection against
eval.ood_datasets, corruptions, PGD attacks, compute, and a capacity sweep. Everything that can be
checked (datasets, splits, class counts, corruption names, sweep values) is checked before the
first forward pass.

`evaluate` is shared with `vmoe ensemble`: it measures "the members' prediction", one model or
several. With more than one member (a partitioned batch ensemble, a deep ensemble, MC-dropout
samples) the prediction is the members' mean probability, and each dataset also gets the members'
own metrics and their diversity (runner/evaluators/ensemble.py).
"""
from __future__ import annotations

import pathlib
import re
import sys

import jax
import numpy as np

from runner import data
from runner.config import as_dict, derived
from runner.config.schema import DataConfig, EvalRun
from runner.data import corruptions as corruptions_lib
from runner.errors import ConfigError
from runner.evaluators import capacity_sweep, predictions
from runner.evaluators.calibration import plot_reliability_diagram
from runner.evaluators.ensemble import EnsembleStats
from runner.evaluators.ood import SCORES, detection_metrics
from runner.logging import MetricWriter
from runner.parallel import Placement
from runner.tasks import common, dataset_specs
from runner.tasks import members as members_lib


def _file_name(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def corrupted_pp(pp: str, name: str, severity: int) -> str:
  """`pp` with the corruption inserted before value_range (corruptions work on [0, 255])."""
  ops = [op.strip() for op in pp.split("|") if op.strip()]
  at = next((i for i, op in enumerate(ops) if op.startswith("value_range")), len(ops))
  return "|".join(ops[:at] + [f"corrupt({name!r}, {int(severity)})"] + ops[at:])


class _Dataset:
  """A dataset named in eval.*: its data config, opened source and the split evaluated."""

  def __init__(self, name: str, base: DataConfig, split: str | None):
    self.name = name
    self.config, self.source = common.open_data(dataset_specs.dataset_config(name, base))
    self.split = split or self.config.test_split or self.config.eval_split
    try:
      n = self.source.num_examples(self.split)
    except data.DataError as e:
      raise data.DataError(f"eval dataset {name!r}: {e}") from None
    if n == 0:
      raise data.DataError(f"eval dataset {name!r}: split {self.split!r} is empty; choose a split "
                           f"with examples (available: {self.source.splits}).")


def corruption_names(names: list[str]) -> list[str]:
  """eval.corruptions with [all] expanded (the names are checked by the schema)."""
  return list(corruptions_lib.CORRUPTIONS) if list(names) == ["all"] else list(names)


class _Run:
  """The state shared by the measurements of one `vmoe eval` or `vmoe ensemble`."""

  def __init__(self, config, members: members_lib.Members, batch_size, placement):
    self.config, self.members = config, members
    self.model = members.model()
    self.batch_size, self.placement = batch_size, placement
    self.loss_name = config.loss.value
    self.step = jax.jit(predictions.make_predict_step(self.model))
    self.verbose = config.logger.progress and jax.process_index() == 0
    self.params = None

  def say(self, text: str) -> None:
    if self.verbose:
      print(text, file=sys.stderr, flush=True)

  def batches(self, dataset: _Dataset, split: str | None = None, pp: str | None = None):
    return data.eval_batches(dataset.source, split or dataset.split, pp or dataset.config.pp,
                             self.batch_size // jax.process_count(),
                             process_index=jax.process_index(),
                             process_count=jax.process_count(), cache=False)

  def evaluate(self, batches, stats, what: str, step=None) -> float:
    rate = predictions.run_pass(step or self.step, self.params, batches, stats,
                                put=self.placement.put)
    self.say(f"[eval] {what}: {stats.count} images, {rate:.0f} images/s")
    return rate


class _EnsembleStats(predictions.PredictionStats):
  """The ensemble's prediction, plus its members' own metrics and their diversity."""

  def __init__(self, *, output: str, keep_members: bool = False, **kwargs):
    super().__init__(**kwargs)
    self.members = EnsembleStats(num_bins=self.calibration.num_bins, output=output,
                                 keep=keep_members)

  def update(self, out: dict) -> None:
    super().update(out)
    if out["mask"].any():
      probs = predictions.probabilities(out["member_logits"], self.loss_name)
      self.members.update(probs, out["labels"], out["mask"])

  def metrics(self, prefix: str) -> dict[str, float]:
    return {**super().metrics(prefix), **self.members.metrics(prefix)}


def run(config: EvalRun, placement: Placement) -> dict:
  members = members_lib.load([(config.init.checkpoint, config.model)],
                             output=derived.model_output(config.loss))
  partitioned = {"ensemble/type": "pbe"} if members.size > 1 else None
  return evaluate(config, members, placement, job_type="eval", extra_summary=partitioned)


def evaluate(config, members: members_lib.Members, placement: Placement, *, job_type: str,
             extra_summary: dict | None = None) -> dict:
  """Every measurement of `config.eval` on the members' prediction; summary.json and W&B."""
  d, e = config.data, config.eval
  workdir = config.workdir
  batch_size = derived.eval_batch_size(e, d)
  names, severities = corruption_names(e.corruptions), list(e.severities)
  num_classes = members.num_classes

  # Every dataset is opened (and its splits and classes checked) before any compute.
  datasets = [_Dataset(name, d, e.split) for name in (e.datasets or [d.name])]
  for ds in datasets:
    if ds.source.num_classes != num_classes:
      role = " (the in-distribution side of OOD detection)" if e.ood_datasets else ""
      raise ConfigError(f"eval dataset {ds.name!r}{role} has {ds.source.num_classes} classes but "
                        f"the checkpoint's head predicts {num_classes}; evaluate on datasets with "
                        "the same label space (OOD datasets go in eval.ood_datasets).")
  ood = [_Dataset(name, d, None) for name in e.ood_datasets]
  in_dist = datasets[0]
  if ood and in_dist.source.num_examples(in_dist.config.split) == 0:
    raise data.DataError(f"the training split {in_dist.config.split!r} of {in_dist.name!r} "
                         "(needed for the Mahalanobis fit) is empty.")

  image_shape = data.image_shape(in_dist.source, in_dist.split, in_dist.config.pp)
  members.check_fit(image_shape, job_type)
  common.write_config(config, workdir)
  out_dir = pathlib.Path(workdir)
  out_dir.mkdir(parents=True, exist_ok=True)
  ev = _Run(config, members, batch_size, placement)
  output = derived.model_output(config.loss)
  ensemble = members.size > 1
  adversarial = None
  if e.adversarial.epsilons:
    from runner.evaluators.adversarial import AdversarialEvaluator
    adv = e.adversarial
    adversarial = AdversarialEvaluator(
        ev.model, epsilons=[float(x) for x in adv.epsilons], steps=adv.steps,
        step_size=adv.step_size, loss_name=ev.loss_name, prefix="",
        put=placement.put, max_examples=adv.max_examples, progress=ev.verbose,
        protocol=adv.protocol)

  steps = members.steps
  summary: dict = {"checkpoint_step": steps[0] if len(steps) == 1 else steps,
                   "split": in_dist.split, **(extra_summary or {})}
  if ensemble or extra_summary:
    summary["ensemble/size"] = members.size
  images, arrays = {}, {}
  with placement.context():
    params = members.place(placement, image_shape)
    ev.params = params

    fit = None
    if ood:
      fit = predictions.fit_mahalanobis(ev.step, params, ev.batches(in_dist, in_dist.config.split),
                                        num_classes, put=placement.put)
    in_scores = {}
    for i, ds in enumerate(datasets):
      kwargs = dict(loss_name=ev.loss_name, ece_bins=e.ece_bins, scores=bool(ood) and i == 0,
                    mahalanobis=fit if i == 0 else None, keep_probs=e.save_predictions)
      stats = (_EnsembleStats(output=output, keep_members=e.save_predictions, **kwargs)
               if ensemble else predictions.PredictionStats(**kwargs))
      rate = ev.evaluate(ev.batches(ds), stats, f"{ds.name}/{ds.split}")
      summary.update(stats.metrics(ds.name))
      summary[f"{ds.name}/split"] = ds.split
      summary[f"{ds.name}/images_per_s"] = rate
      if i == 0:
        summary["compute/images_per_s"] = rate
        in_scores = stats.score_arrays()
      if e.plots:
        path = str(out_dir / f"reliability_{_file_name(ds.name)}.png")
        images[f"{ds.name}/reliability"] = plot_reliability_diagram(
            stats.calibration.result(), path, title=f"{ds.name} ({ds.split})")
      if e.save_predictions:
        arrays.update({f"{ds.name}/{k}": v for k, v in stats.kept_arrays().items()})
        if ensemble:
          arrays[f"{ds.name}/member_probs"] = stats.members.kept()
        if i == 0:
          arrays.update({f"{ds.name}/score_{k}": v for k, v in in_scores.items()})

    for o in ood:
      stats = predictions.PredictionStats(loss_name=ev.loss_name, scores=True, mahalanobis=fit,
                                          labelled=False)
      ev.evaluate(ev.batches(o), stats, f"OOD {o.name}/{o.split}")
      out_scores = stats.score_arrays()
      for score in SCORES:
        for k, v in detection_metrics(in_scores[score], out_scores[score]).items():
          summary[f"{in_dist.name}_vs_{o.name}/{score}/{k}"] = v
      if e.save_predictions:
        arrays.update({f"{o.name}/score_{k}": v for k, v in out_scores.items()})

    for ds in datasets if names else []:
      per_corruption = {}
      for name in names:
        rows = []
        for s in severities:
          stats = predictions.PredictionStats(loss_name=ev.loss_name, ece_bins=e.ece_bins)
          ev.evaluate(ev.batches(ds, pp=corrupted_pp(ds.config.pp, name, s)), stats,
                      f"{ds.name} {name} severity {s}")
          m = stats.metrics("")
          rows.append({k: m[f"/{k}"] for k in ("error", "nll", "ece")})
          for k, v in rows[-1].items():
            summary[f"{ds.name}/corruption/{name}/sev_{s}/{k}"] = v
        per_corruption[name] = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        for k, v in per_corruption[name].items():
          summary[f"{ds.name}/corruption/{name}/{k}"] = v
      for k in ("error", "nll", "ece"):
        summary[f"{ds.name}/corruption/mean/{k}"] = float(
            np.mean([m[k] for m in per_corruption.values()]))

    if adversarial is not None:
      from runner.evaluators.adversarial import plot_pgd
      for ds in datasets:
        adversarial.prefix = ds.name
        attacked = adversarial.run(params, ev.batches(ds))
        summary.update(attacked)
        ev.say(f"[eval] {ds.name}: PGD ({e.adversarial.steps} steps) at eps "
               f"{e.adversarial.epsilons} done")
        if e.plots:
          images[f"{ds.name}/pgd"] = plot_pgd(attacked, ds.name,
                                              str(out_dir / f"pgd_{_file_name(ds.name)}.png"),
                                              title=f"{ds.name}: L-inf PGD")

    example = predictions.zeros_batch_like(ev.batches(in_dist))
    summary.update(_compute_metrics(ev, placement.put(example)))

    ratios = e.capacity_sweep
    if ratios:
      main = {"prec@1": summary[f"{in_dist.name}/prec@1"], "nll": summary[f"{in_dist.name}/nll"],
              "gflops_per_image": summary["compute/gflops_per_image"]}
      rows = _capacity_sweep(ev, in_dist, ratios, placement.put(example), main)
      for r in rows:
        key = capacity_sweep.sweep_key(r["capacity_ratio"], r["batch_priority"])
        summary.update({f"{key}/{k}": r[k] for k in ("prec@1", "nll", "gflops_per_image")})
      capacity_sweep.write_sweep_json(rows, str(out_dir / "capacity_sweep.json"))
      if e.plots:
        images["capacity_sweep"] = capacity_sweep.plot_capacity_sweep(
            rows, str(out_dir / "capacity_sweep.png"), title=f"{in_dist.name}: prec@1 vs compute")

  if arrays and jax.process_index() == 0:
    np.savez_compressed(out_dir / "predictions.npz", **arrays)
  _write_outputs(config, workdir, job_type, members.steps[0], summary, images)
  _print_summary(summary)
  return summary


def _compute_metrics(ev: _Run, example) -> dict:
  """GFLOPs per image (the whole ensemble) from XLA's cost analysis of the compiled eval step;
  parameter counts."""
  flops = predictions.xla_flops(ev.step, ev.params, example)
  return {
      # A partitioned program is costed per device: times the devices, over the global batch.
      "compute/gflops_per_image": flops * jax.device_count() / ev.batch_size / 1e9,
      "compute/gflops_per_image_analytic": ev.members.analytic_flops(ev.batch_size) / 1e9,
      "compute/params_total": ev.members.params_total(),
      "compute/params_active": ev.members.params_active(),
  }


def _runs_as(members: members_lib.Members, capacity_ratio: float, batch_priority: bool) -> bool:
  """Whether every member already routes at this inference capacity and priority."""
  routers = [c.config.router for c in members.checkpoints]
  return all(r.batch_priority == batch_priority and float(
      r.eval_capacity_ratio if r.eval_capacity_ratio is not None else r.capacity_ratio)
      == capacity_ratio for r in routers)


def _capacity_sweep(ev: _Run, ds: _Dataset, ratios, example, main: dict) -> list[dict]:
  """prec@1, NLL and GFLOPs per image at each inference capacity ratio, vanilla and (for routers
  that prioritise, token-choice) BPR.

  The setting the model already runs at reuses the main pass (`main`) instead of repeating it.
  """
  rows = []
  prioritised = any(derived.router_family(m.config).supports_batch_priority
                    for m in ev.members.checkpoints if derived.num_experts(m.config))
  for bpr in (False, True) if prioritised else (False,):
    for c in ratios:
      changes = dict(eval_capacity_ratio=float(c), batch_priority=bpr)
      analytic = ev.members.analytic_flops(ev.batch_size, **changes) / 1e9
      if _runs_as(ev.members, float(c), bpr):
        rows.append({"capacity_ratio": float(c), "batch_priority": bpr, **main,
                     "gflops_per_image_analytic": analytic})
        continue
      step = jax.jit(predictions.make_predict_step(ev.members.model(**changes)))
      stats = predictions.PredictionStats(loss_name=ev.loss_name)
      ev.evaluate(ev.batches(ds), stats, f"{ds.name} C={c:g} {'BPR' if bpr else 'vanilla'}",
                  step=step)
      m = stats.metrics("")
      gflops = predictions.xla_flops(step, ev.params, example) * jax.device_count() \
          / ev.batch_size / 1e9
      rows.append({"capacity_ratio": float(c), "batch_priority": bpr, "prec@1": m["/prec@1"],
                   "nll": m["/nll"], "gflops_per_image": gflops,
                   "gflops_per_image_analytic": analytic})
  return rows


def _write_outputs(config, workdir, job_type, step, summary, images) -> None:
  stored = as_dict(config)
  writer = MetricWriter(workdir, run_config=stored, wandb=config.logger.wandb,
                        job_type=job_type)
  try:
    scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    writer.write(step, scalars)
    for key, path in images.items():
      writer.log_image(step, key, path)
    writer.log_table("eval/summary", ["metric", "value"], sorted(scalars.items()))
    writer.summary(summary)
  finally:
    writer.close()


def _print_summary(summary: dict) -> None:
  """One metric per line (per-severity values stay in summary.json)."""
  keys = [k for k, v in summary.items() if isinstance(v, float) and "/sev_" not in k]
  width = max((len(k) for k in keys), default=0)
  print("\n".join(f"{k:<{width}}  {summary[k]:.4f}" for k in keys))
