"""L∞ PGD attacks on ViT / V-MoE classifiers: error, loss, changed predictions and routing change.

Follows Puigcerver et al. 2022, "On the Adversarial Robustness of Mixture of Experts" (App. F) and
its reference code (google-research/vmoe, vmoe/projects/adversarial_attacks: attacks.py
`stateless_attack_pgd`, `sum_intersection_over_union`; restore.py `get_combine_weights`);
docs/evaluation.md states both protocols. "default" steps by 2.5·ε/steps (Madry et al. 2018), so
that the attack can reach the border of the ball and still move along it, each step clipped into the
ball and [-1, 1] so that adversarial images stay images; "reference" steps by ε/steps with no
projection, and compares the experts that process each token (a token dropped on both images counts
IoU 0, as the reference's `jnp.where(union > 0, intersection / union, 0)`). No random start, so
ε = 0 returns the image unchanged; the attacked loss has no MoE auxiliary loss and the model runs in
inference mode (the reference's `attack_auxiliary_loss=False`, deterministic=True)."""
from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Callable, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from runner.config import checks
from runner.config.preprocessing import DEVICE_VALUE_RANGE
from runner.config.relations import relation
from runner.config.schema import EvalSuiteConfig
from runner.evaluators import suite as suite_lib
from runner.evaluators.figures import new_figure, save_png
from runner.logging.progress import Progress
from runner.losses.classification import LOSSES, precision_at_1
from runner.models import inputs
from runner.models.introspection import apply_with_routing


class AdversarialProtocol(enum.StrEnum):
  """PGD and routing-change rules (the module docstring)."""
  default = "default"  # step 2.5·ε/steps, clipped to the ball and [-1, 1]; TOP-k before drops
  reference = "reference"  # step ε/steps, no clipping; experts that receive the token


PROTOCOLS = tuple(p.value for p in AdversarialProtocol)


def _protocol(protocol) -> str:
  name = str(protocol)
  if name not in PROTOCOLS:
    raise ValueError(f"unknown adversarial protocol {name!r}; valid: {PROTOCOLS}")
  return name


def make_pgd_attack(model, loss_name: str = "softmax_xent", *, steps: int,
                    step_size_fn: Callable | None = None, protocol="default"):
  """Jitted (params, images, labels, epsilon) -> adversarial images, by `steps` sign-gradient steps.
  `epsilon` and `step_size_fn(epsilon)` are in [0, 1] pixel units; `epsilon` is traced, so one
  compilation serves every ε. "default": the loss is summed over the batch (each image's gradient
  is its own loss's: padded rows with all-zero labels have zero softmax loss and do not move),
  every step is clipped to the 2ε ball and [-1, 1]. "reference": the mean loss (as the reference;
  the sign of each image's gradient is the same), step ε/steps unless `step_size_fn` is given, no
  clipping."""
  if steps < 1:
    raise ValueError(f"PGD needs steps >= 1, got {steps}")
  protocol = _protocol(protocol)
  loss_fn = LOSSES[loss_name]
  # The reference's own rule is computed as it does, delta = max_epsilon / num_updates with
  # max_epsilon = 2ε in model units, so the steps agree to the last bit.
  reference_rule = protocol == "reference" and step_size_fn is None
  step_size_fn = step_size_fn or (lambda epsilon: 2.5 * epsilon / steps)  # Madry et al.'s rule
  reduce = jnp.mean if protocol == "reference" else jnp.sum

  def total_loss(images, params, labels):
    logits, _ = model.apply({"params": params}, images, train=False)
    return reduce(loss_fn(logits, labels))

  grad_fn = jax.grad(total_loss)

  def attack(params, images, labels, epsilon):
    epsilon = jnp.asarray(epsilon, jnp.float32)
    radius = 2.0 * epsilon
    alpha = radius / steps if reference_rule else 2.0 * jnp.asarray(step_size_fn(epsilon),
                                                                    jnp.float32)
    if protocol == "reference":
      def step(_, x):
        return x + (alpha * jnp.sign(grad_fn(x, params, labels))).astype(x.dtype)
      return jax.lax.fori_loop(0, steps, step, images)
    # Both constraints are boxes, so projecting onto their intersection is one clip.
    low = jnp.maximum(images - radius, -1.0).astype(images.dtype)
    high = jnp.minimum(images + radius, 1.0).astype(images.dtype)

    def step(_, x):
      g = grad_fn(x, params, labels)
      return jnp.clip(x + (alpha * jnp.sign(g)).astype(x.dtype), low, high)

    return jax.lax.fori_loop(0, steps, step, images)

  return jax.jit(attack)


