"""Bad input fails before any compute: exit code 2, one paragraph naming the culprit and what is
valid, no traceback, and nothing a later resume could mistake for a run.

Config values fail when the CLI validates the composed config, before Hydra creates the workdir:
those cases assert that the workdir does not exist at all. Data and checkpoint faults are found by
the task before its first step: those cases assert that no checkpoint, W&B run or summary exists.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from conftest import TINY_MODEL, TINY_TEXT
from conftest import fails_clearly as _fails_clearly
from conftest import nothing_like_a_run as _nothing_like_a_run

pytestmark = pytest.mark.xdist_group("bad_input")

# W&B offline (not disabled), so that "no W&B run was started" is a real check.
LOGS = ["logger.wandb.mode=offline", "logger.progress=false"]
TRAIN = [*TINY_MODEL, *LOGS, "train.steps=1", "schedule.warmup_steps=0", "data.batch_size=16"]


# --- config values, pretrain / finetune --------------------------------------------------------

TRAINING_CASES = [
    # ranges of single keys
    (["train.steps=-5"], ["train.steps=-5", "must be >= 1"]),
    (["train.steps=null", "train.epochs=-1"], ["train.epochs=-1", "must be > 0"]),
    (["train.steps=null"], ["train.steps=<n>", "train.epochs=<x>"]),
    (["optim.lr=-0.1"], ["optim.lr=-0.1", "must be > 0"]),
    (["optim.lr=0"], ["optim.lr=0", "must be > 0"]),
    (["optim.lr=inf"], ["optim.lr=inf must be finite and > 0"]),  # 1e400 is inf too
    (["model.router.capacity_ratio=1e400"], ["capacity_ratio=inf must be finite and > 0"]),
    (["optim.weight_decay=inf"], ["optim.weight_decay=inf must be a number >= 0"]),
    (["data.batch_size=0"], ["data.batch_size=0", "must be >= 1"]),
    (["data.eval_batch_size=0"], ["data.eval_batch_size=0", ">= 1"]),
    (["data.holdout_fraction=1.5"], ["data.holdout_fraction=1.5", "(0, 1)"]),
    (["data.shuffle_buffer=0"], ["data.shuffle_buffer=0"]),
    (["model.dropout_rate=1.0"], ["model.dropout_rate=1.0", "[0, 1)"]),
    (["model.moe.expert_dropout=-0.1"], ["model.moe.expert_dropout=-0.1", "[0, 1)"]),
    (["model.router.noise_std=-1"], ["model.router.noise_std=-1", ">= 0"]),
    (["model.router.capacity_ratio=0"], ["model.router.capacity_ratio=0", "> 0"]),
    (["model.router.k=0"], ["model.router.k=0", ">= 1"]),
    (["model.router.capacity_rounding=floor"], ["model.router.capacity_rounding", "paper",
                                                "reference"]),
    (["optim.b1=1.0"], ["optim.b1=1.0", "[0, 1)"]),
    (["optim.beta2_cap=0"], ["optim.beta2_cap=0", "(0, 1]"]),
    (["optim.min_dim_size_to_factor=0"], ["optim.min_dim_size_to_factor=0", ">= 1"]),
    (["optim.clipping_threshold=0"], ["optim.clipping_threshold=0", "> 0", "null: none"]),
    (["optim.eps=0"], ["optim.eps=0", "> 0"]),
    (["optim.grad_clip_norm=-1"], ["optim.grad_clip_norm=-1", "> 0", "null: no clipping"]),
    (["optim.weight_decay=-0.1"], ["optim.weight_decay=-0.1", "[regex, value >= 0]"]),
    (['optim.weight_decay=[["(",1.0]]'], ["optim.weight_decay", "regex"]),
    (["schedule.warmup_steps=-1"], ["schedule.warmup_steps=-1", ">= 0"]),
    (["schedule.end_lr_fraction=2"], ["schedule.end_lr_fraction=2", "[0, 1]"]),
    (["train.accum_steps=0"], ["train.accum_steps=0", ">= 1"]),
    (["train.log_every_steps=0"], ["train.log_every_steps=0"]),
    (["train.aux_loss_weight=-1"], ["train.aux_loss_weight=-1", ">= 0"]),
    (["eval.every_steps=-1"], ["eval.every_steps=-1", "0: only at the end"]),
    (["checkpoint.keep=0"], ["checkpoint.keep=0", ">= 1"]),
    (["checkpoint.every_steps=-1"], ["checkpoint.every_steps=-1"]),
    (["mesh.expert=0"], ["mesh.expert=0", "-1 (infer from the device count) or >= 1"]),
    (["sharding.name=nope"], ["sharding.name='nope'", "dp, ep, fsdp_ep"]),
    (["sharding.rules=[[embed,nope]]"], ["sharding.rules", "mesh axis (data, expert)"]),
    (["distributed.coordinator_address=nohost"], ["distributed.coordinator_address", "host:port"]),
    (["distributed.num_processes=2"], ["distributed.num_processes=2 means nothing without "
                                       "distributed.coordinator_address=<host:port>"]),
    (["logger.wandb.mode=sometimes"], ["logger.wandb.mode", "online", "offline", "disabled"]),
    # relations between keys
    (["model.router.k=9"], ["model.router.k=9", "num_experts=8", "1 <= k <= 8"]),
    (["model.num_heads=3"], ["model.hidden_size=32", "model.num_heads=3"]),
    (["model.image_size=18"], ["model.image_size=18", "model.patch_size=4"]),
    (["model.moe.layers=every0"], ["model.moe.layers='every0'", "every<n>"]),
    (["model.moe.layers=[0,0]"], ["model.moe.layers=[0, 0]", "a list of distinct block indices"]),
    (["model.moe.layers=[0,5]"], ["model.moe.layers", "[5] out of range", "2-block"]),
    (["model.moe.num_experts=0"], ["model.moe.num_experts >= 1"]),
    (["train.accum_steps=3"], ["train.accum_steps=3", "data.batch_size=16"]),
    (["data.batch_size=12"], ["data.batch_size=12", "group_size=8"]),
    (["mesh.data=3"], ["mesh.data=3", "devices"]),
    (["distributed.coordinator_address=localhost:1234"],
     ["distributed.num_processes=<n>", "distributed.process_id"]),
    (["fewshot.every_steps=5", "fewshot.datasets=[]"], ["fewshot.every_steps=5", "fewshot.datasets"]),
    (["fewshot.every_steps=5", "fewshot.shots=[0]"], ["fewshot.shots=[0]", "item 0", ">= 1"]),
    (["fewshot.l2_regs=[1,0.5]"], ["fewshot.l2_regs=[1.0, 0.5]", "strictly increasing"]),
    (["fewshot.protocol=whiten"], ["fewshot.protocol", "reference", "plain"]),
    # eval.* in training: the measurements run on the run's validation split
    (["eval.datasets=[uci_digits]"], ["eval.datasets means nothing during training",
                                      "validation split", "vmoe eval init.checkpoint=<the run>"]),
    (["eval.save_predictions=true"], ["eval.save_predictions means nothing during training",
                                      "vmoe eval init.checkpoint=<the run>"]),
    (["eval.capacity_sweep=[0.5]"], ["eval.capacity_sweep means nothing during training",
                                     "vmoe eval's alone with vmoe eval init.checkpoint="]),
    (["eval.routing_analysis=true", "model=vit_tiny"],
     ["eval.routing_analysis=true", "vit_tiny has no MoE layers", "V-MoE, experts-choice or Soft "
      "MoE"]),
    (["eval.routing_analysis=true", "eval.routing.layers=[0]"],
     ["eval.routing.layers=[0]", "without an MoE layer", "its MoE layers are blocks [1]",
      "eval.routing.layers=[]"]),
    (["eval.routing_analysis=true", "eval.routing.capacities=[0]"],
     ["eval.routing.capacities=[0.0]", "must be > 0"]),
    # the schedule against the run's length (train.steps given: checked with the config)
    (["train.steps=20", "schedule.warmup_steps=20"],
     ["schedule.warmup_steps=20 is not shorter than the run (train.steps=20)",
      "never reaching optim.lr=0.003", "schedule.warmup_steps=4 (a fifth of it)"]),
    (["train.steps=20", "schedule.warmup_steps=50"], ["to 0.0012 at its last step"]),
    (["schedule=rsqrt", "train.steps=100", "schedule.warmup_steps=10",
      "schedule.cooldown_steps=95"],
     ["schedule.warmup_steps=10 and schedule.cooldown_steps=95 take 105 steps", "<= 100"]),
    # a key the chosen optimizer or schedule does not read (tests/unit/test_components.py)
    (["schedule.name=constant", "schedule.end_lr_fraction=0.5"],
     ["schedule.end_lr_fraction=0.5 means nothing for schedule.name=constant; its keys are "
      "schedule.{warmup_steps}", "schedule.name=constant|linear|cosine|rsqrt"]),
    (["train.epochs=2"], ["train.epochs=2 would be ignored", "train.steps=1",
                          "add train.steps=null"]),
    # router families: unknown names, bad slot counts, options that mean nothing for the router
    (["model.router.type=hash"], ["model.router.type='hash'", "token_choice", "experts_choice",
                                  "soft"]),
    (["model.router.type=soft", "model.router.slots_per_expert=0"],
     ["model.router.slots_per_expert=0", ">= 1", "num_slots"]),
    (["model.router.type=soft", "model.router.slots_per_expert=-2"],
     ["model.router.slots_per_expert=-2", ">= 1"]),
    (["model.router.type=soft", "model.router.k=1"],
     ["model.router.k=1 means nothing for model.router.type=soft", "slots_per_expert"]),
    (["model.router.type=soft", "model.router.batch_priority=true"],
     ["model.router.batch_priority=true means nothing for model.router.type=soft"]),
    (["model.router.type=soft", "model.moe.dispatcher=einsum"],
     ["model.moe.dispatcher=einsum means nothing for model.router.type=soft"]),
    (["model.router.type=experts_choice", "model.router.batch_priority=true"],
     ["model.router.batch_priority=true means nothing for model.router.type=experts_choice",
      "capacity_ratio"]),
    (["model.router.type=experts_choice", "model.moe.ensemble_size=2"],
     ["model.moe.ensemble_size=2 needs a token-choice router", "experts_choice"]),
    (["model.router.type=soft", "model.moe.ensemble_size=2"],
     ["model.moe.ensemble_size=2 needs a token-choice router", "model.router.type=soft"]),
    (["model.router.slots_per_expert=2"],
     ["model.router.slots_per_expert=2 means nothing for model.router.type=token_choice"]),
    # token choice's gate and balance scope (model=ecmoe_tiny: experts choice)
    (["model=ecmoe_tiny", "model.router.gate=sigmoid"],
     ["model.router.gate=sigmoid means nothing for model.router.type=experts_choice"]),
    (["model.router.type=soft", "model.router.balance_scope=batch"],
     ["model.router.balance_scope=batch means nothing for model.router.type=soft"]),
    (["model.router.gate=relu"], ["model.router.gate", "'relu'", "softmax, sigmoid"]),
    (["model.router.gate=sigmoid", "model.router.batch_priority=true",
      "model.router.priority=sum"],
     ["model.router.priority=sum means nothing with model.router.gate=sigmoid",
      "model.router.priority=max"]),
    # auxiliary-loss-free balancing (a per-expert bias for choosing): token choice's alone
    (["model.router.bias_update_rate=0.01"],
     ["model.router.bias_update_rate=0.01 means nothing with model.router.balance=aux_loss",
      "model.router.balance=bias"]),
    (["model.router.balance=bias", "model.router.bias_update_rate=-0.001"],
     ["model.router.bias_update_rate=-0.001", ">= 0"]),
    (["model.router.balance=loss_free"], ["model.router.balance", "'loss_free'",
                                          "aux_loss, bias"]),
    (["model=vit_tiny", "model.router.balance=bias"],
     ["model.router.balance=bias", "dense ViT"]),
    (["model=softmoe_tiny", "model.router.balance=bias"],
     ["model.router.balance=bias means nothing for model.router.type=soft"]),
    (["model=ecmoe_tiny", "model.router.balance=bias", "model.router.bias_update_rate=0.01"],
     ["model.router.balance=bias, model.router.bias_update_rate=0.01 means nothing for "
      "model.router.type=experts_choice"]),
    # DeepSeekMoE's shared and fine-grained experts
    (["model=vit_tiny", "model.moe.shared_experts=1"],
     ["model.moe.shared_experts=1 means nothing for a dense ViT"]),
    (["model=vit_tiny", "model.moe.expert_split=2"],
     ["model.moe.expert_split=2 means nothing for a dense ViT"]),
    (["model.moe.expert_split=3"], ["model.moe.expert_split=3 does not divide model.mlp_dim=",
                                    "divisor of"]),
    (["model.moe.expert_split=0"], ["model.moe.expert_split=0", ">= 1"]),
    (["model.moe.shared_experts=-1"], ["model.moe.shared_experts=-1", ">= 0"]),
    (["model=softmoe_tiny", "model.moe.expert_split=2"],
     ["model.moe.expert_split=2 means nothing for model.router.type=soft",
      "model.router.type=token_choice"]),
    (["model=vmoe_tiny_s1_f2_m2"],
     ["model.moe.shared_experts=1 and model.moe.expert_split=2 cannot be used with a "
      "partitioned batch ensemble", "model.moe.ensemble_size=1"]),
    # launchers and sweepers (nothing is submitted)
    (["--multirun", "hydra/launcher=kubernetes"], ["hydra/launcher/kubernetes", "slurm",
                                                   "parallel", "basic"]),
    (["--multirun", "hydra/sweeper=bayesian"], ["hydra/sweeper/bayesian", "optuna", "basic"]),
    (["--multirun", "hydra/launcher=slurm", "hydra.launcher.timeout_min=soon"],
     ["hydra.launcher.timeout_min", "'soon'", "Integer"]),
    (["--multirun", "hydra/launcher=slurm", "hydra.launcher.nodes=two"],
     ["hydra.launcher.nodes", "Integer"]),
    (["--multirun", "hydra/launcher=parallel", "hydra.launcher.jobs=many"],
     ["hydra.launcher.jobs", "Integer"]),
    (["--multirun", "hydra/sweeper=optuna", "optim.lr=interval(0.1,0.001)"],
     ["search range optim.lr=interval(0.1,0.001) is empty", "a < b"]),
    (["--multirun", "hydra/sweeper=optuna", "optim.lr=interval(0.1,fast)"],
     ["optim.lr=interval(0.1,fast)", "cannot parse"]),
    (["--multirun", "hydra/sweeper=optuna", "optim.lr=tag(log,interval(-1,0.1))"],
     ["optim.lr=-1.0", "must be > 0"]),
    (["--multirun", "hydra/launcher=slurm", "hydra.launcher.nodes=0"],
     ["hydra.launcher.nodes=0 must be >= 1", "tasks_per_node >= 1", "timeout_min >= 1"]),
    (["--multirun", "hydra/launcher=slurm", "hydra.launcher.timeout_min=0"],
     ["hydra.launcher.timeout_min=0 must be >= 1"]),
    (["--multirun", "hydra/launcher=slurm", "hydra.launcher.mem_gb=-4"],
     ["hydra.launcher.mem_gb=-4 must be > 0"]),
    (["--multirun", "hydra/launcher=parallel", "hydra.launcher.jobs=0", "seed=0,1"],
     ["hydra.launcher.jobs=0 must be >= 1"]),
    (["--multirun", "hydra.sweeper.max_batch_size=0", "seed=0,1"],
     ["hydra.sweeper.max_batch_size=0 must be >= 1"]),
    (["--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=0",
      "optim.lr=interval(0.001,0.1)"], ["hydra.sweeper.n_trials=0 must be >= 1", "n_jobs >= 1"]),
    (["--multirun", "hydra/sweeper=optuna", "hydra.sweeper.direction=up",
      "optim.lr=interval(0.001,0.1)"], ["hydra.sweeper.direction=up", "minimize or maximize"]),
    # Hydra's modes: one at a time (a sweep's --cfg job shows every job: test_end_to_end.py)
    (["--multirun", "--info"], ["--info and --multirun", "give one of them"]),
    (["--multirun", "seed=0,1", "--cfg", "hydra"], ["--cfg hydra with --multirun",
                                                    "--cfg job"]),
    (["data.num_shards=3"], ["data.num_shards=3", "data.batch_size=16"]),
    # a dense ViT has no router and no MoE key
    (["model=vit_tiny", "model.router.type=soft"],
     ["model.router.type=soft means nothing for a dense ViT", "model=vmoe_tiny"]),
    (["model=vit_tiny", "model.router.gate=sigmoid"],
     ["model.router.gate=sigmoid means nothing for a dense ViT", "model=vmoe_tiny"]),
    (["model=vit_tiny", "model.moe.num_experts=8"],
     ["model.moe.num_experts=8 means nothing for a dense ViT", "model.moe.layers=every2"]),
    (["model.moe.layers=[]", "model.router.k=1", "model.moe.group_size=4"],
     ["model.router.k=1, model.moe.num_experts=8, model.moe.group_size=4 means nothing for a "
      "dense ViT"]),
    # several problems are reported together
    (["train.steps=-5", "optim.lr=-0.1"], ["2 problems", "train.steps=-5", "optim.lr=-0.1"]),
    # a seed NumPy, TensorFlow and JAX all take; a workdir that can be a local folder
    (["seed=99999999999999999999"], ["seed=99999999999999999999 must be in [0, 4294967295]"]),
    (["seed=-1"], ["seed=-1 must be in [0, 4294967295]", "non-negative 32-bit"]),
    (["workdir=gs://bucket/run"], ["workdir='gs://bucket/run' is a URL", "e.g. workdir=runs/up"]),
    (["workdir="], ["workdir='' is empty", "a folder of this machine's file system"]),
    # composition: unknown names and keys, types
    (["model=vmoe_nope"], ["unknown model 'vmoe_nope'", "vmoe_tiny", "vit_b16"]),
    (["data=nope"], ["data=", "mnist5k", "uci_digits", "image_folder"]),
    (["optim=nope"], ["optim=", "adam", "sgd", "adafactor"]),
    (["optim.name=adamw"], ["optim.name", "adam", "sgd", "adafactor"]),
    (["optim.lrr=1"], ["unknown config key 'optim.lrr'", "lr", "momentum"]),
    (["train.steps=many"], ["train.steps"]),
    (["data=image_folder"], ["data.root"]),
    (['data.pp_train="decode|blur(3)"'], ["data.pp_train", "unknown preprocessing op 'blur'",
                                          "resize"]),
    (["data.pp_train=decode|blur(3)"], ["must be quoted"]),
]


@pytest.mark.parametrize("args, expected", TRAINING_CASES, ids=lambda v: " ".join(v)[:60])
def test_training_config_value(args, expected, run_cli, tmp_path):
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, *args), *expected)
  assert not workdir.exists()  # validated before Hydra created anything


def test_a_workdir_in_place_of_a_file_is_refused(run_cli, tmp_path):
  (tmp_path / "notes.txt").write_text("not a folder")
  for workdir, what in ((tmp_path / "notes.txt", "is the file"),
                        (tmp_path / "notes.txt" / "run", "lies under the file")):
    _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN),
                   f"workdir='{workdir}' {what} {tmp_path / 'notes.txt'}")
  assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_slurm_launcher_without_slurm_submits_nothing(run_cli, tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sbatch, no sinfo
  workdir = tmp_path / "sweep"
  _fails_clearly(run_cli("pretrain", "--multirun", "hydra/launcher=slurm", f"workdir={workdir}",
                         *TRAIN, "seed=0,1"),
                 "hydra/launcher=slurm submits", "sbatch and sinfo are not on this machine's PATH",
                 "hydra/launcher=parallel")
  assert not workdir.exists()


def test_finetune_config_value(run_cli, tmp_path):
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("finetune", f"workdir={workdir}", *TRAIN, "optim.momentum=1.5"),
                 "optim.momentum=1.5", "[0, 1)")
  assert not workdir.exists()


def test_a_sweep_with_one_bad_value_runs_no_job(run_cli, tmp_path):
  workdir = tmp_path / "sweep"
  _fails_clearly(run_cli("pretrain", "--multirun", f"workdir={workdir}", *TRAIN,
                         "optim.lr=1e-3,-1"), "in the sweep job optim.lr=-1", "optim.lr=-1")
  assert not workdir.exists()


def test_debug_shows_the_traceback(run_cli, tmp_path):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *TRAIN, "train.steps=-5", "debug=true")
  assert code == 2 and "train.steps=-5" in err


def test_unknown_subcommand(run_cli):
  _fails_clearly(run_cli("pretrian"), "unknown subcommand 'pretrian'", "pretrain", "finetune")


# --- data --------------------------------------------------------------------------------------

def _png(path: pathlib.Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  Image.new("RGB", (8, 8), (10, 120, 200)).save(path)


@pytest.fixture
def broken_folder(tmp_path) -> pathlib.Path:
  """An image folder with every kind of fault: an unreadable image, a stray file, an empty class
  folder, a class missing from a split."""
  root = tmp_path / "images"
  for split in ("train", "test"):
    for cls in ("cat", "dog"):
      for i in range(4):
        _png(root / split / cls / f"{i}.png")
  (root / "train" / "cat" / "broken.png").write_bytes(b"\x89PNG not really")
  (root / "train" / "dog" / "notes.txt").write_text("meeting notes")
  (root / "test" / "bird").mkdir()
  _png(root / "test" / "fish" / "0.png")
  return root


def test_broken_image_folder_is_listed_before_compute(broken_folder, run_cli, tmp_path):
  workdir = tmp_path / "w"
  err = _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, "data=image_folder",
                               f"data.root={broken_folder}"),
                       f"data.root={broken_folder}", "train/cat/broken.png",
                       "train/dog/notes.txt", "test/bird", "'fish' is in test/ but not in train/",
                       "data.skip_unreadable=true")
  assert "2 unreadable or non-image files" in err
  _nothing_like_a_run(workdir)


def test_skip_unreadable_still_refuses_a_class_missing_from_train(broken_folder, run_cli,
                                                                  tmp_path):
  workdir = tmp_path / "w"
  code, _, err = run_cli("pretrain", f"workdir={workdir}", *TRAIN, "data=image_folder",
                         f"data.root={broken_folder}", "data.skip_unreadable=true")
  assert code == 2 and "warning: skipped 2 unreadable or non-image files" in err
  assert "'fish' is in test/ but not in train/" in err and "Traceback" not in err
  _nothing_like_a_run(workdir)


def test_image_folder_without_images(run_cli, tmp_path):
  (tmp_path / "images" / "train" / "cat").mkdir(parents=True)
  _fails_clearly(run_cli("pretrain", f"workdir={tmp_path / 'w'}", *TRAIN, "data=image_folder",
                         f"data.root={tmp_path / 'images'}"), "no images")
  _nothing_like_a_run(tmp_path / "w")


def test_broken_caption_file_is_listed_before_compute(run_cli, tmp_path):
  """Every faulty row of a file of image-caption pairs, in one message."""
  _png(tmp_path / "pairs" / "a.png")
  (tmp_path / "pairs" / "b.png").write_text("not an image")
  (tmp_path / "pairs" / "captions.jsonl").write_text("\n".join([
      '{"image": "a.png", "caption": "a blue square"}',
      '{"image": "gone.png", "caption": "missing"}',
      '{"image": "b.png", "caption": "a text file"}',
      '{"image": "a.png", "caption": ""}',
      '{"image": "a.png", "caption": "x", "split": "dev"}']) + "\n")
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, "objective=contrastive",
                         "data=captions", f"data.root={tmp_path / 'pairs'}"),
                 "captions.jsonl has 4 problems", "1 missing image file (line 2: gone.png)",
                 "1 unreadable or non-image file (line 3: b.png", "empty or missing caption "
                 "(line 4)", "unknown split (line 5: 'dev')", "data.skip_unreadable=true")
  _nothing_like_a_run(workdir)


@pytest.mark.parametrize("args, expected", [
    (["data=tfds", "data.name=cifar10"], ["cifar10", "not prepared", "tfds build", "data_dir"]),
    (["objective=contrastive", "data=coco_captions"],
     ["'coco_captions' is not prepared", "tfds build coco_captions", "mnist5k_captions"]),
    (["objective=contrastive", "data=captions", "data.root=/no/such/pairs.jsonl"],
     ["data.root='/no/such/pairs.jsonl' does not exist", "captions.jsonl or captions.csv"]),
    (["data=tfds", "data.name=no_such_dataset"], ["unknown dataset 'no_such_dataset'", "mnist5k"]),
    # a spec that fails as tf.data builds the pipeline: said alone, without autograph's frames
    (['data.pp_train=""'], ["preprocessing '' leaves no decoded image under 'image'"]),
    (['data.pp_train="resize(16)|value_range(-1,1)"'],
     ["fails at resize(16)", "The image is still encoded there: start with decode"]),
    (['data.pp_train="decode|keep(\'label\')|resize(16)"'],
     ["fails at resize(16): no feature 'image' (an op before removed it)"]),
    (['data.pp_train="decode|resize(16)|central_crop(40)|value_range(-1,1)"'],
     ["fails at central_crop(40): a 40x40 crop of a 16x16 image."]),
    # a data_dir an embedded dataset cannot be prepared in; a URL that TFDS (file://) or
    # TensorFlow (s3:// without tensorflow-io) cannot read
    (["data.data_dir=/proc/vmoe"], ["cannot prepare the embedded dataset 'mnist5k' under "
                                    "data_dir '/proc/vmoe'", "a folder you can write to"]),
    (["data.data_dir=file:///no/such"], ["data_dir 'file:///no/such' cannot be read: TFDS reads "
                                         "no file:// paths", "local folder, written without"]),
    (["data.data_dir=s3://bucket/tfds"], ["data_dir 's3://bucket/tfds' cannot be read: ", "gs://"]),
    (["data.split=val"], ["no split 'val'", "train (4000 examples)"]),
    (["fewshot.every_steps=1", "fewshot.datasets=[lfw_faces]", "fewshot.shots=[50]"],
     ["'lfw_faces'", "50 shots"]),
    # the run's length from train.epochs is known once the split is: 0.01 x 4,000 / 16 = 3 steps
    (["train.steps=null", "train.epochs=0.01", "schedule.warmup_steps=5"],
     ["schedule.warmup_steps=5 is not shorter than the run (train.epochs=0.01 = 3 steps of "
      "data.batch_size=16 over 4000 examples)"]),
])
def test_training_data(args, expected, run_cli, tmp_path):
  _fails_clearly(run_cli("pretrain", f"workdir={tmp_path}", *TRAIN, *args), *expected)
  _nothing_like_a_run(tmp_path)


@pytest.fixture
def small_folder(tmp_path) -> pathlib.Path:
  """A first try on one's own images: 3 classes of 8 training and 4 test images."""
  root = tmp_path / "my_images"
  for split, count in (("train", 8), ("test", 4)):
    for cls in ("cat", "dog", "fox"):
      for i in range(count):
        _png(root / split / cls / f"{i}.png")
  return root


