"""Train-step throughput, FLOPs and MFU of every model family and its dense twin, in one process.

    python -m benchmarks.train_step [--presets tiny,bigger] [--dtype float32] [--rounds 5]

For each preset: the ViT and, with the same dimensions, a sparse model of each router family —
token-choice (V-MoE, k = 2, C = 1.05), experts-choice (C = 2: two expert slots per token on
average, as k = 2) and Soft MoE (one image per routing group, slots from C = 2) — run the
library's own train step (Adam, softmax cross-entropy, the MoE auxiliary loss) on synthetic
images, timed in alternating rounds. Reported per model: median step time, train and eval
images/s, analytic train FLOPs (3 x forward matmul FLOPs, experts at padded capacity), XLA's
cost-analysis FLOPs, and MFU (analytic FLOPs/s over the float32 matmul peak measured in the same
run). Each sparse model's overhead is (its step time / dense step time) / (its analytic FLOPs /
dense analytic FLOPs), the median of the per-round ratios; `moe_overhead` is token-choice's.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import arguments, harness
from runner.config import sections
from runner.config.schema import Classifier, DType, ModelConfig, MoeConfig, RouterConfig
from runner.models import build_model
from runner.models.flops import train_flops_per_image, forward_flops_per_image
from runner.train import optimizers, schedules, state as state_lib
from runner.train.step import make_eval_step, make_train_step

# fp32, Adam, token classifier, learned position embeddings, routing groups of 8 images,
# capacity ratio 1.05, k=2, no dropout.
PRESETS = {
    "tiny": dict(image_size=32, patch_size=4, hidden_size=128, num_layers=4, mlp_dim=512,
                 num_heads=4, num_classes=10, batch_size=128, num_experts=8, moe_layers=[1, 3]),
    "bigger": dict(image_size=32, patch_size=4, hidden_size=256, num_layers=6, mlp_dim=1024,
                   num_heads=8, num_classes=10, batch_size=64, num_experts=16, moe_layers=[3, 5]),
    # The papers' smallest models, for accelerators (batch 256 as in the issue).
    "s32": dict(image_size=224, patch_size=32, hidden_size=512, num_layers=8, mlp_dim=2048,
                num_heads=8, num_classes=1000, batch_size=256, num_experts=32, moe_layers=[5, 7]),
    # V-MoE-B/16 with experts on every second block (vmoe_b16_every2).
    "b16": dict(image_size=224, patch_size=16, hidden_size=768, num_layers=12, mlp_dim=3072,
                num_heads=12, num_classes=1000, batch_size=256, num_experts=32,
                moe_layers=[1, 3, 5, 7, 9, 11]),
}


def model_configs(preset: dict, dtype: str) -> dict[str, ModelConfig]:
  base = ModelConfig(name="bench", classifier=Classifier.token, dtype=DType(dtype),
                     **{k: preset[k] for k in ("image_size", "patch_size", "hidden_size",
                                               "num_layers", "mlp_dim", "num_heads")})
  moe = dataclasses.replace(base, moe=MoeConfig(layers=preset["moe_layers"],
                                                num_experts=preset["num_experts"], group_size=8),
                            router=sections.new(RouterConfig, k=2, capacity_ratio=1.05))
  dense = dataclasses.replace(base, moe=MoeConfig(layers=[], num_experts=0))
  experts_choice = dataclasses.replace(
      moe, router=sections.new(RouterConfig, type="experts_choice", capacity_ratio=2.0))
  soft = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, group_size=1),
                             router=sections.new(RouterConfig, type="soft", capacity_ratio=2.0))
  return {"vmoe": moe, "dense": dense, "experts_choice": experts_choice, "soft": soft}


SPARSE = ("vmoe", "experts_choice", "soft")  # compared with "dense"


def jitted_train_step(model, shape: tuple, batch_size: int, classes: int, params=None,
                      **step_options):
  """(jitted Adam train step, its initial state, a synthetic batch), not compiled yet. The state
  starts from `params` if given (the step donates its state: pass a copy to keep them), else
  from the model's init at seed 0; `step_options` go to make_train_step (e.g. the model's
  param_updates)."""
  if params is None:
    params, _ = state_lib.init_params(model, shape, seed=0)
  schedule = schedules.make_schedule("linear", 1e-3, 10_000, 100)
  tx = optimizers.make_optimizer("adam", schedule, params, grad_clip_norm=1.0)
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=tx.init(params))
  rng = np.random.default_rng(0)
  batch = {"image": jnp.asarray(rng.standard_normal((batch_size,) + shape), jnp.float32),
           "labels": jax.nn.one_hot(rng.integers(0, classes, batch_size), classes)}
  step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01,
                                 **step_options), donate_argnums=0)
  return step, state, batch


def compiled_train_step(model, shape: tuple, batch_size: int, classes: int):
  """(compiled Adam train step, its initial state, a synthetic batch): what every train-step
  benchmark times."""
  step, state, batch = jitted_train_step(model, shape, batch_size, classes)
  return step.lower(state, batch).compile(), state, batch


@dataclasses.dataclass
class TrainStep:
  """A compiled train step ready to time, with what its compilation cost."""
  compiled: Callable
  state: state_lib.TrainState
  batch: dict
  model: object
  compile_s: float  # lowering + compilation
  xla_flops: float  # XLA's cost analysis, per step
  num_params: int

  def run(self) -> jax.Array:
    """One step on the same batch: the state is donated to it and replaced by its result."""
    self.state, metrics = self.compiled(self.state, self.batch)
    return metrics["train/loss"]


def prepare_train_step(config: ModelConfig, preset: dict, *, params=None, warmup: int = 2,
                       compiler_options: dict | None = None, **step_options) -> TrainStep:
  """The train step of `config` at the preset's image size, batch and classes, compiled and
  warmed up by `warmup` steps; `params`: as `jitted_train_step` takes them; `compiler_options`:
  XLA options for this program alone (`Lowered.compile(compiler_options)`; None: none)."""
  batch_size, classes = preset["batch_size"], preset["num_classes"]
  model = build_model(config, classes)
  shape = (preset["image_size"], preset["image_size"], 3)
  step, state, batch = jitted_train_step(model, shape, batch_size, classes, params,
                                         **step_options)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile(compiler_options)
  compile_s = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  prepared = TrainStep(compiled=compiled, state=state, batch=batch, model=model,
                       compile_s=compile_s,
                       xla_flops=float((cost or {}).get("flops", float("nan"))),
                       num_params=sum(x.size for x in jax.tree.leaves(state.params)))
  for _ in range(warmup):
    jax.block_until_ready(prepared.run())
  return prepared


def _prepare(config: ModelConfig, preset: dict):
  """Jitted train and eval steps with their inputs, as zero-argument callables."""
  train = prepare_train_step(config, preset)
  eval_batch = dict(train.batch, _mask=jnp.ones((preset["batch_size"],), bool))
  eval_step = jax.jit(make_eval_step(train.model))
  evaluate = lambda: eval_step(train.state.params, eval_batch)["count"]
  jax.block_until_ready(evaluate())  # compile, warm up
  return train.run, evaluate, train.xla_flops


def overhead(sparse_rounds: list, dense_rounds: list, sparse: dict, dense: dict) -> dict:
  """A sparse model against its dense twin, from the step times of rounds in which the two
  alternated and their analytic and XLA train FLOPs: (time ratio) / (analytic FLOP ratio), the
  median of the per-round ratios, robust to drifts of the machine's speed."""
  round_ratios = [m / d for m, d in zip(sparse_rounds, dense_rounds)]
  flop_ratio = sparse["analytic_train_flops"] / dense["analytic_train_flops"]
  return dict(time_ratio=statistics.median(round_ratios), analytic_flop_ratio=flop_ratio,
              xla_flop_ratio=sparse["xla_train_flops"] / dense["xla_train_flops"],
              overhead=statistics.median(r / flop_ratio for r in round_ratios),
              overhead_per_round=[r / flop_ratio for r in round_ratios])


