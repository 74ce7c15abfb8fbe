"""What a training run starts from, worked out once here and handed down to the loop: its model,
its plan (steps, a training image's shape, the parameter updates of its step), its abstract
parameters and their logical axes, and its initial parameters. These are made here alone:
fresh, or mapped from init.checkpoint (an earlier stage's run, a released checkpoint, a
contrastive run's tower; upcycled dense -> experts and Drop-Upcycling by runner/models/transfer.py)
and, when the loop starts, resumed from the workdir's newest checkpoint instead
(`initial_state`: resume > initialise > scratch, big_vision's precedence made explicit)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from runner.checkpoints import checkpoint, weights
from runner.checkpoints.checkpoint import Checkpointer
from runner.config import as_dict, derived
from runner.config.schema import Objective, TrainTask
from runner.models import build_model, param_updates_of, transfer
from runner.models.moe import routers
from runner.parallel import Placement, replicated
from runner.train import state as state_lib


@dataclasses.dataclass(frozen=True)
class TrainPlan:
  """What the stage works out once from the config and data, and the loop takes as given: the
  run's steps (train.steps, or train.epochs over the split: training/fit.py), a training image's
  shape, and the `ParamUpdate`s the train step applies after the optimizer (param_updates_of)."""
  steps: int
  image_shape: tuple
  param_updates: tuple = ()


@dataclasses.dataclass(frozen=True)
class Start:
  """A run's model and plan, its parameters' shapes and logical axes, and the parameters it is
  initialised from (None: from scratch, made on the devices by `initial_state`)."""
  model: object
  plan: TrainPlan
  abstract: dict
  logical: dict
  init_params: dict | None = None


def classifier(config: TrainTask, num_classes: int, image_shape: tuple,
               opened: weights.Opened | None, stage: str, steps: int) -> Start:
  """A classifier's start: the model for the data's classes, from `opened` (init.checkpoint, when
  a new run starts from it) or from scratch."""
  model = build_model(config.model, num_classes, output=derived.model_output(config.train.loss))
  plan = TrainPlan(steps, image_shape, param_updates_of(config.model, stage))
  init_params = _from_checkpoint(config, model, plan.image_shape, opened) if opened else None
  return Start(model, plan, *state_lib.abstract_params(model, plan.image_shape), init_params)


def towers(config: TrainTask, model, image_shape: tuple, opened: weights.Opened | None,
           stage: str, steps: int) -> Start:
  """A contrastive model's start: its image tower from `opened` (no head), the rest fresh."""
  plan = TrainPlan(steps, image_shape, param_updates_of(config.model, stage))
  init_params = _image_tower_from(config, model, image_shape, opened) if opened else None
  return Start(model, plan, *state_lib.abstract_params(model, image_shape), init_params)


def _model_differences(stored: dict, current: dict, prefix: str = "model.") -> str:
  """'model.hidden_size 32 -> 48, ...' for the architecture keys that differ."""
  ignore = {"name", "dropout_rate", "attention_dropout_rate", "dtype", "router", "image_size",
            "expert_dropout", "dispatcher", "grouped_matmul", "group_size"}
  out = []
  for key in sorted((set(stored) | set(current)) - ignore):
    a, b = stored.get(key), current.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      sub = _model_differences(a, b, f"{prefix}{key}.")
      out += [sub] if sub else []
    elif a != b:
      out.append(f"{prefix}{key} {a} -> {b}")
  return ", ".join(out)


def _check_ensemble_size(stored: dict, size: int, path: str, repartition: bool) -> None:
  """A partitioned batch ensemble starts another ensemble `size` only when asked (`repartition`;
  a V-MoE may start any: its experts are partitioned as they are)."""
  stored_size = int((stored.get("model", {}).get("moe") or {}).get("ensemble_size") or 1)
  if stored_size > 1 and size != stored_size and not repartition:
    raise checkpoint.CheckpointError(
        f"init.checkpoint={path} is a partitioned batch ensemble of "
        f"{stored_size} members, and model.moe.ensemble_size={size}: its experts would change "
        "members. Set model.moe.ensemble_size to the checkpoint's, or init.repartition_experts="
        "true to divide its experts anew.")


def _router_changes(family, stored: dict | None, restored) -> bool:
  """Whether the model routes with another router `family` (None: no MoE) than the checkpoint
  did: its router then starts fresh and the checkpoint's is left out (the experts are kept)."""
  if family is None:
    return False
  if stored:  # our runs say; a config of an older version without router.type has the default
    router = (stored.get("model") or {}).get("router") or {}
    return str(router.get("type") or routers.DEFAULT) != family.name
  # A released checkpoint: its routers' parameter names say (Soft MoE stores slot parameters,
  # the others a (D, E) kernel).
  return not transfer.routers_fit(restored, family)


