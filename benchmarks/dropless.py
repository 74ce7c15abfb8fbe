"""Dropless token choice against capacity routing: one MoE layer, and the tiny V-MoE train step.

    python -m benchmarks.dropless [--experts 8,32] [--rounds 5] [--presets tiny]

1. What `jax.lax.ragged_dot` lowers to on this backend: XLA's cost-analysis FLOPs of one grouped
   matmul (M rows of D by (E, D, H) kernels) over the 2*M*D*H of the rows' own products. A
   ratio of 1 is a grouped matmul; E is the dense fallback, which multiplies every row by every
   expert's kernel and masks what is not its own (each row pays for E experts).
2. One `MoeMlpBlock` (hidden 128, MLP 512, k = 2, groups of 512 tokens, 8,192 tokens in all),
   forward + backward, at capacity ratio 1.05 (some tokens dropped), at C = E/k (buffers of S
   slots: nothing can drop, the capacity path's own way of dropping nothing) and dropless with
   each grouped matmul (runner/models/moe/grouped_matmul.py: ragged_dot, and by blocks), in
   alternating rounds: median time, XLA's FLOPs and temporary memory.
3. The `tiny` preset's train step (benchmarks/train_step.py: 4 blocks of 128, 8 experts on blocks
   1 and 3, batch 128) at C = 1.05 and dropless (`model.moe.grouped_matmul=auto`: by blocks),
   alternating rounds; analytic FLOPs (dropless: k experts per token exactly) and XLA's.

Writes runs/benchmarks/dropless.json (`--record`: benchmarks/results/) and prints a markdown
table of each part.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import arguments, harness
from benchmarks.train_step import PRESETS, model_configs, prepare_train_step
from runner.models.flops import train_flops_per_image
from runner.models.moe.layer import MoeMlpBlock

TOTAL_TOKENS, TOKENS_PER_GROUP, HIDDEN, MLP, K = 8_192, 512, 128, 512, 2


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  memory = compiled.memory_analysis()
  return {"xla_flops": float((cost or {}).get("flops", float("nan"))),
          "temp_mb": getattr(memory, "temp_size_in_bytes", float("nan")) / 2**20
          if memory is not None else float("nan")}


def ragged_dot_lowering(num_experts: int, rows: int = TOTAL_TOKENS * K) -> dict:
  """XLA's FLOPs of one ragged_dot over the rows' own 2*M*D*H, and whether its compiled
  program has a dot that contracts over E*D (the dense fallback's (M, E*D) x (E*D, H))."""
  x = jnp.ones((rows, HIDDEN), jnp.float32)
  w = jnp.ones((num_experts, HIDDEN, MLP), jnp.float32)
  sizes = jnp.full((num_experts,), rows // num_experts, jnp.int32)
  compiled = jax.jit(jax.lax.ragged_dot).lower(x, w, sizes).compile()
  text = compiled.as_text()
  ratio = _cost(compiled)["xla_flops"] / (2.0 * rows * HIDDEN * MLP)
  dense = f"[{rows},{num_experts * HIDDEN}]" in text
  return {"experts": num_experts, "rows": rows, "xla_flops_over_rows_own": ratio,
          "dense_fallback": dense}


def _layer_fn(num_experts: int, router: dict, method: str = "auto"):
  """The layer's forward + backward with the grouped matmul `method` (dropless routers)."""
  groups = TOTAL_TOKENS // TOKENS_PER_GROUP
  layer = MoeMlpBlock(num_experts=num_experts, mlp_dim=MLP, group_size=1, router=router,
                      grouped_matmul=method)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((groups, TOKENS_PER_GROUP, HIDDEN)),
                  jnp.float32)
  params = nn.meta.unbox(layer.init({"params": jax.random.key(0), "gating": jax.random.key(1)},
                                    x[:1], train=True))["params"]

  def loss(params, x):
    y, metrics = layer.apply({"params": params}, x, train=True,
                             rngs={"gating": jax.random.key(2)})
    return jnp.sum(y * y) + metrics["auxiliary_loss"]
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
  return (lambda: compiled(params, x)), _cost(compiled)


def measure_layer(num_experts: int, rounds: int) -> list[dict]:
  variants = {"C=1.05": dict(k=K, capacity_ratio=1.05),
              f"C=E/k={num_experts / K:g}": dict(k=K, capacity_ratio=num_experts / K),
              "dropless, ragged_dot": (dict(k=K, dropless=True), "ragged_dot"),
              "dropless, blocks": (dict(k=K, dropless=True), "blocks")}
  prepared = {name: _layer_fn(num_experts, *(v if isinstance(v, tuple) else (v,)))
              for name, v in variants.items()}
  per_round = harness.interleaved_rounds_ms({n: p[0] for n, p in prepared.items()},
                                            rounds=rounds, steps=3)
  base = per_round["C=1.05"]
  rows = []
  for name, (_, cost) in prepared.items():
    ratios = [t / b for t, b in zip(per_round[name], base)]
    rows.append({"experts": num_experts, "routing": name,
                 "fwd_bwd_ms": statistics.median(per_round[name]),
                 "time_ratio_to_c105": statistics.median(ratios),
                 "time_ratio_per_round": ratios, **cost,
                 "xla_flop_ratio_to_c105": cost["xla_flops"] / prepared["C=1.05"][1]["xla_flops"]})
  return rows


def measure_train_step(preset_name: str, rounds: int) -> list[dict]:
  preset = PRESETS[preset_name]
  capacity = model_configs(preset, "float32")["vmoe"]
  dropless = dataclasses.replace(capacity, router=dataclasses.replace(capacity.router,
                                                                      dropless=True))
  configs = {"C=1.05": capacity, "dropless": dropless}
  steps = {name: prepare_train_step(config, preset) for name, config in configs.items()}
  per_round = harness.interleaved_rounds_ms({n: s.run for n, s in steps.items()}, rounds=rounds,
                                            steps=3)
  batch = preset["batch_size"]
  rows = []
  for name, config in configs.items():
    ratios = [t / b for t, b in zip(per_round[name], per_round["C=1.05"])]
    rows.append({"preset": preset_name, "routing": name,
                 "train_step_ms": statistics.median(per_round[name]),
                 "time_ratio_to_c105": statistics.median(ratios),
                 "time_ratio_per_round": ratios,
                 "analytic_train_flops": train_flops_per_image(
                     config, preset["num_classes"], batch_size=batch) * batch,
                 "xla_train_flops": steps[name].xla_flops, "compile_s": steps[name].compile_s})
  return rows


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.dropless", description=__doc__.split("\n")[0])
  parser.add_argument("--experts", default="8,32", help=f"expert counts E, each >= {K} (k = {K})")
  parser.add_argument("--presets", default="tiny", help=f"of {', '.join(PRESETS)}")
  parser.add_argument("--rounds", default="5", help="alternating rounds (at least 1)")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.experts = list(parser.numbers("--experts", args.experts, int, K))
  args.presets = parser.names("--presets", args.presets, "preset", list(PRESETS))
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  experts = args.experts
  record = {"machine": harness.machine(), "date": time.strftime("%Y-%m-%d"),
            "rounds": args.rounds, "total_tokens": TOTAL_TOKENS,
            "tokens_per_group": TOKENS_PER_GROUP, "hidden": HIDDEN, "mlp": MLP, "k": K,
            "ragged_dot": [ragged_dot_lowering(e) for e in experts], "layer": [],
            "train_step": []}
  print("| E | ragged_dot XLA FLOPs / rows' own | dense fallback |\n|---|---|---|")
  for r in record["ragged_dot"]:
    print(f"| {r['experts']} | {r['xla_flops_over_rows_own']:.2f} | {r['dense_fallback']} |",
          flush=True)
  print("\n| E | routing | fwd+bwd ms | time / C=1.05 | XLA GFLOPs | XLA FLOPs / C=1.05 | "
        "temp MB |\n|---|---|---|---|---|---|---|")
  for e in experts:
    for r in measure_layer(e, args.rounds):
      record["layer"].append(r)
      print(f"| {e} | {r['routing']} | {r['fwd_bwd_ms']:.1f} | {r['time_ratio_to_c105']:.2f} | "
            f"{r['xla_flops'] / 1e9:.1f} | {r['xla_flop_ratio_to_c105']:.2f} | "
            f"{r['temp_mb']:.0f} |", flush=True)
  print("\n| preset | routing | step ms | time / C=1.05 | analytic GFLOPs | XLA GFLOPs |\n"
        "|---|---|---|---|---|---|")
  for name in args.presets:
    for r in measure_train_step(name, args.rounds):
      record["train_step"].append(r)
      print(f"| {name} | {r['routing']} | {r['train_step_ms']:.1f} | "
            f"{r['time_ratio_to_c105']:.2f} | {r['analytic_train_flops'] / 1e9:.1f} | "
            f"{r['xla_train_flops'] / 1e9:.1f} |", flush=True)
  print(f"written to {harness.write('dropless', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
