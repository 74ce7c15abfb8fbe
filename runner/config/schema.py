"""Typed schemas of every config: each key's type, default, valid range and hint, in one place.

Hydra composes conf/ against these dataclasses, so an unknown key or a wrong type fails at
composition. This module imports no Hydra, no OmegaConf and no library code at import time: the library, and
the compute path on an accelerator image without them, may use these types.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

from runner.config import preprocessing, registries, sections
from runner.config.checks import (Check, Choice, Items, Range, Rule, at_least, key, matches, positive,
                                  probability, rate)
from runner.config.mesh import MESH_AXES, RULES

# A mandatory key with no value: OmegaConf's own marker (omegaconf.MISSING is this string), kept
# here so that the models and the train step, which use these types, import without OmegaConf.
MISSING = "???"


class Loss(enum.StrEnum):
  softmax_xent = "softmax_xent"
  sigmoid_xent = "sigmoid_xent"


class Classifier(enum.StrEnum):
  token = "token"
  gap = "gap"
  map = "map"


class Dispatcher(enum.StrEnum):
  indices = "indices"
  einsum = "einsum"


class GroupedMatmul(enum.StrEnum):
  """How dropless routing's experts run their rows (runner/models/moe/grouped_matmul.py)."""
  auto = "auto"  # the method measured to be a grouped kernel on the backend: blocks, today
  blocks = "blocks"  # every expert's rows padded to blocks, one batched matmul
  ragged_dot = "ragged_dot"  # jax.lax.ragged_dot, dense over every expert in XLA (jaxlib 0.10)
  pallas = "pallas"  # vmoe's own grouped-matmul kernel in Pallas (Triton), NVIDIA GPUs
  cudnn = "cudnn"  # ragged_dot compiled with XLA's cuDNN grouped-matmul fusion (bfloat16, GPU)


class EnsembleVariant(enum.StrEnum):
  """Partitioned batch ensembles and the two ablations of the E³ paper's Table 3."""
  pbe = "pbe"  # tiled representations, experts partitioned between the members
  tiling_only = "tiling_only"  # tiled representations, one router over all experts
  partition_only = "partition_only"  # no tiling: each token picks k experts in every partition


class HeadType(enum.StrEnum):
  """The classifier head: deterministic, or heteroscedastic (Collier et al., HET-XL paper)."""
  det = "det"  # a linear classifier
  het = "het"  # Gaussian noise on the logits, MC-averaged probabilities
  het_xl = "het_xl"  # Gaussian noise on the pre-logits, through the shared linear classifier


class FewshotProtocol(enum.StrEnum):
  """How the few-shot ridge sees the features (runner/evaluators/fewshot_math.py)."""
  reference = "reference"  # standardised by the shots' mean and std, bias feature 100 (vmoe)
  plain = "plain"  # raw features, a bias column of ones


class Objective(enum.StrEnum):
  """What a training stage learns (runner/training/run.py)."""
  classification = "classification"  # images -> labels (a ViT / V-MoE classifier)
  contrastive = "contrastive"  # image-text pairs -> aligned embeddings (two towers, LiT)


class CompressMethod(enum.StrEnum):
  """How `vmoe compress` chooses the experts it keeps (runner/models/compression.py)."""
  prune = "prune"  # the subset whose layer output is nearest the whole layer's (Lu et al. 2024)
  prune_frequency = "prune_frequency"  # the experts a calibration set chooses most
  merge = "merge"  # cluster experts by their outputs, average each cluster (HC-SMoE)


SEED = Range(0, 2**32 - 1)  # what NumPy, TensorFlow and JAX all take as a seed

# `compress.method=prune` measures every subset of experts it could keep, per MoE layer, at most.
PRUNE_SUBSETS_MAX = 5000


class ContrastiveLoss(enum.StrEnum):
  softmax = "softmax"  # symmetric cross-entropy over the batch (CLIP, LiT, HET-XL's Eq. 6)
  sigmoid = "sigmoid"  # one binary term per pair (SigLIP)


