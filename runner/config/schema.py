"""Typed schemas of every config, registered in Hydra's ConfigStore.

A key that is not here fails at composition ("Key 'lrr' is not in struct"); a value of the wrong
type or outside an Enum fails with the valid choices. Config keys are the constructor argument
names of the library objects they configure.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


class Loss(enum.Enum):
  softmax_xent = "softmax_xent"
  sigmoid_xent = "sigmoid_xent"


class OptimizerName(enum.Enum):
  adam = "adam"
  sgd = "sgd"
  adafactor = "adafactor"


class ScheduleName(enum.Enum):
  constant = "constant"
  linear = "linear"
  cosine = "cosine"
  rsqrt = "rsqrt"


class Classifier(enum.Enum):
  token = "token"
  gap = "gap"
  map = "map"


class Priority(enum.Enum):
  max = "max"
  sum = "sum"


class Dispatcher(enum.Enum):
  indices = "indices"
  einsum = "einsum"


class WandbMode(enum.Enum):
  online = "online"
  offline = "offline"
  disabled = "disabled"


class DType(enum.Enum):
  float32 = "float32"
  bfloat16 = "bfloat16"
  float16 = "float16"


@dataclass
class RouterConfig:
  k: int = 2
  capacity_ratio: float = 1.05
  eval_capacity_ratio: Optional[float] = None  # None: same as capacity_ratio
  batch_priority: bool = False
  priority: Priority = Priority.max
  noise_std: float = 1.0  # multiplied by 1/E, as in the paper


@dataclass
class MoeConfig:
  layers: Any = field(default_factory=list)  # "every2", "last2" or a list of block indices
  num_experts: int = 0
  group_size: int = 8  # images per routing group
  expert_dropout: float = 0.0
  dispatcher: Dispatcher = Dispatcher.indices


@dataclass
class ModelConfig:
  name: str = MISSING
  image_size: int = 224
  patch_size: int = 16
  hidden_size: int = 768
  num_layers: int = 12
  mlp_dim: int = 3072
  num_heads: int = 12
  classifier: Classifier = Classifier.token
  representation_size: Optional[int] = None
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  head_bias_init: float = 0.0
  dtype: DType = DType.float32  # compute dtype; parameters and the router stay float32
  moe: MoeConfig = field(default_factory=MoeConfig)
  router: RouterConfig = field(default_factory=RouterConfig)


@dataclass
class DataConfig:
  name: str = MISSING
  split: str = "train"
  eval_split: str = "validation"  # a held-out slice of `split` when the dataset has none
  test_split: Optional[str] = "test"
  holdout_fraction: float = 0.02
  data_dir: Optional[str] = None  # default: $TFDS_DATA_DIR or ~/tensorflow_datasets
  root: Optional[str] = None  # for data=image_folder
  pp_train: str = "decode(3)|resize(224)|value_range(-1,1)"
  pp: str = "decode(3)|resize(224)|value_range(-1,1)"
  batch_size: int = 128
  eval_batch_size: Optional[int] = None  # None: batch_size
  shuffle_buffer: int = 50_000
  image_key: str = "image"
  label_key: str = "label"


@dataclass
class OptimConfig:
  name: OptimizerName = OptimizerName.adam
  lr: float = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  momentum: float = 0.9
  nesterov: bool = False
  # A float for every parameter, or a list of [regex, value] pairs matched against
  # "block_1/moe/experts/fc1_kernel"-style names (first match wins, unmatched: no decay).
  weight_decay: Any = 0.0
  grad_clip_norm: Optional[float] = 1.0


@dataclass
class ScheduleConfig:
  name: ScheduleName = ScheduleName.linear
  warmup_steps: int = 0
  end_lr_fraction: float = 0.0  # linear/cosine decay to lr * end_lr_fraction
  timescale: Optional[int] = None  # rsqrt: default warmup_steps (or 10_000)
  cooldown_steps: int = 0  # rsqrt: final linear cooldown to zero


@dataclass
class TrainConfig:
  steps: Optional[int] = None
  epochs: Optional[float] = None  # used when steps is None
  loss: Loss = Loss.softmax_xent
  aux_loss_weight: float = 0.01  # lambda of Appendix A.2
  accum_steps: int = 1  # micro-batches per step (gradient accumulation)
  log_every_steps: int = 50


@dataclass
class EvalConfig:
  every_steps: int = 0  # 0: only at the end
  batch_size: Optional[int] = None


@dataclass
class AdversarialConfig:
  epsilons: list = field(default_factory=list)  # L-inf radii in [0, 1] pixel units, e.g. [0.001, 0.003]
  steps: int = 40  # PGD steps
  step_size: Optional[float] = None  # None: 2.5 * epsilon / steps (Madry et al.)
  max_examples: Optional[int] = 512  # attacks cost steps x backward passes: a subset by default


@dataclass
class EvalSuiteConfig:
  """vmoe eval: which measurements to take, on which datasets."""
  batch_size: Optional[int] = None
  datasets: list = field(default_factory=list)  # [] : the checkpoint's own dataset
  split: Optional[str] = None  # None: each dataset's test split (else its eval split)
  ood_datasets: list = field(default_factory=list)  # each vs the first in-distribution dataset
  ece_bins: int = 15
  corruptions: list = field(default_factory=list)  # names from runner/data/corruptions.py, or [all]
  severities: list = field(default_factory=lambda: [1, 2, 3, 4, 5])
  adversarial: AdversarialConfig = field(default_factory=AdversarialConfig)
  capacity_sweep: list = field(default_factory=list)  # inference C values, vanilla vs BPR
  save_predictions: bool = False
  plots: bool = True


@dataclass
class FewshotConfig:
  """Linear few-shot evaluation on frozen pre-logits (`vmoe fewshot`, or every N steps in training)."""
  datasets: list = field(default_factory=list)
  shots: list = field(default_factory=lambda: [1, 5, 10, 25])
  seeds: list = field(default_factory=lambda: [0, 1, 2])
  l2_regs: Optional[list] = None  # None: 2^-10 ... 2^19
  train_split: str = "train"
  test_split: Optional[str] = None  # None: each dataset's test split (else its eval split)
  max_train_examples: Optional[int] = None  # cap on the pool the shots are drawn from
  batch_size: Optional[int] = None
  every_steps: int = 0  # training only: 0 = never during training


@dataclass
class CheckpointConfig:
  every_steps: int = 500
  keep: int = 2
  async_save: bool = True


@dataclass
class InitConfig:
  checkpoint: Optional[str] = None  # a workdir or a checkpoint dir written by an earlier stage
  reinit_head: bool = True  # fine-tuning: a new zero-initialised head
  dense_to_experts: bool = False  # fine-tuning a V-MoE from a dense ViT: copy its MLPs into experts


@dataclass
class WandbConfig:
  mode: WandbMode = WandbMode.offline
  project: str = "vmoe"
  entity: Optional[str] = None
  name: Optional[str] = None
  tags: list = field(default_factory=list)


@dataclass
class LoggerConfig:
  wandb: WandbConfig = field(default_factory=WandbConfig)
  progress: bool = True


@dataclass
class MeshConfig:
  data: int = -1  # devices along the data axis; -1: all the others
  expert: int = 1  # devices along the expert axis; -1: the most that divide the experts


@dataclass
class ShardingConfig:
  name: str = "dp"  # dp | ep | fsdp_ep: a bundle of logical-axis rules (runner/parallel/mesh.py)
  rules: Optional[list] = None  # explicit [[logical axis, mesh axis], ...] instead of the bundle


@dataclass
class DistributedConfig:
  coordinator_address: Optional[str] = None  # host:port of process 0
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  auto: bool = True  # join a job JAX detects from the environment (SLURM, TPU VMs, ...)
  timeout_seconds: int = 300


@dataclass
class TrainTask:
  """pretrain and finetune."""
  seed: int = 0
  workdir: str = MISSING
  debug: bool = False
  model: ModelConfig = MISSING
  data: DataConfig = MISSING
  optim: OptimConfig = field(default_factory=OptimConfig)
  schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  eval: EvalConfig = field(default_factory=EvalConfig)
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
  init: InitConfig = field(default_factory=InitConfig)
  fewshot: FewshotConfig = field(default_factory=FewshotConfig)
  logger: LoggerConfig = field(default_factory=LoggerConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  sharding: ShardingConfig = field(default_factory=ShardingConfig)
  distributed: DistributedConfig = field(default_factory=DistributedConfig)


def optional_copy(cls, prefix: str = "Optional"):
  """The same dataclass with every field optional and None by default: "unchanged" overrides."""
  fields = []
  for f in dataclasses.fields(cls):
    ftype = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # noqa: S307
    if dataclasses.is_dataclass(ftype):
      sub = optional_copy(ftype, prefix)
      fields.append((f.name, sub, field(default_factory=sub)))
    else:
      fields.append((f.name, Optional[ftype], field(default=None)))
  return dataclasses.make_dataclass(prefix + cls.__name__, fields)


ModelOverrides = optional_copy(ModelConfig)
DataOverrides = optional_copy(DataConfig)


@dataclass
class EvalTask:
  """eval: the model and data come from the checkpoint; keys set here override them."""
  seed: int = 0
  workdir: str = MISSING
  debug: bool = False
  init: InitConfig = field(default_factory=InitConfig)
  model: ModelOverrides = field(default_factory=ModelOverrides)
  data: DataOverrides = field(default_factory=DataOverrides)
  eval: EvalSuiteConfig = field(default_factory=EvalSuiteConfig)
  logger: LoggerConfig = field(default_factory=LoggerConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  sharding: ShardingConfig = field(default_factory=ShardingConfig)
  distributed: DistributedConfig = field(default_factory=DistributedConfig)


@dataclass
class FewshotInitConfig:
  checkpoint: Any = None  # one workdir, or a list of them: their pre-logits are concatenated


@dataclass
class FewshotTask:
  """fewshot: frozen features of one or more checkpoints, ridge classifiers per dataset and shots."""
  seed: int = 0
  workdir: str = MISSING
  debug: bool = False
  init: FewshotInitConfig = field(default_factory=FewshotInitConfig)
  model: ModelOverrides = field(default_factory=ModelOverrides)
  fewshot: FewshotConfig = field(default_factory=FewshotConfig)
  logger: LoggerConfig = field(default_factory=LoggerConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  sharding: ShardingConfig = field(default_factory=ShardingConfig)
  distributed: DistributedConfig = field(default_factory=DistributedConfig)


TASK_SCHEMAS = {"pretrain": TrainTask, "finetune": TrainTask, "fewshot": FewshotTask,
                "eval": EvalTask}