def _change(intersection: jax.Array, union: jax.Array, reference: bool) -> jax.Array:
  """(batch,) from per-token set sizes (batch, tokens): 1 − IoU averaged over tokens (an empty
  union counts IoU 0, see the module docstring); `reference` averages the IoU before taking it
  from 1, as the reference does (1 − sum_iou / num_tokens)."""
  iou = jnp.where(union > 0, intersection / jnp.maximum(union, 1), 0.0).astype(jnp.float32)
  if reference:
    return 1.0 - jnp.mean(iou, axis=-1)
  return jnp.mean(1.0 - iou, axis=-1)  # not 1 - mean: XLA's mean of ones can miss 1 by an ulp


def make_measure_step(model, loss_name: str = "softmax_xent", protocol="default"):
  """Jitted (params, batch, adversarial_images) -> sums over the real rows of the batch, which
  holds "image", "labels" and "_mask". Keys: clean/error, clean/loss, error, loss,
  changed_predictions, routing_change/layer_<i> for each MoE layer (`AdversarialProtocol` says
  which experts it compares), and count."""
  loss_fn = LOSSES[loss_name]
  reference = _protocol(protocol) == "reference"
  sown = "routed_mask" if reference else "expert_mask"

  def forward(params, images):
    logits, _, records = apply_with_routing(model, params, images, train=False)
    return logits, {layer: r[sown] for layer, r in records.items() if sown in r}

  def step(params, batch, adversarial_images):
    labels = batch["labels"]
    mask = batch["_mask"].astype(jnp.float32)
    clean_logits, clean_experts = forward(params, batch["image"])
    adv_logits, adv_experts = forward(params, adversarial_images)
    per_example = {
        "clean/error": 1.0 - precision_at_1(clean_logits, labels),
        "clean/loss": loss_fn(clean_logits, labels),
        "error": 1.0 - precision_at_1(adv_logits, labels),
        "loss": loss_fn(adv_logits, labels),
        "changed_predictions": (jnp.argmax(clean_logits, -1) != jnp.argmax(adv_logits, -1)),
    }
    for layer, clean in clean_experts.items():  # (batch, tokens, E) masks, any router family
      adv = adv_experts[layer]
      per_example[f"routing_change/{layer}"] = _change(
          jnp.sum(clean & adv, axis=-1), jnp.sum(clean | adv, axis=-1), reference)
    out = {k: jnp.sum(v.astype(jnp.float32) * mask) for k, v in per_example.items()}
    out["count"] = jnp.sum(mask)
    return out

  return jax.jit(step)


_float_images = jax.jit(inputs.with_images)


def _layer_order(key: str) -> int:
  return int(key.rsplit("_", 1)[1])


