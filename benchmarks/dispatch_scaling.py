"""How the cost of one MoE layer grows with tokens per routing group and number of experts.

    python -m benchmarks.dispatch_scaling [--experts 8,32,128] [--tokens 256,1024,4096]

One `MoeMlpBlock` (hidden 128, MLP 512, k=2, C=1.05), forward + backward, on a fixed total of
16,384 tokens split into groups of S tokens, for E experts, with both dispatchers. The experts'
FLOPs do not depend on E or S here (E x capacity = k x S x C slots per group, so always
2.1 x 16,384 rows of expert MLP), so any growth is dispatch cost. Reports the median time and
XLA's temporary memory for each point.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from benchmarks import arguments, harness
from runner.config.schema import Dispatcher
from runner.models.moe.experts import MlpExperts, apply_experts
from runner.models.moe.layer import MoeMlpBlock
from runner.models.moe.routing import expert_capacity

TOTAL_TOKENS, HIDDEN, MLP = 16_384, 128, 512


def measure(num_experts: int, tokens_per_group: int, dispatcher: str) -> dict:
  groups = TOTAL_TOKENS // tokens_per_group
  # One "image" per group: the layer groups images, so an image of S tokens is a group of S.
  layer = MoeMlpBlock(num_experts=num_experts, mlp_dim=MLP, group_size=1, dispatcher=dispatcher,
                      router=dict(k=2, capacity_ratio=1.05))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((groups, tokens_per_group, HIDDEN)),
                  jnp.float32)
  rngs = {"params": jax.random.key(0), "gating": jax.random.key(1)}
  params = nn.meta.unbox(layer.init(rngs, x[:1], train=True))["params"]

  def loss(params, x):
    y, metrics = layer.apply({"params": params}, x, train=True,
                             rngs={"gating": jax.random.key(2)})
    return jnp.sum(y * y) + metrics["auxiliary_loss"]
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  compiled = grad.lower(params, x).compile()
  memory = compiled.memory_analysis()
  temp = getattr(memory, "temp_size_in_bytes", float("nan")) if memory is not None else float("nan")
  # The experts alone on buffers of the same shape: what the layer costs without routing.
  capacity = expert_capacity(tokens_per_group, num_experts, 2, 1.05)
  buffers = jnp.zeros((num_experts, groups, capacity, HIDDEN), jnp.float32) + 0.1
  weights = nn.meta.unbox(MlpExperts(num_experts, MLP).init(jax.random.key(0), HIDDEN))["params"]
  weights = tuple(weights[k] for k in ("fc1_kernel", "fc1_bias", "fc2_kernel", "fc2_bias"))
  experts = jax.jit(jax.grad(lambda w, b: jnp.sum(apply_experts(w, b) ** 2), argnums=(0, 1)))
  experts = experts.lower(weights, buffers).compile()
  ms = harness.interleaved_median_ms({"layer": lambda: compiled(params, x),
                                      "experts": lambda: experts(weights, buffers)},
                                     rounds=3, steps=3)
  return {"experts": num_experts, "tokens_per_group": tokens_per_group, "dispatcher": dispatcher,
          "fwd_bwd_ms": ms["layer"], "experts_only_ms": ms["experts"],
          "routing_and_dispatch_ms": ms["layer"] - ms["experts"], "temp_mb": temp / 2**20}


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.dispatch_scaling",
                            description=__doc__.split("\n")[0])
  divisors = [s for s in range(1, TOTAL_TOKENS + 1) if TOTAL_TOKENS % s == 0]
  parser.add_argument("--experts", default="8,32,128", help="expert counts E, each >= 2 (k = 2)")
  parser.add_argument("--tokens", default="256,1024,4096",
                      help=f"tokens per group S, each dividing the {TOTAL_TOKENS:,} tokens")
  parser.add_argument("--dispatchers", default="indices,einsum",
                      help=f"of {', '.join(d.value for d in Dispatcher)}")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.experts = parser.numbers("--experts", args.experts, int, 2)
  text, args.tokens = args.tokens, parser.numbers("--tokens", args.tokens, int, 1)
  for s in args.tokens:
    if s not in divisors:
      parser.refuse(f"--tokens {text!r}: {s} does not divide the {TOTAL_TOKENS:,} tokens; valid: "
                    f"comma-separated {', '.join(map(str, divisors))}")
  args.dispatchers = parser.names("--dispatchers", args.dispatchers, "dispatcher",
                                  [d.value for d in Dispatcher])
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  rows = []
  for dispatcher in args.dispatchers:
    for e in args.experts:
      for s in args.tokens:
        row = measure(e, s, dispatcher)
        rows.append(row)
        print(f"{dispatcher:8s} E={e:4d} S={s:5d}: layer {row['fwd_bwd_ms']:7.1f} ms = experts "
              f"{row['experts_only_ms']:7.1f} + routing/dispatch "
              f"{row['routing_and_dispatch_ms']:7.1f} ms; temp {row['temp_mb']:7.1f} MB", flush=True)
  record = {"machine": harness.machine(), "total_tokens": TOTAL_TOKENS, "hidden": HIDDEN,
            "mlp": MLP, "rows": rows}
  path = harness.write("dispatch_scaling", record, record=args.record)
  print(f"written to {path}")
  return record


if __name__ == "__main__":
  main()
