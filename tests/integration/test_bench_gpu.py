"""`make bench-gpu` (benchmarks/gpu.py) as it runs on an accelerator image: one `--small` run in a
process where TensorFlow, TFDS, Hydra, OmegaConf and W&B cannot be imported, every model of both
sizes and dtypes measured, and each row's numbers recomputed here from its configs and its
per-round times (FLOPs, images/s, MFU, the ratios to the dense twin and to the reference); what
ran named (JAX's versions, attention, matmul precision, dispatcher, compiler options, what XLA
compiled); a second run with this PR's options (token-choice and the reference at two group
sizes, dropless by every grouped matmul the CPU runs and the others skipped saying why, an A/B
compiler option, `--profile`'s traces and their time by kernel class, `--precision highest`
traced at true float32); the HLO and trace readers on synthetic inputs; the budget reaching
V-MoE-B/16 in bfloat16; and what must not run at all: a bad argument, or full-size models on a
CPU, exits 2 with one line before anything compiles."""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import gpu, harness
from benchmarks.train_step import model_configs
from runner.config.schema import Dispatcher
from runner.models.flops import train_flops_per_image
from runner.models.vit import attention_path

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSENT = ("tensorflow", "tensorflow_datasets", "hydra", "omegaconf", "wandb")
ROWS = ("dense", "vmoe", "reference", "experts_choice", "soft")
NUMBERS = ("compile_s", "train_step_ms", "images_per_s", "analytic_train_flops", "xla_train_flops",
           "mfu", "parameters")
SPARSE_NUMBERS = ("time_ratio", "analytic_flop_ratio", "xla_flop_ratio", "overhead")
# One step per round keeps the run cheap; two rounds still give per-round ratios to recompute.
SMALL = ["--small", "--rounds", "2", "--steps", "1"]
# The second run: this PR's options on one model and dtype (float32: cuDNN's grouped matmul is
# then skipped for its dtype, Pallas's for the CPU), with --precision highest.
AB_OPTION = "xla_gpu_enable_cublaslt"  # a DebugOptions field: the CPU client accepts it too
FEATURES = ["--models", "s32", "--dtypes", "float32", "--families", "vmoe,dropless",
            "--group-sizes", "8,4", "--compiler-options-ab", AB_OPTION, "--profile",
            "--precision", "highest", "--name", "features"]
FEATURE_ROWS = ("dense", "vmoe", "reference", "vmoe@4", "reference@4", "dropless_blocks",
                "dropless_ragged_dot", f"dense+{AB_OPTION}")


