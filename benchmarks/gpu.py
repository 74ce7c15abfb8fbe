"""V-MoE train steps on one accelerator, against the device's peaks, the dense twin and the
reference V-MoE's dispatch, and where their time goes.

    make bench-gpu            # PYTHONPATH=. python -m benchmarks.gpu
    python -m benchmarks.gpu [--small] [--budget-s 400] [--models s32,b16]
                             [--dtypes bfloat16,float32] [--precision default|highest]
                             [--families vmoe,experts_choice,soft,dropless] [--group-sizes 8,32]
                             [--compiler-options-ab xla_gpu_enable_cublaslt,...] [--profile]
                             [--rounds 5] [--steps 3] [--name gpu] [--output-dir DIR] [--record]
    bash benchmarks/gpu_fill.sh                  # the rows docs/speed.md lacks, within 8 minutes

V-MoE-S/32 (`train_step`'s `s32` preset: 32 experts on blocks 5 and 7) and V-MoE-B/16 (`b16`: 32
experts on every second block), batch 256 at 224 px, each as token-choice (k = 2, C = 1.05),
experts-choice, Soft MoE and the dense twin (`train_step.model_configs`), in bfloat16
(`model.dtype=bfloat16`: float32 parameters) and float32. Beside token-choice, in the same
alternating rounds, the reference: the same model with `model.moe.dispatcher=einsum`, vmoe's
routing plan carried out by the one-hot (G, S, E, C) dispatch and combine einsums of GShard and
google-research/vmoe; "vs reference" is the median over rounds of its step time over
token-choice's. `--group-sizes 8,32` times token-choice and the reference at each routing group
size (`model.moe.group_size`, images; each must divide the batch): the preset's (8) keeps the
plain names, another is named `vmoe@32`, `reference@32`, and "vs reference" pairs rows of one size.
Per model: compile seconds and memory, the median step time over rounds in which it alternates
with its dense twin, images/s, MFU (analytic FLOPs) against the matmul peak measured first and
against the device's specified dense peak (SPECIFIED_PEAK_TFLOPS), the attention implementation
taken and the matmul precision (float32 is TF32 on a GPU unless `--precision highest`), a sparse
model's overhead over the dense twin (`train_step.overhead`), the XLA compiler options its step
was compiled with (`compiler_options`: `runner.models.compiler_options` of its config, and an A/B
row's own) and what XLA compiled it to (`compiled`, `compiled_path` of the optimised HLO: cuDNN's
ragged-dot fusion, Pallas kernel calls, sorts, while loops). The models of one unit (a family, or
a pair of its rows) are compiled, timed and freed together beside the dense twin, so at most
three models' parameters and Adam states are on the device at once. `dropless` (token-choice
with model.router.dropless=true, k = 2) is measured only when named, a row per grouped matmul
(`model.moe.grouped_matmul`) the device runs, `dropless_<method>`: blocks and
`jax.lax.ragged_dot` (which XLA may lower to a dense product over every expert) anywhere, vmoe's
Pallas kernel (pallas) and ragged_dot compiled with XLA's cuDNN ragged-dot fusion (cudnn,
bfloat16 only) on an NVIDIA GPU; the others are listed under `skipped` with why.
`--compiler-options-ab a,b` adds a dense row per named XLA option (a boolean of KNOWN_AB_OPTIONS,
set True), `dense+a`, timed in the same rounds as the dense twin compiled without it.
`--profile`: after timing, one more step of each model (the dense twin and every other row) runs
under `jax.profiler.trace`, written where TensorBoard and Perfetto open it
(<output dir>/<name>_profile/<model>_<dtype>_<family>/), and the row gets its time by kernel
class (`time_by_kernel_class_ms`: matmul, attention, dispatch, sort, elementwise, other) from the
trace's device kernels, classified by name (KERNEL_PATTERNS). A CPU's trace has no device
kernels: there the XLA:CPU thunks (HLO instructions) are classified by what their HLO computes.

It imports jax, flax, optax, numpy and vmoe's source only: no TensorFlow, TFDS, Hydra, OmegaConf
or W&B, so a CUDA JAX image runs it as it is. It prints, and records under `versions`, which JAX
ran (jax, jaxlib, the CUDA plug-in, cuDNN, cuBLAS, the CUDA runtime, the NVIDIA driver; None
where absent). Every argument is checked before anything runs; on a CPU it runs with `--small`
only.

Time: `--budget-s` (from the start; the default fits 8 minutes on one GPU). Before each model
the budget expects it to take as long as the longest model of its size so far, or, for a size
not timed yet, MODEL_SECONDS (one H200's seconds per model), scaled by how much slower this
run's sizes were than theirs. The rows that matter most are kept for: the dense twin,
token-choice and the reference (at the first group size) of every model in the first dtype
(bfloat16 unless `--dtypes` says otherwise) are "protected", and before any other row starts the
budget keeps the expected time of the protected rows still to come, so that a default run
reaches V-MoE-B/16 in bfloat16 (dense, token-choice, reference) after S/32's bfloat16 rows, of
which experts-choice and Soft MoE run only if they leave B/16's three their time (the 3x guess
for an unseen size used before could skip every B/16 row after S/32's five). A
row that does not fit is skipped, saying so. Whatever was measured is written after each model
and dtype, and at the end, to runs/benchmarks/<name>.json (gpu.json; gpu_small.json with
`--small`; `--record`: the tracked benchmarks/results/) and printed as tables. A model that fails
(out of memory, say) is reported as an error, the others still run, and the exit status is 1.
`--small` runs the same code on tiny shapes, compiled with XLA's fast-compile options
(SMALL_XLA_FLAGS): about a minute on a CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import gzip
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import arguments, harness
from benchmarks.train_step import (PRESETS, SPARSE, TrainStep, model_configs, overhead,
                                   prepare_train_step)
from runner.accelerator import driver, gpu_problem, grouped_matmul_problem, installed_build
from runner.config.schema import Classifier, Dispatcher, GroupedMatmul, ModelConfig
from runner.models import build_model, compiler_options
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
# Dropless rows, one per grouped matmul (`model.moe.grouped_matmul`), in this order; those the
# device cannot run (`runner.accelerator.grouped_matmul_problem`) are skipped.
DROPLESS_METHODS = ("blocks", "ragged_dot", "pallas", "cudnn")
ROW_NAMES = {"dense": "dense", "vmoe": "token-choice", "reference": "reference (einsum)",
             "experts_choice": "experts-choice", "soft": "Soft MoE",
             **{f"dropless_{m}": f"dropless ({m})" for m in DROPLESS_METHODS}}
# Routing group size (images) of the presets' sparse models: rows at it keep their plain names.
DEFAULT_GROUP_SIZE = model_configs(PRESETS["s32"], "float32")["vmoe"].moe.group_size
# XLA options `--compiler-options-ab` may set True on an extra dense row (DebugOptions booleans
# that jaxlib 0.10.2 accepts per jit, on a CPU as well; a GPU is where they change anything).
KNOWN_AB_OPTIONS = ("xla_gpu_enable_cublaslt", "xla_gpu_triton_gemm_any",
                    "xla_gpu_enable_latency_hiding_scheduler")
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
# Seconds one model of each size took on one H200 (2026-11-28, benchmarks/results/gpu.json and
# gpu_b16_float32.json: 386 s for 11 S/32 models and a failed B/16, 218 s for 4 B/16 models,
# compile, parameters, warm-up and timed steps beside the dense twin): what the budget expects of
# a size this run has not timed yet, scaled by this run's own measurements (`Budget.expected`).
MODEL_SECONDS = {"s32": 30.0, "b16": 55.0}
SMALL_MODEL_SECONDS = {"s32": 2.0, "b16": 3.0}
# --small compiles tiny programs and runs each for a few steps: XLA's backend optimisation, CPU
# fusion emitters and parallel code generation cost more than they save there (half the run;
# tests/conftest.py sets the same). The functions computed are the same; the flags are in the
# result's machine.xla_flags.
SMALL_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                   "--xla_cpu_parallel_codegen_split_count=1")
COMPILE_MEMORY = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                  "alias_size_in_bytes", "peak_memory_in_bytes")
KERNEL_CLASSES = ("matmul", "attention", "dispatch", "sort", "elementwise", "other")
# A device kernel's class from its name, the first pattern that matches (ignoring case): cuBLAS
# (`*gemm*`, `nvjet*`, `sm90_xmma*`), CUTLASS and XLA's Triton GEMM fusions are matmuls; cuDNN's
# fused attention (`*fmha*`, `*flash*`, `*sdpa*`, any other `cudnn*` kernel) attention; CUB's
# and XLA's sorts sort; gathers, scatters and dynamic (update) slices dispatch; XLA's loop and
# input (reduction) fusions elementwise; anything else (copies, memsets, transposes) other.
KERNEL_PATTERNS = (
    ("sort", r"sort|cub::|radix"),
    ("attention", r"fmha|flash|sdpa|attention"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|matmul|(?<![a-z])dot(?![a-z])|convolution"),
    ("attention", r"^cudnn"),
    ("dispatch", r"gather|scatter|dynamic[-_]update[-_]slice|dynamic[-_]slice"),
    ("elementwise", r"^(loop|input)_.*fusion|elementwise"),
)
# What a row's compiled step must hold to be the method it is named after (else a note says so:
# XLA compiles ragged_dot without cuDNN where its cuDNN is too old for the fusion, say).
EXPECTED_PATHS = {"dropless_cudnn": ("cudnn_ragged_dot", "cuDNN's ragged-dot fusion"),
                  "dropless_pallas": ("pallas_kernel_calls", "a Pallas kernel call")}
# Instructions that only run others (an XLA:CPU thunk per loop or call, around its body's own).
_CONTROL = re.compile(r"^(while|call|conditional)([._-]\d+)*$")
# The HLO opcodes behind each class, for XLA:CPU's thunks (named after instructions, not kernels).
_OPCODE_CLASSES = (("sort", {"sort"}), ("matmul", {"dot", "convolution", "ragged-dot"}),
                   ("dispatch", {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}))
_OTHER_OPCODES = {"copy", "copy-start", "copy-done", "custom-call", "infeed", "outfeed", "send",
                  "recv", "all-reduce", "all-gather", "all-to-all", "collective-permute"}


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


def versions() -> dict:
  """Which JAX ran: jax, jaxlib, the CUDA plug-in (build, version), and as the libraries report
  them cuDNN, cuBLAS, the CUDA runtime and driver API (integers, e.g. cuDNN 91000 is 9.10.0) and
  the NVIDIA driver (nvidia-smi); None where there is none (a CPU) or it cannot be read."""
  from jax._src import lib  # noqa: PLC0415 -- JAX's own record of its CUDA libraries
  found = {"jax": jax.__version__, "jaxlib": getattr(lib, "version_str", None),
           "cuda_plugin": None, "cudnn": None, "cublas": None, "cuda_runtime": None,
           "cuda_driver_api": None, "nvidia_driver": None}
  build = installed_build()
  found["cuda_plugin"] = f"{build[0]} {build[1]}" if build else None
  cuda = getattr(lib, "cuda_versions", None)
  for key, name in (("cudnn", "cudnn_get_version"), ("cublas", "cublas_get_version"),
                    ("cuda_runtime", "cuda_runtime_get_version"),
                    ("cuda_driver_api", "cuda_driver_get_version")):
    try:
      found[key] = int(getattr(cuda, name)()) if cuda is not None else None
    except Exception:  # noqa: BLE001 -- a helper this jaxlib lacks, or no device to ask
      found[key] = None
  try:
    found["nvidia_driver"] = driver()[0]
  except Exception:  # noqa: BLE001 -- no nvidia-smi (a CPU), or a driver that does not answer
    found["nvidia_driver"] = None
  return found


def _versions_line(found: dict) -> str:
  named = [f"jax {found.get('jax')}", f"jaxlib {found.get('jaxlib')}",
           f"CUDA plug-in {found.get('cuda_plugin') or 'none'}"]
  named += [f"{label} {found[key]}" for key, label in
            (("cudnn", "cuDNN"), ("cublas", "cuBLAS"), ("cuda_runtime", "CUDA runtime"),
             ("nvidia_driver", "NVIDIA driver")) if found.get(key) is not None]
  return "JAX: " + ", ".join(named)


def compute_platform() -> str:
  """The platform the first device computes on, as `grouped_matmul_problem` names it: "cuda",
  "rocm", "cpu", "tpu"."""
  device = jax.devices()[0]
  client = getattr(device, "client", None)
  name = str(getattr(client, "platform", "") or device.platform).lower()
  if name == "gpu":  # a client that names no vendor
    return "rocm" if "rocm" in str(getattr(client, "platform_version", "")).lower() else "cuda"
  return name


class Budget:
  """Seconds from the start. A model runs only if the time it is expected to take fits, and, for
  a row not protected, also leaves the expected time of the protected rows still to come
  (`reserve`d per group of rows, released when the group starts)."""

  def __init__(self, seconds: float, estimates: dict | None = None, clock=time.monotonic):
    self.clock = clock
    self.end = clock() + seconds
    self.estimates = dict(MODEL_SECONDS if estimates is None else estimates)
    self.longest: dict[str, float] = {}
    self.reserved: dict[str, tuple[str, int]] = {}

  def expected(self, size: str) -> float:
    """The longest a model of `size` took so far; else its estimate, times the largest ratio of
    measured to estimated seconds among the sizes timed (a slower device, a slower guess)."""
    if size in self.longest:
      return self.longest[size]
    scale = max((self.longest[s] / self.estimates[s] for s in self.longest
                 if self.estimates.get(s)), default=1.0)
    fallback = max(self.estimates.values(), default=0.0)
    return self.estimates.get(size, fallback) * scale

  def reserve(self, key: str, size: str, models: int) -> None:
    self.reserved[key] = (size, models)

  def release(self, key: str) -> None:
    self.reserved.pop(key, None)

  def kept(self) -> float:
    """Seconds kept for the protected rows still to come."""
    return sum(models * self.expected(size) for size, models in self.reserved.values())

  def allows(self, size: str, protected: bool = False) -> bool:
    need = self.expected(size) + (0.0 if protected else self.kept())
    return self.clock() + need <= self.end

  def left(self) -> float:
    return self.end - self.clock()

  def why_not(self, size: str, protected: bool = False) -> str:
    why = (f"{self.left():.0f} s of the budget left, and a {size} model takes about "
           f"{self.expected(size):.0f} s")
    if not protected and self.reserved:
      why += (f", {self.kept():.0f} s kept for the protected rows of "
              f"{', '.join(self.reserved)}")
    return why + " (--budget-s)"

  def spent(self, size: str, seconds: float) -> None:
    self.longest[size] = max(self.longest.get(size, 0.0), seconds)


def _error(exc: Exception) -> str:
  return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def family_name(kind: str, group_size: int) -> str:
  """A token-choice or reference row's family: "vmoe" at the presets' group size, "vmoe@32" at
  another."""
  return kind if group_size == DEFAULT_GROUP_SIZE else f"{kind}@{group_size}"


def base_family(family: str) -> str:
  """"vmoe@32" -> "vmoe", "dense+xla_gpu_enable_cublaslt" -> "dense"."""
  return re.split(r"[@+]", family, maxsplit=1)[0]


def row_name(family: str) -> str:
  """The table's name of a row: "token-choice @32", "dense +xla_gpu_enable_cublaslt"."""
  base = base_family(family)
  return ROW_NAMES[base] + (f" {family[len(base):]}" if family != base else "")


