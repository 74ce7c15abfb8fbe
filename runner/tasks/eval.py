"""`vmoe eval init.checkpoint=<run>`: evaluate a checkpoint on the data it was trained on (or any).

The model and data configs come from the checkpoint; model.* / data.* keys given on the command
line override them (e.g. inference-time k, capacity ratio, Batch Prioritized Routing).
"""
from __future__ import annotations

import jax
from omegaconf import OmegaConf

from runner import checkpoint, data, parallel
from runner.config import validate
from runner.errors import ConfigError
from runner.evaluators.classification import ClassificationEvaluator, make_eval_step
from runner.logging import MetricWriter
from runner.tasks import common
from runner.train import state as state_lib


def _prune_none(tree):
  if isinstance(tree, dict):
    pruned = {k: _prune_none(v) for k, v in tree.items() if v is not None}
    return {k: v for k, v in pruned.items() if v != {}}
  return tree


def effective_config(cfg, workdir: str) -> dict:
  """The checkpoint's stored config with this command's non-null model/data keys on top."""
  given = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
  path = given["init"].get("checkpoint")
  if not path:
    raise ConfigError("vmoe eval needs init.checkpoint=<workdir of a pretrain/finetune run>.")
  stored = checkpoint.read_config(path)
  router = given["model"].get("router") or {}
  if router.get("capacity_ratio") is not None and router.get("eval_capacity_ratio") is None:
    router["eval_capacity_ratio"] = router["capacity_ratio"]  # at inference, C is the eval C
  merged = OmegaConf.merge(
      OmegaConf.create({k: stored[k] for k in ("model", "data", "train") if k in stored}),
      OmegaConf.create(_prune_none({"model": given["model"], "data": given["data"]})))
  config = OmegaConf.to_container(merged, resolve=True)
  own = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
  config.update({k: own[k] for k in ("seed", "init", "eval", "logger", "mesh", "sharding",
                                      "distributed")})
  config["workdir"] = str(workdir)
  return config


def run(cfg, workdir: str) -> dict:
  config = effective_config(cfg, workdir)
  parallel.initialize(config.get("distributed"))
  model_cfg, d = config["model"], config["data"]
  validate.check_model(model_cfg)
  placement = common.make_placement(config)
  batch_size = int(config["eval"].get("batch_size") or d.get("eval_batch_size") or d["batch_size"])
  validate.check_batch(batch_size, model_cfg, what="eval.batch_size")
  params, _, step = checkpoint.load_params(config["init"]["checkpoint"])
  num_classes = int(params["head"]["kernel"].shape[-1])
  source = common.open_data(d)
  if source.num_classes != num_classes:
    raise ConfigError(f"dataset {d['name']!r} has {source.num_classes} classes but the checkpoint's "
                      f"head predicts {num_classes}; evaluate on data with the same label space.")
  model = common.build_checked_model(model_cfg, num_classes)
  common.write_config(config, workdir)
  split = d.get("test_split") or d["eval_split"]
  loss = config.get("train", {}).get("loss", "softmax_xent")
  evaluator = ClassificationEvaluator(
      jax.jit(make_eval_step(model, loss)),
      data.eval_batches(source, split, d["pp"], batch_size // jax.process_count(),
                        process_index=jax.process_index(), process_count=jax.process_count()),
      prefix=d["name"], put=placement.put)
  with placement.context():
    _, logical = state_lib.abstract_params(model, data.image_shape(source, split, d["pp"]))
    params = jax.device_put(params, placement.shardings(logical))
    metrics = evaluator.run(params)
  summary = {"checkpoint_step": step, "split": split, **metrics}
  writer = MetricWriter(workdir, run_config=config, wandb=config["logger"]["wandb"], job_type="eval")
  try:
    writer.write(step, metrics)
    writer.summary(summary)
  finally:
    writer.close()
  print(" ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
  return summary
