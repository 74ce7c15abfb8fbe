"""`make bench-gpu` (benchmarks/gpu.py) as it runs on an accelerator image: one `--small` run in a
process where TensorFlow, TFDS, Hydra, OmegaConf and W&B cannot be imported, every model of both
sizes and dtypes measured, and each row's numbers recomputed here from its configs and its
per-round times (FLOPs, images/s, MFU, the ratios to the dense twin and to the reference); what
ran named (attention, matmul precision, dispatcher); the reference beside token-choice, dropless
by both grouped matmuls, `--precision highest` traced at true float32; and what must not run at
all: a bad argument, or full-size models on a CPU, exits 2 with one line before anything
compiles."""
from __future__ import annotations

import dataclasses
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


def _positive(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _close(a: float, b: float) -> bool:
  return math.isclose(a, b, rel_tol=1e-9)


def _config(preset: dict, dtype: str, family: str):
  """A row's model config, built here from the preset as the benchmark describes it."""
  configs = model_configs(preset, dtype)
  vmoe = configs["vmoe"]
  if family == "reference":
    return dataclasses.replace(vmoe, moe=dataclasses.replace(vmoe.moe,
                                                             dispatcher=Dispatcher.einsum))
  if family.startswith("dropless_"):
    return dataclasses.replace(vmoe, router=dataclasses.replace(vmoe.router, dropless=True))
  return configs[family]


def _flops(report: dict, row: dict) -> float:
  preset = report["presets"][row["model"]]
  batch = preset["batch_size"]
  config = _config(preset, row["dtype"], row["family"])
  return train_flops_per_image(config, preset["num_classes"], batch_size=batch) * batch


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
  # The table the run prints: a line per model, the reference's ratio on token-choice's.
  assert stdout.count("| s32 |") == stdout.count("| b16 |") == 2 * len(ROWS)
  assert stdout.count("| reference (einsum) |") == 4
  vs = [line.rsplit("|", 2)[1].strip() for line in stdout.splitlines()
        if line.startswith("| ") and "| token-choice |" in line]
  assert len(vs) == 4 and all(v.startswith("**") for v in vs), vs


def test_each_rows_numbers_follow_from_its_flops_and_its_per_round_times(small_run):
  """FLOPs from the presets, images/s and MFU from the median step time, the ratios from the
  rounds: a row of made-up numbers fails."""
  _, report = small_run
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
  for model in ("s32", "b16"):
    for dtype in ("bfloat16", "float32"):
      # The dense twin's rounds are those it ran beside each family, in order.
      beside = [rows[(model, dtype, f)]["dense_ms_per_round"]
                for f in ("vmoe", "experts_choice", "soft")]
      assert rows[(model, dtype, "dense")]["train_step_ms_per_round"] == sum(beside, [])
      vmoe, reference = rows[(model, dtype, "vmoe")], rows[(model, dtype, "reference")]
      # Timed in the same rounds, beside the same dense twin.
      assert vmoe["dense_ms_per_round"] == reference["dense_ms_per_round"]
      ratios = [r / v for r, v in zip(reference["train_step_ms_per_round"],
                                      vmoe["train_step_ms_per_round"])]
      assert len(vmoe["vs_reference_per_round"]) == len(ratios) == report["rounds"]
      assert all(map(_close, vmoe["vs_reference_per_round"], ratios)), (model, dtype)
      assert _close(vmoe["vs_reference"], statistics.median(ratios)), (model, dtype)
      assert "vs_reference" not in reference


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


def test_a_spent_budget_skips_every_model_and_still_writes_the_result(tmp_path, capsys):
  report = gpu.main(["--small", "--budget-s", "0", "--output-dir", str(tmp_path)])
  assert report["rows"] == [] and report["errors"] == []
  assert len(report["skipped"]) == 2 * 2 * len(ROWS)
  assert json.loads((tmp_path / "gpu_small.json").read_text())["skipped"] == report["skipped"]
  assert "s32/bfloat16/dense: skipped" in capsys.readouterr().out


def test_dropless_by_both_grouped_matmuls_and_precision_highest_at_true_float32(tmp_path,
                                                                                monkeypatch):
  """`--families dropless`: a row per grouped matmul beside the dense twin; `--precision
  highest`: the float32 models and their peak traced at "highest", and so named."""
  seen = []

  def spy(real):
    def call(*args, **kwargs):
      seen.append((real.__name__, jax.config.jax_default_matmul_precision))
      return real(*args, **kwargs)
    return call

  monkeypatch.setattr(gpu, "prepare_train_step", spy(gpu.prepare_train_step))
  monkeypatch.setattr(gpu.harness, "matmul_peak_gflops", spy(harness.matmul_peak_gflops))
  report = gpu.main(SMALL + ["--models", "s32", "--dtypes", "float32", "--families", "dropless",
                             "--precision", "highest", "--output-dir", str(tmp_path)])
  assert report["errors"] == [] and report["skipped"] == []
  rows = {r["family"]: r for r in report["rows"]}
  assert set(rows) == {"dense", "dropless_blocks", "dropless_ragged_dot"}
  assert rows["dropless_blocks"]["grouped_matmul"] == "blocks"
  assert rows["dropless_ragged_dot"]["grouped_matmul"] == "ragged_dot"
  for family in ("dropless_blocks", "dropless_ragged_dot"):
    row = rows[family]
    assert all(_positive(row.get(name)) for name in NUMBERS + SPARSE_NUMBERS), row
    assert _close(row["analytic_train_flops"], _flops(report, row))
    assert row["compile_memory"]["temp_size_in_bytes"] >= 0
  assert {r["matmul_precision"] for r in rows.values()} == {"float32"}  # true float32 anywhere
  assert report["precision"] == "highest"
  assert seen == [("matmul_peak_gflops", "highest")] + [("prepare_train_step", "highest")] * 3


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
