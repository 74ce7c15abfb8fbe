"""What a train step minimises, objective(params, batch, rngs, collections=()) -> (loss, metrics):
classification's cross-entropy (a partitioned batch ensemble: the mean of its members', E³
App. D.1) or a contrastive loss, plus the MoE auxiliary loss and the losses the routers hand over
(each logged as train/<name>). `collections`: those the train step's parameter updates read
(runner/models/param_updates.py); the model sows into them and the objective returns them in its
metrics under the collection's name."""
from __future__ import annotations

from runner.losses import contrastive
from runner.losses.classification import LOSSES, precision_at_1
from runner.models import inputs


def apply_for_training(model, params, *args, collections=(), **kwargs):
  """(model.apply({"params": params}, *args, **kwargs), {collection: what the model sowed in it}
  for each of `collections`, applied mutable); without collections exactly model.apply's call."""
  if not collections:
    return model.apply({"params": params}, *args, **kwargs), {}
  out, sown = model.apply({"params": params}, *args, mutable=list(collections), **kwargs)
  return out, {c: sown.get(c, {}) for c in collections}


def _routing(extras: dict) -> dict:
  return {f"moe/{layer}/{k}": v for layer, metrics in extras["routing"].items()
          for k, v in metrics.items()}


def _with_router_losses(loss, extras: dict):
  """The loss plus the losses the routers handed over, each weighted and summed over the MoE
  layers by the model (runner/models/moe/routers/base.py, LOSSES), and their metrics."""
  metrics = {}
  for name, value in extras.get("losses", {}).items():
    loss = loss + value
    metrics[f"train/{name}"] = value
  return loss, metrics


def classification(model, *, loss: str, aux_loss_weight: float):
  loss_fn = LOSSES[loss]

  def objective(params, batch, rngs, collections=()):
    images, labels = inputs.images(batch), batch["labels"]
    (logits, extras), sown = apply_for_training(model, params, images, train=True, rngs=rngs,
                                                collections=collections)
    if "member_logits" in extras:  # an ensemble learns from the mean of its members' losses
      cls_loss = loss_fn(extras["member_logits"], labels[:, None, :]).mean()
    else:
      cls_loss = loss_fn(logits, labels).mean()
    aux = extras["auxiliary_loss"]
    total, router_losses = _with_router_losses(cls_loss + aux_loss_weight * aux, extras)
    metrics = {"train/loss": total, "train/cls_loss": cls_loss, "train/aux_loss": aux,
               "train/prec@1": precision_at_1(logits, labels).mean(), **router_losses}
    if "temperature" in extras:  # a heteroscedastic head's τ (learned, or fixed)
      metrics["train/temperature"] = extras["temperature"]
    return total, {**metrics, **_routing(extras), **sown}
  return objective


def contrastive_pairs(model, *, loss: str, aux_loss_weight: float, chunk: int = 1):
  """`loss`: "softmax" or "sigmoid"; `chunk`: HET-XL samples whose logits exist at once (1: the
  least memory, and on CPU also the fastest; benchmarks/contrastive_memory.py)."""

  def objective(params, batch, rngs, collections=()):
    (zimg, extras), sown = apply_for_training(model, params, inputs.images(batch), batch["tokens"],
                                              train=True, rngs=rngs, collections=collections)
    ztxt, scale = extras["text_embedding"], extras["temperature"]
    if loss == "sigmoid":
      pair_loss, metrics = contrastive.sigmoid_loss(zimg, ztxt, scale, extras["bias"])
    else:
      pair_loss, metrics = contrastive.softmax_loss(
          zimg, ztxt, scale, image_samples=extras.get("image_samples"),
          text_samples=extras.get("text_samples"), chunk=chunk)
    aux = extras["auxiliary_loss"]
    total, router_losses = _with_router_losses(pair_loss + aux_loss_weight * aux, extras)
    out = {"train/loss": total, "train/contrastive_loss": pair_loss, "train/aux_loss": aux,
           **router_losses,
           "train/temperature": scale, **{f"train/{k}": v for k, v in metrics.items()}}
    return total, {**out, **_routing(extras), **sown}
  return objective