def _positive(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _close(a: float, b: float) -> bool:
  return math.isclose(a, b, rel_tol=1e-9)


def _config(preset: dict, dtype: str, family: str, group_size: int | None = None):
  """A row's model config, built here from the preset as the benchmark describes it: "vmoe@4" is
  token-choice at group size 4, "dense+option" the dense twin."""
  configs = model_configs(preset, dtype)
  vmoe = configs["vmoe"]
  family = family.split("@")[0].split("+")[0]
  if group_size is not None and family in ("vmoe", "reference"):
    vmoe = dataclasses.replace(vmoe, moe=dataclasses.replace(vmoe.moe, group_size=group_size))
  if family == "reference":
    return dataclasses.replace(vmoe, moe=dataclasses.replace(vmoe.moe,
                                                             dispatcher=Dispatcher.einsum))
  if family.startswith("dropless_"):
    return dataclasses.replace(vmoe, router=dataclasses.replace(vmoe.router, dropless=True))
  return vmoe if family == "vmoe" else configs[family]


def _flops(report: dict, row: dict) -> float:
  preset = report["presets"][row["model"]]
  batch = preset["batch_size"]
  config = _config(preset, row["dtype"], row["family"], row.get("group_size"))
  return train_flops_per_image(config, preset["num_classes"], batch_size=batch) * batch


def _check_numbers(report: dict) -> None:
  """Each row's FLOPs from the presets, images/s and MFU from its median step time, its ratios to
  the dense twin from the rounds, and "vs reference" from the rounds of the reference at its own
  group size: a row of made-up numbers fails."""
  rows = {(r["model"], r["dtype"], r["family"]): r for r in report["rows"]}
  for (model, dtype, family), row in rows.items():
    key = (model, dtype, family)
    flops, ms = _flops(report, row), row["train_step_ms"]
    assert row["batch_size"] == report["presets"][model]["batch_size"], key
    assert _close(row["analytic_train_flops"], flops), key
    assert _close(ms, statistics.median(row["train_step_ms_per_round"])), key
    assert _close(row["images_per_s"], row["batch_size"] / ms * 1e3), key
    peak = report["matmul_peak_gflops"][dtype] * 1e9
    assert _close(row["mfu"], flops / (ms / 1e3) / peak), key
    specified = report["specified_peak_tflops"][dtype]  # TFLOP/s; None for a CPU
    if specified is None:
      assert row["mfu_specified"] is None, key
    else:
      assert _close(row["mfu_specified"], flops / (ms / 1e3) / (specified * 1e12)), key
    if family == "dense":
      continue
    dense = rows[(model, dtype, "dense")]
    flop_ratio = flops / dense["analytic_train_flops"]
    per_round = [s / d for s, d in zip(row["train_step_ms_per_round"], row["dense_ms_per_round"])]
    assert len(per_round) == report["rounds"], key
    assert _close(row["analytic_flop_ratio"], flop_ratio), key
    assert _close(row["xla_flop_ratio"], row["xla_train_flops"] / dense["xla_train_flops"]), key
    assert _close(row["time_ratio"], statistics.median(per_round)), key
    overheads = [r / flop_ratio for r in per_round]
    assert len(row["overhead_per_round"]) == len(overheads), key
    assert all(map(_close, row["overhead_per_round"], overheads)), key
    assert _close(row["overhead"], statistics.median(overheads)), key
    if family.split("@")[0] == "vmoe":
      reference = rows[(model, dtype, family.replace("vmoe", "reference"))]
      # Timed in the same rounds, beside the same dense twin, at the same group size.
      assert row["dense_ms_per_round"] == reference["dense_ms_per_round"], key
      assert row["group_size"] == reference["group_size"], key
      ratios = [r / v for r, v in zip(reference["train_step_ms_per_round"],
                                      row["train_step_ms_per_round"])]
      assert len(row["vs_reference_per_round"]) == len(ratios) == report["rounds"], key
      assert all(map(_close, row["vs_reference_per_round"], ratios)), key
      assert _close(row["vs_reference"], statistics.median(ratios)), key
    else:
      assert "vs_reference" not in row, key
  for model in report["presets"]:
    for dtype in report["matmul_precision"]:
      # The dense twin's rounds are those it ran beside each unit (consecutive rows sharing
      # them), in order.
      beside = []
      for r in report["rows"]:
        if (r["model"], r["dtype"]) == (model, dtype) and r["family"] != "dense" and (
            not beside or r["dense_ms_per_round"] != beside[-1]):
          beside.append(r["dense_ms_per_round"])
      assert rows[(model, dtype, "dense")]["train_step_ms_per_round"] == sum(beside, [])


def _must_not_run(*_, **__):
  raise AssertionError("reached after the arguments were refused")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
  """(stdout, report) of one `make bench-gpu ARGS=--small` run with the accelerator image's
  libraries only."""
  out = tmp_path_factory.mktemp("bench_gpu")
  code = (f"import sys\n"
          f"for name in {ABSENT!r}:\n"
          f"  sys.modules[name] = None\n"
          f"from benchmarks import gpu\n"
          f"sys.exit(1 if gpu.main({SMALL + ['--output-dir', str(out)]!r})['errors'] else 0)\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout, json.loads((out / "gpu_small.json").read_text())


def test_small_run_measures_every_model_without_tensorflow_hydra_or_omegaconf(small_run):
  stdout, report = small_run
  assert stdout.startswith("devices: ["), stdout[:300]
  # Which JAX ran: printed second, recorded under `versions` (no CUDA library on a CPU).
  assert stdout.splitlines()[1].startswith(f"JAX: jax {jax.__version__}, jaxlib "), stdout[:300]
  versions = report["versions"]
  assert versions["jax"] == jax.__version__ and versions["jaxlib"]
  if report["machine"]["backend"] == "cpu":
    assert versions["cudnn"] is versions["cublas"] is versions["nvidia_driver"] is None
  assert report["small"] and report["errors"] == [] and report["skipped"] == []
  assert set(report["matmul_peak_gflops"]) == {"bfloat16", "float32"}
  assert all(_positive(v) for v in report["matmul_peak_gflops"].values())
  rows = {(r["model"], r["dtype"], r["family"]): r for r in report["rows"]}
  assert set(rows) == {(m, d, f) for m in ("s32", "b16") for d in ("bfloat16", "float32")
                       for f in ROWS}
  for key, row in rows.items():
    numbers = NUMBERS + (SPARSE_NUMBERS if key[2] != "dense" else ())
    bad = {name: row.get(name) for name in numbers if not _positive(row.get(name))}
    assert not bad, (key, bad)
    assert row["mfu"] < 1, (key, row["mfu"])
    assert len(row["train_step_ms_per_round"]) >= report["rounds"] == 2
    memory = row["compile_memory"]  # the CPU backend reports XLA's accounting
    assert memory["temp_size_in_bytes"] >= 0 and memory["argument_size_in_bytes"] > 0, memory
  # The tables the run prints: a line per model, the reference's ratio on token-choice's; then
  # where the time goes, a line per model again.
  table, where = stdout.split("Where the time goes:")
  assert table.count("| s32 |") == table.count("| b16 |") == 2 * len(ROWS)
  assert table.count("| reference (einsum) |") == 4
  vs = [line.rsplit("|", 2)[1].strip() for line in table.splitlines()
        if line.startswith("| ") and "| token-choice |" in line]
  assert len(vs) == 4 and all(v.startswith("**") for v in vs), vs
  assert where.count("| s32 |") == where.count("| b16 |") == 2 * len(ROWS)


def test_each_rows_numbers_follow_from_its_flops_and_its_per_round_times(small_run):
  """FLOPs from the presets, images/s and MFU from the median step time, the ratios from the
  rounds: a row of made-up numbers fails."""
  _, report = small_run
  _check_numbers(report)
  rows = {(r["model"], r["dtype"], r["family"]): r for r in report["rows"]}
  for model in ("s32", "b16"):
    for dtype in ("bfloat16", "float32"):
      assert "vs_reference" in rows[(model, dtype, "vmoe")]


def test_each_row_names_the_attention_precision_and_dispatch_that_ran(small_run):
  _, report = small_run
  backend = report["machine"]["backend"]
  assert report["precision"] == "default"
  float32 = {"cpu": "float32", "gpu": "tf32"}.get(backend, "bfloat16")  # JAX's default precision
  assert report["matmul_precision"] == {"bfloat16": "bfloat16", "float32": float32}
  if backend == "cpu":
    assert report["specified_peak"] is None
  for row in report["rows"]:
    preset = report["presets"][row["model"]]
    tokens = (preset["image_size"] // preset["patch_size"]) ** 2 + 1
    head_dim = preset["hidden_size"] // preset["num_heads"]
    expected = attention_path("auto", jnp.dtype(row["dtype"]), head_dim, tokens, masked=False,
                              dropout=False)
    assert row["attention"] == expected, row
    assert backend != "cpu" or expected == "explicit"  # no cuDNN on a CPU
    assert row["matmul_precision"] == report["matmul_precision"][row["dtype"]]
    assert row["dispatcher"] == {"dense": None, "reference": "einsum"}.get(row["family"],
                                                                           "indices"), row
    assert row["grouped_matmul"] is None
    assert row["group_size"] == {"dense": None, "soft": 1}.get(row["family"], 8), row
    # No compiler options but the model's own (none here); what XLA compiled, on every row.
    assert row["compiler_options"] == {}, row
    compiled = row["compiled"]
    assert compiled["cudnn_ragged_dot"] is False and compiled["pallas_kernel_calls"] == 0, row
    assert all(isinstance(compiled[k], int) and compiled[k] >= 0
               for k in ("sort_ops", "while_ops", "custom_calls", "ragged_dot_ops")), row


def test_a_spent_budget_skips_every_model_and_still_writes_the_result(tmp_path, capsys):
  report = gpu.main(["--small", "--budget-s", "0", "--output-dir", str(tmp_path)])
  assert report["rows"] == [] and report["errors"] == []
  assert len(report["skipped"]) == 2 * 2 * len(ROWS)
  assert report["skipped"][0].startswith("s32/bfloat16/dense: ") and "--budget-s" in (
      report["skipped"][0])
  assert "s32/bfloat16/vmoe: its dense twin did not run" in report["skipped"]
  assert json.loads((tmp_path / "gpu_small.json").read_text())["skipped"] == report["skipped"]
  assert "s32/bfloat16/dense: skipped" in capsys.readouterr().out


@pytest.fixture(scope="module")
def features_run(tmp_path_factory):
  """(report, stdout, the output folder, the precision each model and peak was traced at) of one
  in-process `--small` run with FEATURES."""
  out = tmp_path_factory.mktemp("bench_gpu_features")
  seen = []

  def spy(real):
    def call(*args, **kwargs):
      seen.append((real.__name__, jax.config.jax_default_matmul_precision))
      return real(*args, **kwargs)
    return call

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gpu, "prepare_train_step", spy(gpu.prepare_train_step))
    patch.setattr(gpu.harness, "matmul_peak_gflops", spy(harness.matmul_peak_gflops))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
      report = gpu.main(SMALL + FEATURES + ["--output-dir", str(out)])
  return report, stdout.getvalue(), out, seen


def test_group_sizes_dropless_methods_and_an_ab_option_each_get_rows(features_run):
  """Token-choice and the reference at group sizes 8 (the preset's: plain names) and 4, "vs
  reference" within each size; dropless by the grouped matmuls a CPU runs, the others skipped
  with why; the A/B row compiled with its option beside the dense twin without it; every row's
  numbers recomputed."""
  report, stdout, out, _ = features_run
  assert report["errors"] == [], report["errors"]
  assert json.loads((out / "features.json").read_text())["rows"] == report["rows"]
  rows = {r["family"]: r for r in report["rows"]}
  assert tuple(rows) == FEATURE_ROWS  # the order they ran in
  assert report["group_sizes"] == [8, 4] and report["compiler_options_ab"] == [AB_OPTION]
  _check_numbers(report)
  assert rows["vmoe"]["group_size"] == rows["reference"]["group_size"] == 8
  assert rows["vmoe@4"]["group_size"] == rows["reference@4"]["group_size"] == 4
  assert "vs_reference" in rows["vmoe"] and "vs_reference" in rows["vmoe@4"]
  assert rows["dropless_blocks"]["grouped_matmul"] == "blocks"
  assert rows["dropless_ragged_dot"]["grouped_matmul"] == "ragged_dot"
  assert report["skipped"] == [
      "s32/float32/dropless_pallas: it needs an NVIDIA GPU, and this process computes on cpu",
      "s32/float32/dropless_cudnn: cuDNN's grouped matmul takes bfloat16 inputs, and "
      "model.dtype=float32"]
  ab = rows[f"dense+{AB_OPTION}"]
  assert ab["compiler_options"] == {AB_OPTION: True} and rows["dense"]["compiler_options"] == {}
  assert _close(ab["analytic_flop_ratio"], 1.0) and _close(ab["overhead"], ab["time_ratio"])
  for family, row in rows.items():
    assert all(_positive(row.get(name)) for name in NUMBERS), (family, row)
    assert row["compile_memory"]["temp_size_in_bytes"] >= 0, family
    if family != "dense":
      assert all(_positive(row.get(name)) for name in SPARSE_NUMBERS), (family, row)
  # ragged_dot: XLA:CPU leaves no ragged-dot op, nor gives anything to cuDNN or Pallas.
  assert rows["dropless_ragged_dot"]["compiled"]["cudnn_ragged_dot"] is False
  table = stdout.split("Where the time goes:")[0]
  assert "| token-choice @4 |" in table and "| reference (einsum) @4 |" in table
  assert f"| dense +{AB_OPTION} |" in table and "| dropless (ragged_dot) |" in table
  assert "skipped: s32/float32/dropless_pallas: it needs an NVIDIA GPU" in stdout


def test_profile_writes_a_trace_per_row_and_splits_its_time_by_kernel_class(features_run):
  """--profile: a Perfetto trace per row where TensorBoard finds it (plugins/profile/<run>/), and
  the time by kernel class of its events. A CPU's trace has no device kernels: XLA:CPU's thunks,
  classed by their HLO, are what it holds, each a span of the step's wall time on one thread, so
  their union is within the profiled step and the classes' sum within the step on every line."""
  report, _, out, _ = features_run
  for row in report["rows"]:
    profile, split = row["profile"], row["time_by_kernel_class_ms"]
    folder = out / "features_profile" / f"s32_float32_{row['family']}"
    assert pathlib.Path(profile["trace_dir"]) == folder, profile
    trace = pathlib.Path(profile["perfetto_trace"])
    assert trace.is_file() and trace.parent.parent == folder / "plugins" / "profile", trace
    assert list(trace.parent.glob("*.xplane.pb")), "TensorBoard's file"
    with gzip.open(trace, "rt") as file:
      assert json.load(file)["traceEvents"]
    assert set(split) == set(gpu.KERNEL_CLASSES) and all(v >= 0 for v in split.values())
    assert profile["kernel_source"].startswith("no device kernels in the trace: XLA:CPU thunks")
    assert profile["kernel_events"] > 0 and split["elementwise"] > 0, (row["family"], split)
    step_ms = profile["profiled_step_ms"]
    assert 0 < profile["busy_ms"] <= step_ms <= 1e4, profile
    assert profile["busy_ms"] <= sum(split.values()) + 1e-6
    assert sum(split.values()) <= step_ms * profile["kernel_lines"], (split, profile)
  rows = {r["family"]: r for r in report["rows"]}
  assert rows["dense"]["time_by_kernel_class_ms"]["matmul"] > 0  # its dots, found by their HLO


def test_precision_highest_traces_every_model_and_its_peak_at_true_float32(features_run):
  report, _, _, seen = features_run
  assert {r["matmul_precision"] for r in report["rows"]} == {"float32"}  # true float32 anywhere
  assert report["precision"] == "highest"
  assert seen == ([("matmul_peak_gflops", "highest")]
                  + [("prepare_train_step", "highest")] * len(FEATURE_ROWS))


@pytest.mark.parametrize("argv, line", [
    (["--models", "nosuch_model"],
     "--models 'nosuch_model': no model nosuch_model; valid: s32, b16"),
    (["--dtypes", "float8"], "--dtypes 'float8': no dtype float8; valid: bfloat16, float32"),
    (["--families", "dense"],
     "--families 'dense': no family dense; valid: vmoe, experts_choice, soft, dropless"),
    (["--families", ""], "--families '': no family given; valid: vmoe, experts_choice, soft, "
                         "dropless"),
    (["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    (["--steps", "two"], "--steps 'two': valid: an integer >= 1"),
    (["--budget-s", "-1"], "--budget-s '-1': valid: a number >= 0"),
    (["--budget-s", "nan"], "--budget-s 'nan': valid: a number >= 0"),
    (["--precision", "high"], "--precision 'high': valid: default, highest"),
    (["--group-sizes", "3"],
     "--group-sizes '3': 3 does not divide s32's batch of 16; valid: 1, 2, 4, 8, 16"),
    (["--group-sizes", "8,32", "--models", "b16"],
     "--group-sizes '8,32': 32 does not divide b16's batch of 16; valid: 1, 2, 4, 8, 16"),
    (["--group-sizes", "8,0"], "--group-sizes '8,0': '0' is not; valid: comma-separated "
                               "integers >= 1"),
    (["--group-sizes", "x"], "--group-sizes 'x': 'x' is not; valid: comma-separated integers "
                             ">= 1"),
    (["--group-sizes", "4", "--families", "soft"],
     "--group-sizes '4': sizes token-choice and the reference are timed at; valid only with vmoe "
     "in --families"),
    (["--compiler-options-ab", "xla_gpu_nosuch"],
     "--compiler-options-ab 'xla_gpu_nosuch': no option xla_gpu_nosuch; valid: "
     "xla_gpu_enable_cublaslt, xla_gpu_triton_gemm_any, xla_gpu_enable_latency_hiding_scheduler"),
    (["--compiler-options-ab", ","],
     "--compiler-options-ab ',': no option given; valid: xla_gpu_enable_cublaslt, "
     "xla_gpu_triton_gemm_any, xla_gpu_enable_latency_hiding_scheduler"),
    (["--name", "../gpu"], "--name '../gpu': valid: a file name of letters, digits, _, - and . "
                           "(not starting with . or -)"),
    (["--profile", "yes"], "unrecognized arguments: yes (--help lists the options)"),
    (["--nosuch"], "unrecognized arguments: --nosuch (--help lists the options)"),
])
def test_a_bad_argument_exits_2_with_one_line_before_jax_starts(argv, line, monkeypatch, capsys):
  for name in ("devices", "default_backend"):
    monkeypatch.setattr(gpu.jax, name, _must_not_run)
  monkeypatch.setattr(gpu.harness, "matmul_peak_gflops", _must_not_run)
  monkeypatch.setattr(gpu, "prepare_train_step", _must_not_run)
  with pytest.raises(SystemExit) as exit_:
    gpu.main(["--small", *argv])
  assert exit_.value.code == 2
  out, err = capsys.readouterr()
  assert (out, err) == ("", f"benchmarks.gpu: {line}\n")


def test_full_size_on_a_cpu_exits_2_with_what_jax_reported_about_the_gpu(monkeypatch, capsys):
  monkeypatch.setattr(gpu.jax, "default_backend", lambda: "cpu")
  monkeypatch.setattr(gpu, "gpu_problem", lambda: "no NVIDIA GPU here (no nvidia-smi)")
  monkeypatch.setattr(gpu.harness, "matmul_peak_gflops", _must_not_run)
  monkeypatch.setattr(gpu, "prepare_train_step", _must_not_run)
  with pytest.raises(SystemExit) as exit_:
    gpu.main(["--models", "s32"])
  assert exit_.value.code == 2
  assert capsys.readouterr() == ("", "benchmarks.gpu: no NVIDIA GPU here (no nvidia-smi); use "
                                     "--small for the CPU run\n")


def test_full_size_runs_on_a_tpu(monkeypatch):
  """Only a CPU is refused: past the check, the run goes on to list the devices."""
  monkeypatch.setattr(gpu.jax, "default_backend", lambda: "tpu")
  monkeypatch.setattr(gpu, "gpu_problem", _must_not_run)

  class Listed(Exception):
    pass

  def devices():
    raise Listed

  monkeypatch.setattr(gpu.jax, "devices", devices)
  with pytest.raises(Listed):
    gpu.main(["--models", "s32"])


@pytest.mark.parametrize("kind, name, bfloat16", [
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312.0), ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312.0), ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5), ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H200", "H200 SXM", 989.5), ("NVIDIA B200", "B200 (HGX)", 2250.0),
    ("NVIDIA L40S", None, None), ("NVIDIA H100 NVL", None, None), ("NVIDIA H200 NVL", None, None),
    ("NVIDIA GB200", None, None), ("cpu", None, None),
])
def test_specified_peaks_by_device_kind(kind, name, bfloat16):
  found = gpu.specified_peak(kind)
  assert (found and (found[0], found[1]["bfloat16"])) == (name and (name, bfloat16))
  if found:  # dense tensor-core peaks: TF32 half of bfloat16's, FP32 far below
    assert found[1]["tf32"] * 2 == pytest.approx(found[1]["bfloat16"], rel=0.03)
    assert found[1]["float32"] < found[1]["tf32"]


def test_small_adds_the_cpus_compile_flags_only_where_the_cpu_computes():
  """A CUDA image's newer jaxlib aborted on a CPU flag it no longer knows (an H200, JAX 0.11.2)."""
  assert gpu.small_xla_flags("", None) == gpu.SMALL_XLA_FLAGS
  assert gpu.small_xla_flags("--a=1", None) == f"--a=1 {gpu.SMALL_XLA_FLAGS}"
  assert gpu.small_xla_flags(gpu.SMALL_XLA_FLAGS, None) == gpu.SMALL_XLA_FLAGS
  assert gpu.small_xla_flags("--a=1", ("cuda13", "0.11.2")) == "--a=1"


def test_float32_on_a_gpu_is_named_tf32_unless_highest():
  assert gpu.matmul_precision("float32", "default", "gpu") == "tf32"
  assert gpu.matmul_precision("float32", "highest", "gpu") == "float32"
  assert gpu.matmul_precision("float32", "default", "cpu") == "float32"
  assert gpu.matmul_precision("bfloat16", "highest", "gpu") == "bfloat16"
  row = {"dtype": "float32", "matmul_precision": "tf32"}
  assert gpu._dtype_label(row) == "float32 (TF32)"


def test_results_go_where_git_ignores_them_unless_recorded(tmp_path, monkeypatch):
  assert harness.RUNS == ROOT / "runs" / "benchmarks"
  if shutil.which("git") and (ROOT / ".git").exists():
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/benchmarks/gpu_small.json"],
                             cwd=ROOT)
    assert ignored.returncode == 0
  monkeypatch.setattr(harness, "RUNS", tmp_path / "runs")
  monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
  assert harness.write("x", {"a": 1}) == tmp_path / "runs" / "x.json"
  assert harness.write("x", {"a": 2}, record=True) == tmp_path / "results" / "x.json"
  assert harness.write("x", {"a": 3}, tmp_path / "elsewhere", record=True) == (
      tmp_path / "elsewhere" / "x.json")
  assert json.loads((tmp_path / "runs" / "x.json").read_text()) == {"a": 1}