class AdversarialEvaluator:
  """PGD at each ε of a sweep on the same examples; averages over the real examples seen.
  `step_size`: the step in [0, 1] pixel units, a float or a function of ε; None for the
  protocol's rule (2.5·ε/steps, or ε/steps for "reference"). `max_examples` counts rows of this
  process's batches (the first `max_examples`), so that every process stops after the same
  number of batches."""

  def __init__(self, model, *, epsilons, steps: int, step_size=None,
               loss_name: str = "softmax_xent", prefix: str, put=lambda batch: batch,
               max_examples: int | None = None, progress: bool = True, protocol="default"):
    self.epsilons = [float(e) for e in epsilons]
    if not self.epsilons or min(self.epsilons) < 0:
      raise ValueError(f"epsilons must be a non-empty list of values >= 0, got {epsilons}")
    if loss_name not in LOSSES:
      raise ValueError(f"unknown loss {loss_name!r}; valid: {sorted(LOSSES)}")
    if step_size is not None and not callable(step_size):
      fixed = float(step_size)
      step_size = lambda epsilon: fixed  # noqa: E731
    self.protocol = _protocol(protocol)
    self.attack = make_pgd_attack(model, loss_name, steps=steps, step_size_fn=step_size,
                                  protocol=self.protocol)
    self.measure = make_measure_step(model, loss_name, self.protocol)
    self.prefix, self.put, self.max_examples, self.progress = prefix, put, max_examples, progress

  def run(self, params, batches) -> dict[str, float]:
    rows = batches.element_spec["_mask"].shape[0]
    total = int(batches.cardinality())
    if self.max_examples is not None and rows:
      limit = math.ceil(self.max_examples / rows)
      total = limit if total < 0 else min(total, limit)
    progress = Progress(max(total, 0), 0, rows or 0, desc=f"{self.prefix} pgd",
                        enabled=self.progress)
    clean: dict[str, float] = {}
    attacked: dict[float, dict[str, float]] = {e: {} for e in self.epsilons}
    count = 0.0
    try:
      for index, batch in enumerate(batches.as_numpy_iterator()):
        mask = np.asarray(batch["_mask"], bool)
        if self.max_examples is not None:
          first_row = index * len(mask)
          if first_row >= self.max_examples:
            break
          mask = mask & (first_row + np.arange(len(mask)) < self.max_examples)
        kept = ("image", "labels", DEVICE_VALUE_RANGE)
        batch = self.put({**{k: v for k, v in batch.items() if k in kept}, "_mask": mask})
        batch = _float_images(batch)  # PGD moves the model's inputs: uint8 pixels made float
        for i, epsilon in enumerate(self.epsilons):
          adversarial = self.attack(params, batch["image"], batch["labels"], np.float32(epsilon))
          sums = jax.device_get(self.measure(params, batch, adversarial))
          if i == 0:
            count += float(sums["count"])
            for k in ("clean/error", "clean/loss"):
              clean[k] = clean.get(k, 0.0) + float(sums[k])
          for k, v in sums.items():
            if not k.startswith("clean/") and k != "count":
              attacked[epsilon][k] = attacked[epsilon].get(k, 0.0) + float(v)
        progress.step_done(index + 1)
    finally:
      progress.close()
    count = max(count, 1.0)
    base = f"{self.prefix}/pgd"
    out = {f"{base}/{k}": v / count for k, v in clean.items()}
    for epsilon, sums in attacked.items():
      name = f"{base}/eps_{epsilon:g}"
      changes = {k: v / count for k, v in sums.items() if k.startswith("routing_change/")}
      out.update({f"{name}/{k}": v / count for k, v in sums.items()
                  if not k.startswith("routing_change/")})
      out.update({f"{name}/{k}": changes[k] for k in sorted(changes, key=_layer_order)})
      if changes:
        out[f"{name}/routing_change/mean"] = float(np.mean(list(changes.values())))
    return out