def _configs(preset: dict, dtype: str,
             group_sizes: tuple[int, ...] = (DEFAULT_GROUP_SIZE,),
             ab_options: tuple[str, ...] = ()) -> dict[str, ModelConfig]:
  """`train_step.model_configs` and the rows only this benchmark has: token-choice and the
  reference's einsum dispatch at each group size, dropless by each grouped matmul, and the dense
  twin again for each A/B option (its options are the row's, not the config's)."""
  configs = model_configs(preset, dtype)
  vmoe = configs.pop("vmoe")
  for size in group_sizes:
    grouped = dataclasses.replace(vmoe, moe=dataclasses.replace(vmoe.moe, group_size=size))
    configs[family_name("vmoe", size)] = grouped
    configs[family_name("reference", size)] = dataclasses.replace(
        grouped, moe=dataclasses.replace(grouped.moe, dispatcher=Dispatcher.einsum))
  dropless = dataclasses.replace(vmoe, router=dataclasses.replace(vmoe.router, dropless=True))
  for method in DROPLESS_METHODS:
    configs[f"dropless_{method}"] = dataclasses.replace(
        dropless, moe=dataclasses.replace(dropless.moe, grouped_matmul=GroupedMatmul(method)))
  for option in ab_options:
    configs[f"dense+{option}"] = configs["dense"]
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