class TokenizerKind(enum.StrEnum):
  bytes = "bytes"  # UTF-8 bytes: nothing to train or download
  sentencepiece = "sentencepiece"  # a SentencePiece model file the user gives (text.tokenizer.path)
  train = "train"  # a SentencePiece model trained by vmoe on the training captions


class TextPool(enum.StrEnum):
  last = "last"  # the end-of-text token's representation (CLIP, LiT)
  mean = "mean"  # the mean over the caption's tokens
  first = "first"


class Tower(enum.StrEnum):
  image = "image"


class WandbMode(enum.StrEnum):
  online = "online"
  offline = "offline"
  disabled = "disabled"


class DType(enum.StrEnum):
  float32 = "float32"
  bfloat16 = "bfloat16"
  float16 = "float16"


class Attention(enum.StrEnum):
  auto = "auto"
  xla = "xla"
  cudnn = "cudnn"


class Activation(enum.StrEnum):
  """The MLPs' nonlinearity (model.activation; null: gelu_tanh, vmoe's own models')."""
  gelu_tanh = "gelu_tanh"  # GELU by its tanh approximation: Flax's nn.gelu, big_vision's ViTs
  gelu = "gelu"  # exact GELU (erf): timm's and transformers' ViTs
  quick_gelu = "quick_gelu"  # x * sigmoid(1.702 x): OpenAI's CLIP


class Preprocessing(Check):
  """A `|`-separated preprocessing spec whose ops are all registered (runner/data/pp_ops.py)."""

  def __call__(self, value):
    try:
      preprocessing.build(value)
    except preprocessing.PreprocessError as e:
      return f"is not a valid preprocessing spec: {e}"
    return None


def _is_moe_layers(value) -> bool:
  if isinstance(value, str):
    return re.fullmatch(r"(every|last)[1-9]\d*", value) is not None
  indices = isinstance(value, (list, tuple)) and all(
      isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
  return indices and len(set(value)) == len(value)


def _is_weight_decay(value) -> bool:
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return 0 <= value < float("inf")
  if not isinstance(value, (list, tuple)):
    return False
  for rule in value:
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
            and isinstance(rule[1], (int, float)) and 0 <= rule[1] < float("inf")):
      return False
    re.compile(rule[0])  # a bad pattern raises: the check reports it as invalid
  return True


def _is_sharding_rules(value) -> bool:
  def axes_ok(axes):
    axes = [axes] if isinstance(axes, str) or axes is None else axes
    return all(a is None or a in MESH_AXES for a in axes)
  return isinstance(value, (list, tuple)) and all(
      isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], str) and axes_ok(r[1])
      for r in value)


_DEVICES = Rule(lambda v: v == -1 or v >= 1, "-1 (infer from the device count) or >= 1")


DEFAULT_ROUTER = "token_choice"  # the router family model.router.type chooses by default


@sections.open_section
class RouterConfig:
  """model.router: `type` chooses a router family, whose registration adds its own keys here."""
  type: str = key(DEFAULT_ROUTER, Choice(registries.ROUTERS.names), "a registered router family")