@pytest.mark.parametrize("args, expected", [
    # 24 training images, 2 held out for validation: 22 to train on, in batches of 8 images'
    # routing groups (TINY_MODEL's V-MoE)
    (["data.batch_size=128"],
     ["data.batch_size=128 is larger than the training data", "split 'train[:22]'",
      "2 of the 24 examples of 'train' are held out for validation, data.holdout_fraction=0.1",
      "has 22 examples", "Use data.batch_size=16 or less",
      "the pretrain recipe's default is 128, finetune's 64"]),
    (["data.batch_size=32", "data.num_shards=2"],
     ["data.batch_size=32", "data.num_shards=2 shards of 11 examples, each giving 16 images",
      "Use data.batch_size=16 or less"]),
])
def test_a_dataset_smaller_than_a_batch_writes_nothing(args, expected, small_folder, run_cli,
                                                       tmp_path):
  workdir = tmp_path / "runs" / "first"
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, "data=image_folder",
                         f"data.root={small_folder}", *args), *expected)
  assert not (tmp_path / "runs").exists()  # the workdir and the folder Hydra made for it


# --- checkpoints -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(shared_run, tmp_path_factory):
  """Tiny V-MoE (checkpoints at steps 1 and 2), ViT and Soft MoE runs, the session's shared runs
  (read, never written; the cases ask what the checkpoints are, not how far they trained), and
  damaged copies of the V-MoE's."""
  root = tmp_path_factory.mktemp("runs")
  vmoe = shared_run("vmoe_2steps")
  damaged = {
      "corrupt_params": lambda d: _garbage(d / "checkpoints/2/params/_METADATA"),
      "corrupt_config": lambda d: _garbage(d / "checkpoints/2/config/metadata"),
      "corrupt_arrays": lambda d: [_garbage(p) for p in (d / "checkpoints/2/params").rglob("d/*")],
      "partial": lambda d: shutil.rmtree(d / "checkpoints/2/params"),
      "all_corrupt": lambda d: [_garbage(d / f"checkpoints/{s}/params/_METADATA") for s in (1, 2)],
  }
  for name, damage in damaged.items():
    shutil.copytree(vmoe, root / name)
    damage(root / name)
  (root / "file.txt").write_text("not a run")
  (root / "empty").mkdir()
  return {"vmoe": vmoe, "vit": shared_run("vit_1step"), "soft": shared_run("softmoe_3steps"),
          **{name: root / name for name in ["file.txt", "empty", *damaged]}}


