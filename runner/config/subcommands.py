"""The subcommands of `vmoe`, one record each: everything that lists subcommands (the CLI and its
help, Hydra's schemas, the config's resolution, reports, `vmoe summarize`, a sweep's main metric)
reads this table. It sits in the config layer and names each subcommand's module by its path, so
that `vmoe --help` answers without loading JAX, TensorFlow or Hydra (docs/extending.md: a new
subcommand)."""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

from runner.config import components, registries
from runner.config.schema import (CompressTask, EnsembleTask, EvalTask, ExportTask, FewshotTask,
                                  TrainTask)

# A column of `vmoe summarize`'s default table: header, summary key (or a function of the
# summary), digits.
ColumnSpec = tuple


@dataclasses.dataclass(frozen=True)
class Subcommand:
  """`vmoe <name>`. A stage (`schema` given) is composed by Hydra and runs `module`'s
  `run(config, placement, checkpoints) -> summary`; a tool (no schema) takes plain arguments,
  `module`'s `main(argv) -> exit code`."""
  name: str
  help: str  # its line in `vmoe --help`
  module: str  # runner.tasks.<name>, or a tool's module
  schema: Optional[type] = None
  main_metric: str = ""  # what `metric` reads, in words (the sweep table's header: up to " (")
  metric: Optional[Callable[[dict], float]] = None  # the number a stage is judged by
  wrote: Optional[Callable[[dict], bool]] = None  # does this summary look like this stage's?
  columns: Optional[Callable[[dict], list[ColumnSpec]]] = None  # `vmoe summarize`'s defaults
  has_run_page: bool = True  # `vmoe report` names the stage on its run and chain pages
  # How runner/config/resolve.py types its config: that module's function `resolver`, given the
  # stored configs of no checkpoint (the command line is the config), of `init.checkpoint`
  # ("checkpoint"), or of each path of its list ("checkpoints"); a released checkpoint, which
  # stores no config, needs data= where `released_needs_data`.
  resolver: str = ""
  reads: str = ""
  released_needs_data: bool = True

  @property
  def is_stage(self) -> bool:
    return self.schema is not None


SUBCOMMANDS: registries.Registry[Subcommand] = registries.Registry("subcommand", "vmoe")
KIND = components.Kind(SUBCOMMANDS)  # no keys: a stage's keys are its schema's


def register(subcommand: Subcommand) -> Subcommand:
  """Adds `subcommand` to the table, as any component is added (its name checked first)."""
  components.register(KIND, subcommand.name, subcommand)
  return subcommand


def get(name: str) -> Subcommand:
  if name not in SUBCOMMANDS:
    raise ValueError(f"unknown stage {name!r}; valid: {', '.join(stages())}")
  return SUBCOMMANDS.get(name)


def stages() -> list[str]:
  """The subcommands Hydra composes (every one but the tools)."""
  return [name for name, sub in SUBCOMMANDS.items() if sub.is_stage]


def main_metric(stage: str, summary: dict) -> float:
  """The stage's main metric from its summary (its record's `main_metric` says which)."""
  sub = get(stage)
  if sub.metric is None:
    raise ValueError(f"vmoe {stage} has no main metric")
  return sub.metric(summary)


def stage_of(summary: dict) -> str:
  """Which stage wrote a summary, from its keys (eval where no record recognises it)."""
  return next((name for name, sub in SUBCOMMANDS.items() if sub.wrote and sub.wrote(summary)),
              "eval")


def _trained(summary: dict) -> float:
  for key in ("val/prec@1", "val/zero_shot_prec@1", "val/i2t_prec@1"):
    if key in summary:
      return float(summary[key])
  raise KeyError("the summary has none of val/prec@1, val/zero_shot_prec@1, val/i2t_prec@1")


def _contrastive(summary: dict) -> bool:
  return "val/i2t_prec@1" in summary and "val/prec@1" not in summary


def _trained_columns(summary: dict) -> list[ColumnSpec]:
  if _contrastive(summary):
    return [("val zero-shot prec@1", "val/zero_shot_prec@1"), ("val i2t prec@1", "val/i2t_prec@1"),
            ("val t2i prec@1", "val/t2i_prec@1"), ("val loss", "val/loss"),
            ("test zero-shot prec@1", "test/zero_shot_prec@1")]
  return [("val prec@1", "val/prec@1"), ("val NLL", "val/nll"), ("test prec@1", "test/prec@1"),
          ("test NLL", "test/nll"), *balance_columns(summary)]


_BALANCE = re.compile(r"moe/layer_\d+/(max_violation|dead_experts|saturated_experts)")


