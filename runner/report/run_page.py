"""One run's page: what ran, its curves, the routers' expert load, final metrics, pictures.

`write_run_page(workdir)` reads the workdir once and writes <workdir>/report.html in one replace,
so a reader never opens a half-written page; it takes about a second on a small run. A page
replaces only a page vmoe wrote (`check_replaceable`)."""
from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np

from runner.report import curves as curves_lib
from runner.report import evaluator_sections, final_metrics, markup, plots, workdir
from runner.report.markup import Raw, esc

PAGE = "report.html"
# Pictures are inlined while they fit this budget (and each under MAX_PICTURE), so a page stays
# well under 10 MB however many an evaluator wrote; the others are named, not inlined.
PICTURE_BUDGET = 4_000_000
MAX_PICTURE = 3_000_000
_LAYER = curves_lib.LAYER
# A token-choice layer's balance over the batch (runner/models/moe/balance.py).
_BALANCE = ("max_violation", "dead_experts", "saturated_experts")
# Training scalars drawn together: (title, keys, y label).
_TRAIN_CHARTS = (("Loss", ("train/loss", "val/loss"), "loss"),
                 ("Precision@1", ("train/prec@1", "val/prec@1"), "prec@1"),
                 ("Learning rate", ("train/lr",), "learning rate"),
                 ("Images per second", ("train/images_per_s",), "images/s"))


class PathTaken(ValueError):
  """Something vmoe did not write is where a page goes; the message is the paragraph to print."""


