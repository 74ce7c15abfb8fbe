"""Evaluators as plug-ins: one class each, derived from `Evaluator` and registered with `register`
(runner/evaluators/suite.py; docs/extending.md). The built-in ones register here, in the order they
run; a plug-in's after them. Nothing outside this package names an evaluator; `contrastive` adds the
zero-shot prompts (eval.zero_shot.*), which no evaluator owns."""
from runner.config.registries import EVALUATORS
from runner.config.relations import relation
from runner.evaluators import (adversarial, capacity_sweep, classification, compute, contrastive,
                               corruption, ood_detection, retrieval, routing_analysis)
from runner.evaluators.suite import Dataset, Evaluator, PassHook, Result, Suite, register

for _module in (
    classification,  # prec@1, NLL, Brier, ECE per dataset (the main passes)
    ood_detection,  # eval.ood_datasets: MSP, max-logit, entropy, Mahalanobis detection
    corruption,  # eval.corruptions x eval.severities
    adversarial,  # eval.adversarial.epsilons: PGD and routing change
    compute,  # GFLOPs per image (XLA, analytic), parameters
    capacity_sweep,  # eval.capacity_sweep: accuracy vs inference capacity
    routing_analysis,  # eval.routing_analysis: the V-MoE paper's Sec. 5
    retrieval,  # eval.retrieval: image<->text recall@k of a contrastive checkpoint
):
  register(_module.Evaluator)
del _module

__all__ = ["EVALUATORS", "Dataset", "Evaluator", "PassHook", "Result", "Suite", "register",
           "relation"]