@dataclass
class MoeConfig:
  layers: Any = key([], Rule(_is_moe_layers, "'every<n>', 'last<n>' (n >= 1) or a list of distinct "
                             "block indices >= 0"))
  num_experts: int = key(0, at_least(0))
  group_size: int = key(8, at_least(1), "images per routing group")
  expert_dropout: float = key(0.0, rate())
  dispatcher: Dispatcher = Dispatcher.indices
  grouped_matmul: GroupedMatmul = key(GroupedMatmul.auto, hint="dropless routing's grouped "
                                      "matmul: auto (measured best: blocks), blocks, ragged_dot, "
                                      "pallas or cudnn (an NVIDIA GPU)")
  # Partitioned batch ensembles (E³): M members, each with E/M of the experts and its own router.
  ensemble_size: int = key(1, at_least(1), "1: a V-MoE; M > 1: a partitioned batch ensemble")
  ensemble_variant: EnsembleVariant = EnsembleVariant.pbe
  # DeepSeekMoE (Dai et al. 2024): experts every token passes through, and each expert split into
  # m narrower ones (E*m experts of width mlp_dim/m, k*m chosen); runner/config/derived.py.
  shared_experts: int = key(0, at_least(0), "experts every token passes through, added to the "
                            "routed output (DeepSeekMoE); 0: none")
  expert_split: int = key(1, at_least(1), "m: each expert split into m of width mlp_dim/m, "
                          "E*m experts, k*m chosen (DeepSeekMoE's fine-grained experts)")


def _is_bounds(value) -> bool:
  return (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
          and 0 < value[0] < value[1])


@dataclass
class HeadConfig:
  """The classifier head. Defaults are the HET-XL paper's (App. N.1): a parameter-efficient
  covariance of rank R = 50 plus a rank-1 term, 1000 MC samples, τ learned in [0.05, 5]."""
  type: HeadType = HeadType.det
  num_factors: int = key(50, at_least(1), "R, the rank of the low-rank covariance term")
  parameter_efficient: bool = True  # V(x) = J o (1 v(x)^T): parameters independent of R x classes
  train_mc_samples: int = key(1000, at_least(1))
  eval_mc_samples: int = key(1000, at_least(1))
  temperature: Optional[float] = key(None, positive(), "null: learned within temperature_bounds")
  temperature_bounds: List[float] = key([0.05, 5.0], Rule(_is_bounds, "[low, high] with 0 < low < "
                                                          "high, e.g. [0.05,5.0]"))
  latent_dim: Optional[int] = key(None, at_least(1), "het_xl: the noise's width; null: the "
                                  "pre-logits' width, the only one that fits")
  # 64: at S = 1000 samples a vit_tiny step with K = 1000 classes needs 0.78 GB instead of 3.5 GB
  # (benchmarks/het_head.py); fewer samples than a chunk run at once.
  mc_chunk_size: Optional[int] = key(64, at_least(1), "MC samples computed at a time (memory "
                                     "grows with it, not with the samples); null: all at once")
  share_samples_across_batch: bool = False  # the same noise draws for every example of a batch


@dataclass
class ModelConfig:
  name: str = MISSING
  image_size: int = key(224, at_least(1))
  patch_size: int = key(16, at_least(1))
  hidden_size: int = key(768, at_least(1))
  num_layers: int = key(12, at_least(1))
  mlp_dim: int = key(3072, at_least(1))
  num_heads: int = key(12, at_least(1))
  classifier: Classifier = Classifier.token
  representation_size: Optional[int] = key(None, at_least(1), "null: no pre-logits layer")
  dropout_rate: float = key(0.0, rate())
  attention_dropout_rate: float = key(0.0, rate())
  attention_qk_norm: bool = False  # LayerNorm on queries and keys (the Soft MoE paper's ViTs)
  attention: Attention = key(Attention.auto, hint="auto: cuDNN's fused kernel where the GPU, "
                             "dtype and shapes allow it, else XLA; xla; cudnn: the fused kernel "
                             "or an error (docs/models.md#attention)")
  head_bias_init: float = 0.0
  # What the ViTs of timm and transformers vary (docs/released-checkpoints.md); the defaults are
  # vmoe's own ViT. null: not said, gelu_tanh; a checkpoint whose files do not say which it uses
  # (a bare timm state_dict) needs it said.
  activation: Optional[Activation] = key(None, hint="null: gelu_tanh (vmoe's own, Flax's "
                                         "nn.gelu); gelu (exact: timm, transformers); quick_gelu "
                                         "(OpenAI CLIP)")
  layer_norm_eps: float = key(1e-6, positive(), "every LayerNorm's epsilon: 1e-6 (Flax, timm, "
                              "DINOv2), 1e-12 (transformers' ViT)")
  registers: int = key(0, at_least(0), "learned tokens after the class token, left out of "
                       "pooling (register tokens, Darcet et al. 2024)")
  layer_scale: Optional[float] = key(None, positive(), "null: none; a learned per-channel scale "
                                     "of each block's attention and MLP outputs, initialised to "
                                     "this (CaiT, DeiT III, DINOv2)")
  pre_norm: bool = False  # a LayerNorm on the tokens before the first block (CLIP's)
  # classifier=gap: the final LayerNorm normalises the tokens' mean, not each token before it
  # (timm's fc_norm)
  fc_norm: bool = False
  # The compute dtype; parameters, the routers, the head and the loss stay float32
  # (docs/models.md#precision).
  dtype: DType = DType.float32
  moe: MoeConfig = field(default_factory=MoeConfig)
  router: RouterConfig = field(default_factory=sections.made(RouterConfig))
  head: HeadConfig = field(default_factory=HeadConfig)


