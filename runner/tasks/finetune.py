"""`vmoe finetune`: start from an earlier stage's checkpoint, map its parameters, train on new data."""
from __future__ import annotations

import pathlib

from runner import checkpoint, data
from runner.models import transfer
from runner.tasks import common
from runner.train import state as state_lib
from runner.train.loop import train_and_evaluate


def run(cfg, workdir: str) -> dict:
  config = common.plain_config(cfg, workdir)
  common.check_training(config)
  init = config["init"]
  resuming = any(pathlib.Path(workdir, "checkpoints").glob("[0-9]*/params"))
  if init.get("checkpoint") and not resuming:
    checkpoint.locate(init["checkpoint"])  # fail fast on a wrong path, before opening data
  source = common.open_data(config["data"])
  model = common.build_checked_model(config["model"], source.num_classes)
  init_params = None
  if init.get("checkpoint") and not resuming:
    restored, stored, step = checkpoint.load_params(init["checkpoint"])
    d = config["data"]
    fresh, _ = state_lib.init_params(model, data.image_shape(source, d["split"], d["pp_train"]),
                                     config["seed"])
    init_params = transfer.adapt_params(restored, fresh, reinit_head=init["reinit_head"],
                                        dense_to_experts=init["dense_to_experts"],
                                        source=f"checkpoint {init['checkpoint']} (step {step})")
  common.write_config(config, workdir)
  return train_and_evaluate(config, model=model, source=source, workdir=workdir,
                            init_params=init_params, stage="finetune")