def _from_checkpoint(config: TrainTask, model, image_shape: tuple, start: weights.Opened):
  """Parameters for `model` mapped from init.checkpoint, opened as `start` (an earlier stage's run
  or a released checkpoint); with init.tower, from that tower of a contrastive run (a new head)."""
  init, model_config = config.init, config.model
  family = derived.router_family(model_config) if derived.num_experts(model_config) else None
  ensemble_size = derived.ensemble_size(model_config)
  stored = start.stored_config()
  if stored is not None:
    _check_ensemble_size(stored, model_config.moe.ensemble_size, init.checkpoint,
                         init.repartition_experts)
  restored, stored, step = start.load(ensemble_size=ensemble_size)
  what = f"checkpoint {init.checkpoint} (step {step})"
  if init.tower is not None:  # a contrastive run's (checkpoints/checks.py classifier_from_a_tower)
    restored, what = restored[init.tower.value], f"the {init.tower.value} tower of {what}"
  fresh = state_lib.fresh_params(model, image_shape, config.seed)
  try:
    return transfer.adapt_params(restored, fresh, reinit_head=init.reinit_head,
                                 dense_to_experts=init.dense_to_experts,
                                 drop_upcycling=(init.drop_upcycling_ratio, config.seed),
                                 new_router=_router_changes(family, stored, restored), source=what)
  except checkpoint.CheckpointError as e:
    if not stored:  # a released checkpoint: no config to compare with
      raise checkpoint.CheckpointError(
          f"{e} init.checkpoint={init.checkpoint} is {start.describe()}; pass "
          "the model= that matches it (the head and the position embeddings may differ).") from None
    stored_model = stored.get("model", {})
    diff = _model_differences(stored_model, as_dict(model_config))
    raise checkpoint.CheckpointError(
        f"{e} The checkpoint was trained with model={stored_model.get('name')}"
        + (f", which differs from this one in {diff}" if diff else "")
        + "; pass the same model (and model.* overrides) as that run.") from None


def _image_tower_from(config: TrainTask, model, image_shape, start: weights.Opened) -> dict:
  """Parameters: the image tower from init.checkpoint (`start`; no head), the rest fresh."""
  init = config.init
  restored, stored, step = start.load(ensemble_size=derived.ensemble_size(config.model))
  fresh = state_lib.fresh_params(model, image_shape, config.seed)
  if (stored or {}).get("objective", {}).get("name") == Objective.contrastive.value:
    return transfer.adapt_params(restored, fresh, reinit_head=False,  # a contrastive run, on
                                 source=f"checkpoint {init.checkpoint} (step {step})")
  image = transfer.adapt_params(restored, fresh["image"], reinit_head=True,
                                source=f"image checkpoint {init.checkpoint} (step {step})")
  return {**fresh, "image": image}


def _abstract(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def initial_state(checkpointer: Checkpointer, *, model, tx, image_shape, placement: Placement,
                  seed: int, init_params=None, warn=print, abstract=None):
  """(state, state shardings, data position, where it came from): resume > init > scratch.
  `abstract`: the model's (abstract parameters, logical axes), where the caller has them."""
  abstract, logical = abstract or state_lib.abstract_params(model, image_shape)
  param_shardings = placement.shardings(logical)
  opt_init = jax.jit(tx.init).lower(_abstract(abstract, param_shardings)).compile()
  shardings = state_lib.TrainState(step=replicated(placement.mesh), params=param_shardings,
                                   opt_state=opt_init.output_shardings)
  restored = checkpointer.restore_latest(
      _abstract(abstract, param_shardings),
      _abstract(jax.eval_shape(tx.init, abstract), shardings.opt_state))
  if restored is not None:
    for step, reason in restored.skipped:
      warn(f"warning: checkpoint step {step} cannot be read ({reason}); it was moved to "
           f"unreadable_checkpoints/ in the workdir, and the run resumes from step "
           f"{restored.step}.")
    state = state_lib.TrainState(step=jnp.asarray(restored.step, jnp.int32),
                                 params=restored.params, opt_state=restored.opt_state)
    return state, shardings, int(restored.meta["position"]), f"resumed from step {restored.step}"
  if init_params is not None:
    params = jax.device_put(init_params, param_shardings)
    origin = "initialised from an earlier stage"
  else:
    params = state_lib.fresh_params(model, image_shape, seed, out_shardings=param_shardings)
    origin = "initialised from scratch"
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=opt_init(params))
  return state, shardings, 0, origin