@dataclass
class DataConfig:
  name: str = MISSING
  split: str = "train"
  eval_split: str = "validation"  # a held-out slice of `split` when the dataset has none
  test_split: Optional[str] = "test"
  holdout_fraction: float = key(0.02, Range(0, 1, low_open=True, high_open=True),
                                "the held-out share of `split` when there is no eval split")
  data_dir: Optional[str] = None  # default: $TFDS_DATA_DIR or ~/tensorflow_datasets
  root: Optional[str] = None  # data=image_folder: its folder; data=captions: its file or folder
  skip_unreadable: bool = False  # image_folder, captions: skip unreadable images (warning) instead of failing
  label_noise: float = key(0.0, probability(), "the fraction of training labels replaced by random "
                           "classes, the same examples in every run; evaluation labels stay clean")
  pp_train: str = key("decode(3)|resize(224)|value_range(-1,1)", Preprocessing())
  pp: str = key("decode(3)|resize(224)|value_range(-1,1)", Preprocessing())
  batch_size: int = key(128, at_least(1))
  eval_batch_size: Optional[int] = key(None, at_least(1), "null: batch_size")
  shuffle_buffer: int = key(50_000, at_least(1))
  cache: Optional[bool] = key(None, hint="keep the split's records in memory after the first "
                              "epoch: null where it has at most 200,000 examples (per shard), "
                              "true always, false never")
  num_shards: Optional[int] = key(None, at_least(1), "training reads the split in this many "
                                  "shards, each process its share; null: one per process. A "
                                  "run's batches depend on it, not on the process count")
  image_key: str = "image"
  label_key: str = "label"
  text_key: Optional[str] = None  # the caption of an image-text dataset (contrastive objective)


@dataclass
class TokenizerConfig:
  kind: TokenizerKind = key(TokenizerKind.bytes, hint="bytes (no model), sentencepiece (a model "
                            "file: text.tokenizer.path), train (trained on the training captions)")
  path: Optional[str] = None  # the SentencePiece model file (kind=sentencepiece)
  vocab_size: int = key(1000, at_least(8), "kind=train: the vocabulary of the model trained on "
                        "the training captions")