# --- The readers of what XLA compiled and of a profiled step, on synthetic inputs -------------

# An optimised GPU module as XLA prints it (trimmed): cuDNN's ragged-dot fusion, a cuDNN GEMM
# fusion without one, a Pallas (Triton) kernel, a sort, a while loop, cuDNN's attention, cuBLAS.
GPU_HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[512,64]{1,0})->bf16[512,128]{1,0}}

%fused_ragged_dot (param_0: bf16[512,64], param_1: bf16[4,64,128], param_2: s32[4]) -> bf16[512,128] {
  %param_0 = bf16[512,64]{1,0} parameter(0)
  %param_1 = bf16[4,64,128]{2,1,0} parameter(1)
  %param_2 = s32[4]{0} parameter(2)
  ROOT %ragged-dot.1 = bf16[512,128]{1,0} ragged-dot(%param_0, %param_1, %param_2), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
}

%fused_gemm (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.3 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%compare (a: f32[], b: f32[], c: s32[], d: s32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  %c = s32[] parameter(2)
  %d = s32[] parameter(3)
  ROOT %compare.1 = pred[] compare(%a, %b), direction=GT
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %tuple.2 = (s32[], f32[4]{0}) tuple(%t)
}

%cond (t.1: (s32[], f32[4])) -> pred[] {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %constant.1 = pred[] constant(false)
}

ENTRY %main.10 (Arg_0.1: bf16[512,64], Arg_1.2: bf16[4,64,128], Arg_2.3: s32[4]) -> bf16[512,128] {
  %Arg_0.1 = bf16[512,64]{1,0} parameter(0)
  %Arg_1.2 = bf16[4,64,128]{2,1,0} parameter(1)
  %Arg_2.3 = s32[4]{0} parameter(2)
  %cudnn-fusion.1 = bf16[512,128]{1,0} fusion(%Arg_0.1, %Arg_1.2, %Arg_2.3), kind=kCustom, calls=%fused_ragged_dot, metadata={op_name="jit(step)/ragged_dot"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{"kind":"__cudnn$fusion","cudnn_fusion_config":{"plan_id":"3"}},"force_earliest_schedule":false}
  %cudnn-fusion.2 = bf16[64,64]{1,0} fusion(%x, %y), kind=kCustom, calls=%fused_gemm, backend_config={"fusion_backend_config":{"kind":"__cudnn$fusion"}}
  %sort.2 = (f32[4,128]{1,0}, s32[4,128]{1,0}) sort(%a.1, %b.1), dimensions={1}, is_stable=true, to_apply=%compare
  %while.4 = (s32[], /*index=1*/f32[4]{0}) while(%tuple.1), condition=%cond, body=%body
  %custom-call.3 = bf16[512,128]{1,0} custom-call(%Arg_0.1, %Arg_1.2), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"grouped_matmul","num_warps":4}
  %custom-call.5 = (bf16[8,197,12,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"
  %custom-call.6 = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul"
  %gemm_fusion_dot.7 = bf16[64,64]{1,0} fusion(%x, %y), kind=kCustom, calls=%fused_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64"}}}
  ROOT %get-tuple-element.9 = bf16[512,128]{1,0} get-tuple-element(%custom-call.5), index=0
}
"""
# The same ragged dot where XLA:GPU expanded it into a dense dot over every expert (no cuDNN).
EXPANDED_HLO = """HloModule jit_step

ENTRY %main.3 (p: bf16[512,64], w: bf16[4,64,128]) -> bf16[512,128] {
  %p = bf16[512,64]{1,0} parameter(0)
  %w = bf16[4,64,128]{2,1,0} parameter(1)
  ROOT %dot.1 = bf16[512,128]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""


def test_compiled_path_names_what_xla_compiled_the_step_to():
  found = gpu.compiled_path(GPU_HLO)
  assert found == dict(sort_ops=1, while_ops=1, custom_calls=3, cudnn_fusions=2,
                       cudnn_ragged_dot=True, ragged_dot_ops=1, pallas_kernel_calls=1,
                       cudnn_attention_calls=1, cublas_calls=1, xla_triton_fusions=1)
  expanded = gpu.compiled_path(EXPANDED_HLO)
  assert expanded["cudnn_ragged_dot"] is False and expanded["ragged_dot_ops"] == 0
  assert expanded["cudnn_fusions"] == expanded["pallas_kernel_calls"] == expanded["sort_ops"] == 0
  # A cuDNN fusion of a plain GEMM is not the grouped matmul.
  gemm_only = GPU_HLO.replace("calls=%fused_ragged_dot", "calls=%fused_gemm")
  assert gpu.compiled_path(gemm_only)["cudnn_ragged_dot"] is False
  # XLA may print names without "%".
  assert gpu.compiled_path(GPU_HLO.replace("%", "")) == found


def test_hlo_op_classes_class_each_instruction_by_what_it_computes():
  classes = gpu.hlo_op_classes(GPU_HLO)
  assert classes["cudnn-fusion.1"] == "matmul" and classes["gemm_fusion_dot.7"] == "matmul"
  assert classes["sort.2"] == "sort" and classes["while.4"] is None
  assert classes["custom-call.5"] == "attention" and classes["custom-call.3"] == "other"
  assert classes["get-tuple-element.9"] == "elementwise"


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8", "matmul"),
    ("gemm_fusion_dot_12", "matmul"), ("dot.3", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x64", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"), ("flash_fwd_kernel", "attention"),
    ("cudnn_generated_other_kernel", "attention"),
    ("void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy>", "sort"),
    ("sort_3", "sort"), ("input_scatter_fusion_2", "dispatch"), ("loop_gather_fusion", "dispatch"),
    ("dynamic-update-slice.4", "dispatch"), ("loop_dynamic_slice_fusion", "dispatch"),
    ("loop_multiply_fusion_3", "elementwise"), ("input_reduce_fusion_1", "elementwise"),
    ("elementwise_kernel", "elementwise"),
    ("MemcpyDtoD", "other"), ("wrapped_transpose", "other"), ("copy.5", "other"),
    ("while.94", None), ("call.2", None),
])
def test_kernel_class_by_name(name, kind):
  assert gpu.kernel_class(name) == kind


def _meta(pid, name, tid=None):
  event = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name",
           "args": {"name": name}}
  return event if tid is None else {**event, "tid": tid}


