"""What a train step minimises, as a function of (params, batch, rngs) -> (loss, metrics).

Classification: the cross-entropy of the labels (a partitioned batch ensemble: the mean of its
members' cross-entropies, E³ App. D.1) plus the MoE auxiliary loss. Contrastive: the symmetric
softmax loss (with HET-XL's noisy samples) or SigLIP's sigmoid loss of image-text pairs
(runner/losses/contrastive.py), plus the image tower's auxiliary loss.

A model whose routers balance with a bias (model.router.balance=bias) adds no auxiliary loss
(its routers' `auxiliary_loss` is 0) and is applied with the `balance_loads` collection mutable:
the objective returns those loads in its metrics under `balance_loads` (a tree of the bias
parameters' paths), which the train step takes out to move the biases (runner/train/step.py).
"""
from __future__ import annotations

from runner.losses import contrastive
from runner.losses.classification import LOSSES, precision_at_1
from runner.models import inputs
from runner.models.moe import balance


def apply_for_training(model, params, *args, **kwargs):
  """(model.apply({"params": params}, *args, **kwargs), the `balance_loads` it sowed, or None
  where no router of `params` has a balance bias: then the call is exactly model.apply's)."""
  if not balance.has_bias(params):
    return model.apply({"params": params}, *args, **kwargs), None
  out, sown = model.apply({"params": params}, *args, mutable=[balance.LOADS], **kwargs)
  return out, sown.get(balance.LOADS, {})


def _with_loads(metrics: dict, loads) -> dict:
  return metrics if loads is None else {**metrics, balance.LOADS: loads}


def _routing(extras: dict) -> dict:
  return {f"moe/{layer}/{k}": v for layer, metrics in extras["routing"].items()
          for k, v in metrics.items()}


def classification(model, *, loss: str, aux_loss_weight: float):
  loss_fn = LOSSES[loss]

  def objective(params, batch, rngs):
    images, labels = inputs.images(batch), batch["labels"]
    (logits, extras), loads = apply_for_training(model, params, images, train=True, rngs=rngs)
    if "member_logits" in extras:  # an ensemble learns from the mean of its members' losses
      cls_loss = loss_fn(extras["member_logits"], labels[:, None, :]).mean()
    else:
      cls_loss = loss_fn(logits, labels).mean()
    aux = extras["auxiliary_loss"]
    total = cls_loss + aux_loss_weight * aux
    metrics = {"train/loss": total, "train/cls_loss": cls_loss, "train/aux_loss": aux,
               "train/prec@1": precision_at_1(logits, labels).mean()}
    if "temperature" in extras:  # a heteroscedastic head's τ (learned, or fixed)
      metrics["train/temperature"] = extras["temperature"]
    return total, _with_loads({**metrics, **_routing(extras)}, loads)
  return objective


def contrastive_pairs(model, *, loss: str, aux_loss_weight: float, chunk: int = 1):
  """`loss`: "softmax" or "sigmoid"; `chunk`: HET-XL samples whose logits exist at once (1: the
  least memory, and on CPU also the fastest; benchmarks/contrastive_memory.py)."""

  def objective(params, batch, rngs):
    (zimg, extras), loads = apply_for_training(model, params, inputs.images(batch), batch["tokens"],
                                               train=True, rngs=rngs)
    ztxt, scale = extras["text_embedding"], extras["temperature"]
    if loss == "sigmoid":
      pair_loss, metrics = contrastive.sigmoid_loss(zimg, ztxt, scale, extras["bias"])
    else:
      pair_loss, metrics = contrastive.softmax_loss(
          zimg, ztxt, scale, image_samples=extras.get("image_samples"),
          text_samples=extras.get("text_samples"), chunk=chunk)
    aux = extras["auxiliary_loss"]
    total = pair_loss + aux_loss_weight * aux
    out = {"train/loss": total, "train/contrastive_loss": pair_loss, "train/aux_loss": aux,
           "train/temperature": scale, **{f"train/{k}": v for k, v in metrics.items()}}
    return total, _with_loads({**out, **_routing(extras)}, loads)
  return objective