@dataclass
class TextConfig:
  """The text tower of a contrastive model: a Transformer encoder over tokens (LiT's)."""
  name: str = "text_tiny"
  width: int = key(128, at_least(1))
  depth: int = key(2, at_least(1))
  mlp_dim: int = key(512, at_least(1))
  num_heads: int = key(4, at_least(1))
  max_length: int = key(48, at_least(2), "tokens per caption, the end token included (longer "
                        "captions are cut); 48 holds the embedded captions in bytes")
  pool: TextPool = TextPool.last
  tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class ObjectiveConfig:
  """What training optimises: a classifier, or image-text alignment (two towers)."""
  name: Objective = Objective.classification
  loss: ContrastiveLoss = key(ContrastiveLoss.softmax, hint="contrastive: softmax (CLIP, LiT) or "
                              "sigmoid (SigLIP)")
  embedding_dim: int = key(128, at_least(1), "contrastive: the shared embedding width")
  temperature_init: Optional[float] = key(None, positive(), "contrastive: the learned logit "
                                          "scale's start; null: 10 (det head), 3 (het_xl), as "
                                          "the HET-XL paper's App. N")
  bias_init: Optional[float] = key(None, hint="sigmoid loss: the learned logit bias's start; "
                                   "null: -10 (SigLIP)")
  lock_image: bool = True  # contrastive from init.checkpoint: the image tower is locked (LiT)
  noise_pre_norm: bool = True  # het_xl: normalise the representations before the noise
  noise_post_norm: bool = False  # het_xl: and again after it (the HET-XL paper's Table 7)


@sections.open_section
class OptimConfig:
  """optim: what every optimizer reads; registering one adds its own keys here."""
  name: str = key("adam", Choice(registries.OPTIMIZERS.names), "a registered optimizer "
                  "(runner/train/optimizers.py)")
  lr: float = key(1e-3, positive(), "the peak learning rate")
  # A float for every parameter, or a list of [regex, value] pairs matched against
  # "block_1/moe/experts/fc1_kernel"-style names (first match wins, unmatched: no decay).
  weight_decay: Any = key(0.0, Rule(_is_weight_decay, "a number >= 0 or a list of [regex, value "
                                    ">= 0] pairs, e.g. '[[head/kernel,3.0],[.*kernel,0.03]]'"))
  grad_clip_norm: Optional[float] = key(1.0, positive(), "null: no clipping")


@sections.open_section
class ScheduleConfig:
  """schedule: what every schedule reads; registering one adds its own keys here."""
  name: str = key("linear", Choice(registries.SCHEDULES.names), "a registered schedule "
                  "(runner/train/schedules.py)")
  warmup_steps: int = key(0, at_least(0))
  end_lr_fraction: float = key(0.0, probability(), "linear/cosine decay to lr * end_lr_fraction")


@dataclass
class TrainConfig:
  steps: Optional[int] = key(None, at_least(1), "null: use train.epochs")
  epochs: Optional[float] = key(None, positive(), "used when train.steps is null")
  loss: Loss = Loss.softmax_xent
  aux_loss_weight: float = key(0.01, at_least(0), "lambda of Appendix A.2")
  accum_steps: int = key(1, at_least(1), "micro-batches per step (gradient accumulation)")
  log_every_steps: int = key(50, at_least(1))


@sections.open_section
class EvalSuiteConfig:
  """vmoe eval: which measurements to take, on which datasets; registering an evaluator adds its
  own keys here."""
  batch_size: Optional[int] = key(None, at_least(1), "null: data.eval_batch_size, else "
                                  "data.batch_size (of the checkpoint, in vmoe eval)")
  datasets: List[str] = key([], Items(unique=True), "[]: the checkpoint's own dataset")
  split: Optional[str] = None  # None: each dataset's test split (else its eval split)
  save_predictions: bool = False
  plots: bool = True


@sections.open_section
class EvalConfig(EvalSuiteConfig):
  """pretrain and finetune: the validation split every `every_steps` and at the end."""
  every_steps: int = key(0, at_least(0), "0: only at the end")