def _event(pid, tid, name, ts, dur, **args):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def test_time_by_kernel_class_from_a_gpu_trace_counts_its_stream_kernels_once():
  """Kernels on the device's Stream lines, in µs: classed and summed; the XLA Ops line (the same
  time by HLO op), the host's events and metadata are not counted; `busy_ms` is their union."""
  trace = {"displayTimeUnit": "ns", "traceEvents": [
      _meta(1, "/device:GPU:0"), _meta(1, "Stream #13(compute)", 13),
      _meta(1, "Stream #14(MemcpyD2D)", 14), _meta(1, "XLA Ops", 1000),
      _meta(701, "/host:CPU"), _meta(701, "python", 5),
      _event(1, 13, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 0, 400, hlo_op="dot.1"),
      _event(1, 13, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 400, 300),
      _event(1, 13, "input_scatter_fusion", 700, 100),
      _event(1, 13, "void cub::DeviceRadixSortOnesweepKernel", 800, 50),
      _event(1, 13, "loop_multiply_fusion", 850, 150),
      _event(1, 14, "MemcpyDtoD", 900, 200),  # overlaps the multiply: counted, busy once
      _event(1, 1000, "dot.1", 0, 400),  # the XLA Ops line: the same time again
      _event(701, 5, "$profiler.py:151 start_trace", 0, 5000),
      {"ph": "i", "pid": 1, "tid": 13, "name": "marker", "ts": 10},
  ]}
  events, source = gpu.kernel_events(trace)
  assert source == "device" and len(events) == 6
  split = gpu.time_by_kernel_class(events)
  assert split["time_by_kernel_class_ms"] == pytest.approx(
      {"matmul": 0.4, "attention": 0.3, "dispatch": 0.1, "sort": 0.05, "elementwise": 0.15,
       "other": 0.2})
  assert split["kernel_events"] == 6 and split["kernel_lines"] == 2
  assert split["busy_ms"] == pytest.approx(1.1)  # 0 to 1100 µs


