"""The router-family interface: the `Plan` a router returns, the `RouterFamily` that answers the
rest of vmoe, and the registry (`register`, `family`) that resolves `model.router.type`. See the
package's docstring for what a family is."""
from __future__ import annotations

import dataclasses
import typing
from typing import Mapping, Protocol

import jax

from runner.config import components, registries
from runner.config.schema import DEFAULT_ROUTER
from runner.models.param_updates import ParamUpdate


class Plan(Protocol):
  """What a router returns besides its metrics (see the package docstring)."""
  num_experts: int
  capacity: int

  def dispatch(self, x: jax.Array, method: str) -> jax.Array:
    """(G, S, D) tokens -> (E, G, C, D) expert buffers."""

  def combine(self, y: jax.Array, method: str) -> jax.Array:
    """(E, G, C, D) expert outputs -> (G, S, D) tokens."""

  def expert_weights(self) -> jax.Array:
    """(G, S, E) the weight each token gives each expert: the gates, or (soft) each token's share
    of its dispatch mass per expert (rows sum to 1)."""

  def expert_mask(self, routed: bool) -> jax.Array | None:
    """(G, S, E) bool: the experts a token chose, or (`routed`) that process it after capacity.
    Asked only of a `discrete` family's plan; None without discrete choices (soft)."""

  # A plan whose class sets `ragged = True` (dropless `DroplessPlan`) has no buffers: the layer
  # asks it for `layout()`, `rows(x, layout)` and `combine_rows(y, layout)` instead (layer.py).


# A router hands over its own losses in its metrics: LOSSES, {metric name: weight}, says which of
# its metrics enter the training loss and with what weight (ST-MoE's z-loss: {"z_loss": c_z}).
# The model sums each over its MoE layers and weights the sum (`weighted_losses`); the objective
# adds every one to the loss and logs it as train/<name>. The balance loss, `auxiliary_loss`, is
# the one weighted by the trainer (train.aux_loss_weight), as in the V-MoE paper.
LOSSES = "losses"


def split_losses(metrics: dict) -> tuple[dict, dict]:
  """(the metrics without the record, the record {name: weight})."""
  return {k: v for k, v in metrics.items() if k != LOSSES}, dict(metrics.get(LOSSES, {}))


def weighted_losses(layers: list[tuple[dict, dict]]) -> dict:
  """{name: weight x its sum over the layers} from each layer's (metrics, losses record)."""
  weights = {name: weight for _, losses in layers for name, weight in losses.items()}
  return {name: weight * sum(metrics[name] for metrics, losses in layers if name in losses)
          for name, weight in weights.items()}


@dataclasses.dataclass(frozen=True)
class TorchRouting:
  """How a family routes in PyTorch, what `vmoe export` writes for its routers (docs/extending.md,
  "Export", states each field); `source` is kept in `<module>_torch.py`, which nothing imports."""
  config: Mapping[str, typing.Any]
  source: str
  class_name: str
  parameters: Mapping[str, tuple[str, tuple[int, ...] | None]] = dataclasses.field(
      default_factory=lambda: {"dense/kernel": ("dense.weight", (1, 0))})