def plot_pgd(metrics: dict, prefix: str, path: str, title: str = "") -> str:
  """Writes a PNG of error vs ε and routing change vs ε per MoE layer; returns the path. Reads
  the keys `AdversarialEvaluator.run` writes; the clean error is drawn at ε = 0."""
  base = f"{prefix}/pgd/"
  pattern = re.compile(re.escape(base) + r"eps_([^/]+)/(.+)")
  by_eps: dict[float, dict[str, float]] = {}
  for key, value in metrics.items():
    if m := pattern.fullmatch(key):
      by_eps.setdefault(float(m[1]), {})[m[2]] = value
  if not by_eps:
    raise ValueError(f"no {base}eps_<e>/... keys in the metrics")
  epsilons = sorted(by_eps)
  layers = sorted({k.split("/", 1)[1] for sums in by_eps.values() for k in sums
                   if k.startswith("routing_change/") and k != "routing_change/mean"},
                  key=_layer_order)

  figure = new_figure(10 if layers else 5, 4)
  axes = figure.add_subplot(1, 2 if layers else 1, 1)
  xs, errors = list(epsilons), [by_eps[e].get("error", np.nan) for e in epsilons]
  if f"{base}clean/error" in metrics and 0.0 not in by_eps:
    xs, errors = [0.0] + xs, [metrics[f"{base}clean/error"]] + errors
  axes.plot(xs, errors, marker="o", label="error")
  axes.plot(epsilons, [by_eps[e].get("changed_predictions", np.nan) for e in epsilons],
            marker="x", linestyle="--", label="changed predictions")
  axes.set(xlabel="ε (L∞, [0, 1] pixel units)", ylim=(0, 1), title="error under PGD")
  axes.legend(loc="lower right")
  if layers:
    route = figure.add_subplot(1, 2, 2)
    for layer in layers:
      route.plot(epsilons, [by_eps[e].get(f"routing_change/{layer}", np.nan) for e in epsilons],
                 marker="o", label=layer.replace("_", " "))
    route.plot(epsilons, [by_eps[e].get("routing_change/mean", np.nan) for e in epsilons],
               color="black", linestyle="--", label="mean")
    route.set(xlabel="ε (L∞, [0, 1] pixel units)", ylabel="1 − IoU of selected experts",
              ylim=(0, 1), title="routing change under PGD")
    route.legend(loc="upper left")
  if title:
    figure.suptitle(title)
  return save_png(figure, path)


@dataclasses.dataclass
class AdversarialConfig:
  """eval.adversarial.*: PGD's radii, steps and rules."""
  epsilons: List[float] = checks.key([], checks.Items(checks.Range(0, 1), example="[0.001,0.003]"),
                                     "L-inf radii in [0, 1] pixel units")
  steps: int = checks.key(40, checks.at_least(1), "PGD steps")
  step_size: Optional[float] = checks.key(None, checks.positive(), "null: 2.5 * epsilon / steps "
                                          "(Madry et al.); protocol=reference fixes epsilon / "
                                          "steps")
  max_examples: Optional[int] = checks.key(512, checks.at_least(1), "attacks cost steps x "
                                           "backward passes; null: every example")
  protocol: AdversarialProtocol = checks.key(
      AdversarialProtocol.default, hint="reference: the vmoe adversarial_attacks code's step "
      "ε/steps, no clipping, routing change on the experts that receive each token")


@relation
def reference_attack_fixes_its_step(eval: EvalSuiteConfig):
  adv = eval.adversarial
  if adv.protocol == AdversarialProtocol.reference and adv.step_size is not None:
    return (f"eval.adversarial.step_size={adv.step_size} is set, but "
            "eval.adversarial.protocol=reference steps by epsilon / eval.adversarial.steps, as "
            "the reference code does; drop eval.adversarial.step_size, or use "
            "eval.adversarial.protocol=default for a step of your choice.")


class Evaluator(suite_lib.Evaluator):
  """`eval.adversarial.*`: PGD at each ε on every eval dataset (`AdversarialEvaluator`), with a
  plot of error and routing change against ε."""
  name = "adversarial"
  enabling_key = "eval.adversarial.epsilons"
  Config = AdversarialConfig

  def run(self) -> suite_lib.Result:
    s, adv = self.suite, self.suite.config.adversarial
    attack = AdversarialEvaluator(
        s.model, epsilons=[float(x) for x in adv.epsilons], steps=adv.steps,
        step_size=adv.step_size, loss_name=s.loss_name, prefix="", put=s.placement.put,
        max_examples=adv.max_examples, progress=s.verbose, protocol=adv.protocol)
    result = suite_lib.Result()
    for ds in s.datasets:
      attack.prefix = ds.name
      attacked = attack.run(s.params, s.batches(ds))
      result.summary.update(attacked)
      s.say(f"[eval] {ds.name}: PGD ({adv.steps} steps) at eps {list(adv.epsilons)} done")
      if s.plots:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", ds.name)
        result.images[f"{ds.name}/pgd"] = plot_pgd(attacked, ds.name, s.path(f"pgd_{name}.png"),
                                                    title=f"{ds.name}: L-inf PGD")
    return result
