"""The members of an ensemble as one prediction: the mean of their probabilities, in log space.

Allingham et al. (E³, App. D.1): members are trained on the mean of their cross-entropies and
combined at evaluation by averaging probabilities, never logits. A tiled batch's rows are
image-major (row b*M + m is member m's copy of image b): (B*M, ...) -> (B, M, ...) is a reshape."""
from __future__ import annotations

import jax
import jax.numpy as jnp

OUTPUTS = ("softmax", "sigmoid")


def combine_logits(member_logits, output: str = "softmax"):
  """(..., M, C) member logits -> (..., C) logits whose softmax (or sigmoid) is the members'
  mean probability p̄: log p̄ for softmax, logit(p̄) for sigmoid (multi-label) outputs; for M = 1
  log_softmax(z) (resp. z), the member's probabilities."""
  z = jnp.asarray(member_logits, jnp.float32)
  log_m = jnp.log(z.shape[-2])
  if output == "softmax":
    return jax.nn.logsumexp(jax.nn.log_softmax(z, axis=-1), axis=-2) - log_m
  if output == "sigmoid":
    log_p = jax.nn.logsumexp(jax.nn.log_sigmoid(z), axis=-2) - log_m
    log_not_p = jax.nn.logsumexp(jax.nn.log_sigmoid(-z), axis=-2) - log_m
    return log_p - log_not_p
  raise ValueError(f"unknown output {output!r}; valid: {OUTPUTS}")


def members(rows: jax.Array, size: int) -> jax.Array:
  """(B*M, ...) tiled rows -> (B, M, ...)."""
  return rows.reshape((rows.shape[0] // size, size) + rows.shape[1:])


class Ensemble:
  """Separate models (a deep ensemble) or one model sampled with dropout on (MC-dropout), applied
  like one model: `apply({"params": (params of each model, ...)}, images)` returns the mean
  probability as logits and extras with every member's logits (B, M, C), their representations
  side by side (B, sum of widths), and routing metrics and sown intermediates under `member_<i>/`.
  Inference only; MC-dropout's sample i draws with a key folded from `seed`, always the same."""

  def __init__(self, models: list, *, output: str = "softmax", mc_samples: int = 0, seed: int = 0):
    if mc_samples and len(models) != 1:
      raise ValueError("MC-dropout samples one model")
    self.models, self.output, self.mc_samples, self.seed = list(models), output, mc_samples, seed

  def _runs(self, params):
    """(name, model, params, apply keyword arguments) of every forward pass."""
    if self.mc_samples:
      key = jax.random.key(self.seed)
      return [(f"member_{i}", self.models[0], params[0],
               dict(dropout=True, rngs={"dropout": jax.random.fold_in(key, i)}))
              for i in range(self.mc_samples)]
    return [(f"member_{i}", model, p, {}) for i, (model, p) in enumerate(zip(self.models, params))]

  def apply(self, variables, images, *, train: bool = False, mutable=None):
    if train:
      raise ValueError("an Ensemble of separate models is for inference; train its members")
    member_logits, features, routing, merged, aux = [], [], {}, {}, 0.0
    for name, model, params, kwargs in self._runs(variables["params"]):
      out = model.apply({"params": params}, images, train=False, mutable=mutable or False, **kwargs)
      if mutable:  # every collection's trees of the members, under their names
        out, state = out
        for collection, tree in state.items():
          merged.setdefault(collection, {})[name] = tree
      logits, extras = out
      member_logits.append(extras.get("member_logits", logits[:, None]))
      features.append(extras["pre_logits"])
      routing.update({f"{name}/{layer}": m for layer, m in extras["routing"].items()})
      aux = aux + extras["auxiliary_loss"]
    member_logits = jnp.concatenate(member_logits, axis=1)
    extras = {"member_logits": member_logits, "pre_logits": jnp.concatenate(features, axis=-1),
              "routing": routing, "auxiliary_loss": aux}
    result = (combine_logits(member_logits, self.output), extras)
    return (result, merged) if mutable else result
