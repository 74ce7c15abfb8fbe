"""The config checks that open a run's inputs (what a starting checkpoint was trained for, whether
the run to export or compress has ended): relations (runner/config/relations.py) whose `checkpoints`
(weights.Checkpoints) the pre-flight checks and the job give; config reads no file."""
from __future__ import annotations

from runner.config.relations import relation, shown
from runner.config.schema import CompressRun, ExportRun, Objective, TrainTask
from runner.errors import UserError


def _checkpoint_objective(path: str, checkpoints) -> str | None:
  """What the run at `path` was trained for (released checkpoints are classifiers); None when
  it cannot be read here (the task then reports why)."""
  try:
    stored = checkpoints.stored_config(path)
  except UserError:
    return None
  return str(((stored or {}).get("objective") or {}).get("name") or "classification")


@relation
def classifier_from_a_tower(run: TrainTask, checkpoints):
  """A classifier starts from a contrastive checkpoint only from the tower init.tower names, which
  names only a contrastive checkpoint's tower (`checkpoints` reads what init.checkpoint was)."""
  init, tower = run.init, f"init.tower={shown(run.init.tower)}"
  if init.tower is not None and not init.checkpoint:
    return (f"{tower} names a tower of init.checkpoint, which is not set; give "
            "init.checkpoint=<a run of vmoe pretrain objective=contrastive>, or drop init.tower.")
  if not init.checkpoint:
    return None
  if run.objective.name == Objective.contrastive:
    if init.tower is not None:
      return (f"{tower} means nothing with objective=contrastive: a contrastive run starts its "
              "image tower from init.checkpoint (or both towers from a contrastive run) as it "
              "is; drop init.tower.")
    return None
  stored = _checkpoint_objective(init.checkpoint, checkpoints)
  if stored == Objective.contrastive.value and init.tower is None:
    return (f"init.checkpoint={init.checkpoint} is a contrastive run (an image and a text tower), "
            "not a classifier: say which tower the classifier starts from, init.tower=image "
            "(its image tower, with a new head).")
  if init.tower is not None and stored is not None and stored != Objective.contrastive.value:
    return (f"{tower} means nothing for init.checkpoint={init.checkpoint}, a classifier "
            f"(objective={stored}): init.tower picks a tower of a contrastive run (vmoe pretrain "
            "objective=contrastive); drop it.")
  if init.tower is not None and not init.reinit_head:
    return (f"init.reinit_head=false with {tower}: the image tower of a contrastive run has no "
            "classifier head to keep; drop init.reinit_head=false.")
  return None


def _finished_classifier(run, command: str, verb: str, checkpoints) -> str | None:
  """A classifier whose run has ended (or a step folder, or a released checkpoint); `verb`: what
  the command does to it ("writes")."""
  if run.objective.name == Objective.contrastive:
    return (f"init.checkpoint={run.init.checkpoint} is a contrastive run (an image and a text "
            f"tower): vmoe {command} {verb} classifiers; fine-tune its image tower into one (vmoe "
            f"finetune init.checkpoint=<the run> init.tower=image) and {command} that.")
  if run.init.tower is not None:
    return (f"init.tower={shown(run.init.tower)} means nothing in vmoe {command}, which {verb} a "
            "classifier whole; drop it.")
  try:
    return checkpoints.unfinished(run.init.checkpoint)
  except UserError as e:  # no checkpoint there: said in the words of the checkpoint's reader
    return str(e)


@relation
def export_a_finished_classifier(run: ExportRun, checkpoints):
  """An export takes a classifier whose run has ended (`checkpoints` says whether it has)."""
  return _finished_classifier(run, "export", "writes", checkpoints)


@relation
def compress_a_finished_classifier(run: CompressRun, checkpoints):
  """A compression takes a classifier whose run has ended, as an export does."""
  return _finished_classifier(run, "compress", "compresses", checkpoints)
