"""The checkpoints that `vmoe eval` and `vmoe ensemble` evaluate, run as one model.

One checkpoint (a ViT, a V-MoE, a partitioned batch ensemble) is its own flax model; several
checkpoints (a deep ensemble) or MC-dropout samples become a `runner.models.ensemble.Ensemble`.
A contrastive checkpoint is one member too: its two towers as a zero-shot classifier
(`zero_shot`, runner/inference/zero_shot.py), whose parameters hold the class embeddings. Either way
the evaluators see "a model" whose logits are the prediction and whose extras carry the members'
logits when there are several (design principle 12: an ensemble is a list of members)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from runner.checkpoints import weights
from runner.config import derived
from runner.config.schema import EnsembleVariant, ModelConfig
from runner.errors import ConfigError
from runner.models import build_model, flops as flops_lib, heads, size, tokens_per_group
from runner.models.ensemble import Ensemble
from runner.stages import setup
from runner.train import state as state_lib


@dataclasses.dataclass
class Checkpoint:
  path: str
  step: int
  config: ModelConfig
  params: dict  # host NumPy arrays
  zero_shot: Any = None  # a contrastive checkpoint: runner/inference/zero_shot.py `ZeroShot`

  def build(self, config: ModelConfig, num_classes: int, output: str):
    """This checkpoint's flax model with `config` (its own, or with inference changes)."""
    return (self.zero_shot.model(config) if self.zero_shot is not None
            else build_model(config, num_classes, output=output))

  @property
  def predicting_params(self) -> dict:
    """The parameters a prediction uses (a zero-shot classifier's text tower ran once, before)."""
    return self.zero_shot.per_image(self.params) if self.zero_shot is not None else self.params


def _with_router(config: ModelConfig, changes: dict) -> ModelConfig:
  """`config` with `changes` to its router (inference capacity, Batch Prioritized Routing)."""
  return (dataclasses.replace(config, router=dataclasses.replace(config.router, **changes))
          if changes else config)


class Members:
  """Loaded checkpoints, the way they combine, and what they cost."""

  def __init__(self, checkpoints: list[Checkpoint], *, output: str, mc_samples: int = 0,
               seed: int = 0):
    self.checkpoints, self.output, self.mc_samples, self.seed = checkpoints, output, mc_samples, seed
    classes = [c.zero_shot.num_classes if c.zero_shot is not None else
               heads.num_classes(c.params) for c in checkpoints]
    if len(set(classes)) > 1:
      listing = "; ".join(f"{c.path}: {n} classes" for c, n in zip(checkpoints, classes))
      raise ConfigError("the members of an ensemble must predict the same classes, but their heads "
                        f"differ ({listing}); combine checkpoints fine-tuned on the same dataset.")
    self.num_classes = classes[0]
    self.placed = None

  @property
  def is_one_model(self) -> bool:
    return len(self.checkpoints) == 1 and not self.mc_samples

  def model(self, **router_changes):
    """The flax model of one checkpoint, or an `Ensemble`; `router_changes` (inference capacity,
    Batch Prioritized Routing) apply to every member with experts."""
    models = [c.build(_with_router(c.config, router_changes), self.num_classes, self.output)
              for c in self.checkpoints]
    if self.is_one_model:
      return models[0]
    return Ensemble(models, output=self.output, mc_samples=self.mc_samples, seed=self.seed)

  @property
  def size(self) -> int:
    """Members in all (a V-MoE or a ViT alone: 1; MC-dropout of a pBE: samples x M)."""
    tiled = sum(1 if c.zero_shot is not None else derived.predictions_per_image(c.config)
                for c in self.checkpoints)
    return tiled * (self.mc_samples or 1)

  def check_fit(self, image_shape, command: str) -> None:
    for c in self.checkpoints:
      model = c.build(c.config, self.num_classes, self.output)
      setup.check_params_fit(c.path, c.step, c.params, model, image_shape, command)

  def place(self, placement, image_shape):
    """Parameters on the devices, laid out as each model's logical axes say (call once)."""
    placed = []
    for c in self.checkpoints:
      _, logical = state_lib.abstract_params(
          c.build(c.config, self.num_classes, self.output), image_shape)
      placed.append(jax.device_put(c.params, placement.shardings(logical)))
    self.placed = placed[0] if self.is_one_model else tuple(placed)
    return self.placed

  def analytic_flops(self, batch_size: int, **router_changes) -> float:
    """Forward matmul FLOPs per image of every member. MC-dropout samples share what precedes the
    first layer with dropout: counted as a V-MoE's tiled copies where its only dropout is in its
    experts (the paper's MC-dropout V-MoE, tiled at the first MoE layer), else as whole passes."""
    total = 0.0
    for c in self.checkpoints:
      config = _with_router(c.config, router_changes)
      samples = self.mc_samples or 1
      if c.zero_shot is not None:
        total += samples * c.zero_shot.flops_per_image(config, batch_size)
        continue
      if samples > 1 and derived.num_experts(config) and derived.ensemble_size(config) == 1 and \
          not (config.dropout_rate or config.attention_dropout_rate):
        config = dataclasses.replace(config, moe=dataclasses.replace(
            config.moe, ensemble_size=samples, ensemble_variant=EnsembleVariant.tiling_only))
        samples = 1
      total += samples * flops_lib.forward_flops_per_image(
          config, self.num_classes, batch_size=batch_size, train=False)
    return total

  def params_total(self) -> int:
    return sum(size.count_params(c.predicting_params) for c in self.checkpoints)

  def params_active(self) -> int:
    """Parameters one token uses: each member's experts count (experts per token) / E, as its
    router family says (token-choice: k; per partition of a pBE, k of E/M; k*m of E*m
    fine-grained experts); shared experts count whole, as every token uses them."""
    total = 0
    for c in self.checkpoints:
      experts = derived.num_experts(c.config)
      if not experts:
        total += size.active_params(c.predicting_params, 0, 0)
        continue
      config = c.config
      tokens = tokens_per_group(config)
      family = derived.router_family(config)
      router = derived.router(config)  # k*m of E*m fine-grained experts
      capacity = family.capacity(router, tokens, experts, train=False)
      chosen = family.experts_per_token(router, tokens, experts, capacity)
      chosen *= derived.ensemble_size(config)
      total += size.active_params(c.predicting_params, experts, min(chosen, experts))
    return total

  @property
  def steps(self) -> list[int]:
    return [c.step for c in self.checkpoints]


def load(opened_and_models: list[tuple[weights.Opened, ModelConfig]], *, output: str,
         mc_samples: int = 0, seed: int = 0) -> Members:
  """Reads every opened checkpoint's parameters (host memory), checks their heads agree."""
  checkpoints = []
  for opened, config in opened_and_models:
    params, _, step = opened.load(ensemble_size=derived.ensemble_size(config))
    checkpoints.append(Checkpoint(path=opened.path, step=step, config=config, params=params))
  return Members(checkpoints, output=output, mc_samples=mc_samples, seed=seed)