@dataclass
class FewshotConfig:
  """Linear few-shot evaluation on frozen pre-logits (`vmoe fewshot`, or every N steps in training)."""
  datasets: List[str] = key([], Items(unique=True), "e.g. [uci_digits,mnist5k]; "
                            "'name:split' picks the test split")
  shots: List[int] = key([1, 5, 10, 25], Items(at_least(1), nonempty=True, example="[1,5,10,25]"),
                         "examples per class")
  seeds: List[int] = key([0, 1, 2], Items(SEED, nonempty=True, example="[0,1,2]"),
                         "accuracies are averaged over them")
  l2_regs: Optional[List[float]] = key(None, Items(positive(), nonempty=True, increasing=True,
                                                   example="[0.1,1,10,100]"),
                                       "null: the grid 2^-10 ... 2^19")
  train_split: str = "train"
  test_split: Optional[str] = None  # None: each dataset's test split (else its eval split)
  max_train_examples: Optional[int] = key(None, at_least(1), "null: the whole pool")
  batch_size: Optional[int] = key(None, at_least(1), "null: the evaluation batch size")
  every_steps: int = key(0, at_least(0), "training only: 0 = never during training")
  protocol: FewshotProtocol = key(FewshotProtocol.reference, hint="reference: features "
                                  "standardised by the shots' statistics, bias feature 100 (vmoe, "
                                  "big_vision); plain: raw features, a bias column of ones")


@dataclass
class CheckpointConfig:
  every_steps: int = key(500, at_least(0), "0: only at the end")
  keep: int = key(2, at_least(1), "the newest checkpoints kept")
  async_save: bool = True


@dataclass
class InitConfig:
  checkpoint: Optional[str] = None  # a workdir or a checkpoint dir written by an earlier stage
  reinit_head: bool = True  # fine-tuning: a new zero-initialised head
  dense_to_experts: bool = False  # fine-tuning a V-MoE from a dense ViT: copy its MLPs into experts
  drop_upcycling_ratio: float = key(0.0, Range(0, 1), "Drop-Upcycling's r: the share of each "
                                    "copied expert's MLP dimensions redrawn (paper: 0.5)")
  # A partitioned batch ensemble may start a model with another ensemble_size only when asked:
  # its experts are then divided anew between the members.
  repartition_experts: bool = False
  # A contrastive checkpoint's tower to start a classifier from (only `image`).
  tower: Optional[Tower] = None


@dataclass
class WandbConfig:
  mode: WandbMode = WandbMode.offline
  project: str = key("vmoe", matches(r".+", "a non-empty name"))
  entity: Optional[str] = None
  name: Optional[str] = None
  tags: List[str] = field(default_factory=list)
  # A sweep's jobs are one W&B group (null: the sweep's folder); the CLI fills in a job's
  # overrides, which the W&B config shows next to the resolved config.
  group: Optional[str] = None
  overrides: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
  wandb: WandbConfig = field(default_factory=WandbConfig)
  progress: bool = True
  report: bool = True  # write <workdir>/report.html when the stage ends (`vmoe report`)


@dataclass
class MeshConfig:
  data: int = key(-1, _DEVICES, "devices along the data axis")
  expert: int = key(1, _DEVICES, "devices along the expert axis; -1: the most that divide the "
                    "experts")


@dataclass
class ShardingConfig:
  name: str = key("dp", Choice(tuple(RULES)), "a bundle of logical-axis rules")
  rules: Optional[list] = key(None, Rule(_is_sharding_rules, "a list of [logical axis, mesh axis "
                                         "(data, expert), a list of them, or null] pairs"),
                              "null: the bundle's rules")


@dataclass
class DistributedConfig:
  coordinator_address: Optional[str] = key(None, matches(r"[^\s:]+:\d+", "host:port"),
                                           "of process 0")
  num_processes: Optional[int] = key(None, at_least(1))
  process_id: Optional[int] = key(None, at_least(0))
  auto: bool = True  # join a job JAX detects from the environment (SLURM, TPU VMs, ...)
  timeout_seconds: int = key(300, at_least(1))


