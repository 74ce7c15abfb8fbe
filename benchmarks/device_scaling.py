"""The same global batch on 1, 2, 4 and 8 (fake CPU) devices gives the same training.

    python -m benchmarks.device_scaling [--devices 1,2,4,8] [--steps 5]

Each device count runs in its own process (XLA_FLAGS=--xla_force_host_platform_device_count=N):
`vmoe_tiny`, global batch 64, expert parallelism over as many devices as divide the 8 experts,
no dropout. Reports each run's losses and their largest difference from the 1-device run. The
fake devices share the same two cores, so step times say nothing about speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import arguments, harness

STEPS_DEFAULT = 5
GLOBAL_BATCH = 64  # split over every device: a device count must divide it


def _worker(steps: int) -> dict:
  """Runs inside the N-device process; prints one JSON line."""
  import jax
  import numpy as np
  from runner.checkpoints.checkpoint import Checkpointer
  from runner.models import build_model, model_config
  from runner.parallel import Placement, RULES, make_mesh
  from runner.train import optimizers, schedules, state as state_lib
  from runner.train.start import initial_state
  from runner.train.step import make_train_step
  import tempfile
  n = jax.device_count()
  expert = np.gcd(n, 8)
  placement = Placement(make_mesh(n // expert, expert), RULES["ep"])
  model = build_model(model_config("vmoe_tiny"), 10)
  schedule = schedules.make_schedule("linear", 1e-3, 100, 2)
  abstract, _ = state_lib.abstract_params(model, (32, 32, 3))
  tx = optimizers.make_optimizer("adam", schedule, abstract, grad_clip_norm=1.0)
  rng = np.random.default_rng(0)
  losses, times = [], []
  with placement.context():
    state, shardings, _, _ = initial_state(Checkpointer(tempfile.mkdtemp()), model=model, tx=tx,
                                           image_shape=(32, 32, 3), placement=placement, seed=0)
    step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01),
                   in_shardings=(shardings, placement.batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0)
    for _ in range(steps):
      batch = {"image": rng.standard_normal((GLOBAL_BATCH, 32, 32, 3)).astype(np.float32),
               "labels": np.eye(10, dtype=np.float32)[rng.integers(0, 10, GLOBAL_BATCH)]}
      start = time.perf_counter()
      state, metrics = step(state, placement.put(batch))
      losses.append(float(metrics["train/loss"]))
      times.append(time.perf_counter() - start)
  return {"devices": n, "mesh": {"data": n // int(expert), "expert": int(expert)},
          "losses": losses, "median_step_ms": float(np.median(times[1:]) * 1e3)}


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before any process starts."""
  parser = arguments.Parser(prog="benchmarks.device_scaling",
                            description=__doc__.split("\n")[0])
  divisors = [n for n in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % n == 0]
  parser.add_argument("--devices", default="1,2,4,8",
                      help=f"fake CPU device counts, each dividing the global batch of "
                           f"{GLOBAL_BATCH}: {', '.join(map(str, divisors))}")
  parser.add_argument("--steps", default=str(STEPS_DEFAULT),
                      help="train steps per run (at least 2: the first compiles)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  text, args.devices = args.devices, parser.numbers("--devices", args.devices, int, 1)
  for n in args.devices:
    if n not in divisors:
      parser.refuse(f"--devices {text!r}: {n} does not divide the global batch of "
                    f"{GLOBAL_BATCH}; valid: comma-separated {', '.join(map(str, divisors))}")
  args.steps = parser.number("--steps", args.steps, int, 2)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  if args.worker:
    print("RESULT " + json.dumps(_worker(args.steps)), flush=True)
    return {}
  runs = []
  for n in args.devices:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    out = subprocess.run([sys.executable, "-m", "benchmarks.device_scaling", "--worker",
                          "--steps", str(args.steps)], env=env, capture_output=True, text=True,
                         check=True).stdout
    runs.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
  reference = runs[0]["losses"]
  for run in runs:
    run["max_abs_loss_difference"] = max(abs(a - b) for a, b in zip(run["losses"], reference))
    print(f"{run['devices']} device(s), mesh {run['mesh']}: losses "
          f"{[round(x, 5) for x in run['losses']]}, max |diff| vs 1 device "
          f"{run['max_abs_loss_difference']:.2e}", flush=True)
  record = {"machine": harness.machine(), "global_batch": GLOBAL_BATCH, "runs": runs}
  print(f"written to {harness.write('device_scaling', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