def page_path(path: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
  """Where the page of the run, chain or sweep in `path` goes: `out`, else <path>/report.html."""
  return pathlib.Path(out) if out else pathlib.Path(path) / PAGE


def check_replaceable(pages: list[pathlib.Path], out: str | pathlib.Path | None = None) -> None:
  """Raises PathTaken for the first of `pages` that exists and is not a page vmoe wrote (its
  marker, markup.GENERATOR): replacing it would destroy it. `out`: the path --out named, told
  apart in the message (another --out path is the way out there)."""
  where = ("each run's, chain's and sweep's page is report.html in its folder, and vmoe "
           "replaces only its own pages there")
  for page in pages:
    named = out is not None and page == pathlib.Path(out)
    if page.is_dir():
      if named:
        raise PathTaken(
            f"--out {page} is a folder, and --out names the page's file: give it a path that "
            f"does not exist yet (e.g. {page / PAGE}) or that of a page vmoe report wrote, or "
            "leave --out out to write the page into the folder given as PATH "
            "(PATH/report.html). Nothing was written.")
      raise PathTaken(f"{page} is a folder where vmoe writes a page; {where}, so nothing was "
                      "written. Move or remove that folder, then run the command again.")
    if not page.exists():
      continue
    try:
      if markup.is_report_page(page):
        continue
      why = f"is a file vmoe report did not write (it has no {markup.GENERATOR} near its start)"
    except OSError as e:
      why = f"cannot be read ({e.strerror or e}) to check that vmoe report wrote it"
    if named:
      raise PathTaken(
          f"--out {page} {why}, and --out replaces only a page vmoe report wrote, so nothing "
          "was written. Give --out a path that does not exist yet (or that of an earlier "
          "report page), or remove that file first if it can go.")
    raise PathTaken(f"{page} {why}; {where}, so nothing was written. Move or remove that "
                    "file, then run the command again.")


def write_run_page(path: str | pathlib.Path, out: str | pathlib.Path | None = None, *,
                   live: bool | None = None, run: workdir.Run | None = None) -> pathlib.Path:
  """Writes the page of the run in `path` (to <path>/report.html, or `out`); returns its path.
  `live`: whether to show the "in progress" banner; None asks the workdir's lock (a lock this
  process holds does not count: a stage writing its own page has finished its work). `run`:
  the workdir as the caller read it already (`workdir.read(path)`). PathTaken, writing nothing,
  where the page's path holds anything but a page vmoe wrote."""
  target = page_path(path, out)
  check_replaceable([target], out)
  run = run or workdir.read(path)
  if live is None:
    live = workdir.held_by_another_process(path)
  write_atomically(target, build(run, target.parent, live))
  return target


def write_atomically(target: pathlib.Path, text: str) -> None:
  target.parent.mkdir(parents=True, exist_ok=True)
  fd, temporary = tempfile.mkstemp(prefix=".report-", suffix=".tmp", dir=target.parent)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as file:
      file.write(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, target)
  except BaseException:
    if os.path.exists(temporary):
      os.unlink(temporary)
    raise


def build(run: workdir.Run, page_dir: pathlib.Path, live: bool) -> str:
  problem = evaluator_sections.load_plugins(run.config)
  sections = [("run", "Run", _what_ran(run, page_dir)),
              ("config", "Configuration", _configuration(run)),
              ("training", "Training curves", _training(run)),
              ("validation", "Validation curves", _validation(run.curves.scalars)),
              ("routing", "Expert load and dropped tokens", _routing(run.curves)),
              ("metrics", "Final metrics", final_metrics.tables(run.summary)
               if run.summary else markup.note("No summary.json yet: the stage has not "
                                               "finished (or it stopped before the end).")),
              ("pictures", "Pictures", _pictures(run.pictures)),
              ("checkpoints", "Checkpoints", _checkpoints(run))]
  sections += evaluator_sections.sections(run.summary, run.path)
  if problem:
    sections.append(("plugins", "Plug-in sections", markup.note(problem)))
  banner = None
  if live:
    who = (f" (pid {run.holder.pid} on {run.holder.host}, started {run.holder.started})"
           if run.holder else "")
    banner = (f"In progress: a vmoe process is still running in this workdir{who}. This page "
              "shows what it had written when the page was made; run `vmoe report "
              f"{run.path}` again to refresh it.")
  title = f"vmoe {run.stage or 'run'}: {run.path.name or run.path}"
  return markup.page(title, str(run.path.resolve()), sections, banner=banner)


def _what_ran(run: workdir.Run, page_dir: pathlib.Path) -> str:
  rows = [[what, value] for what, value in run.facts]
  for origin in run.origins:
    report = (markup.link(os.path.relpath(origin.run / PAGE, page_dir), "its report")
              if origin.run is not None else None)
    rows.append(["started from", Raw(f"{esc(origin.text)} ({report})") if report else origin.text])
  if (run.path.parent / "multirun.yaml").is_file():  # a job of a sweep
    href = os.path.relpath(run.path.parent / PAGE, page_dir)
    rows.append(["part of the sweep", markup.link(href, f"{run.path.parent.name} (its report)")])
  if not rows:
    return markup.note("The workdir records nothing of how it ran (no .vmoe.lock, no config.yaml).")
  return markup.table(None, rows, numeric=False)


def _configuration(run: workdir.Run) -> str:
  parts = []
  if run.overrides:
    parts.append("<h3>Command-line overrides</h3>" + markup.table(
        ["key", "value"], [o.partition("=")[::2] for o in run.overrides], numeric=False))
    parts.append(markup.note("What the command line set on top of the stage's config "
                             "(conf/<stage>.yaml); the resolved config below has every key."))
  else:
    parts.append(markup.note("No overrides recorded (.hydra/overrides.yaml): the stage's "
                             "defaults, or a workdir not written by Hydra."))
  if run.config_text:
    parts.append(f"<details><summary>Resolved config (config.yaml)</summary>"
                 f"<pre>{esc(run.config_text)}</pre></details>")
  return "\n".join(parts)


def _downsampling_note(drawn: list[curves_lib.Curve], logged: int,
                       what: str = "records in metrics.jsonl") -> str:
  buckets = max((c.bucket for c in drawn), default=1)
  if buckets == 1:
    return markup.note(f"{logged} {what}; every one is drawn.")
  return markup.note(
      f"{logged} {what}: curves longer than {curves_lib.MAX_POINTS:,} points are drawn "
      f"as the means of buckets of up to {buckets} consecutive logged steps (at most "
      f"{curves_lib.MAX_POINTS:,} points per curve), which smooths spikes shorter than a "
      "bucket; summary.json and metrics.jsonl hold the exact values.")


def _series(scalars: dict, keys, drawn: list) -> list:
  """(key, steps, values) of each key logged at two steps or more (validation: at one or
  more, drawn as markers beside training's curve), downsampled; `drawn` collects the curves."""
  series = []
  for key in keys:
    if key in scalars and len(scalars[key]) >= (1 if key.startswith("val/") else 2):
      curve = curves_lib.downsample(scalars[key])
      drawn.append(curve)
      series.append((key, curve.steps, curve.values))
  return series


def _training(run: workdir.Run) -> str:
  scalars, drawn, charts = run.curves.scalars, [], []
  train = [k for k in scalars if k.startswith("train/") and len(scalars[k]) >= 2]
  if not train:
    return _too_few_training_points(run)
  shown = {"train/aux_loss", "train/cls_loss"}  # drawn in the MoE losses' chart and the loss chart
  for title, keys, ylabel in _TRAIN_CHARTS:
    series = _series(scalars, keys, drawn)
    if any(k.startswith("train/") for k, _, _ in series):
      charts.append(markup.figure(plots.lines(title, series, ylabel)))
    shown.update(keys)
  if "train/cls_loss" in scalars and "train/aux_loss" in scalars:
    series = _series(scalars, ("train/cls_loss", "train/aux_loss"), drawn)
    charts.append(markup.figure(plots.lines("Classification and auxiliary loss", series,
                                            "loss", log=True)))
  charts += [markup.figure(plots.lines(key, _series(scalars, (key,), drawn))) for key in train
             if key not in shown]
  charts += _per_layer_charts(scalars, drawn, lambda name: name.endswith("loss"),
                              "auxiliary losses per MoE layer")
  # Anything else logged over training (a plug-in's, a newer stage's): a chart each.
  charts += [markup.figure(plots.lines(key, _series(scalars, (key,), drawn))) for key in scalars
             if len(scalars[key]) >= 2 and not key.startswith(("train/", "val/", "test/"))
             and not _LAYER.fullmatch(key)]
  return _downsampling_note(drawn, run.curves.logged) + markup.grid(charts)


def _too_few_training_points(run: workdir.Run) -> str:
  """The training section of a run with no training curve: a stage that trains but logged once
  or never (train.steps within one train.log_every_steps) shows its one point and how to get
  curves; only a stage that does not train says it logs once."""
  logged = {k: c for k, c in run.curves.scalars.items() if len(c) == 1 and (
      k.startswith("train/") or (_LAYER.fullmatch(k) and not _LAYER.fullmatch(k)[1]))}
  train = run.config.get("train")
  trains = (run.stage in ("pretrain", "finetune") or isinstance(train, dict)
            or any(k.startswith("train/") for k in logged))
  if not trains:
    return markup.note("Nothing was logged over training steps (an eval, few-shot or ensemble "
                       "stage logs its metrics once).")
  train = train if isinstance(train, dict) else {}
  steps, every = train.get("steps"), train.get("log_every_steps")
  known = isinstance(steps, int) and isinstance(every, int) and steps > 0
  setting = f" (train.log_every_steps={every} over train.steps={steps})" if known else ""
  smaller = max(1, steps // 10) if known else 0
  advice = (f"For curves, train with a smaller train.log_every_steps (e.g. "
            f"train.log_every_steps={smaller}: {steps // smaller} points)."
            if known and smaller < every else
            "For curves, train with a smaller train.log_every_steps (or more train.steps).")
  if not logged:
    return markup.note(
        f"No training step was logged{setting}: training logs its metrics every "
        "train.log_every_steps steps and at its last step, and metrics.jsonl has no training "
        f"record (the run stopped, or has not yet come to it). {advice}")
  points = sorted({int(step) for curve in logged.values() for step in curve.steps})
  when = f"at step {points[0]}" if len(points) == 1 else f"at steps {', '.join(map(str, points))}"
  rows = [[key, int(curve.steps[0]), final_metrics.fmt(float(curve.values[0]))]
          for key, curve in logged.items()]
  return (markup.note(f"Training logged once, {when}{setting}: a single point per metric and "
                      f"no curve to draw; its values are below. {advice}")
          + markup.table(["metric", "step", "value"], rows))


def _per_layer_charts(scalars: dict, drawn: list, wanted, what: str, prefix: str = "") -> list:
  """One chart per per-layer name the predicate accepts (a line per layer)."""
  names: dict[str, list[str]] = {}
  for key in scalars:
    match = _LAYER.fullmatch(key)
    if match and (match[1] or "") == prefix and wanted(match[3]) and len(scalars[key]) >= 2:
      names.setdefault(match[3], []).append(key)
  charts = []
  for name, keys in names.items():
    keys.sort(key=lambda k: int(_LAYER.fullmatch(k)[2]))
    series = [(f"layer {_LAYER.fullmatch(key)[2]}", steps, values)
              for key, steps, values in _series(scalars, keys, drawn)]
    title = f"{prefix + '/' if prefix else ''}moe/layer_*/{name}"
    charts.append(markup.figure(plots.lines(title, series, name), what))
  return charts


def _validation(scalars: dict) -> str:
  keys = [k for k in scalars if k.startswith("val/") and "/moe/" not in k and len(scalars[k]) >= 2]
  if not keys:
    return markup.note("Fewer than two validation points were logged (eval.every_steps sets how "
                       "often training evaluates); the final ones are under Final metrics.")
  drawn: list = []
  charts = [markup.figure(plots.lines(k, _series(scalars, (k,), drawn))) for k in keys]
  return _downsampling_note(drawn, max(len(scalars[k]) for k in keys),
                            "validation points") + markup.grid(charts)


def _routing(curves: curves_lib.Curves) -> str:
  parts, drawn = [], []
  for load in curves_lib.load_maps(curves):
    drawn.append(load.drawn)
    image = plots.heatmap(load.key, load.drawn.steps, load.drawn.values, load.name, load.fraction)
    parts.append(markup.figure(image, f"{load.key}: logged steps x experts"))
    if load.fraction:
      parts.append(_dead_or_saturated(load.logged))
  dropped = _per_layer_charts(curves.scalars, drawn, lambda n: n.startswith("fraction_dropped"),
                              "over training")
  dropped += _per_layer_charts(curves.scalars, drawn, lambda n: n.startswith("fraction_dropped"),
                               "during training's validation", prefix="val")
  balance = _per_layer_charts(curves.scalars, drawn, lambda n: n in _BALANCE,
                              "balance per MoE layer, over the batch")
  if balance:
    parts.append(markup.note(
        "Balance of each token-choice layer over the whole batch, from the (token, choice) "
        "assignments TOP-k made before capacity drops: max_violation is MaxVio = (max_i load_i - "
        "mean load) / mean load (0: perfectly even; Wang et al. 2024), dead_experts the experts "
        "given no assignment, saturated_experts those whose buffer was full in at least half of "
        "the routing groups."))
  dropped += balance
  dropped += _per_layer_charts(  # what a router family logs of its own (Soft MoE's weights)
      curves.scalars, drawn, lambda n: (not n.endswith("loss") and n not in _BALANCE
                                        and not n.startswith("fraction_dropped")),
      "per MoE layer")
  if not parts and not dropped:
    return markup.note("No MoE layer logged its expert load or dropped tokens over training "
                       "(a dense ViT, or a stage that does not train).")
  intro = markup.note(
      "One heat map per MoE layer: the fraction of each expert's buffer slots filled at each "
      f"logged step. Black: about 0 (a dead expert, below {plots.DEAD}); red: about 1 (a "
      f"saturated expert, above {plots.SATURATED}, which drops tokens once its buffer is full).")
  return intro + _downsampling_note(drawn, curves.logged) + "".join(parts) + markup.grid(dropped)


def _dead_or_saturated(curve: curves_lib.Curve) -> str:
  """The experts dead or saturated at the last logged step, and how often each was."""
  last = curve.values[-1]
  dead = [str(i) for i, v in enumerate(last) if v < plots.DEAD]
  full = [str(i) for i, v in enumerate(last) if v > plots.SATURATED]
  often_dead = np.mean(curve.values < plots.DEAD, axis=0)
  often_full = np.mean(curve.values > plots.SATURATED, axis=0)
  text = (f"At the last logged step ({int(curve.steps[-1])}): dead experts "
          f"{', '.join(dead) or 'none'}; saturated experts {', '.join(full) or 'none'}. "
          f"Over all {len(curve)} logged steps: ")
  text += (f"expert {int(often_dead.argmax())} was dead most often ({often_dead.max():.0%} of "
           "them); " if often_dead.max() > 0 else "no expert was ever dead; ")
  text += (f"expert {int(often_full.argmax())} was saturated most often ({often_full.max():.0%})."
           if often_full.max() > 0 else "no expert was ever saturated.")
  return markup.note(text)


def _pictures(pictures: list[pathlib.Path]) -> str:
  if not pictures:
    return markup.note("No pictures in the workdir (the evaluators write them: reliability "
                       "diagrams, capacity sweeps, routing analysis).")
  budget, shown, skipped = PICTURE_BUDGET, [], []
  for picture in pictures:
    size = picture.stat().st_size
    if size > MAX_PICTURE or size > budget:
      skipped.append(f"{picture.name} ({size / 1e6:.1f} MB)")
      continue
    budget -= size
    uri = markup.data_uri(picture.read_bytes(), "image/png")
    shown.append(markup.figure(f'<img src="{uri}" alt="{esc(picture.name)}" loading="lazy">',
                               picture.name))
  text = markup.grid(shown)
  if skipped:
    text += markup.note("Not inlined, to keep the page small (open them in the workdir): "
                        + ", ".join(skipped))
  return text


def _checkpoints(run: workdir.Run) -> str:
  if not run.checkpoints:
    return markup.note("No checkpoint kept in the workdir (checkpoints/<step>/).")
  rows = [[c.step, "complete" if c.complete else "incomplete (no commit marker)",
           f"{c.size / 1e6:.1f} MB"] for c in run.checkpoints]
  return markup.table(["step", "state", "size"], rows)