def test_time_by_kernel_class_from_a_cpu_trace_takes_its_thunks_classes_from_the_hlo():
  """A CPU's trace: no device process; the host events that name an HLO instruction are the
  thunks, classed by `hlo_op_classes` (a while loop's thunk, around its body's, not counted)."""
  trace = {"traceEvents": [
      _meta(701, "/host:CPU"), _meta(701, "tf_XLAEigen", 3),
      _event(701, 3, "cudnn-fusion.1", 0, 1000, hlo_op="cudnn-fusion.1"),  # a ragged dot
      _event(701, 3, "sort.2", 1000, 500, hlo_op="sort.2"),
      _event(701, 3, "while.4", 1500, 3000, hlo_op="while.4"),
      _event(701, 3, "ynn_fusion.7", 1600, 200, hlo_op="ynn_fusion.7"),  # not in the HLO: by name
      _event(701, 3, "end: sort.2", 1500, 1),  # no hlo_op: not a thunk
      _event(701, 3, "ThunkExecutor::Execute", 0, 5000),
  ]}
  events, source = gpu.kernel_events(trace)
  assert source == "host" and len(events) == 4
  split = gpu.time_by_kernel_class(events, gpu.hlo_op_classes(GPU_HLO))
  assert split["time_by_kernel_class_ms"] == pytest.approx(
      {"matmul": 1.0, "attention": 0.0, "dispatch": 0.0, "sort": 0.5, "elementwise": 0.0,
       "other": 0.2})
  assert split["kernel_events"] == 3 and split["busy_ms"] == pytest.approx(1.7)