def _garbage(path: pathlib.Path) -> None:
  path.write_bytes(os.urandom(256))


CHECKPOINT_CASES = [
    ("finetune", ["init.checkpoint=/no/such/run"], ["init.checkpoint='/no/such/run'",
                                                     "does not exist"]),
    ("finetune", ["init.checkpoint={file.txt}"], ["no checkpoint found", "file.txt"]),
    ("finetune", ["init.checkpoint={empty}"], ["no checkpoint found", "empty"]),
    ("finetune", ["init.checkpoint={partial}"], ["checkpoints/2 is partial", "params missing",
                                                 "checkpoints/1"]),
    ("finetune", ["init.checkpoint={corrupt_params}"], ["checkpoints/2 cannot be read",
                                                        "params is corrupted"]),
    ("finetune", ["init.checkpoint={corrupt_arrays}"], ["checkpoints/2 cannot be read",
                                                        "params is corrupted"]),
    ("finetune", ["init.checkpoint={corrupt_config}"], ["config is corrupted"]),
    ("finetune", ["init.checkpoint={vmoe}", "model.hidden_size=48"],
     ["does not fit the model", "checkpoint (32,) vs model (48,)", "model.hidden_size 32 -> 48"]),
    ("eval", ["init.checkpoint={corrupt_config}"], ["checkpoints/2 cannot be read",
                                                    "config is corrupted"]),
    ("eval", ["init.checkpoint={corrupt_params}"], ["params is corrupted"]),
    ("eval", ["init.checkpoint={partial}"], ["is partial"]),
    ("eval", ["init.checkpoint=/no/such/run"], ["does not exist"]),
    ("eval", [], ["vmoe eval needs init.checkpoint"]),
    ("eval", ["init.checkpoint={vmoe}", "model.hidden_size=48"],
     ["does not fit its model", "model.* may change inference settings"]),
    ("fewshot", ["init.checkpoint={corrupt_config}"], ["config is corrupted"]),
    ("fewshot", ["init.checkpoint={corrupt_arrays}"], ["params is corrupted"]),
    ("fewshot", ["init.checkpoint=null"], ["vmoe fewshot needs init.checkpoint"]),
]


