"""What a prediction costs: GFLOPs per image (XLA's cost analysis of the compiled eval step, and
the analytic count of runner/models/flops.py, which asks each router family), total and active
parameters. For an ensemble: the whole ensemble."""
from __future__ import annotations

import jax

from runner.evaluators import predictions, suite as suite_lib


def xla_gflops_per_image(step, params, example, batch_size: int) -> float:
  """A partitioned program is costed per device: times the devices, over the global batch."""
  return predictions.xla_flops(step, params, example) * jax.device_count() / batch_size / 1e9


class Evaluator(suite_lib.Evaluator):
  name = "compute"
  in_training = False  # the checkpoints' cost: vmoe eval's
  # The cost of the classifier: of a contrastive checkpoint, the zero-shot one over the classes.
  needs_labels = True

  def run(self) -> suite_lib.Result:
    s = self.suite
    example = s.placement.put(predictions.zeros_batch_like(s.batches(s.in_distribution)))
    s.shared["example"] = example
    gflops = xla_gflops_per_image(s.step, s.params, example, s.batch_size)
    s.shared["gflops_per_image"] = gflops
    return suite_lib.Result(summary={
        "compute/gflops_per_image": gflops,
        "compute/gflops_per_image_analytic": s.members.analytic_flops(s.batch_size) / 1e9,
        "compute/params_total": s.members.params_total(),
        "compute/params_active": s.members.params_active(),
    })