def test_versions_name_jax_and_no_cuda_library_without_a_cuda_plugin(monkeypatch):
  monkeypatch.setattr(gpu, "installed_build", lambda: None)
  found = gpu.versions()
  assert found["jax"] == jax.__version__ and found["jaxlib"]
  if jax.default_backend() == "cpu" and shutil.which("nvidia-smi") is None:
    assert {found[k] for k in ("cuda_plugin", "cudnn", "cublas", "cuda_runtime",
                               "nvidia_driver")} == {None}
  assert gpu._versions_line(found).startswith(f"JAX: jax {jax.__version__}, jaxlib ")


# --- The budget -------------------------------------------------------------------------------

def test_budget_keeps_the_protected_rows_time_and_scales_its_estimates():
  now = [0.0]
  budget = gpu.Budget(300, {"s32": 30.0, "b16": 55.0}, clock=lambda: now[0])
  budget.reserve("b16/bfloat16", "b16", 3)  # 165 s kept
  assert budget.allows("s32") and budget.allows("s32", protected=True)
  now[0] = 120.0  # 180 s left: enough for one more S/32 model only if nothing is kept
  assert budget.allows("s32", protected=True) and not budget.allows("s32")
  assert "165 s kept for the protected rows of b16/bfloat16" in budget.why_not("s32")
  budget.spent("s32", 60.0)  # twice its estimate: B/16 is expected to take twice its own
  assert budget.expected("b16") == pytest.approx(110.0)
  budget.release("b16/bfloat16")
  assert budget.kept() == 0 and budget.allows("s32")
  budget.spent("b16", 50.0)
  assert budget.expected("b16") == 50.0  # measured: no longer the estimate