def _fill(args: list[str], runs: dict) -> list[str]:
  """'{name}' in an argument -> the path of that run."""
  out = []
  for arg in args:
    for name, path in runs.items():
      arg = arg.replace("{" + name + "}", str(path))
    out.append(arg)
  return out


@pytest.mark.parametrize("sub, args, expected", CHECKPOINT_CASES,
                         ids=lambda v: " ".join(v)[:50] if isinstance(v, list) else v)
def test_checkpoint_input(sub, args, expected, runs, run_cli, tmp_path):
  workdir = tmp_path / "w"
  extra = TRAIN if sub == "finetune" else LOGS
  _fails_clearly(run_cli(sub, f"workdir={workdir}", *extra, *_fill(args, runs)), *expected)
  _nothing_like_a_run(workdir)


# A stage never writes over its own input: its workdir is not an input run, holds none, lies in none.
OWN_INPUT_CASES = [
    ("compress", "{R}", "{R}", "is the run it reads", ["compress.experts=2"]),
    ("finetune", "{R}", "{tmp}", "holds the run it reads", TRAIN),
    ("eval", "{R}/checkpoints/2", "{R}", "is the run it reads", LOGS),
    ("fewshot", "[{R}]", "{R}/fewshot", "lies inside the run it reads", LOGS),
    ("ensemble", "[{R},{R2}]", "{R2}/ensemble", "lies inside the run it reads", LOGS),
    ("export", "{R}", "{R}/export", "lies inside the run it reads", LOGS),
]