class RouterFamily:
  """A router family's answers to the rest of vmoe (never decided by its name); `router` is the
  `model.router` config. A plug-in defines `name`, `module`, `Config`, `summary`, `module_kwargs`,
  `capacity` and `experts_per_token`; every other hook defaults to what suits tokens picking
  experts by a (D, E) gate kernel (docs/extending.md says who asks each hook)."""
  name: str = ""
  module: type  # the Flax module class
  Config: type  # a dataclass: the model.router.* keys this family reads (besides `type`)
  options: tuple[str, ...] = ()  # their names (set by `register`)
  supports_ensembles: bool = False  # partitioned batch ensembles (E³)
  supports_batch_priority: bool = False
  capacity_at_inference: bool = True  # eval may change the capacity ratio (capacity sweeps)
  discrete: bool = True  # tokens go to chosen experts (PGD routing change is defined)
  uses_dispatcher: bool = True  # model.moe.dispatcher (indices or einsum) applies
  supports_expert_split: bool = False  # model.moe.expert_split (fine-grained experts)
  summary: str = ""  # one line for error messages and docs
  router_parameters: tuple[str, ...] = ("dense/kernel",)  # under the layer's `router/`
  analysis_views: tuple[str, ...] = ()  # the routing analysis' extra views that apply

  @classmethod
  def problem(cls, model) -> str | None:
    """What is wrong with `model` (a ModelConfig with MoE layers and this family's router)."""
    del model
    return None

  @classmethod
  def runs_grouped_matmul(cls, router) -> bool:
    """Whether, with the keys of `router`, its experts run as grouped matmuls."""
    del router
    return False

  @classmethod
  def split_router(cls, router, m: int):
    """`router` as it routes E*m fine-grained experts, each expert's MLP split into m
    (DeepSeekMoE); None: this family cannot, and vmoe refuses model.moe.expert_split > 1."""
    del router, m
    return None

  @classmethod
  def unread_key_problem(cls, router) -> str | None:
    """Why a key of `router` that this family does not read is wrong (asked before the generic
    check that such a key keeps its default); None: the generic message."""
    ratio = getattr(router, "eval_capacity_ratio", None)
    if cls.capacity_at_inference or ratio is None:
      return None
    return (f"model.router.eval_capacity_ratio={ratio} (a capacity ratio at inference, which "
            "vmoe eval's model.router.capacity_ratio also sets) means nothing for "
            f"model.router.type={cls.name}: its slots are parameters fixed when the model is "
            "trained. Drop it; to compare capacities, train with model.router.capacity_ratio or "
            "model.router.slots_per_expert.")

  @classmethod
  def at_inference(cls, given: dict) -> dict:
    """A later stage's given model.router.* keys (a dict) as they apply at inference: where the
    capacity may change there, a given capacity_ratio sets eval_capacity_ratio too unless that is
    given; elsewhere (Soft MoE) it keeps its training meaning, as the keys that trained a model."""
    if cls.capacity_at_inference and "capacity_ratio" in given and (
        "eval_capacity_ratio" not in given):
      return {**given, "eval_capacity_ratio": given["capacity_ratio"]}
    return given

  @classmethod
  def later_stage_problem(cls, stored: dict, given: dict) -> str | None:
    """What a later stage's given model.router.* keys change that the checkpoint fixed (`stored`:
    as trained; both plain dicts): where the capacity is fixed at training, the slots' keys."""
    if cls.capacity_at_inference:
      return None
    for key in ("capacity_ratio", "slots_per_expert"):
      new, kept = given.get(key), stored.get(key)
      if new is not None and str(new) != str(kept):
        return (f"model.router.{key}={new} differs from the checkpoint's {kept}: for "
                f"model.router.type={cls.name} it sets the slots, parameters fixed when the "
                "model is trained, so a later stage cannot change it. Drop the override (the "
                "keys that trained the model may be repeated), or train with the new value.")
    return None

  @classmethod
  def expert_parallel_problem(cls, router, sharding: str) -> str | None:
    """Why `router` cannot run with the experts' weights split over devices (`sharding`: that
    setting as typed, e.g. "sharding=ep"); None: it can (fixed-capacity buffers, all-to-all)."""
    del router, sharding
    return None

  @classmethod
  def without_capacity(cls, router) -> str | None:
    """Why `router` has no capacity for the capacity sweep to vary, a clause naming its key;
    None: it has one (or it is fixed at training: `capacity_at_inference`)."""
    del router
    return None

  @classmethod
  def module_kwargs(cls, router, *, tokens: int, experts: int) -> dict:
    """The Flax module's keyword arguments (besides num_experts) from the config; `tokens` are
    those of a full routing group, `experts` the layer's."""
    raise NotImplementedError

  @classmethod
  def capacity(cls, router, tokens: int, experts: int, *, train: bool) -> int:
    """Slots per expert for a routing group of `tokens` tokens."""
    raise NotImplementedError

  @classmethod
  def expert_rows(cls, router, tokens: int, experts: int, capacity: int) -> float:
    """Rows the experts compute for a routing group of `tokens` tokens: every buffer slot, E *
    capacity, filled or not (FLOP counting's padded capacity)."""
    del router, tokens
    return experts * capacity

  @classmethod
  def router_flops(cls, tokens: int, dim: int, experts: int, capacity: int) -> float:
    """Matmul FLOPs of routing one group (gates, and for soft routers the two mixing einsums)."""
    return 2.0 * tokens * dim * experts

  @classmethod
  def experts_per_token(cls, router, tokens: int, experts: int, capacity: int) -> float:
    """How many experts' parameters one token uses on average (active parameters)."""
    raise NotImplementedError

  @classmethod
  def expert_ids(cls, plan, routed: bool) -> jax.Array | None:
    """(G, S, k) int32: each token's k chosen experts (the plan's ids) before capacity, or
    (`routed`) -1 where no buffer processes the choice; None without k choices per token."""
    del plan, routed
    return None

  @classmethod
  def sown_records(cls, plan) -> dict[str, jax.Array]:
    """{name: (G, S, N) array}: what the layer also sows, per image as (images, tokens, N)."""
    del plan
    return {}

  @classmethod
  def param_updates(cls, router, stage: str) -> tuple[ParamUpdate, ...]:
    """What the train step of `stage` ("pretrain", "finetune") sets after the optimizer."""
    del router, stage
    return ()

  @classmethod
  def torch_routing(cls, router, *, tokens: int, experts: int) -> TorchRouting | None:
    """How this family's routers run in PyTorch at inference, for `vmoe export` (arguments as
    `module_kwargs`); None: vmoe export refuses a model that uses it."""
    del router, tokens, experts
    return None

  @classmethod
  def dropped_at_capacity(cls, router, weights: jax.Array, capacity: int) -> dict[str, jax.Array]:
    """{routing ("vanilla", "bpr"): (G, S) bool, True where no expert processes the token} when
    groups with `weights` (G, S, E) (as `Plan.expert_weights`) are routed again at `capacity`
    slots per expert. Empty: no dropped-patch maps (it drops nothing, or cannot replan)."""
    del router, weights, capacity
    return {}


def register(family_cls: type[RouterFamily]) -> type[RouterFamily]:
  """Registers a router family under `family_cls.name` (a class decorator, as for plug-ins)."""
  family_cls.options = components.register(components.ROUTER, family_cls.name, family_cls,
                                           family_cls.Config)
  return family_cls


DEFAULT = DEFAULT_ROUTER  # the schema's default family


def family(name: str | None) -> type[RouterFamily]:
  """The family registered as `name` (None: the schema's default, token-choice)."""
  return registries.ROUTERS.get(str(name or DEFAULT))
