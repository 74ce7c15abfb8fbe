"""Rules between config keys, each stated once: k <= experts, a batch that tiles the devices, ...

A relation's parameters name config sections, annotated with the schema each must be, so it
applies to every config that has them; it returns what is wrong in one sentence, or None. `run`
receives a whole config; `devices` the device count (the relation runs once it is known).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
import typing
from typing import Callable

from runner.accelerator import cudnn_attention_problem, grouped_matmul_problem
from runner.config import derived, registries, sections
from runner.config.schema import (PRUNE_SUBSETS_MAX, CompressMethod, CompressRun,
                                  ContrastiveLoss, DataConfig, InitConfig, DistributedConfig,
                                  EnsembleRun, EnsembleVariant, EvalConfig, EvalRun,
                                  EvalSuiteConfig, ExportRun, FewshotConfig, FewshotRun, HeadConfig,
                                  HeadType, ModelConfig, MoeConfig, Objective, ObjectiveConfig,
                                  OptimConfig, RunFields, TextConfig, TokenizerKind, TrainConfig,
                                  TrainTask)
from runner.config.mesh import expert_mesh_axes, mesh_shape
from runner.errors import ConfigError


def shown(value) -> str:
  """A value as one would type it in an override."""
  return str(value).lower() if isinstance(value, bool) else str(value)


def changed_keys(section, prefix: str, skip=(), show=shown) -> list[str]:
  """`prefix.key=value` for each key of `section` that leaves its default, in field order."""
  defaults = type(section)()
  return [f"{prefix}.{f.name}={show(getattr(section, f.name))}" for f in dataclasses.fields(section)
          if f.name not in skip and getattr(section, f.name) != getattr(defaults, f.name)]


@dataclasses.dataclass(frozen=True)
class Relation:
  fn: Callable[..., str | None]
  sections: dict  # parameter name -> the schema type it must have

  @property
  def needs_devices(self) -> bool:
    return "devices" in inspect.signature(self.fn).parameters

  def arguments(self, config, devices: int | None, checkpoints=None) -> dict | None:
    """The sections this relation reads from `config`, or None when it does not apply."""
    takes = inspect.signature(self.fn).parameters
    args = {name: value for name, value in (("devices", devices), ("checkpoints", checkpoints))
            if name in takes}
    if any(value is None for value in args.values()):
      return None
    for name, schema in self.sections.items():
      value = (config if isinstance(config, schema) and name == "run"
               else getattr(config, name, None))
      if not isinstance(value, schema):
        return None
      args[name] = value
    return args


RELATIONS: list[Relation] = []


def relation(fn):
  hints = typing.get_type_hints(fn)
  sections = {name: hints[name] for name in inspect.signature(fn).parameters
              if name not in ("devices", "checkpoints")}
  RELATIONS.append(Relation(fn, sections))
  return fn


# --- the model ---------------------------------------------------------------------------------

@relation
def heads_split_the_width(model: ModelConfig):
  if model.hidden_size % model.num_heads:
    return (f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads="
            f"{model.num_heads}; each head takes hidden_size / num_heads dimensions.")


@relation
def patches_tile_the_image(model: ModelConfig):
  if model.image_size % model.patch_size:
    return (f"model.image_size={model.image_size} is not divisible by model.patch_size="
            f"{model.patch_size}; patches must tile the image.")


@relation
def fc_norm_follows_average_pooling(model: ModelConfig):
  """timm's fc_norm moves the final LayerNorm after the mean of the tokens; a class token or a
  MAP head reads normalised tokens, where the LayerNorm stays (for one token it is the same)."""
  if model.fc_norm and str(model.classifier) != "gap":
    return (f"model.fc_norm=true normalises the mean of the tokens (model.classifier=gap), but "
            f"model.classifier={model.classifier}: drop model.fc_norm, or set "
            "model.classifier=gap.")


@relation
def moe_layers_exist(model: ModelConfig):
  try:
    layers = derived.moe_layers(model)
  except ValueError as e:
    return f"model.moe.layers: {e}."
  if layers and model.moe.num_experts < 1:
    return (f"model.moe.layers={model.moe.layers} needs model.moe.num_experts >= 1 (or "
            "model.moe.layers=[] for a dense ViT).")


# The model.moe keys a dense ViT may hold: its (empty) layers, the ensemble keys (checked by
# ensemble_needs_experts), and expert dropout, which conf/finetune.yaml sets for every model.
_DENSE_KEYS = ("layers", "ensemble_size", "ensemble_variant", "expert_dropout")


def _moe_layers(model: ModelConfig) -> tuple[int, ...] | None:
  """The MoE blocks, or None for an invalid model.moe.layers (moe_layers_exist reports it)."""
  try:
    return derived.moe_layers(model)
  except ValueError:
    return None


@relation
def dense_model_has_no_router(model: ModelConfig):
  """A dense ViT reads no router or MoE key: one given would silently train a plain ViT."""
  if _moe_layers(model) != ():
    return None  # a V-MoE, or invalid layers
  given = (changed_keys(model.router, "model.router")
           + changed_keys(model.moe, "model.moe", skip=_DENSE_KEYS))
  if given:
    return (f"{', '.join(given)} means nothing for a dense ViT (model.moe.layers=[], as "
            f"model={model.name or 'vit_*'} has): it has no MoE layer and no router. Drop "
            f"{'it' if len(given) == 1 else 'them'}, or choose a V-MoE (model=vmoe_tiny, "
            "model=vmoe_s32_last2_e8, ...) or add MoE layers (model.moe.layers=every2 "
            "model.moe.num_experts=8).")


@relation
def router_options_apply(model: ModelConfig):
  """A model.router key (or model.moe.dispatcher) the chosen router does not read, given."""
  if not _moe_layers(model):
    return None  # a dense ViT (dense_model_has_no_router) or invalid layers
  family = derived.router_family(model)
  if problem := family.unread_key_problem(model.router):
    return problem
  ignored = changed_keys(model.router, "model.router", skip=("type", *family.options))
  if not family.uses_dispatcher and model.moe.dispatcher != MoeConfig().dispatcher:
    ignored.append(f"model.moe.dispatcher={shown(model.moe.dispatcher)}")
  if ignored:
    return (f"{', '.join(ignored)} means nothing for model.router.type={family.name} "
            f"({family.summary}); its keys are model.router.{{{', '.join(family.options)}}}. "
            "Drop the other keys, or choose a router that reads them (model.router.type="
            f"{'|'.join(registries.ROUTERS.names())}).")


@relation
def grouped_matmul_applies(model: ModelConfig):
  """A router that fills fixed-capacity buffers runs no grouped matmul."""
  chosen = model.moe.grouped_matmul
  if chosen == MoeConfig().grouped_matmul or not _moe_layers(model):
    return None  # the default, or a dense ViT (dense_model_has_no_router)
  family = derived.router_family(model)
  if family.runs_grouped_matmul(model.router):
    return None
  return (f"model.moe.grouped_matmul={shown(chosen)} means nothing for model.router.type="
          f"{family.name} with these keys: it chooses how routing without capacity (dropless "
          "token choice) runs its experts' rows, and this router runs its experts on "
          "fixed-capacity buffers. Drop it, or route dropless (model.router.type=token_choice "
          "model.router.dropless=true).")


@relation
def grouped_matmul_runs(model: ModelConfig):
  """What the config alone decides (the device is the MoE layer's to check when traced)."""
  return (grouped_matmul_problem(shown(model.moe.grouped_matmul), shown(model.dtype))
          if _moe_layers(model) else None)


@relation
def router_family_rules(model: ModelConfig):
  """The chosen router family's own rules (`RouterFamily.problem`: token-choice's k <= E)."""
  return derived.router_family(model).problem(model) if derived.num_experts(model) else None


@relation
def ensemble_needs_experts(model: ModelConfig):
  m = model.moe.ensemble_size
  if m == 1:
    if model.moe.ensemble_variant != EnsembleVariant.pbe:
      return (f"model.moe.ensemble_variant={model.moe.ensemble_variant.value} is an ablation of "
              "a partitioned batch ensemble: it needs model.moe.ensemble_size >= 2.")
    return None
  if not derived.num_experts(model):
    return (f"model.moe.ensemble_size={m} needs MoE layers: the members of a partitioned batch "
            f"ensemble are partitions of the experts, and model {model.name} has none (use a "
            "vmoe_* model, or a deep ensemble of ViTs with vmoe ensemble).")
  family = derived.router_family(model)
  if not family.supports_ensembles:
    return (f"model.moe.ensemble_size={m} needs a token-choice router: a partitioned batch "
            f"ensemble routes each member's tokens TOP-k among its own experts, and "
            f"model.router.type={family.name} has no such routing; use a router that forms "
            "them (model.router.type="
            f"{'|'.join(n for n, f in registries.ROUTERS.items() if f.supports_ensembles)}), or a "
            "deep ensemble of separate runs with vmoe ensemble.")
  if model.moe.num_experts % m:
    return (f"model.moe.ensemble_size={m} does not divide model.moe.num_experts="
            f"{model.moe.num_experts}: each member gets an equal share of the experts; use a "
            f"divisor of {model.moe.num_experts}.")


@relation
def deepseek_experts_apply(model: ModelConfig):
  """Shared and fine-grained experts (DeepSeekMoE): one router per layer, a family that splits
  its experts, and a split that divides the MLP's width."""
  moe = model.moe
  if (moe.shared_experts == 0 and moe.expert_split == 1) or not _moe_layers(model) or (
      moe.num_experts < 1):
    return None
  given = [f"model.moe.{name}={value}" for name, value, default in (
      ("shared_experts", moe.shared_experts, 0), ("expert_split", moe.expert_split, 1))
      if value != default]
  if moe.ensemble_size > 1:
    return (f"{' and '.join(given)} cannot be used with a partitioned batch ensemble "
            f"(model.moe.ensemble_size={moe.ensemble_size}): its members partition the experts "
            "among themselves, and vmoe does not partition shared or fine-grained experts. Drop "
            f"{'it' if len(given) == 1 else 'them'}, or model.moe.ensemble_size=1.")
  if moe.expert_split == 1:
    return None
  family = derived.router_family(model)
  if not family.supports_expert_split:
    return (f"model.moe.expert_split={moe.expert_split} means nothing for model.router.type="
            f"{family.name} ({family.summary}): fine-grained experts let each token choose k*m "
            "of the E*m narrower experts, which only a router whose tokens choose k experts "
            "does. Drop it, or choose such a router (model.router.type="
            f"{'|'.join(n for n, f in registries.ROUTERS.items() if f.supports_expert_split)}).")
  if model.mlp_dim % moe.expert_split:
    return (f"model.moe.expert_split={moe.expert_split} does not divide model.mlp_dim="
            f"{model.mlp_dim}: each expert's MLP splits into {moe.expert_split} experts of width "
            f"mlp_dim / {moe.expert_split}; use a divisor of {model.mlp_dim}.")
  return None


@relation
def head_temperature_in_bounds(model: ModelConfig):
  head = model.head
  low, high = head.temperature_bounds
  if head.type == HeadType.det and head.temperature is not None:
    return (f"model.head.temperature={head.temperature} is set, but model.head.type=det has no "
            "temperature: set model.head.type=het or het_xl for a heteroscedastic head.")
  if head.type != HeadType.det and head.temperature is not None and not low <= head.temperature <= high:
    return (f"model.head.temperature={head.temperature} lies outside model.head.temperature_bounds="
            f"{list(head.temperature_bounds)}; give a temperature in [{low:g}, {high:g}], widen the "
            "bounds, or model.head.temperature=null to learn it there.")


@relation
def het_xl_noise_fits_the_pre_logits(model: ModelConfig):
  head = model.head
  width = derived.pre_logits_width(model)
  if head.type == HeadType.het_xl and head.latent_dim is not None and head.latent_dim != width:
    return (f"model.head.latent_dim={head.latent_dim} does not match the pre-logits' width {width} "
            f"(model.representation_size, else model.hidden_size): HET-XL adds its noise to the "
            "pre-logits before the shared classifier, so the two must match; set "
            f"model.head.latent_dim={width} or null.")


@relation
def cudnn_attention_applies(model: ModelConfig):
  """The device itself is checked when the model is traced (runner/models/vit.py)."""
  if shown(model.attention) != "cudnn" or model.hidden_size % model.num_heads:
    return None  # heads_split_the_width reports the latter
  return cudnn_attention_problem(shown(model.dtype), model.hidden_size // model.num_heads,
                                 dropout=model.attention_dropout_rate > 0)


# --- data --------------------------------------------------------------------------------------

@relation
def shards_split_the_batch(data: DataConfig):
  if data.num_shards and data.batch_size % data.num_shards:
    return (f"data.num_shards={data.num_shards} does not divide data.batch_size="
            f"{data.batch_size}: every global batch takes an equal part from each shard.")


@relation
def image_folder_has_a_root(data: DataConfig):
  if data.name == "image_folder" and not data.root:
    return ("data=image_folder needs data.root=<dir>, a folder holding train/ and test/ "
            "(optionally validation/) with one sub-folder of images per class.")
  if data.name == "captions" and not data.root:
    return ("data=captions needs data.root=<file or dir>: a JSONL or CSV file of (image path, "
            "caption) rows, or a folder holding one (docs/data.md, image-text pairs).")


# --- the objective ------------------------------------------------------------------------------

@relation
def contrastive_heads(objective: ObjectiveConfig, model: ModelConfig):
  """A contrastive model's towers end in embeddings: only det or HET-XL-noisy ones apply."""
  if objective.name != Objective.contrastive:
    return None
  head, defaults = model.head, HeadConfig()
  if head.type not in (HeadType.det, HeadType.het_xl):
    return (f"model.head.type={shown(head.type)} means nothing for objective=contrastive: its "
            "towers end in embeddings, not a classifier; valid: det (the deterministic "
            "baseline) or het_xl (HET-XL's noise on the representations, its paper's Sec. 5).")
  if head.type == HeadType.het_xl and objective.loss == ContrastiveLoss.sigmoid:
    return ("model.head.type=het_xl with objective.loss=sigmoid: HET-XL's contrastive noise is "
            "defined for the softmax loss (the HET-XL paper's Eq. 8); use objective.loss=softmax, "
            "or the sigmoid loss with model.head.type=det.")
  unused = [f"model.head.{name}" for name in ("temperature", "latent_dim")
            if getattr(head, name) != getattr(defaults, name)]
  if unused:
    return (f"{', '.join(unused)} means nothing for objective=contrastive: the learned scale "
            "starts at objective.temperature_init, and HET-XL's noise has the embedding's width "
            "(objective.embedding_dim).")


@relation
def pairs_need_the_contrastive_objective(objective: ObjectiveConfig, data: DataConfig):
  if data.name in ("captions", "coco_captions") and objective.name != Objective.contrastive:
    return (f"data={data.name} holds image-caption pairs without class labels: train on it with "
            "objective=contrastive (a classifier needs labels: choose a dataset with classes).")


@relation
def tokenizer_has_its_model(objective: ObjectiveConfig, text: TextConfig):
  if (objective.name == Objective.contrastive and text.tokenizer.kind == TokenizerKind.sentencepiece
          and not text.tokenizer.path):
    return ("text.tokenizer.kind=sentencepiece needs text.tokenizer.path=<file>, a SentencePiece "
            "model; or use text.tokenizer.kind=bytes (no model) or train (a model trained on the "
            "training captions).")


@relation
def contrastive_batches_stay_whole(objective: ObjectiveConfig, train: TrainConfig):
  """Each pair's negatives are the other pairs of its batch: micro-batches would shrink them."""
  if objective.name == Objective.contrastive and train.accum_steps > 1:
    return (f"train.accum_steps={train.accum_steps} with objective=contrastive: the contrastive "
            "loss of a micro-batch sees only its own pairs as negatives, so accumulating "
            "micro-batches is not the loss of the whole batch; use train.accum_steps=1 (a "
            "smaller data.batch_size, or more devices, for memory).")


@relation
def contrastive_measurements_in_training(objective: ObjectiveConfig, eval: EvalConfig):
  """A contrastive model's classifier measurements are vmoe eval's (zero-shot)."""
  if objective.name != Objective.contrastive:
    return None
  given = [cls.enabling_key or f"the evaluator {cls.name} (always on)" for cls in _evaluators()
           if cls.in_training and cls.enabled(eval)]
  if given:
    return (f"{', '.join(given)} during objective=contrastive training: its validation measures "
            "the loss, in-batch retrieval and zero-shot accuracy; take these measurements of "
            "the zero-shot classifier with vmoe eval init.checkpoint=<the run>.")


# --- training ----------------------------------------------------------------------------------

@relation
def drop_upcycling_upcycles(init: InitConfig, model: ModelConfig):
  r = init.drop_upcycling_ratio  # floor(r * F) of each copied expert's F dimensions redrawn
  if r and not init.dense_to_experts:
    return (f"init.drop_upcycling_ratio={r:g} re-initialises part of each expert copied from a "
            "dense model's MLP, and init.dense_to_experts=false copies none: set "
            "init.dense_to_experts=true with init.checkpoint=<a dense ViT's run>, or drop it.")
  width = derived.expert_width(model)
  if r and derived.num_experts(model) and not int(r * width):
    return (f"init.drop_upcycling_ratio={r:g} re-initialises floor({r:g} x {width}) = 0 of an "
            f"expert's {width} intermediate dimensions (model.mlp_dim): use at least "
            f"{1 / width:.3g}, or 0 for plain copies.")


@relation
def duration_given(train: TrainConfig):
  if train.steps is None and train.epochs is None:
    return "set the training duration: train.steps=<n> or train.epochs=<x>."
  if train.steps is not None and train.epochs is not None:
    return (f"train.epochs={train.epochs:g} would be ignored: train.steps={train.steps} (each "
            "stage's recipe sets it) decides the run's length when both are set; add "
            f"train.steps=null to train for {train.epochs:g} epochs, or drop train.epochs.")


@relation
def optimizer_rules(optim: OptimConfig):
  """The chosen optimizer's own rules between its keys (its `problem`, stated where it is
  registered; none of the built-in ones has any)."""
  chosen = registries.OPTIMIZERS.get(optim.name)
  return chosen.problem(optim) if chosen.problem else None


@relation
def fewshot_in_training_names_datasets(train: TrainConfig, fewshot: FewshotConfig):
  if fewshot.every_steps and not fewshot.datasets:
    return (f"fewshot.every_steps={fewshot.every_steps} needs datasets to evaluate: "
            "fewshot.datasets=[uci_digits] (embedded or prepared TFDS names).")


# --- a timm or transformers ViT as init.checkpoint ---------------------------------------------

# What a fine-tune keeps of the ViT it starts from: its nonlinearity, its LayerNorms, its tokens
# and layer scale (the sizes, which the transfer checks, may differ where it maps them: the
# resolution, the head, MoE layers in place of MLPs).
_KEPT_BY_A_FINE_TUNE = ("activation", "layer_norm_eps", "registers", "layer_scale", "pre_norm")


def _checkpoint_models(run) -> list[tuple[str, ModelConfig, bool]]:
  """(checkpoint path, the model that reads it, whether it must be that checkpoint's model
  exactly: a later stage, not a fine-tune) for each checkpoint the run reads."""
  members = getattr(run, "members", None)
  if members is not None:
    return [(str(m.path), m.model, True) for m in members]
  init, model = getattr(run, "init", None), getattr(run, "model", None)
  if not isinstance(model, ModelConfig) or not isinstance(getattr(init, "checkpoint", None), str):
    return []
  if getattr(init, "tower", None) is not None:  # a contrastive run's tower: vmoe's own
    return []
  return [(init.checkpoint, model, not isinstance(run, TrainTask))]


@relation
def model_is_the_checkpoints_vit(run: RunFields, checkpoints):
  """A timm or transformers checkpoint says what its ViT is (its config.json and arrays): the
  model that evaluates it, probes it or exports it must be that ViT, and one fine-tuned from it
  keeps its activation, LayerNorms, tokens and layer scale. The keys its files do not state (a
  bare timm state_dict's activation) must be given."""
  read = getattr(checkpoints, "architecture", None)
  if read is None:
    return None
  for path, model, exact in _checkpoint_models(run):
    found = read(path)  # a CheckpointError stops the command here, before anything runs
    if found is None:
      continue
    if found.num_classes is None and isinstance(run, (EvalRun, EnsembleRun, ExportRun,
                                                      CompressRun)):
      return (f"init.checkpoint={path} is a {found.kind} ({found.name}) without a classifier "
              "head: a backbone, whose features vmoe fewshot probes; fine-tune a head on it "
              f"(vmoe finetune init.checkpoint={path} model=... data=...) to evaluate, ensemble, "
              "export or compress it.")
    same_pooling = str(model.classifier) == "gap" == found.stated.get("classifier")
    keys = [k for k in found.stated if exact or k in _KEPT_BY_A_FINE_TUNE
            or (k == "fc_norm" and same_pooling)]
    differ = [k for k in keys if not found.fits(k, getattr(model, k))]
    unsaid = "activation" in found.unstated and model.activation is None
    if not differ and not unsaid:
      continue
    add = [found.override(k) for k in differ]
    problems = []
    if differ:
      has = ", ".join(f"model.{k}={shown(_model_value(model, k))}" for k in differ)
      problems.append(f"its files say {', '.join(add)}, where the model has {has}")
    if unsaid:
      problems.append("its files do not say its MLPs' activation: give model.activation=gelu "
                      "(timm's default, exact GELU), quick_gelu (OpenAI CLIP) or gelu_tanh")
    return (f"init.checkpoint={path} is a {found.kind} ({found.name}): {'; '.join(problems)}"
            + (f". Add {' '.join(add)} to the command" if add else "")
            + ("" if exact else " (a fine-tune keeps what the ViT it starts from computes)")
            + ".")
  return None


def _model_value(model: ModelConfig, key: str):
  value = getattr(model, key)
  if key == "activation":
    return value or "gelu_tanh"
  return "null" if value is None else value


# --- evaluation and few-shot -------------------------------------------------------------------

def _evaluators() -> list:
  """Every registered evaluator class, in the order they run."""
  return [cls for _, cls in registries.EVALUATORS.items()]


def _given(cls, eval: EvalSuiteConfig) -> str:
  """The key that turned evaluator `cls` on, with its value, as one would type it."""
  value = cls.setting(eval)
  text = f"[{', '.join(map(shown, value))}]" if isinstance(value, (list, tuple)) else shown(value)
  return f"{cls.enabling_key}={text}"


# The metadata flag of an eval.* section that only a contrastive checkpoint reads (the zero-shot
# prompts, runner/evaluators/contrastive.py): given for a classifier it means nothing.
CONTRASTIVE_ONLY = "contrastive_only"


def _contrastive_sections(eval: EvalSuiteConfig) -> list[str]:
  return [f.name for f in dataclasses.fields(eval) if f.metadata.get(CONTRASTIVE_ONLY)]


@relation
def evaluations_during_training(eval: EvalConfig, objective: ObjectiveConfig):
  """Training measures its own validation split (a contrastive run's zero-shot reads the
  contrastive-only sections); evaluators not `in_training` are vmoe eval's."""
  defaults = sections.new(EvalConfig)
  names = ("datasets", "split", "save_predictions")
  if objective.name != Objective.contrastive:
    names += tuple(_contrastive_sections(eval))
  given = [f"eval.{name}" for name in names if getattr(eval, name) != getattr(defaults, name)]
  given += [cls.enabling_key for cls in _evaluators()
            if not cls.in_training and cls.enabling_key and cls.enabled(eval)]
  if given:
    return (f"{', '.join(given)} means nothing during training: the eval.* measurements run on "
            "the run's validation split every eval.every_steps and at the end; take them on "
            "other datasets, save predictions or take the measurements that are vmoe eval's "
            "alone with vmoe eval init.checkpoint=<the run>.")


def _contrastive_keys(eval: EvalSuiteConfig) -> list[str]:
  """The eval.* keys given that only a contrastive checkpoint reads (its sections' keys, the
  evaluators not `on_classifier`)."""
  given = [key for name in _contrastive_sections(eval)
           for key in changed_keys(getattr(eval, name), f"eval.{name}", show=_listed)]
  return given + [_given(cls, eval) for cls in _evaluators()
                  if not cls.on_classifier and cls.enabling_key and cls.enabled(eval)]


def _listed(value):
  """A list as Python writes it (['a photo of a {}.']), anything else as one would type it."""
  return list(value) if isinstance(value, (list, tuple)) else shown(value)


@relation
def zero_shot_needs_a_contrastive_checkpoint(run: EvalRun):
  """Prompts and the evaluators not `on_classifier` mean nothing for a classifier's checkpoint,
  those not `on_contrastive` nothing for a contrastive one (a zero-shot classifier)."""
  if run.init.tower is not None:
    return (f"init.tower={shown(run.init.tower)} means nothing in vmoe eval: a contrastive "
            "checkpoint is evaluated whole, as a zero-shot classifier (its image tower's "
            "features by vmoe fewshot); init.tower is for vmoe finetune.")
  given = _contrastive_keys(run.eval)
  if given and run.objective.name != Objective.contrastive:
    return (f"{', '.join(given)} means nothing for init.checkpoint={run.init.checkpoint}, a "
            "classifier: zero-shot classification from class prompts and the image-text "
            "measurements need a contrastive checkpoint (vmoe pretrain objective=contrastive); "
            f"drop {'them' if len(given) > 1 else 'it'}.")
  refused = [_given(cls, run.eval) for cls in _evaluators()
             if not cls.on_contrastive and cls.enabling_key and cls.enabled(run.eval)]
  if refused and run.objective.name == Objective.contrastive:
    which = ("the evaluators they turn on do" if len(refused) > 1
             else "the evaluator it turns on does")
    return (f"{', '.join(refused)} means nothing for init.checkpoint={run.init.checkpoint}, a "
            f"contrastive run evaluated as a zero-shot classifier, which {which} not measure; "
            f"drop {'them' if len(refused) > 1 else 'it'}, or evaluate a classifier fine-tuned "
            "from its image tower (vmoe finetune init.checkpoint=<the run> init.tower=image).")


@relation
def ensembles_of_classifiers(run: EnsembleRun):
  if towers := [m.path for m in run.members if m.objective == Objective.contrastive]:
    return (f"init.checkpoint names a contrastive run ({', '.join(towers)}): vmoe ensemble "
            "averages the predictions of classifiers, which a contrastive checkpoint is not; "
            "evaluate it zero-shot with vmoe eval init.checkpoint=<the run>, or fine-tune its "
            "image tower into a classifier (vmoe finetune init.checkpoint=<the run> "
            "init.tower=image) and ensemble that.")
  if given := _contrastive_keys(run.eval):
    return (f"{', '.join(given)} means nothing in vmoe ensemble: zero-shot classification and "
            "the image-text measurements are vmoe eval's, of one contrastive checkpoint; drop "
            f"{'them' if len(given) > 1 else 'it'}.")


@relation
def fewshot_names_datasets(run: FewshotRun):
  if not run.fewshot.datasets:
    return ("fewshot.datasets is empty: name the datasets to evaluate, e.g. "
            "fewshot.datasets=[uci_digits,mnist5k] (embedded or prepared TFDS names; "
            "'name:split' picks the test split).")


@relation
def members_share_preprocessing(run: FewshotRun):
  pps = [m.data.pp for m in run.members]
  if len(set(pps)) > 1:
    listing = "; ".join(f"{m.path}: {m.data.pp!r}" for m in run.members)
    return ("the checkpoints of init.checkpoint preprocess images differently, so their features "
            f"cannot be concatenated image by image ({listing}); combine checkpoints trained at "
            "the same resolution and value range.")


@relation
def ensemble_has_members(run: EnsembleRun):
  mc = run.ensemble.mc_dropout
  if mc:
    if len(run.members) != 1:
      return (f"ensemble.mc_dropout={mc} samples one checkpoint with its dropout on, but "
              f"init.checkpoint names {len(run.members)}; give one, or drop ensemble.mc_dropout "
              "for a deep ensemble of them.")
    if mc < 2:
      return f"ensemble.mc_dropout={mc} is one sample, not an ensemble: use 2 or more."
    model = run.members[0].model
    if not (model.moe.expert_dropout or model.dropout_rate or model.attention_dropout_rate):
      return ("ensemble.mc_dropout needs a model with dropout, but model.moe.expert_dropout, "
              "model.dropout_rate and model.attention_dropout_rate of "
              f"{run.members[0].path} are all 0 (set model.moe.expert_dropout=0.1, the "
              "fine-tuning rate, to sample with it).")
    return None
  size = sum(derived.ensemble_size(m.model) if m.model.moe.ensemble_variant
             != EnsembleVariant.partition_only else 1 for m in run.members)
  if size < 2:
    return (f"init.checkpoint names one member ({run.members[0].path}), which is not an ensemble: "
            "give two or more checkpoints, a partitioned batch ensemble "
            "(model.moe.ensemble_size >= 2), or ensemble.mc_dropout=<M> samples of one.")


@relation
def ensemble_members_agree(run: EnsembleRun):
  for what, value in (("preprocess images", lambda m: m.data.pp),
                      ("were trained with different losses", lambda m: m.loss.value)):
    values = [value(m) for m in run.members]
    if len(set(values)) > 1:
      listing = "; ".join(f"{m.path}: {v!r}" for m, v in zip(run.members, values))
      verb = what if what.startswith("were") else f"{what} differently"
      return (f"the members of init.checkpoint {verb} ({listing}), so their predictions cannot "
              "be averaged image by image; combine checkpoints trained with the same "
              "preprocessing and loss.")


# --- vmoe export -------------------------------------------------------------------------------

def unexportable(model: ModelConfig) -> str | None:
  """What of `model` vmoe export cannot write, or None: a router family says how it routes in
  PyTorch (`RouterFamily.torch_routing`); the exporter refuses a family that does not."""
  if not derived.num_experts(model):
    return None
  family = derived.router_family(model)
  if family.torch_routing(derived.router(model), tokens=derived.tokens_per_group(model),
                          experts=derived.num_experts(model)) is None:
    return (f"model.router.type={family.name} does not say how it routes in PyTorch, so vmoe "
            "export cannot write this model; its family defines RouterFamily.torch_routing "
            "for that (docs/extending.md), as the built-in token_choice, experts_choice and "
            "soft do.")
  return None


@relation
def exporter_expresses_the_router(model: ModelConfig, run: ExportRun):
  return unexportable(model)


# --- vmoe compress ------------------------------------------------------------------------------

@relation
def compression_fits(model: ModelConfig, run: CompressRun):
  """E' fewer than the experts, whole per member and per fine-grained expert, and a family whose
  tokens choose experts."""
  c, experts = run.compress, derived.num_experts(model)
  if not experts:
    return (f"init.checkpoint={run.init.checkpoint} is a dense ViT (model {model.name}): it has no "
            "experts to compress; vmoe compress takes a V-MoE.")
  family = derived.router_family(model)
  if not family.discrete:
    return (f"model.router.type={family.name} does not route each token to chosen experts (Soft "
            "MoE's slots mix every token), so there is no per-expert choice to prune or merge by; "
            "vmoe compress takes token-choice and experts-choice V-MoEs.")
  if c.experts is None or c.experts >= experts:
    return (f"vmoe compress needs compress.experts=<E'>, the routed experts each MoE layer keeps, "
            f"fewer than the checkpoint's {experts}" + (f" (got {c.experts})." if c.experts
                                                        else "."))
  groups, split = derived.expert_partitions(model), derived.expert_split(model)
  reasons = ([f"each of the ensemble's {groups} members keeps as many of its own experts"]
             if groups > 1 else []) + (
      [f"model.moe.expert_split={split} makes each expert {split} routed ones"] if split > 1 else [])
  if c.experts % (groups * split):
    return (f"compress.experts={c.experts} must be a multiple of {groups * split}: "
            f"{' and '.join(reasons)}; e.g. compress.experts={groups * split}.")
  subsets = (math.comb(experts // groups, c.experts // groups) ** groups
             if c.method == CompressMethod.prune else 0)
  if subsets > PRUNE_SUBSETS_MAX:
    return (f"compress.method=prune measures every way to keep {c.experts} of the {experts} "
            f"experts in each MoE layer: {subsets:,} subsets here, more than the "
            f"{PRUNE_SUBSETS_MAX:,} it measures; use compress.method=prune_frequency (the most "
            "chosen experts) or compress.method=merge.")
  batch = "data.eval_batch_size" if run.data.eval_batch_size else "data.batch_size"
  return batch_problem(int(run.data.eval_batch_size or run.data.batch_size), batch, model, 1)


# --- multi-host start-up -----------------------------------------------------------------------

@relation
def coordinator_knows_the_processes(distributed: DistributedConfig):
  d = distributed
  if d.coordinator_address is None:
    given = [f"distributed.{k}={v}" for k, v in (("num_processes", d.num_processes),
                                                 ("process_id", d.process_id)) if v is not None]
    return (f"{', '.join(given)} means nothing without distributed.coordinator_address="
            "<host:port> of process 0: give all three to start the processes by hand; a job JAX "
            "detects (SLURM, TPU VMs) needs none of them.") if given else None
  if d.num_processes is None or d.process_id is None or d.process_id >= d.num_processes:
    return (f"distributed.coordinator_address={d.coordinator_address} needs "
            f"distributed.num_processes=<n> and distributed.process_id=<0..n-1>; got "
            f"num_processes={d.num_processes}, process_id={d.process_id}.")


# --- the devices -------------------------------------------------------------------------------

def batch_problem(batch_size: int, what: str, model: ModelConfig, devices: int,
                  accum_steps: int = 1) -> str | None:
  """A batch must split evenly over the devices, the micro-batches, and the routing groups."""
  if batch_size % devices:
    return (f"{what}={batch_size} is not divisible by the {devices} devices; use a multiple of "
            f"{devices}.")
  if batch_size % accum_steps:
    return f"train.accum_steps={accum_steps} must divide {what}={batch_size}."
  if not derived.num_experts(model):
    return None
  group = model.moe.group_size
  per_device = batch_size // accum_steps // devices
  if per_device % group == 0 or (devices <= 1 and per_device < group):
    return None
  split = f"{devices} device(s)" + (f", train.accum_steps={accum_steps}"
                                    if what == "data.batch_size" else "")
  return (f"{what}={batch_size} gives {per_device} images per device and micro-batch "
          f"({split}); routing groups of "
          f"model.moe.group_size={group} images must tile each device's share: use a multiple "
          f"of {group * devices * accum_steps} images, or a group size dividing {per_device}.")


@relation
def train_batch_fits(data: DataConfig, train: TrainConfig, model: ModelConfig, devices: int):
  return batch_problem(data.batch_size, "data.batch_size", model, devices, train.accum_steps)


@relation
def training_eval_batch_fits(data: DataConfig, eval: EvalConfig, model: ModelConfig,
                             devices: int):
  if eval.batch_size or data.eval_batch_size:
    return batch_problem(derived.eval_batch_size(eval, data), "eval.batch_size", model, devices)


@relation
def training_fewshot_batch_fits(data: DataConfig, eval: EvalConfig, fewshot: FewshotConfig,
                                model: ModelConfig, devices: int):
  if derived.fewshot_in_training(fewshot):
    return batch_problem(derived.fewshot_batch_size(fewshot, data, eval.batch_size),
                         "fewshot.batch_size", model, devices)


@relation
def inference_batch_fits(run: RunFields, devices: int):
  """eval, ensemble and few-shot: their batch must fit every model they hold."""
  batch = derived.inference_batch(run)
  if batch is None:
    return None
  problems = (batch_problem(*batch, model, devices) for model in derived.held_models(run))
  return next(filter(None, problems), None)


@relation
def workdir_is_a_folder(run: RunFields):
  """A run writes its workdir with local file operations (a mounted file system serves): an
  empty path would be the current folder, a URL a folder named after it."""
  given = str(run.workdir)
  if not given.strip():
    what = "is empty"
  elif "://" in given:
    what = "is a URL"
  else:
    path = pathlib.Path(given).expanduser().absolute()
    file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if file is None:
      return None
    what = f"is the file {file}" if file == path else f"lies under the file {file}"
  return (f"workdir={given!r} {what}: a run writes its checkpoints, config and metrics into a "
          "folder of this machine's file system (a mounted one too); give one, e.g. "
          "workdir=runs/up.")


@relation
def workdir_is_not_an_input(run: RunFields):
  """A stage never writes over what it reads: its workdir is none of its input runs, holds none
  of them and lies inside none (finetune, eval, fewshot, ensemble, compress, export, and a
  pretrain that starts from a checkpoint). A checkpoint folder (<run>/checkpoints/<step>) stands
  for its run."""
  workdir = pathlib.Path(str(run.workdir)).expanduser().resolve()
  for given in derived.input_runs(run):
    if "://" in given:  # a remote path: not this machine's folders
      continue
    path = pathlib.Path(given).expanduser().resolve()
    if path.parent.name == "checkpoints":
      path = path.parent.parent
    if workdir == path:
      how, outer = "is", path
    elif workdir in path.parents:
      how, outer = "holds", workdir
    elif path in workdir.parents:
      how, outer = "lies inside", path
    else:
      continue
    return (f"workdir={run.workdir} {how} the run it reads (init.checkpoint={given}): a run "
            "writes its checkpoints, config.yaml, metrics and report into its workdir, so the "
            "input would no longer say what it holds. Give this run a workdir of its own, outside "
            f"the input's folder (e.g. workdir={outer.parent / (outer.name + '-next')}).")
  return None


@relation
def experts_split_for_the_router(run: RunFields):
  """Sharding that splits the experts for a router that cannot run so; whatever the device
  count, so that a run refused on a cluster is refused on a laptop too."""
  sharding = run.sharding
  if not expert_mesh_axes(sharding.name, sharding.rules):
    return None
  where = (f"sharding={sharding.name}" if sharding.rules is None
           else f"sharding.rules={shown(sharding.rules)}")
  problems = (derived.router_family(model).expert_parallel_problem(model.router, where)
              for model in derived.held_models(run) if derived.num_experts(model))
  return next(filter(None, problems), None)


@relation
def mesh_fits(run: RunFields, devices: int):
  for model in derived.held_models(run):
    try:
      mesh_shape(run.mesh.data, run.mesh.expert, devices, derived.num_experts(model))
    except ConfigError as e:
      return str(e)
  return None