@pytest.mark.parametrize("sub, given, workdir, how, extra", OWN_INPUT_CASES,
                         ids=[case[0] for case in OWN_INPUT_CASES])
def test_a_stage_never_writes_over_its_own_input(sub, given, workdir, how, extra, runs, run_cli,
                                                 tmp_path):
  """Refused before anything runs (exit 2, one paragraph), the input run left as it was."""
  for name in ("R", "R2"):
    shutil.copytree(runs["vmoe"], tmp_path / name)
  before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
  fill = lambda text: text.format(R=tmp_path / "R", R2=tmp_path / "R2", tmp=tmp_path)
  said = _fails_clearly(run_cli(sub, f"init.checkpoint={fill(given)}", f"workdir={fill(workdir)}",
                                *extra), f"workdir={fill(workdir)} {how}",
                        "Give this run a workdir of its own")
  assert f"workdir={tmp_path / 'R'}-next" in said or f"workdir={tmp_path}-next" in said or \
      f"workdir={tmp_path / 'R2'}-next" in said
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_resume_with_no_readable_checkpoint_refuses_and_moves_nothing(runs, run_cli, tmp_path):
  workdir = tmp_path / "rerun"
  shutil.copytree(runs["all_corrupt"], workdir)
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TINY_MODEL, *LOGS, "train.steps=2",
                         "schedule.warmup_steps=0",
                         "checkpoint.every_steps=1", "data.batch_size=16"),
                 "no checkpoint in", "step 2:", "step 1:", "does not start from scratch",
                 "mv ")
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
  assert not (workdir / "unreadable_checkpoints").exists()


def test_resume_with_another_optimizer_says_so_and_moves_nothing(runs, run_cli, tmp_path):
  """The run's checkpoints are whole: another optimizer's state is no reason to call them damaged
  (as Orbax's failed restore would have it), and none is moved aside."""
  workdir = tmp_path / "rerun"
  shutil.copytree(runs["vmoe"], workdir)
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, "train.steps=3", "optim=sgd"),
                 f"checkpoint {workdir / 'checkpoints' / '2'} holds the state of another "
                 "optimizer than this run's", "optim.* overrides of the run that wrote it")
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
  assert not (workdir / "unreadable_checkpoints").exists()


# --- eval and fewshot options --------------------------------------------------------------------

EVAL_CASES = [
    (["eval.ece_bins=0"], ["eval.ece_bins=0", ">= 1"]),
    (["eval.corruptions=[fog_machine]"], ["eval.corruptions", "'fog_machine'", "contrast",
                                          "or [all]"]),
    (["eval.corruptions=[contrast]", "eval.severities=[0,6]"], ["eval.severities=[0, 6]",
                                                                 "[1, 5]"]),
    (["eval.corruptions=[contrast]", "eval.severities=[]"], ["eval.severities is empty"]),
    (["eval.adversarial.epsilons=[8]"], ["eval.adversarial.epsilons=[8.0]", "[0, 1]",
                                         "pixel units"]),
    (["eval.adversarial.steps=0"], ["eval.adversarial.steps=0", ">= 1"]),
    (["eval.adversarial.step_size=0"], ["eval.adversarial.step_size=0", "> 0"]),
    (["eval.adversarial.protocol=madry"], ["eval.adversarial.protocol", "default", "reference"]),
    (["eval.adversarial.protocol=reference", "eval.adversarial.step_size=0.01"],
     ["eval.adversarial.step_size=0.01", "eval.adversarial.protocol=reference",
      "epsilon / eval.adversarial.steps"]),
    (["model.router.capacity_rounding=ceil"], ["model.router.capacity_rounding", "paper",
                                               "reference"]),
    (["eval.capacity_sweep=[0]"], ["eval.capacity_sweep=[0.0]", "> 0"]),
    (["eval.batch_size=12"], ["eval.batch_size=12", "group_size=8"]),
    (["eval.datasets=[uci_digits,uci_digits]"], ["eval.datasets", "twice"]),
    (["model.router.k=0"], ["model.router.k=0", ">= 1"]),
    (["model.router.k=9"], ["model.router.k=9", "1 <= k <= 8"]),
    (["model.router.capacity_ratio=-1"], ["model.router.capacity_ratio=-1", "> 0"]),
    # the routing analysis: MoE blocks, positive capacity ratios (vmoe runs: MoE on block 1 of 2)
    (["eval.routing_analysis=true", "eval.routing.layers=[0]"],
     ["eval.routing.layers=[0]", "without an MoE layer in model vmoe_tiny",
      "its MoE layers are blocks [1]", "eval.routing.layers=[] for all of them"]),
    (["eval.routing_analysis=true", "eval.routing.layers=[1,5]"],
     ["eval.routing.layers=[1, 5]", "([5])", "blocks [1]"]),
    (["eval.routing_analysis=true", "eval.routing.layers=[-1]"],
     ["eval.routing.layers=[-1]", ">= 0"]),
    (["eval.routing_analysis=true", "eval.routing.capacities=[0]"],
     ["eval.routing.capacities=[0.0]", "item 0.0", "must be > 0", "[1.0,0.5,0.1]"]),
    (["eval.routing_analysis=true", "eval.routing.capacities=[-0.5]"],
     ["eval.routing.capacities=[-0.5]", "item -0.5", "must be > 0"]),
    (["eval.routing_analysis=true", "eval.routing.capacities=[]"],
     ["eval.routing.capacities=[]", "non-empty"]),
    (["eval.routing_analysis=true", "eval.routing.images=-1"],
     ["eval.routing.images=-1", ">= 0"]),
]


@pytest.mark.parametrize("args, expected", EVAL_CASES, ids=lambda v: " ".join(v)[:60])
def test_eval_config_value(args, expected, runs, run_cli, tmp_path):
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("eval", f"workdir={workdir}", f"init.checkpoint={runs['vmoe']}", *LOGS,
                         *args), *expected)
  assert not workdir.exists()


@pytest.mark.parametrize("args, expected", [
    (["eval.capacity_sweep=[0.5]"], ["eval.capacity_sweep=[0.5] means nothing for "
                                     "model.router.type=soft",
                                     "model.router.type=token_choice|experts_choice"]),
    (["model.router.capacity_ratio=0.5"], ["model.router.capacity_ratio=0.5 differs from the "
                                           "checkpoint's 1.0", "model.router.type=soft",
                                           "fixed when the model is trained"]),
    (["model.router.eval_capacity_ratio=0.5"], ["model.router.eval_capacity_ratio=0.5",
                                                "means nothing for model.router.type=soft",
                                                "fixed when the model is trained"]),
    (["model.router.batch_priority=true"], ["model.router.batch_priority=true means nothing for "
                                            "model.router.type=soft"]),
    (["model=softmoe_tiny", *TINY_MODEL], None),  # the keys that trained it evaluate it
])
def test_eval_of_a_soft_moe(args, expected, runs, run_cli, tmp_path):
  workdir = tmp_path / "w"
  result = run_cli("eval", f"workdir={workdir}", f"init.checkpoint={runs['soft']}", *LOGS, *args)
  if expected is None:
    assert result[0] == 0, result[2]
    return
  _fails_clearly(result, *expected)
  assert not workdir.exists()