class _FakeCompiled:
  def as_text(self):
    return "HloModule m\n\nENTRY %main (p: f32[]) -> f32[] {\n  ROOT %p = f32[] parameter(0)\n}\n"

  def memory_analysis(self):
    return None


def test_a_default_run_reaches_b16_bfloat16_before_s32s_other_families(monkeypatch, capsys):
  """The default run's order and budget with S/32 models slower than MODEL_SECONDS (50 s each;
  B/16 55 s) on a fake clock: the old budget (each size's longest, 3x for a size not seen yet)
  ran S/32's five bfloat16 models (250 s), then expected 150 s of B/16's first model with 135 s
  left and skipped every B/16 row. Now B/16's dense, token-choice and reference are kept for:
  S/32's experts-choice and Soft MoE are skipped instead, saying why."""
  now = [0.0]
  cost = {id(preset): seconds for preset, seconds in
          ((gpu.MODELS["s32"], 50.0), (gpu.MODELS["b16"], 55.0))}

  def prepare(config, preset, *, params=None, warmup=2, compiler_options=None):
    now[0] += cost[id(preset)]
    return gpu.TrainStep(compiled=_FakeCompiled(), state=None, batch=None, model=None,
                         compile_s=1.0, xla_flops=1e9, num_params=1)

  monkeypatch.setattr(gpu, "prepare_train_step", prepare)
  monkeypatch.setattr(gpu, "_initial_params", lambda config, preset: None)
  monkeypatch.setattr(gpu.harness, "interleaved_rounds_ms",
                      lambda runs, rounds, steps: {name: [10.0] * rounds for name in runs})
  budget = gpu.Budget(400 - 15, gpu.MODEL_SECONDS, clock=lambda: now[0])  # 15 s: JAX, peaks
  report = {"matmul_peak_gflops": {"bfloat16": 1e5, "float32": 1e5},
            "specified_peak_tflops": {"bfloat16": None, "float32": None},
            "matmul_precision": {"bfloat16": "bfloat16", "float32": "tf32"},
            "rows": [], "skipped": [], "errors": []}
  plan = gpu.Plan(rounds=2, steps=1, platform="cuda")
  gpu.measure_all(gpu.MODELS, gpu.DTYPES, budget, report, plan)
  measured = [f"{r['model']}/{r['dtype']}/{r['family']}" for r in report["rows"]]
  assert measured[:6] == ["s32/bfloat16/dense", "s32/bfloat16/vmoe", "s32/bfloat16/reference",
                          "b16/bfloat16/dense", "b16/bfloat16/vmoe", "b16/bfloat16/reference"]
  assert report["errors"] == [] and now[0] <= 400 - 15
  kept = [line for line in report["skipped"] if "kept for the protected rows of b16/bfloat16"
          in line]
  assert [line.split(":")[0] for line in kept] == ["s32/bfloat16/experts_choice",
                                                   "s32/bfloat16/soft"]
  assert "b16/bfloat16/vmoe: compile" in capsys.readouterr().out