def balance_columns(summary: dict) -> list[ColumnSpec]:
  """A token-choice MoE's balance at the last logged training step (runner/models/moe/balance.py):
  the worst layer's MaxVio, and the dead and saturated experts of all its layers together; none
  for a run that logged no balance (a dense ViT, another router family)."""
  if not any(_BALANCE.fullmatch(k) for k in summary):
    return []

  def over_layers(name: str, reduce) -> Callable[[dict], float | None]:
    def read(s: dict):
      values = [v for k, v in s.items() if (m := _BALANCE.fullmatch(k)) and m[1] == name]
      return reduce(values) if values else None
    return read
  return [("MaxVio (worst layer)", over_layers("max_violation", max), 3),
          ("dead experts", over_layers("dead_experts", sum), 1),
          ("saturated experts", over_layers("saturated_experts", sum), 1)]


def _evaluated(summary: dict) -> float:
  """The first dataset's prec@1 (retrieval alone, captions without labels: its i2t recall@1)."""
  return float(next(v for pattern in (r"[^/]+/prec@1", r"[^/]+/i2t_recall@1")
                    for k, v in summary.items() if re.fullmatch(pattern, k)))


def _evaluated_columns(summary: dict) -> list[ColumnSpec]:
  dataset = next(k.split("/")[0] for k in summary if k.endswith("/prec@1") and k.count("/") == 1)
  return [(f"{dataset} prec@1", f"{dataset}/prec@1"), ("NLL", f"{dataset}/nll"),
          ("ECE", f"{dataset}/ece"), ("GFLOPs/image", "compute/gflops_per_image")]


def _most_shots(summary: dict) -> float:
  shots = max(int(m[1]) for k in summary if (m := re.fullmatch(r"mean/(\d+)shot/accuracy", k)))
  return float(summary[f"mean/{shots}shot/accuracy"])


_TRAINS = dict(schema=TrainTask, metric=_trained, columns=_trained_columns, resolver="train_task")
register(Subcommand(
    "pretrain", "train a ViT or V-MoE upstream (default: V-MoE tiny on embedded MNIST-5k)",
    "runner.tasks.pretrain", **_TRAINS, wrote=_contrastive,
    main_metric="val/prec@1 (objective=contrastive: val/zero_shot_prec@1, else val/i2t_prec@1)"))
register(Subcommand(
    "finetune", "fine-tune a checkpoint with a new head (default: embedded UCI digits)",
    "runner.tasks.finetune", **_TRAINS, wrote=lambda s: "val/prec@1" in s,
    main_metric="val/prec@1"))
register(Subcommand(
    "fewshot", "linear few-shot accuracy of frozen features (ridge on pre-logits, 1-25 shots)",
    "runner.tasks.fewshot", FewshotTask, main_metric="mean/<most shots>shot/accuracy",
    metric=_most_shots, resolver="fewshot_run", reads="checkpoints", released_needs_data=False,
    wrote=lambda s: any(k.startswith("mean/") and k.endswith("shot/accuracy") for k in s),
    columns=lambda s: [("few-shot accuracy (most shots)", _most_shots)]))
register(Subcommand(
    "eval", "evaluate a checkpoint: accuracy, NLL, calibration, OOD, corruptions, PGD, GFLOPs",
    "runner.tasks.eval", EvalTask, metric=_evaluated, columns=_evaluated_columns,
    resolver="eval_run", reads="checkpoint",
    main_metric="<first eval dataset>/prec@1 (retrieval alone: <dataset>/i2t_recall@1)"))
register(Subcommand(
    "ensemble", "evaluate checkpoints as one ensemble (deep, partitioned, MC-dropout): + diversity",
    "runner.tasks.ensemble", EnsembleTask, main_metric="<first eval dataset>/prec@1",
    metric=_evaluated, wrote=lambda s: "ensemble/size" in s, columns=_evaluated_columns,
    resolver="ensemble_run", reads="checkpoints"))
register(Subcommand(
    "compress", "fewer experts per MoE layer, pruned or merged by a calibration set's routing",
    "runner.tasks.compress", CompressTask, resolver="compress_run", reads="checkpoint",
    main_metric="calibration/prec@1 (the compressed model's, on the calibration images)",
    metric=lambda s: float(s["calibration/prec@1"]), wrote=lambda s: "compress/experts" in s,
    columns=lambda s: [("experts kept", "compress/experts", 0),
                       ("calibration prec@1", "calibration/prec@1"),
                       ("before compression", "calibration/prec@1_before"),
                       ("parameters", "compress/parameters", 0)]))
register(Subcommand(
    "export", "a checkpoint as safetensors + a plain PyTorch model with the same probabilities",
    "runner.tasks.export", ExportTask, has_run_page=False, resolver="export_run",
    reads="checkpoint", released_needs_data=False,
    main_metric="export/max_abs_diff (PyTorch against vmoe; NaN where PyTorch is not installed)",
    metric=lambda s: float(s.get("export/max_abs_diff", float("nan")))))
register(Subcommand(
    "summarize", "one table (Markdown, CSV, plots) of a sweep's jobs: overrides and final metrics",
    "runner.report.summarize_command", has_run_page=False))
register(Subcommand(
    "report", "one offline HTML page of a run or a sweep: curves, expert load, metrics, pictures",
    "runner.report.command", has_run_page=False))