@dataclass
class RunFields:
  """The fields every run repeats, declared once: each task's schema and each resolved run adds
  its own sections to these."""
  # Loaded before the config is composed (runner/plugins.py): what they register is then chosen
  # by name like a built-in router family, evaluator, model, dataset, op, optimizer or schedule.
  plugins: List[str] = key([], Items(matches(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "a Python module "
                                               "name"), unique=True, example="[my_lab.router]"),
                           "modules of your own that register routers, evaluators, models, ...")
  seed: int = key(0, SEED, "a non-negative 32-bit integer, as NumPy's seeds")
  workdir: str = MISSING
  debug: bool = False
  logger: LoggerConfig = field(default_factory=LoggerConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  sharding: ShardingConfig = field(default_factory=ShardingConfig)
  distributed: DistributedConfig = field(default_factory=DistributedConfig)


@dataclass
class TrainTask(RunFields):
  """pretrain and finetune."""
  model: ModelConfig = MISSING
  data: DataConfig = MISSING
  objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
  text: TextConfig = field(default_factory=TextConfig)  # the contrastive objective's text tower
  optim: OptimConfig = field(default_factory=sections.made(OptimConfig))
  schedule: ScheduleConfig = field(default_factory=sections.made(ScheduleConfig))
  train: TrainConfig = field(default_factory=TrainConfig)
  eval: EvalConfig = field(default_factory=sections.made(EvalConfig))
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
  init: InitConfig = field(default_factory=InitConfig)
  fewshot: FewshotConfig = field(default_factory=FewshotConfig)


def optional_copy(cls, prefix: str = "Optional"):
  """The same dataclass with every field optional and None by default: "unchanged" overrides,
  each range-checked like the key it overrides."""
  fields = []
  for f in dataclasses.fields(cls):
    ftype = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # noqa: S307
    if sections.is_open(ftype):  # its copy takes the keys declared to it (router families')
      sub = sections.optional_copy(ftype, prefix + ftype.__name__)
      fields.append((f.name, sub, field(default_factory=sections.made(sub))))
    elif dataclasses.is_dataclass(ftype):
      sub = optional_copy(ftype, prefix)
      fields.append((f.name, sub, field(default_factory=sub)))
    else:
      fields.append((f.name, Optional[ftype], field(default=None, metadata=f.metadata)))
  return dataclasses.make_dataclass(prefix + cls.__name__, fields)


ModelOverrides = optional_copy(ModelConfig)
DataOverrides = optional_copy(DataConfig)


@dataclass
class EvalTask(RunFields):
  """eval: the model and data come from the checkpoint; keys set here override them."""
  init: InitConfig = field(default_factory=InitConfig)
  model: ModelOverrides = field(default_factory=ModelOverrides)
  data: DataOverrides = field(default_factory=DataOverrides)
  eval: EvalSuiteConfig = field(default_factory=sections.made(EvalSuiteConfig))


@dataclass
class FewshotInitConfig:
  checkpoint: Any = None  # one workdir, or a list of them: their pre-logits are concatenated


@dataclass
class FewshotTask(RunFields):
  """fewshot: frozen features of one or more checkpoints, ridge classifiers per dataset and shots."""
  init: FewshotInitConfig = field(default_factory=FewshotInitConfig)
  model: ModelOverrides = field(default_factory=ModelOverrides)
  fewshot: FewshotConfig = field(default_factory=FewshotConfig)


@dataclass
class EnsembleConfig:
  mc_dropout: int = key(0, at_least(0), "0: off; M >= 2: M samples of one checkpoint with its "
                        "dropout on at inference")


@dataclass
class EnsembleTask(RunFields):
  """ensemble: checkpoints (or MC-dropout samples of one) evaluated as one ensemble."""
  init: FewshotInitConfig = field(default_factory=FewshotInitConfig)
  model: ModelOverrides = field(default_factory=ModelOverrides)
  data: DataOverrides = field(default_factory=DataOverrides)
  eval: EvalSuiteConfig = field(default_factory=sections.made(EvalSuiteConfig))
  ensemble: EnsembleConfig = field(default_factory=EnsembleConfig)


@dataclass
class ExportTask(RunFields):
  """export: the model and its preprocessing come from the checkpoint; model.* keys set here
  change how it runs at inference (k, capacity, Batch Prioritized Routing), as in eval."""
  init: InitConfig = field(default_factory=InitConfig)
  model: ModelOverrides = field(default_factory=ModelOverrides)
  data: DataOverrides = field(default_factory=DataOverrides)


@dataclass
class CompressConfig:
  method: CompressMethod = CompressMethod.merge
  experts: Optional[int] = key(None, at_least(1), "E', the routed experts each MoE layer keeps "
                               "(required; fewer than the checkpoint's)")
  split: Optional[str] = key(None, hint="the calibration split; null: data.split, the training "
                             "split")
  examples: int = key(1024, at_least(1), "calibration images: the split's first")


@dataclass
class CompressTask(RunFields):
  """compress: the model comes from the checkpoint, the calibration images from data.*."""
  init: InitConfig = field(default_factory=InitConfig)
  model: ModelOverrides = field(default_factory=ModelOverrides)
  data: DataOverrides = field(default_factory=DataOverrides)
  compress: CompressConfig = field(default_factory=CompressConfig)


# What a later stage runs: the checkpoint's stored model and data with the command line on top.
@dataclass
class EvalRun(RunFields):
  """vmoe eval, resolved: the full model and data configs and the checkpoint's loss."""
  init: InitConfig = MISSING
  model: ModelConfig = MISSING
  data: DataConfig = MISSING
  loss: Loss = MISSING
  eval: EvalSuiteConfig = MISSING
  # A contrastive checkpoint's (from its stored config): evaluated zero-shot.
  objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
  text: TextConfig = field(default_factory=TextConfig)


@dataclass
class CheckpointModelRun(RunFields):
  """A run of one checkpoint's model: its stored model and data with the command line on top,
  its loss and objective."""
  init: InitConfig = MISSING
  model: ModelConfig = MISSING
  data: DataConfig = MISSING
  loss: Loss = MISSING
  objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


@dataclass
class ExportRun(CheckpointModelRun):
  """vmoe export, resolved: the model as it runs at inference, the preprocessing its inputs
  need (data.pp), and the loss that says whether it predicts with a softmax or sigmoids."""


@dataclass
class CompressRun(CheckpointModelRun):
  """vmoe compress, resolved: the checkpoint's model and loss, the calibration data."""
  compress: CompressConfig = MISSING


@dataclass
class FewshotMember:
  """One checkpoint whose frozen features few-shot evaluation uses."""
  path: str
  model: ModelConfig
  data: DataConfig
  # A contrastive checkpoint's (objective=contrastive) features are its image tower's.
  objective: Objective = Objective.classification


@dataclass
class FewshotRun(RunFields):
  """vmoe fewshot, resolved: each checkpoint's model, the preprocessing they share."""
  members: List[FewshotMember] = MISSING
  data: DataConfig = MISSING  # the first member's data config: its preprocessing reads every dataset
  fewshot: FewshotConfig = MISSING


@dataclass
class EnsembleMember:
  """One checkpoint of an ensemble, with what its stored config says about its origin."""
  path: str
  model: ModelConfig
  data: DataConfig
  loss: Loss
  stage: Optional[str] = None  # "pretrain" or "finetune" (None: a checkpoint that does not say)
  upstream: Optional[str] = None  # the init.checkpoint it was trained from
  seed: Optional[int] = None
  objective: Objective = Objective.classification  # what the checkpoint was trained for


@dataclass
class EnsembleRun(RunFields):
  """vmoe ensemble, resolved: every member's model and the data and loss they share."""
  members: List[EnsembleMember] = MISSING
  data: DataConfig = MISSING  # the first member's, with the command line's data.* on top
  loss: Loss = MISSING
  eval: EvalSuiteConfig = MISSING
  ensemble: EnsembleConfig = MISSING