@pytest.mark.parametrize("args, expected", [
    (["eval.capacity_sweep=[0.5]"], ["eval.capacity_sweep=[0.5] needs a V-MoE checkpoint"]),
    (["model.router.k=1"], ["model.router.k=1 means nothing for a dense ViT",
                            "model.moe.layers=[]"]),  # as in training: the same keys, one meaning
    (["eval.routing_analysis=true"], ["eval.routing_analysis=true looks at what routers decide",
                                      "vit_tiny has no MoE layers",
                                      "analyse a V-MoE, experts-choice or Soft MoE checkpoint"]),
])
def test_eval_of_a_vit(args, expected, runs, run_cli, tmp_path):
  workdir = tmp_path / "w"
  result = run_cli("eval", f"workdir={workdir}", f"init.checkpoint={runs['vit']}", *LOGS, *args)
  if expected is None:
    assert result[0] == 0, result[2]
    return
  _fails_clearly(result, *expected)
  assert not workdir.exists()


@pytest.mark.parametrize("args, expected", [
    (["eval.datasets=[mnist5k,lfw_faces]"], ["'lfw_faces'", "2 classes", "predicts 10"]),
    (["eval.ood_datasets=[no_such_dataset]"], ["unknown dataset 'no_such_dataset'"]),
    (['eval.split="test[:0]"'], ["is empty"]),
])
def test_eval_data(args, expected, runs, run_cli, tmp_path):
  _fails_clearly(run_cli("eval", f"workdir={tmp_path}", f"init.checkpoint={runs['vmoe']}", *LOGS,
                         *args), *expected)
  _nothing_like_a_run(tmp_path)


FEWSHOT_CASES = [
    (["fewshot.shots=[]"], ["fewshot.shots=[]", "non-empty"]),
    (["fewshot.shots=[0,5]"], ["fewshot.shots=[0, 5]", ">= 1"]),
    (["fewshot.seeds=[]"], ["fewshot.seeds=[]", "non-empty"]),
    (["fewshot.l2_regs=[1,1e400]"], ["has the item inf, which must be finite and > 0"]),
    (["fewshot.seeds=[0,-1]"], ["fewshot.seeds=[0, -1] has the item -1", "[0, 4294967295]"]),
    (["fewshot.l2_regs=[1,0.5]"], ["fewshot.l2_regs", "strictly increasing"]),
    (["fewshot.l2_regs=[0,1]"], ["fewshot.l2_regs", "> 0"]),
    (["fewshot.datasets=[]"], ["fewshot.datasets is empty"]),
    (["fewshot.max_train_examples=0"], ["fewshot.max_train_examples=0", ">= 1"]),
    (["fewshot.protocol=ridge"], ["fewshot.protocol", "reference", "plain"]),
    (["fewshot.batch_size=12"], ["fewshot.batch_size=12", "group_size=8"]),
    (["model.router.k=9"], ["model.router.k=9"]),
]


@pytest.mark.parametrize("args, expected", FEWSHOT_CASES, ids=lambda v: " ".join(v)[:60])
def test_fewshot_config_value(args, expected, runs, run_cli, tmp_path):
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("fewshot", f"workdir={workdir}", f"init.checkpoint={runs['vmoe']}",
                         *LOGS, *args), *expected)
  assert not workdir.exists()


@pytest.mark.parametrize("args, expected", [
    (["fewshot.shots=[1000]"], ["class", "fewer than the 1000 shots"]),
    (["fewshot.datasets=[uci_digits:nosplit]"], ["no split 'nosplit'", "validation"]),
])
def test_fewshot_data(args, expected, runs, run_cli, tmp_path):
  _fails_clearly(run_cli("fewshot", f"workdir={tmp_path}", f"init.checkpoint={runs['vmoe']}",
                         *LOGS, *args), *expected)
  _nothing_like_a_run(tmp_path)


def test_a_damaged_checkpoint_ends_in_the_paragraph_alone(tmp_path):
  """When one array of a checkpoint cannot be read, Orbax abandons the concurrent reads of the
  others, and Python reports each abandoned coroutine as it collects it (dozens of tracebacks
  after the message, for arrays of vmoe_tiny's width). The stages say the paragraph alone."""
  from runner import cli
  run = tmp_path / "run"
  assert cli.main(["pretrain", f"workdir={run}", "model.num_layers=2", "model.image_size=16",
                   *LOGS, "logger.wandb.mode=disabled", "train.steps=1",
                   "schedule.warmup_steps=0", "data.batch_size=16"]) == 0
  for chunk in (run / "checkpoints" / "1" / "params").glob("ocdbt.process_*/d/*"):
    chunk.unlink()
  for sub in ("eval", "export"):
    proc = subprocess.run([sys.executable, "-m", "runner.cli", sub, f"init.checkpoint={run}",
                           f"workdir={tmp_path / sub}", "logger.wandb.mode=disabled"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[:3000]
    assert f"checkpoint {run}/checkpoints/1 cannot be read" in proc.stderr
    assert not (tmp_path / sub).exists()


# --- the installed entry point -----------------------------------------------------------------

def test_console_script_exit_code_and_message():
  """The installed `vmoe` executable itself: non-zero exit, the paragraph, no traceback."""
  exe = os.path.join(os.path.dirname(sys.executable), "vmoe")
  proc = subprocess.run([exe, "pretrain", "model=vmoe_nope"], capture_output=True, text=True,
                        env=dict(os.environ), timeout=300)
  assert proc.returncode == 2
  assert "unknown model 'vmoe_nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_subcommands_and_config(run_cli):
  code, out, _ = run_cli("--help")
  assert code == 0
  for sub in ("pretrain", "finetune", "fewshot", "eval"):
    assert f"  {sub} " in out
  code, out, _ = run_cli("pretrain", "--help")
  assert code == 0 and "model: " in out and "vmoe_tiny" in out and "optim: " in out
  names = out.split("== Registered names (built-in and from plugins=[...]) ==")[1]
  assert "model.router.type: token_choice, experts_choice, soft" in names
  assert "schedule.name: constant, linear, cosine, rsqrt" in names
  code, out, _ = run_cli("pretrain", "--cfg", "job", "model=vit_s32")
  assert code == 0
  assert "hidden_size: 512" in out and "patch_size: 32" in out and "num_layers: 8" in out


# --- ensembles: partitioned batch ensembles (pBE) and vmoe ensemble ------------------------------

ENSEMBLE_MODEL_CASES = [
    (["model.moe.ensemble_size=3"], ["model.moe.ensemble_size=3", "does not divide",
                                     "model.moe.num_experts=8", "divisor of 8"]),
    (["model=vmoe_tiny_k3_m4"], ["model.router.k=3", "model.moe.ensemble_size=4",
                                 "1 <= k <= 2"]),
    (["model=vit_tiny", "model.moe.ensemble_size=2"], ["model.moe.ensemble_size=2",
                                                        "needs MoE layers", "vit_tiny"]),
    (["model.moe.ensemble_variant=tiling_only"], ["model.moe.ensemble_variant=tiling_only",
                                                  "ensemble_size >= 2"]),
    (["model.moe.ensemble_size=0"], ["model.moe.ensemble_size=0", ">= 1"]),
    (["model.moe.ensemble_variant=nope"], ["model.moe.ensemble_variant", "pbe", "tiling_only",
                                           "partition_only"]),
]


@pytest.mark.parametrize("args, expected", ENSEMBLE_MODEL_CASES, ids=lambda v: " ".join(v)[:60])
def test_ensemble_model_config_value(args, expected, run_cli, tmp_path):
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, *args), *expected)
  assert not workdir.exists()