# --- What XLA compiled: the optimised HLO's text (`compiled.as_text()`) -----------------------

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*.*?\s([a-z][a-z0-9-]*)\(")
_CALLS = re.compile(r"\bcalls=\{?%?([^\s,}]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CUDNN_FUSION = re.compile(r'"kind"\s*:\s*"__cudnn\$fusion"')
_TRITON_FUSION = re.compile(r'"kind"\s*:\s*"__triton')
_PALLAS_TARGET = re.compile(r"^(__gpu\$xla\.gpu\.triton|triton_kernel_call|mosaic_gpu\w*)$")


def _instructions(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
  """{computation: [(instruction, opcode, line)]} of an HLO module's text."""
  computations, current = {}, None
  for line in hlo.splitlines():
    if line and not line[0].isspace():
      header = _HEADER.match(line)
      current = header.group(1) if header else None
      if current is not None:
        computations[current] = []
      continue
    instruction = _INSTRUCTION.match(line) if current is not None else None
    if instruction:
      computations[current].append((instruction.group(1), instruction.group(2), line))
  return computations


def _fused_opcodes(computations: dict, name: str, seen: set | None = None) -> set[str]:
  """The opcodes a (fused) computation runs, those of the computations it calls included."""
  seen = set() if seen is None else seen
  if name in seen or name not in computations:
    return set()
  seen.add(name)
  opcodes = set()
  for _, opcode, line in computations[name]:
    opcodes.add(opcode)
    if opcode == "fusion" and (called := _CALLS.search(line)):
      opcodes |= _fused_opcodes(computations, called.group(1), seen)
  return opcodes


def compiled_path(hlo: str) -> dict:
  """What a compiled program does, from its optimised HLO text: counts of sort and while ops,
  of custom calls; of the fusions XLA gives cuDNN (`"kind":"__cudnn$fusion"`) and whether one of
  them computes a ragged dot (`cudnn_ragged_dot`: the grouped matmul went to cuDNN); the ragged
  dots left as such (XLA:GPU otherwise rewrites them to dense dots); Pallas kernel calls (Triton,
  `__gpu$xla.gpu.triton`, or Mosaic GPU custom calls); cuDNN attention and cuBLAS custom calls;
  and XLA's own Triton fusions."""
  computations = _instructions(hlo)
  found = dict(sort_ops=0, while_ops=0, custom_calls=0, cudnn_fusions=0, cudnn_ragged_dot=False,
               ragged_dot_ops=0, pallas_kernel_calls=0, cudnn_attention_calls=0, cublas_calls=0,
               xla_triton_fusions=0)
  for instructions in computations.values():
    for _, opcode, line in instructions:
      found["sort_ops"] += opcode == "sort"
      found["while_ops"] += opcode == "while"
      found["ragged_dot_ops"] += opcode == "ragged-dot"
      if opcode == "custom-call":
        found["custom_calls"] += 1
        target = _TARGET.search(line)
        target = target.group(1) if target else ""
        found["pallas_kernel_calls"] += bool(_PALLAS_TARGET.match(target))
        found["cudnn_attention_calls"] += target.startswith("__cudnn$fmha")
        found["cublas_calls"] += target.startswith("__cublas$")
      elif opcode == "fusion":
        found["xla_triton_fusions"] += bool(_TRITON_FUSION.search(line))
        if _CUDNN_FUSION.search(line):
          found["cudnn_fusions"] += 1
          called = _CALLS.search(line)
          if called and "ragged-dot" in _fused_opcodes(computations, called.group(1)):
            found["cudnn_ragged_dot"] = True
  return found


def hlo_op_classes(hlo: str) -> dict[str, str | None]:
  """{instruction: kernel class} of a compiled program, from what each instruction (a fusion: its
  fused computation) computes, in KERNEL_PATTERNS' order of precedence; None for those that only
  run others (while, call, conditional). For traces whose events name instructions (XLA:CPU's
  thunks), where the names do not say (`ynn_fusion` holds dots and reductions alike)."""
  computations = _instructions(hlo)
  classes = {}
  for instructions in computations.values():
    for name, opcode, line in instructions:
      if opcode in ("while", "call", "conditional"):
        classes[name] = None
        continue
      called = _CALLS.search(line) if opcode == "fusion" else None
      opcodes = _fused_opcodes(computations, called.group(1)) if called else {opcode}
      target = _TARGET.search(line) if opcode == "custom-call" else None
      if target and re.search(r"fmha|flash|attention", target.group(1), re.IGNORECASE):
        classes[name] = "attention"
        continue
      kind = next((k for k, codes in _OPCODE_CLASSES if opcodes & codes), None)
      if kind is None:
        kind = "other" if opcode in _OTHER_OPCODES else "elementwise"
      classes[name] = kind
  return classes


# --- Where the time goes: a profiled step's trace ---------------------------------------------

def kernel_class(name: str) -> str | None:
  """A device kernel's class by its name (KERNEL_PATTERNS); None for an instruction that only
  runs others (a while loop's or a call's thunk on a CPU, whose body has its own events)."""
  if _CONTROL.match(name):
    return None
  for kind, pattern in KERNEL_PATTERNS:
    if re.search(pattern, name, re.IGNORECASE):
      return kind
  return "other"


def kernel_events(trace) -> tuple[list[dict], str]:
  """(the complete events of the trace's device kernels, "device"), from the processes named
  /device:GPU:n (or TPU), on their "Stream #..." lines where the trace has them (not the "XLA Ops"
  and "XLA Modules" summaries of the same time); where there is no device process (a CPU), the
  host events that name an HLO instruction (XLA:CPU's thunks), and "host"."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads = {}, {}
  for event in events:
    if event.get("ph") == "M" and event.get("name") == "process_name":
      processes[event.get("pid")] = str((event.get("args") or {}).get("name", ""))
    elif event.get("ph") == "M" and event.get("name") == "thread_name":
      threads[(event.get("pid"), event.get("tid"))] = str((event.get("args") or {}).get("name", ""))
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "name" in e]
  devices = {pid for pid, name in processes.items() if re.match(r"/device:(GPU|TPU)", name)}
  if devices:
    lines = {key: name for key, name in threads.items() if key[0] in devices}
    keep = ({key for key, name in lines.items() if name.lower().startswith("stream")} or
            {key for key, name in lines.items()
             if not re.search(r"XLA (Ops|Modules)|Steps|TensorFlow|Framework|Source", name)})
    return [e for e in complete if e.get("pid") in devices
            and (not lines or (e.get("pid"), e.get("tid")) in keep)], "device"
  return [e for e in complete if "hlo_op" in (e.get("args") or {})], "host"


def time_by_kernel_class(events: list[dict], op_classes: dict | None = None) -> dict:
  """Milliseconds by kernel class (KERNEL_CLASSES) of trace events (durations in µs), each
  classed by its instruction's class in `op_classes` where given and listed, else by its name;
  with the events counted, the lines (pid, tid) they ran on, and `busy_ms`, the time at least one
  of them ran (the union of their intervals: at most the step's wall time)."""
  split = {kind: 0.0 for kind in KERNEL_CLASSES}
  intervals, lines = [], set()
  for event in events:
    op = (event.get("args") or {}).get("hlo_op")
    if op_classes is not None and op in op_classes:
      kind = op_classes[op]
    else:
      kind = kernel_class(str(event["name"]))
    if kind is None:
      continue
    start, duration = float(event.get("ts", 0.0)), float(event["dur"])
    split[kind] += duration / 1e3
    intervals.append((start, start + duration))
    lines.add((event.get("pid"), event.get("tid")))
  busy, reach = 0.0, float("-inf")
  for start, end in sorted(intervals):
    if end > reach:
      busy += end - max(start, reach)
      reach = end
  return {"time_by_kernel_class_ms": split, "kernel_events": len(intervals),
          "kernel_lines": len(lines), "busy_ms": busy / 1e3}


def profile_step(step: TrainStep, directory: pathlib.Path, hlo: str | None = None) -> dict:
  """One more step of `step` under `jax.profiler.trace` (a rerun replaces the folder's trace): the
  row's `time_by_kernel_class_ms` and `profile` (where the trace is, the step's wall time, which
  events were classed), from its perfetto_trace.json.gz."""
  shutil.rmtree(directory, ignore_errors=True)
  directory.mkdir(parents=True, exist_ok=True)
  with jax.profiler.trace(str(directory), create_perfetto_trace=True):
    start = time.perf_counter()
    jax.block_until_ready(step.run())
    step_ms = (time.perf_counter() - start) * 1e3
  found = sorted(directory.glob("plugins/profile/*/perfetto_trace.json.gz"))
  record = {"trace_dir": str(directory), "profiled_step_ms": step_ms}
  if not found:
    return {"profile": {**record, "error": "the profiler wrote no perfetto_trace.json.gz"}}
  with gzip.open(found[-1], "rt") as file:
    events, source = kernel_events(json.load(file))
  op_classes = hlo_op_classes(hlo) if source == "host" and hlo else None
  split = time_by_kernel_class(events, op_classes)
  record.update(perfetto_trace=str(found[-1]), kernel_source=(
      "device kernels, classed by name" if source == "device" else
      "no device kernels in the trace: XLA:CPU thunks (HLO instructions), classed by their HLO"
      if op_classes is not None else "host events naming HLO instructions, classed by name"),
      kernel_events=split["kernel_events"], kernel_lines=split["kernel_lines"],
      busy_ms=split["busy_ms"])
  return {"time_by_kernel_class_ms": split["time_by_kernel_class_ms"], "profile": record}


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to measure of each model and dtype, from the arguments."""
  rounds: int
  steps: int
  families: tuple[str, ...] = SPARSE
  precision: str = "default"
  warmup: int = 2
  group_sizes: tuple[int, ...] = (DEFAULT_GROUP_SIZE,)
  ab_options: tuple[str, ...] = ()
  profile_dir: pathlib.Path | None = None  # --profile: traces go under it
  platform: str = "cpu"  # compute_platform()


def _pairs(rows: list[str]) -> list[tuple[str, ...]]:
  return [tuple(rows[i:i + 2]) for i in range(0, len(rows), 2)]


def _units(plan: Plan, methods: list[str],
           protected: bool = True) -> list[tuple[tuple[str, ...], bool]]:
  """(rows timed together beside the dense twin, protected) in order: token-choice with its
  reference at the first group size (protected if the group's rows are), then at the others, the
  other families as named, dropless two methods at a time, the A/B rows two at a time."""
  units = []
  if "vmoe" in plan.families:
    units += [((family_name("vmoe", g), family_name("reference", g)), protected and i == 0)
              for i, g in enumerate(plan.group_sizes)]
  for family in plan.families:
    if family in ("experts_choice", "soft"):
      units.append(((family,), False))
    elif family == "dropless":
      units += [(pair, False) for pair in _pairs([f"dropless_{m}" for m in methods])]
  units += [(pair, False) for pair in _pairs([f"dense+{o}" for o in plan.ab_options])]
  return units


def measure_group(size: str, preset: dict, dtype: str, budget: Budget, report: dict,
                  plan: Plan, protected: bool = True) -> list[dict]:
  """The rows of the dense twin and of each unit's models timed beside it; the peaks come from
  `report`, skips (with why) and errors go into it. `protected`: the dense twin, token-choice and
  the reference run whatever the budget keeps for later groups."""
  group = f"{size}/{dtype}"
  budget.release(group)  # its protected rows come first, and do not wait on their own reserve
  methods = []
  if "dropless" in plan.families:
    for method in DROPLESS_METHODS:
      why = grouped_matmul_problem(method, dtype, plan.platform)
      if why is None:
        methods.append(method)
      else:
        why = re.sub(r"^.*cannot run here: |\. Use .*$", "", why)
        report["skipped"].append(f"{group}/dropless_{method}: {why}")
        print(f"{group}/dropless_{method}: skipped: {why}", flush=True)
  units = _units(plan, methods, protected)
  configs = _configs(preset, dtype, plan.group_sizes, plan.ab_options)
  batch = preset["batch_size"]
  flops = {kind: train_flops_per_image(config, preset["num_classes"], batch_size=batch) * batch
           for kind, config in configs.items()}
  options = {kind: {**compiler_options(config),
                    **({kind.split("+", 1)[1]: True} if "+" in kind else {})}
             for kind, config in configs.items()}
  attention = _attention(configs["dense"])
  peak_gflops = report["matmul_peak_gflops"][dtype]
  specified_tflops = report["specified_peak_tflops"][dtype]
  compiled, texts = {}, {}

  def skip(kind: str, why: str) -> None:
    report["skipped"].append(f"{group}/{kind}: {why}")
    print(f"{group}/{kind}: skipped: {why}", flush=True)

  def prepare(kind: str, protected: bool, params=None) -> TrainStep | None:
    name = f"{group}/{kind}"
    if not budget.allows(size, protected):
      skip(kind, budget.why_not(size, protected))
      return None
    try:
      with precision_scope(dtype, plan.precision):
        step = prepare_train_step(configs[kind], preset, params=params, warmup=plan.warmup,
                                  compiler_options=options[kind] or None)
    except Exception as e:  # noqa: BLE001 -- out of memory, say: the other models still run
      report["errors"].append(f"{name}: {_error(e)}")
      print(f"{name}: failed: {_error(e)}", flush=True)
      return None
    hlo = step.compiled.as_text()
    compiled[kind] = compiled_path(hlo)
    if kind in EXPECTED_PATHS and not compiled[kind][EXPECTED_PATHS[kind][0]]:
      field, what = EXPECTED_PATHS[kind]
      print(f"{name}: note: compiled without {what} (compiled.{field} is "
            f"{compiled[kind][field]}): its time is not that method's", flush=True)
    if plan.profile_dir is not None:
      texts[kind] = hlo
    return step

  def row(kind: str, step: TrainStep, rounds_ms: list) -> dict:
    config, step_ms = configs[kind], statistics.median(rounds_ms)
    seconds, moe = step_ms / 1e3, base_family(kind) != "dense"
    return {"model": size, "dtype": dtype, "family": kind,
            "matmul_precision": report["matmul_precision"][dtype], "attention": attention,
            "dispatcher": config.moe.dispatcher.value if moe else None,
            "grouped_matmul": config.moe.grouped_matmul.value if config.router.dropless else None,
            "group_size": config.moe.group_size if moe else None,
            "compiler_options": options[kind], "compiled": compiled.get(kind),
            "batch_size": batch, "compile_s": step.compile_s,
            "compile_memory": compile_memory(step), "train_step_ms": step_ms,
            "train_step_ms_per_round": rounds_ms, "images_per_s": batch / seconds,
            "analytic_train_flops": flops[kind], "xla_train_flops": step.xla_flops,
            "mfu": flops[kind] / seconds / (peak_gflops * 1e9),
            "mfu_specified": (None if specified_tflops is None
                              else flops[kind] / seconds / (specified_tflops * 1e12)),
            "parameters": step.num_params}

  def profiled(kind: str, step: TrainStep) -> dict:
    """--profile: the row's time by kernel class; a trace that fails is the row's, not the run's."""
    if plan.profile_dir is None:
      return {}
    try:
      return profile_step(step, plan.profile_dir / f"{size}_{dtype}_{kind}", texts.get(kind))
    except Exception as e:  # noqa: BLE001 -- no CUPTI, say: the row's times stand
      print(f"{group}/{kind}: profile failed: {_error(e)}", flush=True)
      return {"profile": {"error": _error(e)}}

  start = budget.clock()
  dense = prepare("dense", protected)
  if dense is None:  # skipped or failed: the other models would have nothing to compare with
    for members, _ in units:
      for kind in members:
        skip(kind, "its dense twin did not run")
    return []
  budget.spent(size, budget.clock() - start)
  dense_flops = {"analytic_train_flops": flops["dense"], "xla_train_flops": dense.xla_flops}

  def timed(prepared: dict[str, TrainStep]) -> list[dict]:
    """The rows of a unit's models, timed in rounds that alternate them with the dense twin."""
    runs = {"dense": dense.run, **{kind: step.run for kind, step in prepared.items()}}
    times = harness.interleaved_rounds_ms(runs, rounds=plan.rounds, steps=plan.steps)
    dense_rounds.extend(times["dense"])
    rows = {}
    for kind, step in prepared.items():
      rows[kind] = row(kind, step, times[kind])
      rows[kind].update(overhead(times[kind], times["dense"], rows[kind], dense_flops),
                        dense_ms_per_round=times["dense"])
    for kind in rows:
      reference = kind.replace("vmoe", "reference", 1)
      if base_family(kind) == "vmoe" and reference in rows:
        ratios = [r / v for r, v in zip(times[reference], times[kind])]
        rows[kind].update(vs_reference=statistics.median(ratios), vs_reference_per_round=ratios)
    for kind, step in prepared.items():
      rows[kind].update(profiled(kind, step))
    return list(rows.values())

  dense_rounds, sparse_rows = [], []
  for members, kept in units:
    start, prepared, params, own, step = budget.clock(), {}, None, None, None
    try:
      if len(members) > 1 and budget.allows(size, kept):
        # The rows of a unit are one model computed two ways (the reference's dispatch, another
        # grouped matmul, other compiler options): one init, a copy for each row but the last,
        # which takes it (its step donates it), so no parameters but the models' own stay on
        # the device.
        params = _initial_params(configs[members[0]], preset)
      for kind in members:
        own = params if params is None or kind == members[-1] else jax.tree.map(jnp.copy, params)
        step = prepare(kind, kept, own)
        if step is not None:
          prepared[kind] = step
      params = own = step = None
      if prepared:
        sparse_rows += timed(prepared)
    except Exception as e:  # noqa: BLE001 -- as in prepare
      report["errors"].append(f"{group}/{'+'.join(members)}: {_error(e)}")
      print(f"{group}/{'+'.join(members)}: failed: {_error(e)}", flush=True)
    finally:
      if prepared:  # per model, its share of the unit's time (profiles included)
        budget.spent(size, (budget.clock() - start) / len(prepared))
      params = own = step = None
      for kind in prepared:
        texts.pop(kind, None)
      prepared.clear()  # their parameters and Adam states leave the device before the next's
      gc.collect()
  if not dense_rounds:  # every other model skipped or failed: the dense twin alone
    dense_rounds = harness.interleaved_rounds_ms({"dense": dense.run}, rounds=plan.rounds,
                                                 steps=plan.steps)["dense"]
  dense_row = row("dense", dense, dense_rounds)
  dense_row.update(profiled("dense", dense))
  return [dense_row, *sparse_rows]


def measure_all(presets: dict, dtypes: tuple[str, ...], budget: Budget, report: dict, plan: Plan,
                after_group=None) -> None:
  """Every model (`presets`, in order) in every dtype, the dtypes in order (bfloat16 first by
  default), the first dtype's dense, token-choice and reference rows reserved for in `budget`
  from the start; rows go into `report`, `after_group()` is called after each model and dtype."""
  core = 1 + (2 if "vmoe" in plan.families else 0)  # dense, token-choice, reference
  for size in presets:
    budget.reserve(f"{size}/{dtypes[0]}", size, core)
  for dtype in dtypes:
    for size, preset in presets.items():
      rows = measure_group(size, preset, dtype, budget, report, plan,
                           protected=dtype == dtypes[0])
      report["rows"] += rows
      for r in rows:
        vs = (f" ({r['vs_reference']:.3f}x as fast as the reference)" if "vs_reference" in r
              else "")
        print(f"{size}/{dtype}/{r['family']}: compile {r['compile_s']:.1f} s, "
              f"{r['train_step_ms']:.1f} ms per step{vs}, {r['images_per_s']:,.0f} img/s, "
              f"MFU {r['mfu']:.1%} ({r['attention']} attention, {r['matmul_precision']} "
              f"matmuls)", flush=True)
      if after_group is not None:
        after_group()


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
    cells = [r["model"], row_name(r["family"]), _dtype_label(r), r["attention"],
             f"{r['compile_s']:.1f}", "-" if temp is None else f"{temp / 1e6:,.1f}",
             f"{r['train_step_ms']:.1f}", f"{r['images_per_s']:,.0f}", f"{r['mfu']:.1%}",
             "-" if r["mfu_specified"] is None else f"{r['mfu_specified']:.1%}", ratios,
             f"**{r['vs_reference']:.3f}**" if "vs_reference" in r else "-"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _where_table(rows: list) -> str:
  """Per row, by its family key: the group size, compiler options, what XLA compiled, and with
  --profile the profiled step's milliseconds by kernel class."""
  lines = ["| model | dtype | row | group | compiler options | cuDNN ragged dot | Pallas calls | "
           "sorts | whiles | " + " | ".join(f"{k} ms" for k in KERNEL_CLASSES) +
           " | profiled step ms |", "|---" * (10 + len(KERNEL_CLASSES)) + "|"]
  for r in rows:
    path = r.get("compiled") or {}
    split = r.get("time_by_kernel_class_ms") or {}
    profiled = (r.get("profile") or {}).get("profiled_step_ms")
    cells = [r["model"], r["dtype"], f"`{r['family']}`",
             "-" if r.get("group_size") is None else str(r["group_size"]),
             ", ".join(f"{k}={v}" for k, v in (r.get("compiler_options") or {}).items()) or "-",
             "yes" if path.get("cudnn_ragged_dot") else "no",
             str(path.get("pallas_kernel_calls", "-")), str(path.get("sort_ops", "-")),
             str(path.get("while_ops", "-"))]
    cells += [f"{split[k]:.2f}" if k in split else "-" for k in KERNEL_CLASSES]
    cells.append("-" if profiled is None else f"{profiled:.1f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def print_report(report: dict) -> None:
  """The run's tables, its skips and errors (also for a report read back from its JSON)."""
  print(_versions_line(report.get("versions") or {"jax": report["machine"]["jax"]}))
  print(_table(report["rows"]))
  print()
  print("Where the time goes:")
  print(_where_table(report["rows"]))
  for line in report["skipped"]:
    print(f"skipped: {line}")
  for line in report["errors"]:
    print(f"error: {line}")


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before JAX starts its backend."""
  parser = arguments.Parser(prog=PROG, description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes, few rounds: the same code on a CPU in about a minute")
  parser.add_argument("--budget-s", default="400",
                      help="seconds from the start; models that would not fit are skipped")
  parser.add_argument("--models", default="s32,b16", help=f"of {', '.join(MODELS)}")
  parser.add_argument("--dtypes", default=",".join(DTYPES),
                      help=f"of {', '.join(DTYPES)}; the budget keeps time first for the first "
                           "one's dense, token-choice and reference rows")
  parser.add_argument("--precision", default="default",
                      help="float32 matmuls: default (JAX's: TF32 on a GPU) or highest (float32)")
  parser.add_argument("--rounds", help="alternating rounds (default 5; --small 2)")
  parser.add_argument("--steps", help="steps per round (default 3; --small 2)")
  parser.add_argument("--families", default=",".join(SPARSE),
                      help="models beside the dense twin: vmoe (token-choice, with the reference "
                           "dispatch), experts_choice, soft, dropless (token-choice dropless, by "
                           "every grouped matmul the device runs)")
  parser.add_argument("--group-sizes",
                      help=f"routing group sizes (images) token-choice and the reference are "
                           f"timed at, each dividing the batch (default {DEFAULT_GROUP_SIZE})")
  parser.add_argument("--compiler-options-ab",
                      help=f"XLA options, each set True on an extra dense row timed beside the "
                           f"dense twin: of {', '.join(KNOWN_AB_OPTIONS)}")
  parser.add_argument("--profile", action="store_true",
                      help="after timing, one profiled step per model: a trace, and its time "
                           "by kernel class")
  parser.add_argument("--name", help="of the JSON written, <name>.json, and of the traces' "
                                     "folder <name>_profile (default gpu; --small gpu_small)")
  parser.add_argument("--output-dir", type=pathlib.Path,
                      help="where the JSON (and the traces) go (default runs/benchmarks/; the "
                           "JSON to benchmarks/results/ with --record)")
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
  if args.group_sizes is None:
    args.group_sizes = (DEFAULT_GROUP_SIZE,)
  else:
    text = args.group_sizes
    args.group_sizes = tuple(dict.fromkeys(parser.numbers("--group-sizes", text, int, 1)))
    if "vmoe" not in args.families:
      parser.refuse(f"--group-sizes {text!r}: sizes token-choice and the reference are timed "
                    "at; valid only with vmoe in --families")
    presets = SMALL_MODELS if args.small else MODELS
    for model in args.models:
      batch = presets[model]["batch_size"]
      for size in args.group_sizes:
        if batch % size:
          divisors = [d for d in range(1, batch + 1) if batch % d == 0]
          parser.refuse(f"--group-sizes {text!r}: {size} does not divide {model}'s batch of "
                        f"{batch}; valid: {', '.join(map(str, divisors))}")
  args.compiler_options_ab = (() if args.compiler_options_ab is None else parser.names(
      "--compiler-options-ab", args.compiler_options_ab, "option", KNOWN_AB_OPTIONS))
  if args.name is None:
    args.name = "gpu_small" if args.small else "gpu"
  elif not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", args.name):
    parser.refuse(f"--name {args.name!r}: valid: a file name of letters, digits, _, - and . "
                  "(not starting with . or -)")
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
  found = versions()
  print(_versions_line(found), flush=True)
  budget = Budget(args.budget_s - (time.monotonic() - started),
                  SMALL_MODEL_SECONDS if args.small else MODEL_SECONDS)
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
  plan = Plan(rounds=args.rounds, steps=args.steps, families=args.families,
              precision=args.precision, warmup=1 if args.small else 2,
              group_sizes=args.group_sizes, ab_options=args.compiler_options_ab,
              profile_dir=(pathlib.Path(args.output_dir or harness.RUNS) / f"{args.name}_profile"
                           if args.profile else None),
              platform=compute_platform())
  report = {"machine": harness.machine(), "versions": found,
            "devices": [str(d) for d in jax.devices()],
            "date": time.strftime("%Y-%m-%d"), "small": args.small,
            "precision": args.precision, "matmul_precision": precisions,
            "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
            "matmul_peak_gflops": peaks, "matmul_n": matmul_n,
            "specified_peak": ({"device": specified[0], "tflops": specified[1]} if specified
                               else None),
            "specified_peak_tflops": {d: specified[1][precisions[d]] if specified else None
                                      for d in args.dtypes},
            "rounds": args.rounds, "steps_per_round": args.steps,
            "warmup_steps": plan.warmup, "budget_s": args.budget_s,
            "presets": {m: models[m] for m in args.models}, "families": list(args.families),
            "group_sizes": list(args.group_sizes),
            "compiler_options_ab": list(args.compiler_options_ab),
            "profile_dir": None if plan.profile_dir is None else str(plan.profile_dir),
            "rows": [], "skipped": [], "errors": []}
  for d in args.dtypes:
    listed = (f"{report['specified_peak_tflops'][d]:,.1f} TFLOP/s specified ({specified[0]})"
              if specified else f"none specified for {device_kind}")
    label = _dtype_label({"dtype": d, "matmul_precision": precisions[d]})
    print(f"matmul peak, {label}: {peaks[d]:,.0f} GFLOP/s measured; {listed}", flush=True)
  def write() -> pathlib.Path:
    report["elapsed_s"] = time.monotonic() - started
    return harness.write(args.name, report, args.output_dir, record=args.record)

  measure_all({m: models[m] for m in args.models}, args.dtypes, budget, report, plan,
              after_group=write)  # what was measured so far survives a run cut short
  path = write()
  print_report(report)
  print(f"{report['elapsed_s']:.0f} s; written to {path}")
  return report


if __name__ == "__main__":
  sys.exit(1 if main()["errors"] else 0)
