"""Evaluators as plug-ins: one module each, with its `Evaluator` class, its eval.* keys, and one
line in this registry. `vmoe eval` and `vmoe ensemble` run every evaluator the eval.* keys enable,
in this order; the training loop runs the same ones (but classification and compute, which it
measures itself) on its validation split every `eval.every_steps` (runner/evaluators/suite.py).
"""

# name -> module under runner/evaluators defining `Evaluator`; the order they run in.
REGISTRY = {
    "classification": "classification",  # prec@1, NLL, Brier, ECE per dataset (the main passes)
    "ood": "ood_detection",  # eval.ood_datasets: MSP, max-logit, entropy, Mahalanobis detection
    "corruptions": "corruption",  # eval.corruptions x eval.severities
    "adversarial": "adversarial",  # eval.adversarial.epsilons: PGD and routing change
    "compute": "compute",  # GFLOPs per image (XLA, analytic), parameters
    "capacity_sweep": "capacity_sweep",  # eval.capacity_sweep: accuracy vs inference capacity
    "routing_analysis": "routing_analysis",  # eval.routing_analysis: the V-MoE paper's Sec. 5
    "retrieval": "retrieval",  # eval.retrieval: image<->text recall@k of a contrastive checkpoint
}