@pytest.fixture(scope="module")
def ensemble_runs(runs, tmp_path_factory):
  """`runs` plus a pBE (vmoe_tiny_k1_m2 at 8x8 pixels, so its preprocessing differs from the
  16x16 runs) and a V-MoE fine-tuned on digits 0-4 (5 classes, expert dropout 0.1)."""
  from runner import cli
  root = tmp_path_factory.mktemp("ensemble_runs")
  quiet = ["logger.wandb.mode=disabled", "logger.progress=false", "train.steps=1",
           "schedule.warmup_steps=0",
           "data.batch_size=16"]
  assert cli.main(["pretrain", f"workdir={root / 'pbe8'}", "model=vmoe_tiny_k1_m2", *TINY_MODEL,
                   "model.image_size=8", *quiet]) == 0
  assert cli.main(["finetune", f"workdir={root / 'digits04'}", f"init.checkpoint={runs['vmoe']}",
                   *TINY_MODEL, "data.name=uci_digits_0to4", *quiet]) == 0
  return {**runs, "pbe8": root / "pbe8", "digits04": root / "digits04"}


# (subcommand, arguments, expected substrings, whether the config alone is at fault: then the
# workdir must not exist; otherwise no checkpoint, W&B run or summary may exist in it)
ENSEMBLE_CASES = [
    ("ensemble", ["init.checkpoint={vmoe}"], ["names one member", "not an ensemble",
                                              "ensemble.mc_dropout=<M>"], True),
    ("ensemble", ["init.checkpoint=[{vmoe}]"], ["names one member"], True),
    ("ensemble", [], ["vmoe ensemble needs init.checkpoint"], True),
    ("ensemble", ["init.checkpoint=[{vmoe},{vmoe}]"], ["names a checkpoint twice"], True),
    ("ensemble", ["init.checkpoint=[{vmoe},{digits04}]"],
     ["same classes", "{vmoe}: 10 classes", "{digits04}: 5 classes"], False),
    ("ensemble", ["init.checkpoint=[{vmoe},{pbe8}]"],
     ["preprocess images differently", "{vmoe}", "resize(16)", "{pbe8}", "resize(8)"], True),
    ("ensemble", ["init.checkpoint={digits04}", "ensemble.mc_dropout=1"],
     ["ensemble.mc_dropout=1", "one sample", "2 or more"], True),
    ("ensemble", ["init.checkpoint=[{vmoe},{vit}]", "ensemble.mc_dropout=2"],
     ["ensemble.mc_dropout=2", "samples one checkpoint", "names 2"], True),
    ("ensemble", ["init.checkpoint={vmoe}", "ensemble.mc_dropout=2"],
     ["ensemble.mc_dropout needs a model with dropout", "{vmoe}", "model.moe.expert_dropout"],
     True),
    ("ensemble", ["init.checkpoint={digits04}", "ensemble.mc_dropout=-1"],
     ["ensemble.mc_dropout=-1", ">= 0"], True),
    ("ensemble", ["init.checkpoint={pbe8}", "model.moe.ensemble_size=4"],
     ["model.moe.ensemble_size=4", "checkpoint's 2", "init.repartition_experts"], True),
    ("eval", ["init.checkpoint={pbe8}", "model.moe.ensemble_size=4"],
     ["model.moe.ensemble_size=4", "checkpoint's 2", "init.repartition_experts"], True),
    ("eval", ["init.checkpoint={pbe8}", "model.moe.ensemble_variant=tiling_only"],
     ["model.moe.ensemble_variant=tiling_only", "checkpoint's pbe"], True),
    ("eval", ["init.checkpoint={vmoe}", "model.moe.ensemble_size=2"],
     ["model.moe.ensemble_size=2", "checkpoint's 1"], True),
    ("finetune", ["init.checkpoint={pbe8}"],
     ["is a partitioned batch ensemble of 2 members", "model.moe.ensemble_size=1",
      "init.repartition_experts=true"], False),
]


@pytest.mark.parametrize("sub, args, expected, config_only", ENSEMBLE_CASES,
                         ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else str(v))
def test_ensemble_input(sub, args, expected, config_only, ensemble_runs, run_cli, tmp_path):
  workdir = tmp_path / "w"
  extra = TRAIN if sub == "finetune" else LOGS
  expected = _fill(expected, ensemble_runs)
  _fails_clearly(run_cli(sub, f"workdir={workdir}", *extra, *_fill(args, ensemble_runs)),
                 *expected)
  if config_only:
    assert not workdir.exists()  # validated before Hydra created anything
  else:
    _nothing_like_a_run(workdir)


# --- heteroscedastic heads and label noise -------------------------------------------------------

HEAD_CASES = [
    (["model.head.type=nope"], ["model.head.type", "'nope'", "det", "het", "het_xl"]),
    (["model.head.type=het", "model.head.num_factors=0"], ["model.head.num_factors=0", ">= 1"]),
    (["model.head.type=het_xl", "model.head.train_mc_samples=0"],
     ["model.head.train_mc_samples=0", ">= 1"]),
    (["model.head.type=het_xl", "model.head.eval_mc_samples=-1"],
     ["model.head.eval_mc_samples=-1", ">= 1"]),
    (["model.head.type=het", "model.head.mc_chunk_size=0"], ["model.head.mc_chunk_size=0", ">= 1"]),
    (["model.head.type=het", "model.head.temperature=9"],
     ["model.head.temperature=9.0", "model.head.temperature_bounds=[0.05, 5.0]",
      "model.head.temperature=null"]),
    (["model.head.type=het_xl", "model.head.temperature=9"], ["model.head.temperature=9.0",
                                                               "[0.05, 5]"]),
    (["model.head.type=het", "model.head.temperature=0"], ["model.head.temperature=0.0", "> 0"]),
    (["model.head.temperature=1.5"], ["model.head.temperature=1.5", "model.head.type=det",
                                      "het or het_xl"]),
    (["model.head.type=het_xl", "model.head.temperature_bounds=[5,0.05]"],
     ["model.head.temperature_bounds=[5.0, 0.05]", "0 < low < high"]),
    (["model.head.type=het_xl", "model.head.latent_dim=7"],
     ["model.head.latent_dim=7", "width 32", "model.head.latent_dim=32 or null"]),
    (["data.label_noise=1.5"], ["data.label_noise=1.5", "[0, 1]"]),
    (["data.label_noise=-0.1"], ["data.label_noise=-0.1", "[0, 1]"]),
    # several problems are reported together
    (["model.head.type=het", "model.head.num_factors=0", "model.head.train_mc_samples=0"],
     ["2 problems", "model.head.num_factors=0", "model.head.train_mc_samples=0"]),
]


@pytest.mark.parametrize("args, expected", HEAD_CASES, ids=lambda v: " ".join(v)[:60])
def test_head_config_value(args, expected, run_cli, tmp_path):
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, *args), *expected)
  assert not workdir.exists()  # validated before Hydra created anything


@pytest.fixture(scope="module")
def het_run(tmp_path_factory):
  """A tiny V-MoE with a HET-XL head (1 step)."""
  from runner import cli
  root = tmp_path_factory.mktemp("het_run")
  assert cli.main(["pretrain", f"workdir={root / 'het_xl'}", *TINY_MODEL,
                   "logger.wandb.mode=disabled", "logger.progress=false", "train.steps=1",
                   "schedule.warmup_steps=0",
                   "data.batch_size=16",
                   "model.head.type=het_xl", "model.head.train_mc_samples=4",
                   "model.head.eval_mc_samples=4"]) == 0
  return root / "het_xl"


@pytest.mark.parametrize("sub, args, expected, config_only", [
    ("eval", ["model.head.eval_mc_samples=0"], ["model.head.eval_mc_samples=0", ">= 1"], True),
    ("eval", ["model.head.type=det"], ["does not fit its model", "head/kernel",
                                        "not the architecture"], False),
    ("eval", ["model.head.num_factors=3"], ["does not fit its model",
                                            "head/scale_layer_homoscedastic/kernel"], False),
    ("finetune", ["model.head.type=het", "init.reinit_head=false"],
     ["does not fit the model", "head/diag_layer/kernel", "init.reinit_head=true"], False),
], ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else str(v))
def test_a_het_checkpoint_with_another_head(sub, args, expected, config_only, het_run, run_cli,
                                            tmp_path):
  workdir = tmp_path / "w"
  extra = TRAIN if sub == "finetune" else LOGS
  _fails_clearly(run_cli(sub, f"workdir={workdir}", f"init.checkpoint={het_run}", *extra, *args),
                 *expected)
  if config_only:
    assert not workdir.exists()
  else:
    _nothing_like_a_run(workdir)


