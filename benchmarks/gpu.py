"""V-MoE train steps on one accelerator, against the device's peaks, the dense twin and the
reference V-MoE's dispatch.

    make bench-gpu            # PYTHONPATH=. python -m benchmarks.gpu
    python -m benchmarks.gpu [--small] [--budget-s 400] [--models s32,b16]
                             [--dtypes bfloat16,float32] [--precision default|highest]
                             [--families vmoe,experts_choice,soft,dropless] [--rounds 5]
                             [--steps 3] [--output-dir DIR] [--record]

V-MoE-S/32 (`train_step`'s `s32` preset: 32 experts on blocks 5 and 7) and V-MoE-B/16 (`b16`: 32
experts on every second block), batch 256 at 224 px, each as token-choice (k = 2, C = 1.05),
experts-choice, Soft MoE and the dense twin (`train_step.model_configs`), in bfloat16
(`model.dtype=bfloat16`: float32 parameters) and float32. Beside token-choice, in the same
alternating rounds, the reference: the same model with `model.moe.dispatcher=einsum`, vmoe's
routing plan carried out by the one-hot (G, S, E, C) dispatch and combine einsums of GShard and
google-research/vmoe; "vs reference" is the median over rounds of its step time over
token-choice's. Per model: compile seconds and memory, the median step time over rounds in which
it alternates with its dense twin, images/s, MFU (analytic FLOPs) against the matmul peak
measured first and against the device's specified dense peak (SPECIFIED_PEAK_TFLOPS), the
attention implementation taken and the matmul precision (float32 is TF32 on a GPU unless
`--precision highest`), and a sparse model's overhead over the dense twin
(`train_step.overhead`). The models of one family are compiled, timed and freed together beside
the dense twin, so at most three models' parameters and Adam states are on the device at once.
`dropless` (token-choice with model.router.dropless=true, k = 2) is measured only when named, by
both grouped matmuls (`model.moe.grouped_matmul`): blocks, and `jax.lax.ragged_dot`, which XLA
may lower to a dense product over every expert (E times the experts' FLOPs, and the time and
memory that go with it).

It imports jax, flax, optax, numpy and vmoe's source only: no TensorFlow, TFDS, Hydra, OmegaConf
or W&B, so a CUDA JAX image runs it as it is. Every argument is checked before anything runs; on
a CPU it runs with `--small` only. Before each model it checks the time budget (`--budget-s`,
from the start: the default fits 8 minutes on one GPU) against the longest a model of its size
took so far, and skips what would not fit, saying so; whatever was measured is written, always,
to runs/benchmarks/gpu.json (gpu_small.json with `--small`; `--record`: the tracked
benchmarks/results/) and printed as a table. A model that fails (out of memory, say) is reported
as an error, the others still run, and the exit status is 1. `--small` runs the same code on
tiny shapes, compiled with XLA's fast-compile options (SMALL_XLA_FLAGS): about a minute on a CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import pathlib
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import arguments, harness
from benchmarks.train_step import (PRESETS, SPARSE, TrainStep, model_configs, overhead,
                                   prepare_train_step)
from runner.accelerator import gpu_problem, installed_build
from runner.config.schema import Classifier, Dispatcher, GroupedMatmul, ModelConfig
from runner.models import build_model
from runner.models.flops import train_flops_per_image
from runner.models.vit import attention_path
from runner.train import state as state_lib

PROG = "benchmarks.gpu"
MODELS = {"s32": PRESETS["s32"], "b16": PRESETS["b16"]}
# The same code on shapes a CPU runs in about a minute: the two models' structure (experts on the
# last block; on every second block), not their size.
SMALL_MODELS = {
    "s32": dict(image_size=32, patch_size=8, hidden_size=32, num_layers=2, mlp_dim=64,
                num_heads=2, num_classes=10, batch_size=16, num_experts=4, moe_layers=[1]),
    "b16": dict(image_size=32, patch_size=8, hidden_size=32, num_layers=4, mlp_dim=64,
                num_heads=2, num_classes=10, batch_size=16, num_experts=4, moe_layers=[1, 3]),
}
DTYPES = ("bfloat16", "float32")
PRECISIONS = ("default", "highest")
FAMILY_NAMES = {"dense": "dense", "vmoe": "token-choice", "experts_choice": "experts-choice",
                "soft": "Soft MoE", "dropless": "token-choice dropless"}
# The rows a family adds, timed together beside the dense twin: token-choice with the reference
# dispatch, dropless by both grouped matmuls.
FAMILY_ROWS = {"vmoe": ("vmoe", "reference"), "experts_choice": ("experts_choice",),
               "soft": ("soft",), "dropless": ("dropless_blocks", "dropless_ragged_dot")}
ROW_NAMES = {"dense": "dense", "vmoe": "token-choice", "reference": "reference (einsum)",
             "experts_choice": "experts-choice", "soft": "Soft MoE",
             "dropless_blocks": "dropless (blocks)", "dropless_ragged_dot": "dropless (ragged_dot)"}
# Dense peaks in TFLOP/s by matmul precision: tensor cores for bfloat16 and TF32 (the datasheets'
# figures "with sparsity" halved), the FP32 (non-tensor) figure for float32. Matched in order,
# ignoring case, against JAX's device_kind (the CUDA device name); other variants (H100 NVL,
# H200 NVL, GB200) are not listed and get no specified MFU. Sources: NVIDIA A100 Tensor Core GPU
# datasheet (SXM4 and PCIe, 40 and 80 GB alike); NVIDIA L4 Tensor Core GPU datasheet; NVIDIA
# H100 Tensor Core GPU datasheet (H100 SXM, H100 PCIe); NVIDIA H200 Tensor Core GPU datasheet
# (H200 SXM); NVIDIA GB200 NVL72 / HGX B200 datasheet (HGX B200, per GPU).
SPECIFIED_PEAK_TFLOPS = (
    (r"A100.*SXM", "A100 SXM", {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5}),
    (r"A100.*PCIE", "A100 PCIe", {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5}),
    (r"\bL4\b", "L4", {"bfloat16": 121.0, "tf32": 60.0, "float32": 30.3}),
    (r"H100.*PCIE", "H100 PCIe", {"bfloat16": 756.5, "tf32": 378.0, "float32": 51.0}),
    (r"H100.*(SXM|HBM3)", "H100 SXM", {"bfloat16": 989.5, "tf32": 494.5, "float32": 67.0}),
    (r"H200(?!.*NVL)", "H200 SXM", {"bfloat16": 989.5, "tf32": 494.5, "float32": 67.0}),
    (r"(?<!G)B200", "B200 (HGX)", {"bfloat16": 2250.0, "tf32": 1100.0, "float32": 75.0}),
)
PRECISION_LABELS = {"tf32": "TF32", "bfloat16": "bfloat16 passes"}
# A model larger than any measured so far is guessed to take this many times the longest.
UNSEEN_SIZE_FACTOR = 3.0
# --small compiles tiny programs and runs each for a few steps: XLA's backend optimisation, CPU
# fusion emitters and parallel code generation cost more than they save there (half the run;
# tests/conftest.py sets the same). The functions computed are the same; the flags are in the
# result's machine.xla_flags.
SMALL_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                   "--xla_cpu_parallel_codegen_split_count=1")
COMPILE_MEMORY = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                  "alias_size_in_bytes", "peak_memory_in_bytes")


def small_xla_flags(flags: str, cuda_build) -> str:
  """XLA_FLAGS for --small: SMALL_XLA_FLAGS added where the CPU computes (no CUDA plugin,
  `cuda_build` None). Where a plug-in makes the GPU compute they would speed nothing, and a jaxlib
  newer than the pin aborts on a CPU flag it dropped (0.11.2 on an H200, 2026-11-28:
  "Unknown flag in XLA_FLAGS: --xla_cpu_use_fusion_emitters=false")."""
  if cuda_build is not None or SMALL_XLA_FLAGS in flags:
    return flags
  return f"{flags} {SMALL_XLA_FLAGS}".strip()


def specified_peak(device_kind: str) -> tuple[str, dict] | None:
  """(the device's name, its dense peaks by precision) from SPECIFIED_PEAK_TFLOPS; None if not
  listed."""
  for pattern, name, peaks in SPECIFIED_PEAK_TFLOPS:
    if re.search(pattern, device_kind, re.IGNORECASE):
      return name, peaks
  return None


def matmul_precision(dtype: str, precision: str, backend: str) -> str:
  """What the matmuls of a `dtype` model compute in. At JAX's default precision a float32 matmul
  is TF32 on a GPU (Ampere and later) and bfloat16 passes on a TPU: calling it float32 would
  compare it with the wrong peak."""
  if dtype == "bfloat16":
    return "bfloat16"
  if precision == "highest" or backend == "cpu":
    return "float32"
  return "tf32" if backend == "gpu" else "bfloat16"


def precision_scope(dtype: str, precision: str):
  """`--precision highest`: the float32 models and their matmul peak are traced, hence compiled,
  at true float32."""
  if dtype == "float32" and precision == "highest":
    return jax.default_matmul_precision("highest")
  return contextlib.nullcontext()


class Budget:
  """Seconds from the start; a model runs only if the longest one of its size took fits."""

  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds
    self.longest: dict[str, float] = {}

  def expected(self, size: str) -> float:
    if size in self.longest:
      return self.longest[size]
    return UNSEEN_SIZE_FACTOR * max(self.longest.values(), default=0.0)

  def allows(self, size: str) -> bool:
    return time.monotonic() + self.expected(size) <= self.end

  def left(self) -> float:
    return self.end - time.monotonic()

  def spent(self, size: str, seconds: float) -> None:
    self.longest[size] = max(self.longest.get(size, 0.0), seconds)


def _error(exc: Exception) -> str:
  return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _configs(preset: dict, dtype: str) -> dict[str, ModelConfig]:
  """`train_step.model_configs` and the rows only this benchmark has: token-choice with the
  reference's einsum dispatch, and dropless by each grouped matmul."""
  configs = model_configs(preset, dtype)
  vmoe = configs["vmoe"]
  configs["reference"] = dataclasses.replace(
      vmoe, moe=dataclasses.replace(vmoe.moe, dispatcher=Dispatcher.einsum))
  dropless = dataclasses.replace(vmoe, router=dataclasses.replace(vmoe.router, dropless=True))
  for method in ("blocks", "ragged_dot"):
    configs[f"dropless_{method}"] = dataclasses.replace(
        dropless, moe=dataclasses.replace(dropless.moe, grouped_matmul=GroupedMatmul(method)))
  return configs


def _attention(config: ModelConfig) -> str:
  """The attention implementation the model's (unmasked, dropout-free) layers take."""
  tokens = (config.image_size // config.patch_size) ** 2
  tokens += 1 if config.classifier == Classifier.token else 0
  return attention_path(config.attention, jnp.dtype(config.dtype.value),
                        config.hidden_size // config.num_heads, tokens, masked=False,
                        dropout=False)


def _initial_params(config: ModelConfig, preset: dict):
  """Seed 0's parameters of the model, as `prepare_train_step` starts it."""
  shape = (preset["image_size"], preset["image_size"], 3)
  return state_lib.init_params(build_model(config, preset["num_classes"]), shape, seed=0)[0]


def compile_memory(step: TrainStep) -> dict | None:
  """XLA's memory accounting of the compiled step, in bytes; None where the backend has none."""
  try:
    stats = step.compiled.memory_analysis()
  except (NotImplementedError, RuntimeError):  # a backend without it (XlaRuntimeError)
    return None
  if stats is None:
    return None
  return {name: int(getattr(stats, name)) for name in COMPILE_MEMORY if hasattr(stats, name)}


def measure_group(size: str, preset: dict, dtype: str, budget: Budget, report: dict, *,
                  rounds: int, steps: int, families: tuple[str, ...] = SPARSE,
                  precision: str = "default", warmup: int = 2) -> list[dict]:
  """The rows of the dense twin and of each family's models timed beside it; the peaks come from
  `report`, skips and errors go into it."""
  kinds = ("dense",) + tuple(kind for family in families for kind in FAMILY_ROWS[family])
  configs = {kind: config for kind, config in _configs(preset, dtype).items() if kind in kinds}
  batch = preset["batch_size"]
  flops = {kind: train_flops_per_image(config, preset["num_classes"], batch_size=batch) * batch
           for kind, config in configs.items()}
  attention = _attention(configs["dense"])
  peak_gflops = report["matmul_peak_gflops"][dtype]
  specified_tflops = report["specified_peak_tflops"][dtype]

  def prepare(kind: str, params=None) -> TrainStep | None:
    name = f"{size}/{dtype}/{kind}"
    if not budget.allows(size):
      print(f"{name}: skipped: {budget.left():.0f} s of the budget left, and a {size} model "
            f"takes about {budget.expected(size):.0f} s (--budget-s)", flush=True)
      report["skipped"].append(name)
      return None
    try:
      with precision_scope(dtype, precision):
        return prepare_train_step(configs[kind], preset, params=params, warmup=warmup)
    except Exception as e:  # noqa: BLE001 -- out of memory, say: the other models still run
      report["errors"].append(f"{name}: {_error(e)}")
      print(f"{name}: failed: {_error(e)}", flush=True)
      return None

  def row(kind: str, step: TrainStep, rounds_ms: list) -> dict:
    config, step_ms = configs[kind], statistics.median(rounds_ms)
    seconds, moe = step_ms / 1e3, kind != "dense"
    return {"model": size, "dtype": dtype, "family": kind,
            "matmul_precision": report["matmul_precision"][dtype], "attention": attention,
            "dispatcher": config.moe.dispatcher.value if moe else None,
            "grouped_matmul": config.moe.grouped_matmul.value if config.router.dropless else None,
            "batch_size": batch, "compile_s": step.compile_s,
            "compile_memory": compile_memory(step), "train_step_ms": step_ms,
            "train_step_ms_per_round": rounds_ms, "images_per_s": batch / seconds,
            "analytic_train_flops": flops[kind], "xla_train_flops": step.xla_flops,
            "mfu": flops[kind] / seconds / (peak_gflops * 1e9),
            "mfu_specified": (None if specified_tflops is None
                              else flops[kind] / seconds / (specified_tflops * 1e12)),
            "parameters": step.num_params}

  start = time.monotonic()
  dense = prepare("dense")
  if dense is None:  # skipped or failed: the other models would have nothing to compare with
    report["skipped"] += [f"{size}/{dtype}/{kind}" for kind in kinds[1:]]
    return []
  budget.spent(size, time.monotonic() - start)
  dense_flops = {"analytic_train_flops": flops["dense"], "xla_train_flops": dense.xla_flops}

  def timed(prepared: dict[str, TrainStep]) -> list[dict]:
    """The rows of a family's models, timed in rounds that alternate them with the dense twin."""
    runs = {"dense": dense.run, **{kind: step.run for kind, step in prepared.items()}}
    times = harness.interleaved_rounds_ms(runs, rounds=rounds, steps=steps)
    dense_rounds.extend(times["dense"])
    rows = {}
    for kind, step in prepared.items():
      rows[kind] = row(kind, step, times[kind])
      rows[kind].update(overhead(times[kind], times["dense"], rows[kind], dense_flops),
                        dense_ms_per_round=times["dense"])
    if "vmoe" in rows and "reference" in rows:
      ratios = [r / v for r, v in zip(times["reference"], times["vmoe"])]
      rows["vmoe"].update(vs_reference=statistics.median(ratios), vs_reference_per_round=ratios)
    return list(rows.values())

  dense_rounds, sparse_rows = [], []
  for family in families:
    start, members, prepared, params = time.monotonic(), FAMILY_ROWS[family], {}, None
    try:
      if len(members) > 1 and budget.allows(size):
        # The rows of a family are one model computed two ways (the reference's dispatch, the
        # other grouped matmul): one init, a copy for each row but the last, which takes it
        # (its step donates it), so no parameters but the models' own stay on the device.
        params = _initial_params(configs[members[0]], preset)
      for kind in members:
        own = params if params is None or kind == members[-1] else jax.tree.map(jnp.copy, params)
        step = prepare(kind, own)
        if step is not None:
          prepared[kind] = step
      params = own = step = None
      if prepared:
        sparse_rows += timed(prepared)
    except Exception as e:  # noqa: BLE001 -- as in prepare
      report["errors"].append(f"{size}/{dtype}/{family}: {_error(e)}")
      print(f"{size}/{dtype}/{family}: failed: {_error(e)}", flush=True)
    finally:
      budget.spent(size, (time.monotonic() - start) / max(1, len(prepared)))
      params = own = step = None
      prepared.clear()  # their parameters and Adam states leave the device before the next's
      gc.collect()
  if not dense_rounds:  # every other model skipped or failed: the dense twin alone
    dense_rounds = harness.interleaved_rounds_ms({"dense": dense.run}, rounds=rounds,
                                                 steps=steps)["dense"]
  return [row("dense", dense, dense_rounds), *sparse_rows]


def _dtype_label(row: dict) -> str:
  """"float32 (TF32)" where the matmuls are not what the dtype says."""
  precision = row["matmul_precision"]
  if precision == row["dtype"]:
    return row["dtype"]
  return f"{row['dtype']} ({PRECISION_LABELS.get(precision, precision)})"


def _table(rows: list) -> str:
  lines = ["| model | family | dtype | attention | compile s | temp MB | step ms | images/s | "
           "MFU (measured peak) | MFU (specified peak) | time ratio | FLOP ratio | overhead | "
           "vs reference |", "|---" * 14 + "|"]
  for r in rows:
    ratios = (f"{r['time_ratio']:.3f} | {r['analytic_flop_ratio']:.3f} | **{r['overhead']:.3f}**"
              if "overhead" in r else "1 | 1 | -")
    memory = r["compile_memory"] or {}
    temp = memory.get("temp_size_in_bytes")
    cells = [r["model"], ROW_NAMES[r["family"]], _dtype_label(r), r["attention"],
             f"{r['compile_s']:.1f}", "-" if temp is None else f"{temp / 1e6:,.1f}",
             f"{r['train_step_ms']:.1f}", f"{r['images_per_s']:,.0f}", f"{r['mfu']:.1%}",
             "-" if r["mfu_specified"] is None else f"{r['mfu_specified']:.1%}", ratios,
             f"**{r['vs_reference']:.3f}**" if "vs_reference" in r else "-"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before JAX starts its backend."""
  parser = arguments.Parser(prog=PROG, description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes, few rounds: the same code on a CPU in about a minute")
  parser.add_argument("--budget-s", default="400",
                      help="seconds from the start; models that would not fit are skipped")
  parser.add_argument("--models", default="s32,b16", help=f"of {', '.join(MODELS)}")
  parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"of {', '.join(DTYPES)}")
  parser.add_argument("--precision", default="default",
                      help="float32 matmuls: default (JAX's: TF32 on a GPU) or highest (float32)")
  parser.add_argument("--rounds", help="alternating rounds (default 5; --small 2)")
  parser.add_argument("--steps", help="steps per round (default 3; --small 2)")
  parser.add_argument("--families", default=",".join(SPARSE),
                      help="models beside the dense twin: vmoe (token-choice, with the reference "
                           "dispatch), experts_choice, soft, dropless (token-choice dropless, by "
                           "blocks and by ragged_dot)")
  parser.add_argument("--output-dir", type=pathlib.Path,
                      help="where the JSON goes (default runs/benchmarks/; benchmarks/results/ "
                           "with --record)")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.models = parser.names("--models", args.models, "model", list(MODELS))
  args.dtypes = parser.names("--dtypes", args.dtypes, "dtype", DTYPES)
  args.families = parser.names("--families", args.families, "family",
                         [f for f in FAMILY_NAMES if f != "dense"])
  args.precision = parser.choice("--precision", args.precision, PRECISIONS)
  args.budget_s = parser.number("--budget-s", args.budget_s, float, 0)
  args.rounds = (parser.number("--rounds", args.rounds, int, 1) if args.rounds is not None
                 else 2 if args.small else 5)
  args.steps = (parser.number("--steps", args.steps, int, 1) if args.steps is not None
                else 2 if args.small else 3)
  return args


def main(argv=None) -> dict:
  started = time.monotonic()
  args = parse(argv)
  if args.small:  # read when JAX starts its backend, just below
    os.environ["XLA_FLAGS"] = small_xla_flags(os.environ.get("XLA_FLAGS", ""), installed_build())
  if not args.small and jax.default_backend() == "cpu":  # a TPU may run it
    problem = (gpu_problem() or "JAX computes on the CPU").rstrip(". ")
    arguments.Parser(prog=PROG).refuse(f"{problem}; use --small for the CPU run")
  print(f"devices: {jax.devices()}", flush=True)
  budget = Budget(args.budget_s - (time.monotonic() - started))
  models = SMALL_MODELS if args.small else MODELS
  backend, device_kind = jax.default_backend(), jax.devices()[0].device_kind
  precisions = {d: matmul_precision(d, args.precision, backend) for d in args.dtypes}
  specified = specified_peak(device_kind) if backend == "gpu" else None
  # A matmul the size of the device's (2048^3 would leave a GPU mostly waiting on the launch).
  matmul_n = 256 if args.small else 8192
  peaks = {}
  for d in args.dtypes:
    with precision_scope(d, args.precision):
      peaks[d] = harness.matmul_peak_gflops(matmul_n, jnp.dtype(d))
  report = {"machine": harness.machine(), "devices": [str(d) for d in jax.devices()],
            "date": time.strftime("%Y-%m-%d"), "small": args.small,
            "precision": args.precision, "matmul_precision": precisions,
            "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
            "matmul_peak_gflops": peaks, "matmul_n": matmul_n,
            "specified_peak": ({"device": specified[0], "tflops": specified[1]} if specified
                               else None),
            "specified_peak_tflops": {d: specified[1][precisions[d]] if specified else None
                                      for d in args.dtypes},
            "rounds": args.rounds, "steps_per_round": args.steps,
            "warmup_steps": 1 if args.small else 2, "budget_s": args.budget_s,
            "presets": {m: models[m] for m in args.models}, "families": list(args.families),
            "rows": [], "skipped": [], "errors": []}
  for d in args.dtypes:
    listed = (f"{report['specified_peak_tflops'][d]:,.1f} TFLOP/s specified ({specified[0]})"
              if specified else f"none specified for {device_kind}")
    label = _dtype_label({"dtype": d, "matmul_precision": precisions[d]})
    print(f"matmul peak, {label}: {peaks[d]:,.0f} GFLOP/s measured; {listed}", flush=True)
  for dtype in args.dtypes:  # bfloat16 first: on an accelerator it matters most
    for size in args.models:
      rows = measure_group(size, models[size], dtype, budget, report, rounds=args.rounds,
                           steps=args.steps, families=args.families, precision=args.precision,
                           warmup=report["warmup_steps"])
      report["rows"] += rows
      for r in rows:
        vs = (f" ({r['vs_reference']:.3f}x as fast as the reference)" if "vs_reference" in r
              else "")
        print(f"{size}/{dtype}/{r['family']}: compile {r['compile_s']:.1f} s, "
              f"{r['train_step_ms']:.1f} ms per step{vs}, {r['images_per_s']:,.0f} img/s, "
              f"MFU {r['mfu']:.1%} ({r['attention']} attention, {r['matmul_precision']} "
              f"matmuls)", flush=True)
  report["elapsed_s"] = time.monotonic() - started
  path = harness.write("gpu_small" if args.small else "gpu", report, args.output_dir,
                       record=args.record)
  print(_table(report["rows"]))
  for line in report["skipped"]:
    print(f"skipped (budget): {line}")
  for line in report["errors"]:
    print(f"error: {line}")
  print(f"{report['elapsed_s']:.0f} s; written to {path}")
  return report


if __name__ == "__main__":
  sys.exit(1 if main()["errors"] else 0)
