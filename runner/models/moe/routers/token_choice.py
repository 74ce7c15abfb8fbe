"""Token-choice routing, the router of V-MoE: each token picks its TOP-k experts (Riquelme et al.).

docs/routers.md states its options; the policy itself is `runner.models.moe.routing`. The reference
code names this router `NoisyTopExpertsPerItemRouter` (vmoe/nn/routing.py)."""
from __future__ import annotations

import dataclasses
import enum
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from runner.config import derived
from runner.config.checks import at_least, key, positive
from runner.models.moe import balance, routing, z_loss
from runner.models.moe.routers.base import LOSSES, RouterFamily, TorchRouting, register
from runner.models.param_updates import ParamUpdate

# Keys other families read too, with the same type, default and hint in each.
SHARED_KEYS = {
    "capacity_ratio": lambda: key(1.05, positive(), "1.05 upstream; below 1 drops tokens, which "
                                  "Batch Prioritized Routing makes graceful"),
    "eval_capacity_ratio": lambda: key(None, positive(), "null: same as capacity_ratio"),
    "noise_std": lambda: key(None, at_least(0), "null: the router's default, 1 for token- and "
                             "experts-choice (multiplied by 1/E, as V-MoE), 0 for soft"),
    "capacity_rounding": lambda: key(CapacityRounding.paper, hint="paper: round(k*N*C/E); "
                                     "reference: ceil, then a multiple of 4 (vmoe code)"),
    "z_loss_weight": lambda: key(0.0, at_least(0), "c_z of ST-MoE's router z-loss (eq. 5), "
                                 "added to the training loss: the paper's 0.001; 0: off"),
}


class Priority(enum.StrEnum):
  """Batch Prioritized Routing's score: a token's largest gate, or the sum of its TOP-k."""
  max = "max"
  sum = "sum"


class CapacityRounding(enum.StrEnum):
  """How an expert's buffer size follows from k * tokens * C / E (runner/models/moe/routing.py)."""
  paper = "paper"  # round half up, at least 1 (V-MoE §2.4)
  reference = "reference"  # ceil, then up to a multiple of 4 (vmoe/moe.py compute_capacity)


class Gate(enum.StrEnum):
  softmax = "softmax"  # softmax(Wx + eps), V-MoE
  sigmoid = "sigmoid"  # sigmoid(Wx + eps), TOP-k weights normalized to sum to 1 (DeepSeek-V3)


class BalanceScope(enum.StrEnum):
  group = "group"  # the auxiliary losses per routing group, averaged (V-MoE)
  batch = "batch"  # per-expert sums over the whole batch first (Qiu et al. 2025)


class Balance(enum.StrEnum):
  aux_loss = "aux_loss"  # V-MoE's importance and load losses in the training loss
  bias = "bias"  # auxiliary-loss-free: a per-expert bias for choosing (Wang et al. 2024)


@dataclasses.dataclass
class TokenChoiceConfig:
  """model.router.* of router type token_choice."""
  k: int = key(2, at_least(1), "experts per token")
  capacity_ratio: float = SHARED_KEYS["capacity_ratio"]()
  eval_capacity_ratio: Optional[float] = SHARED_KEYS["eval_capacity_ratio"]()
  batch_priority: bool = False
  priority: Priority = Priority.max
  noise_std: Optional[float] = SHARED_KEYS["noise_std"]()
  capacity_rounding: CapacityRounding = SHARED_KEYS["capacity_rounding"]()
  gate: Gate = key(Gate.softmax, hint="softmax: V-MoE; sigmoid: sigmoid scores, the TOP-k "
                   "weights normalized to sum to 1 (DeepSeek-V3)")
  balance_scope: BalanceScope = key(BalanceScope.group, hint="group: the auxiliary losses per "
                                    "routing group (V-MoE); batch: over the whole batch "
                                    "(global-batch balancing, Qiu et al. 2025)")
  balance: Balance = key(Balance.aux_loss, hint="aux_loss: V-MoE's auxiliary losses; bias: "
                         "auxiliary-loss-free, a per-expert bias on the scores that choose the "
                         "TOP-k, moved after every step towards even loads (Wang et al. 2024)")
  bias_update_rate: Optional[float] = key(None, at_least(0), "u in b_i += u*sign(mean load - "
                                          "load_i), the paper's 0.001; null: 0.001 in pretrain, "
                                          "0 (a frozen bias) in finetune")
  dropless: bool = key(False, hint="true: every chosen assignment is processed, nothing dropped, "
                       "no capacity (the experts as grouped matmuls over tokens sorted by expert)")
  z_loss_weight: float = SHARED_KEYS["z_loss_weight"]()