# --- contrastive image-text training (objective=contrastive) -------------------------------------

CONTRASTIVE = ["objective=contrastive", *TINY_TEXT]

CONTRASTIVE_CONFIG_CASES = [
    (["model.head.type=het"], ["model.head.type=het means nothing for objective=contrastive",
                               "det", "het_xl"]),
    (["model.head.type=het_xl", "objective.loss=sigmoid"],
     ["model.head.type=het_xl with objective.loss=sigmoid", "softmax loss", "Eq. 8",
      "objective.loss=softmax"]),
    (["objective.loss=hinge"], ["objective.loss", "softmax", "sigmoid"]),
    (["text.tokenizer.kind=wordpiece"], ["text.tokenizer.kind", "bytes", "sentencepiece",
                                         "train"]),
    (["objective.temperature_init=0"], ["objective.temperature_init=0", "> 0"]),
]


@pytest.mark.parametrize("args, expected", CONTRASTIVE_CONFIG_CASES,
                         ids=lambda v: " ".join(v)[:60])
def test_contrastive_config_value(args, expected, run_cli, tmp_path):
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, *CONTRASTIVE, *args),
                 *expected)
  assert not workdir.exists()  # validated before Hydra created anything


def _caption_file(folder: pathlib.Path, rows: list[str]) -> pathlib.Path:
  """captions.jsonl in `folder` with these rows; a.png, b.png and c.png exist beside it."""
  for name in ("a", "b", "c"):
    _png(folder / f"{name}.png")
  path = folder / "captions.jsonl"
  path.write_text("\n".join(rows) + "\n")
  return path


GOOD_ROWS = ['{"image": "a.png", "caption": "a blue square"}',
             '{"image": "b.png", "caption": "another blue square"}',
             '{"image": "c.png", "caption": "a third one", "split": "validation"}']


def _no_run_at_all(workdir: pathlib.Path) -> None:
  """Nothing a rerun could mistake for a run or reuse: no checkpoint, W&B run, summary, metrics,
  nor a trained tokenizer."""
  _nothing_like_a_run(workdir)
  assert not (workdir / "tokenizer.model").exists()


@pytest.mark.parametrize("args, expected", [
    (["objective=contrastive", "data=mnist5k"],
     ["objective=contrastive trains on image-caption pairs", "data=mnist5k has no captions",
      "data=mnist5k_captions"]),
    (["data=captions", "data.root={good}"],
     ["data=captions holds image-caption pairs without class labels", "objective=contrastive"]),
    (["objective=contrastive", "data=captions", "data.root={missing_image}"],
     ["has 1 problem", "1 missing image file (line 2: gone.png)", "data.skip_unreadable=true"]),
    (["objective=contrastive", "data=captions", "data.root={empty_caption}"],
     ["has 1 problem", "1 row with an empty or missing caption (line 2)", "non-empty `caption`"]),
    (["objective=contrastive", "text.tokenizer.kind=sentencepiece"],
     ["text.tokenizer.kind=sentencepiece needs text.tokenizer.path=<file>",
      "text.tokenizer.kind=bytes"]),
    (["objective=contrastive", "text.tokenizer.kind=sentencepiece",
      "text.tokenizer.path=/no/such/spm.model"],
     ["text.tokenizer.path='/no/such/spm.model' does not exist", "SentencePiece model file"]),
    (["objective=contrastive", "text.tokenizer.kind=sentencepiece",
      "text.tokenizer.path={corrupt_model}"],
     ["is not a SentencePiece model", "spm_train"]),
], ids=lambda v: " ".join(v)[:70])
def test_contrastive_data_and_tokenizer(args, expected, run_cli, tmp_path):
  files = {"good": _caption_file(tmp_path / "good", GOOD_ROWS),
           "missing_image": _caption_file(tmp_path / "missing", [
               GOOD_ROWS[0], '{"image": "gone.png", "caption": "missing"}', *GOOD_ROWS[1:]]),
           "empty_caption": _caption_file(tmp_path / "empty", [
               GOOD_ROWS[0], '{"image": "b.png", "caption": "  "}', *GOOD_ROWS[1:]]),
           "corrupt_model": tmp_path / "spm.model"}
  files["corrupt_model"].write_bytes(os.urandom(512))
  workdir = tmp_path / "w"
  text_args = CONTRASTIVE[1:] if "objective=contrastive" in args else []
  err = _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, *text_args,
                               *_fill(args, files)), *_fill(expected, files))
  for name in ("missing_image", "empty_caption"):
    if f"{{{name}}}" in " ".join(args):
      assert str(files[name]) in err
  _no_run_at_all(workdir)


def test_contrastive_from_an_image_checkpoint_that_does_not_fit(runs, run_cli, tmp_path):
  """LiT from an image model of another width: the checkpoint's and the model's shapes named.
  With a tokenizer trained on the captions (text.tokenizer.kind=train), no tokenizer is left in
  the workdir either: a rerun there would take it as its own, whatever its vocabulary size."""
  workdir = tmp_path / "w"
  _fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, *CONTRASTIVE,
                         "text.tokenizer.kind=train", "text.tokenizer.vocab_size=64",
                         f"init.checkpoint={runs['vmoe']}", "model.hidden_size=48"),
                 f"the image checkpoint {runs['vmoe']}", "does not fit the model",
                 "checkpoint (32,) vs model (48,)")
  _no_run_at_all(workdir)


@pytest.mark.parametrize("argv, code", [([], 0), (["--help"], 0), (["nosuch"], 2)])
def test_help_and_an_unknown_subcommand_load_no_library(argv, code):
  """Answered from the subcommand table alone, in a fresh process: no JAX, TensorFlow or Hydra
  (each seconds to import) and no restart with jemalloc (`entry`)."""
  check = ("import sys; from runner import cli; sys.argv = ['vmoe', *sys.argv[1:]]\n"
           "try:\n  cli.entry()\nexcept SystemExit as e:\n  code = e.code\n"
           "loaded = [m for m in ('jax', 'tensorflow', 'hydra', 'omegaconf', 'flax') "
           "if m in sys.modules]\n"
           "print('loaded:', loaded, 'code:', code)")
  proc = subprocess.run([sys.executable, "-c", check, *argv], capture_output=True, text=True,
                        env=dict(os.environ), timeout=60)
  assert proc.stdout.strip().endswith(f"loaded: [] code: {code}"), proc.stdout + proc.stderr


def test_a_bad_value_or_dataset_is_refused_without_loading_tensorflow():
  """The schema's checks need the data ops' and datasets' names, and a dataset's name or folder is
  checked, without TensorFlow (seconds to import): it loads when data is first read
  (runner/data/tensorflow_on_use.py). Four commands in one fresh process."""
  check = ("import sys; from runner import cli\n"
           "for args in (['model.router.k=0'], ['data.name=nope'],\n"
           "             ['data.name=image_folder', 'data.root=/no/such'],\n"
           "             ['data.name=cifar10', 'data.data_dir=/no/such']):\n"
           "  try:\n    code = cli.main(['pretrain', *args])\n"
           "  except SystemExit as e:\n    code = e.code\n"
           "  print('code:', code, 'tensorflow loaded:', 'tensorflow' in sys.modules)")
  proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                        env=dict(os.environ), timeout=120)
  said = [line for line in proc.stdout.splitlines() if line.startswith("code:")]
  assert said == ["code: 2 tensorflow loaded: False"] * 4, proc.stdout + proc.stderr
  for message in ("model.router.k=0 must be >= 1", "unknown dataset 'nope'",
                  "data.root='/no/such' must contain a train/ folder",
                  "TFDS dataset 'cifar10' is not prepared under data_dir '/no/such'"):
    assert message in proc.stderr, (message, proc.stderr)