def measure(name: str, preset: dict, dtype: str, peak_gflops: float, rounds: int,
            families: tuple[str, ...] = SPARSE) -> dict:
  configs = {k: v for k, v in model_configs(preset, dtype).items() if k in families + ("dense",)}
  prepared = {kind: _prepare(cfg, preset) for kind, cfg in configs.items()}
  train_rounds = harness.interleaved_rounds_ms({k: v[0] for k, v in prepared.items()},
                                               rounds=rounds, steps=3)
  train_ms = {k: statistics.median(v) for k, v in train_rounds.items()}
  eval_ms = harness.interleaved_median_ms({k: v[1] for k, v in prepared.items()}, rounds=rounds)
  out = {}
  for kind, cfg in configs.items():
    bs = preset["batch_size"]
    flops = train_flops_per_image(cfg, preset["num_classes"], batch_size=bs) * bs
    out[kind] = {
        "train_step_ms": train_ms[kind],
        "train_images_per_s": bs / train_ms[kind] * 1e3,
        "eval_images_per_s": bs / eval_ms[kind] * 1e3,
        "analytic_train_flops": flops,
        "analytic_forward_flops_per_image": forward_flops_per_image(
            cfg, preset["num_classes"], batch_size=bs, train=False),
        "xla_train_flops": prepared[kind][2],
        "mfu": flops / (train_ms[kind] / 1e3) / (peak_gflops * 1e9),
    }
  for kind in families:
    out[kind].update(overhead(train_rounds[kind], train_rounds["dense"], out[kind], out["dense"]))
  if "vmoe" in families:  # token-choice, under the names earlier records used
    vmoe = out["vmoe"]
    out.update(time_ratio=vmoe["time_ratio"], analytic_flop_ratio=vmoe["analytic_flop_ratio"],
               xla_flop_ratio=vmoe["xla_flop_ratio"], moe_overhead=vmoe["overhead"],
               moe_overhead_per_round=vmoe["overhead_per_round"])
  return out


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything is measured."""
  parser = arguments.Parser(prog="benchmarks.train_step", description=__doc__.split("\n")[0])
  parser.add_argument("--presets", default="tiny,bigger", help=f"of {', '.join(PRESETS)}")
  parser.add_argument("--dtype", default="float32", help=f"of {', '.join(d.value for d in DType)}")
  parser.add_argument("--rounds", default="7", help="alternating rounds (at least 1)")
  parser.add_argument("--name", default="train_step",
                      help="of the JSON written, <name>.json (letters, digits, _, - and .)")
  parser.add_argument("--families", default=",".join(SPARSE),
                      help="sparse models compared with the ViT: vmoe (token-choice), "
                           "experts_choice, soft")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.presets = parser.names("--presets", args.presets, "preset", list(PRESETS))
  args.dtype = parser.choice("--dtype", args.dtype, [d.value for d in DType])
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", args.name):
    parser.refuse(f"--name {args.name!r}: valid: a file name of letters, digits, _, - and . "
                  "(not starting with . or -)")
  args.families = parser.names("--families", args.families, "family", SPARSE)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  families = args.families
  peak = harness.matmul_peak_gflops()
  record = {"machine": harness.machine(), "dtype": args.dtype, "presets": {}}
  for name in args.presets:
    peak = max(peak, harness.matmul_peak_gflops())  # the machine's best, next to the steps
    result = measure(name, PRESETS[name], args.dtype, peak, args.rounds, families)
    record["presets"][name] = result
    for kind in families + ("dense",):
      r = result[kind]
      print(f"{name}/{kind}: {r['train_step_ms']:.1f} ms per step "
            f"({r['train_images_per_s']:.0f} img/s, MFU {r['mfu']:.1%}); train FLOPs per step "
            f"analytic {r['analytic_train_flops'] / 1e9:.2f} G, XLA cost analysis "
            f"{r['xla_train_flops'] / 1e9:.2f} G")
    for kind in families:
      r = result[kind]
      print(f"{name}/{kind} vs dense: time ratio {r['time_ratio']:.3f}, analytic FLOP ratio "
            f"{r['analytic_flop_ratio']:.3f} (XLA {r['xla_flop_ratio']:.3f}), overhead "
            f"{r['overhead']:.3f}", flush=True)
  record["matmul_peak_gflops"] = peak
  record["overhead"] = {kind: max(r[kind]["overhead"] for r in record["presets"].values())
                        for kind in families}
  if "vmoe" in families:
    record["moe_overhead"] = record["overhead"]["vmoe"]
  path = harness.write(args.name, record, record=args.record)
  print(f"matmul peak {peak:.0f} GFLOP/s; written to {path}")
  return record


if __name__ == "__main__":
  main()