# The initialiser of the (D, E) router kernel (experts-choice's too).
KERNEL_INIT = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None))
# Whole on every device: every routing group adds all of it.
_BIAS_INIT = nn.with_logical_partitioning(nn.initializers.zeros, (None,))


class _PartitionedKernel(nn.Module):
  """The router's (D, E) kernel, at the path and with the initialisation of `nn.Dense`, so that a
  V-MoE checkpoint and a partitioned batch ensemble share it unchanged."""
  num_experts: int

  @nn.compact
  def __call__(self, dim: int) -> jax.Array:
    return self.param("kernel", KERNEL_INIT, (dim, self.num_experts), jnp.float32)


class NoisyTopKRouter(nn.Module):
  """g(x) = TOP_k(softmax(Wx + eps)); returns a `DispatchPlan` (dropless: a `DroplessPlan`) and
  per-layer metrics.

  With `partitions` P > 1 (a partitioned batch ensemble, E³) group g is routed by partition g % P
  of E/P contiguous experts alone, exactly as a V-MoE with E/P experts (its own router columns,
  noise std noise_std / (E/P), capacity and auxiliary losses; Allingham et al., eq. 3 and
  Ω_partition of App. D.2); the plan indexes the experts of the group's partition. With
  `balance="bias"` (docs/routers.md) the router has a parameter `balance_bias` (E,) and, in
  training, sows the batch's loads (P, E/P) in `balance_loads` for the train step (balance.py).
  Always float32: routing decisions are discrete, and bfloat16 rounding would change them."""
  num_experts: int
  k: int = 2
  capacity_ratio: float = 1.05
  eval_capacity_ratio: float | None = None
  batch_priority: bool = False
  priority: str = "max"
  noise_std: float = 1.0
  capacity_rounding: str = "paper"  # routing.expert_capacity: "paper" or "reference"
  partitions: int = 1
  gate: str = "softmax"  # or "sigmoid": routing.sigmoid_gates
  balance_scope: str = "group"  # or "batch": balance.py
  balance: str = "aux_loss"  # or "bias": auxiliary-loss-free balancing, balance.py
  dropless: bool = False  # every assignment processed: routing.plan_dropless, no capacity
  z_loss_weight: float = 0.0  # > 0: the logits' z-loss, a metric and a loss (base.LOSSES)

  @nn.compact
  def __call__(self, x: jax.Array, *,
               train: bool) -> tuple[routing.DispatchPlan | routing.DroplessPlan, dict]:
    """x: (G, S, D) groups of tokens (G a multiple of `partitions`)."""
    num_groups, num_tokens, dim = x.shape
    p = self.partitions
    experts = self.num_experts // p
    x = x.astype(jnp.float32)
    if p == 1:
      # The expert dimension of the router stays whole on every device: top-k needs all of it.
      logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                        param_dtype=jnp.float32, kernel_init=KERNEL_INIT, name="dense")(x)
    else:  # (G/P, P, S, D) x (D, P, E/P): each group meets its partition's columns only
      kernel = _PartitionedKernel(self.num_experts, name="dense")(dim).reshape(dim, p, experts)
      logits = jnp.einsum("gpsd,dpe->gpse", x.reshape(num_groups // p, p, num_tokens, dim),
                          kernel).reshape(num_groups, num_tokens, experts)
    gates_clean = routing.gate_weights(logits, self.gate, self.k)
    metrics = {"importance_loss": balance.importance_loss(
        routing.importance_weights(logits, gates_clean, self.gate), self.balance_scope, p)}
    if self.z_loss_weight:  # on the logits before noise, over the experts each token chooses among
      metrics["z_loss"] = z_loss.z_loss(logits)
      metrics[LOSSES] = {"z_loss": self.z_loss_weight}  # the model weighs and adds it
    noise_std = self.noise_std / experts
    routed = logits  # what the TOP-k is chosen on
    if train and noise_std > 0:
      noisy = routed = logits + noise_std * jax.random.normal(self.make_rng("gating"), logits.shape)
      gates = routing.gate_weights(noisy, self.gate, self.k)
      metrics["load_loss"] = balance.load_loss(logits, noisy, noise_std, self.k,
                                               self.balance_scope, p)
      metrics["auxiliary_loss"] = 0.5 * metrics["importance_loss"] + 0.5 * metrics["load_loss"]
    else:
      # No noise (evaluation, or noise_std = 0): no load loss, and the importance loss keeps its
      # weight 1/2, as in the reference code, whose two loss weights are both lambda / 2 (0.005;
      # vmoe/nn/routing.py, vmoe/configs/vmoe_paper/common.py).
      gates = gates_clean
      metrics["auxiliary_loss"] = 0.5 * metrics["importance_loss"]
    select = None
    if self.balance == "bias":  # the losses above are metrics only: none enters the loss
      bias = self.param(balance.BIAS, _BIAS_INIT, (self.num_experts,), jnp.float32)
      gates, select = routing.biased_gates(routed, self.gate, self.k,
                                           balance.group_bias(bias, num_groups, p))
      metrics["auxiliary_loss"] = jnp.zeros((), jnp.float32)
      metrics["bias_spread"] = jnp.max(bias) - jnp.min(bias)
    elif self.balance != "aux_loss":
      raise ValueError(f"unknown balance {self.balance!r}; valid: {balance.BALANCES}")
    if self.dropless:  # every token's TOP-k processed: no capacity, nothing dropped
      if p > 1:
        raise ValueError("dropless routing does not form partitioned batch ensembles")
      plan = routing.plan_dropless(gates, k=self.k, select=select)
    else:
      capacity = routing.expert_capacity(num_tokens, experts, self.k,
                                         routing.ratio_in_force(self, train),
                                         self.capacity_rounding)
      plan = routing.plan_dispatch(gates, k=self.k, capacity=capacity, select=select,
                                   batch_priority=self.batch_priority, priority=self.priority)
    if select is not None and train:  # the train step moves the bias (TokenChoice.param_updates)
      self.sow(balance.LOADS, balance.BIAS, balance.assignment_counts(plan, p).reshape(p, experts))
    if self.dropless:  # an expert's load is its share of the group's S tokens, which never overflow
      metrics["fraction_dropped_tokens"] = jnp.zeros((), jnp.float32)
      metrics["fraction_dropped_assignments"] = jnp.zeros((), jnp.float32)
      metrics["expert_load"] = jnp.mean(plan.expert_of_slot_filled, axis=0) / plan.capacity
    else:
      kept = plan.kept
      metrics["fraction_dropped_tokens"] = jnp.mean(~kept.any(axis=-1))
      metrics["fraction_dropped_assignments"] = jnp.mean(~kept)
      # Fraction of the layer's buffer slots each of the E experts filled, averaged over groups.
      filled = plan.expert_of_slot_filled.reshape(num_groups // p, self.num_experts)
      metrics["expert_load"] = jnp.mean(filled, axis=0) / capacity
    metrics.update(balance.diagnostics(plan, p))
    return plan, metrics


@register
class TokenChoice(RouterFamily):
  name = "token_choice"
  module = NoisyTopKRouter
  Config = TokenChoiceConfig
  supports_ensembles = True
  supports_batch_priority = True
  supports_expert_split = True
  summary = "each token picks its TOP-k experts, buffers of round(k*N*C/E) slots (V-MoE)"

  @classmethod
  def problem(cls, model) -> str | None:
    """k <= the experts a token chooses among (its member's in an ensemble); priority=sum means
    nothing with sigmoid gates, whose TOP-k weights sum to 1 (routing.sigmoid_gates); a bias update
    rate needs the bias it moves (balance=bias)."""
    router = model.router
    if dropless := _dropless_problem(model):
      return dropless
    if router.bias_update_rate is not None and str(router.balance) != "bias":
      return (f"model.router.bias_update_rate={router.bias_update_rate} means nothing with "
              f"model.router.balance={str(router.balance)}: it is the step of the per-expert "
              "bias of auxiliary-loss-free balancing, which only model.router.balance=bias has "
              "(V-MoE's auxiliary losses balance the experts otherwise). Set "
              "model.router.balance=bias, or drop model.router.bias_update_rate.")
    if router.gate == Gate.sigmoid and router.batch_priority and str(router.priority) == "sum":
      return ("model.router.priority=sum means nothing with model.router.gate=sigmoid: the TOP-k "
              "weights of sigmoid gates sum to 1 for every token, so Batch Prioritized Routing "
              "would order the tokens by rounding noise. Use model.router.priority=max (the "
              "largest normalized weight), or model.router.gate=softmax.")
    split = derived.expert_split(model)  # k of E experts, as the user wrote them (k*m of E*m)
    experts = derived.num_experts(model) // split
    per_member = derived.experts_per_router(model) // split
    if model.router.k <= per_member:
      return None
    if per_member == experts:
      return (f"model.router.k={model.router.k} selects more experts per token than there are "
              f"(model.moe.num_experts={experts}); valid: 1 <= k <= {experts}.")
    return (f"model.router.k={model.router.k} selects more experts per token than each "
            f"ensemble member has (model.moe.num_experts={experts} / model.moe.ensemble_size="
            f"{model.moe.ensemble_size} = {per_member}); valid: 1 <= k <= {per_member}.")

  @classmethod
  def param_updates(cls, router, stage: str) -> tuple[ParamUpdate, ...]:
    """With balance=bias, the bias' update after every train step at `bias_update_rate`."""
    if str(router.balance) != "bias":
      return ()
    return (balance.bias_param_update(bias_update_rate(router, stage)),)

  @classmethod
  def later_stage_problem(cls, stored: dict, given: dict) -> str | None:
    """model.router.balance decides whether the router has its bias parameter, so a later stage
    keeps the checkpoint's."""
    new, kept = given.get("balance"), stored.get("balance") or Balance.aux_loss.value
    if new is not None and str(new) != str(kept):
      return (f"model.router.balance={str(new)} differs from the checkpoint's {str(kept)}: "
              "with bias the router has a parameter, balance_bias, fixed when the model is "
              "trained, so a later stage cannot change it. Drop the override, or fine-tune with "
              "the new value (vmoe finetune init.checkpoint=... model.router.balance=...).")
    return super().later_stage_problem(stored, given)

  @classmethod
  def runs_grouped_matmul(cls, router) -> bool:
    return _is_dropless(router)

  @classmethod
  def split_router(cls, router, m: int):
    """Fine-grained experts (DeepSeekMoE): each token chooses k*m of the E*m experts, so the
    buffers keep round(k*m*N*C/(E*m)) = round(k*N*C/E) slots each, of a 1/m as wide expert."""
    return dataclasses.replace(router, k=router.k * m)

  @classmethod
  def module_kwargs(cls, router, *, tokens: int, experts: int) -> dict:
    kwargs = dict(k=router.k, capacity_ratio=router.capacity_ratio,
                  eval_capacity_ratio=router.eval_capacity_ratio,
                  batch_priority=router.batch_priority, priority=str(router.priority),
                  noise_std=1.0 if router.noise_std is None else router.noise_std)
    for option, default in (("capacity_rounding", "paper"), ("gate", "softmax"),
                            ("balance_scope", "group"), ("balance", "aux_loss")):
      if str(getattr(router, option)) != default:  # the default's arguments stay as they were
        kwargs[option] = str(getattr(router, option))
    if _is_dropless(router):
      kwargs["dropless"] = True
    if router.z_loss_weight:
      kwargs["z_loss_weight"] = router.z_loss_weight
    return kwargs

  @classmethod
  def capacity(cls, router, tokens: int, experts: int, *, train: bool) -> int:
    if _is_dropless(router):  # no buffer; an expert takes each token at most once
      return tokens
    return routing.expert_capacity(tokens, experts, router.k,
                                   routing.ratio_in_force(router, train), router.capacity_rounding)

  @classmethod
  def expert_rows(cls, router, tokens: int, experts: int, capacity: int) -> float:
    """Dropless: the k * tokens assignments themselves, no padding; else every buffer slot."""
    if _is_dropless(router):
      return float(router.k * tokens)
    return super().expert_rows(router, tokens, experts, capacity)

  @classmethod
  def at_inference(cls, given: dict) -> dict:
    """As any family's; a later stage's dropless=true also sets the checkpoint's keys of capacity
    routing back to their defaults (those given stay, and are refused): dropless reads none."""
    given = super().at_inference(given)
    if given.get("dropless") in (True, "true"):
      return {**_CAPACITY_DEFAULTS, **given}
    return given

  @classmethod
  def expert_parallel_problem(cls, router, sharding: str) -> str | None:
    if not _is_dropless(router):
      return None
    return (f"model.router.dropless=true cannot run under {sharding}, which splits the experts' "
            "weights over the devices (expert parallelism): dropless routing sorts each "
            "device's assignments by expert into rows whose number per expert changes from "
            "batch to batch, and the all-to-all that sends each expert its tokens exchanges "
            "buffers of a fixed capacity. Use sharding=dp (every expert on every device, the "
            "routing groups split over the devices), or model.router.dropless=false.")

  @classmethod
  def without_capacity(cls, router) -> str | None:
    if not _is_dropless(router):
      return None
    return ("model.router.dropless=true processes every chosen assignment, with no capacity to "
            "vary; to sweep the capacities of this checkpoint (an ordinary token-choice one), "
            "evaluate it with model.router.dropless=false")

  @classmethod
  def experts_per_token(cls, router, tokens: int, experts: int, capacity: int) -> float:
    return float(min(router.k, experts))

  @classmethod
  def expert_ids(cls, plan: routing.DispatchPlan, routed: bool) -> jax.Array:
    """Each token's TOP-k, or (`routed`) -1 where its buffer was full (combine weight 0); a
    dropless plan processes every choice."""
    if routed and not isinstance(plan, routing.DroplessPlan):
      return jnp.where(plan.combine_weights > 0, plan.experts, -1)
    return plan.experts

  @classmethod
  def torch_routing(cls, router, *, tokens: int, experts: int) -> TorchRouting:
    """token_choice_torch.py at the inference capacity ratio (eval_capacity_ratio when set)."""
    del tokens, experts
    bias = str(router.balance) == "bias"  # written only where used: the default's is as was
    parameters = {"dense/kernel": ("dense.weight", (1, 0))}
    if bias:
      parameters[balance.BIAS] = (balance.BIAS, None)
    return TorchRouting(
        config=dict(k=int(router.k), capacity_ratio=float(routing.ratio_in_force(router, False)),
                    capacity_rounding=str(router.capacity_rounding),
                    batch_priority=bool(router.batch_priority), priority=str(router.priority),
                    **({} if str(router.gate) == "softmax" else {"gate": str(router.gate)}),
                    **({"balance": "bias"} if bias else {}),
                    **({"dropless": True} if _is_dropless(router) else {})),
        source=pathlib.Path(__file__).with_name("token_choice_torch.py").read_text(),
        class_name="TokenChoiceRouter", parameters=parameters)

  @classmethod
  def dropped_at_capacity(cls, router, weights: jax.Array, capacity: int) -> dict[str, jax.Array]:
    """Vanilla routing and Batch Prioritized Routing of the gates; none where a bias chose the
    TOP-k (the gates alone cannot replan it), or for a dropless router, which drops nothing."""
    if str(getattr(router, "balance", "aux_loss")) == "bias" or _is_dropless(router):
      return {}
    return {name: ~routing.plan_dispatch(weights, k=router.k, capacity=capacity,
                                         batch_priority=batch_priority,
                                         priority=str(router.priority)).kept.any(-1)
            for name, batch_priority in (("vanilla", False), ("bpr", True))}


DEFAULT_BIAS_UPDATE_RATE = 0.001  # Wang et al. 2024's u, for pretraining


def bias_update_rate(router, stage: str) -> float:
  """u, the step of the per-expert bias of auxiliary-loss-free balancing after every train step
  of `stage`: model.router.bias_update_rate as given, else 0.001 in pretrain and 0 (the bias
  frozen as loaded) in any other stage (finetune); 0 without the bias (balance=aux_loss)."""
  if str(router.balance) != "bias":
    return 0.0
  if router.bias_update_rate is not None:
    return float(router.bias_update_rate)
  return DEFAULT_BIAS_UPDATE_RATE if stage == "pretrain" else 0.0


def _is_dropless(router) -> bool:
  return bool(getattr(router, "dropless", False))


# Capacity routing's keys at their defaults, as a later stage's dropless=true leaves them.
_CAPACITY_DEFAULTS = {"capacity_ratio": SHARED_KEYS["capacity_ratio"]().default,
                      "eval_capacity_ratio": None,
                      "capacity_rounding": CapacityRounding.paper.value, "batch_priority": False}


def _dropless_problem(model) -> str | None:
  """What model.router.dropless=true refuses: the keys of capacity routing, given other values
  than their defaults, and partitioned batch ensembles; one rule each."""
  router = model.router
  if not _is_dropless(router):
    return None
  if router.batch_priority:
    return ("model.router.batch_priority=true means nothing with model.router.dropless=true: "
            "Batch Prioritized Routing decides which tokens a full buffer drops, and dropless "
            "routing drops none. Drop it, or route at a capacity with "
            "model.router.dropless=false.")
  default = _CAPACITY_DEFAULTS["capacity_ratio"]
  if router.capacity_ratio != default:
    return (f"model.router.capacity_ratio={router.capacity_ratio:g} means nothing with "
            "model.router.dropless=true: dropless routing processes every chosen assignment and "
            f"has no buffer to size. Drop it (its default {default:g} is kept), or route at "
            "that capacity with model.router.dropless=false.")
  if router.eval_capacity_ratio is not None:
    return (f"model.router.eval_capacity_ratio={router.eval_capacity_ratio:g} means nothing with "
            "model.router.dropless=true: dropless routing processes every chosen assignment at "
            "evaluation as in training. Drop it; to evaluate the model at a capacity, evaluate "
            "it with model.router.dropless=false model.router.capacity_ratio=<C> (a dropless "
            "checkpoint is an ordinary token-choice one).")
  if str(router.capacity_rounding) != _CAPACITY_DEFAULTS["capacity_rounding"]:
    return (f"model.router.capacity_rounding={str(router.capacity_rounding)} means nothing "
            "with model.router.dropless=true: it rounds the buffers' slots, and dropless routing "
            "has no buffers. Drop it, or model.router.dropless=false.")
  if model.moe.ensemble_size > 1:
    return (f"model.router.dropless=true cannot be used with a partitioned batch ensemble "
            f"(model.moe.ensemble_size={model.moe.ensemble_size}): vmoe's dropless routing runs "
            "all of a layer's experts on rows sorted by expert and does not route each member "
            "among its own partition of them. Use model.router.dropless=false (capacity "
            "routing), or model.moe.ensemble_size=1.")
  return None
