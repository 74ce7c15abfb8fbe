"""`make bench-gpu` (benchmarks/gpu.py) as it runs on an accelerator image: `--small` in a process
where TensorFlow, TFDS, Hydra, OmegaConf and W&B cannot be imported, every model of both sizes and
dtypes measured, every number finite and positive; a spent budget still writes the result; and
`--families dropless` measures token-choice dropless, which the default run leaves out."""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

from benchmarks import gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSENT = ("tensorflow", "tensorflow_datasets", "hydra", "omegaconf", "wandb")
FAMILIES = ("dense", "vmoe", "experts_choice", "soft")
NUMBERS = ("compile_s", "train_step_ms", "images_per_s", "analytic_train_flops", "xla_train_flops",
           "mfu", "parameters")
SPARSE_NUMBERS = ("time_ratio", "analytic_flop_ratio", "xla_flop_ratio", "overhead")


def _positive(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_small_run_measures_every_model_without_tensorflow_hydra_or_omegaconf(tmp_path):
  code = (f"import sys\n"
          f"for name in {ABSENT!r}:\n"
          f"  sys.modules[name] = None\n"
          f"from benchmarks import gpu\n"
          f"sys.exit(1 if gpu.main(['--small', '--output-dir', {str(tmp_path)!r}])['errors'] "
          f"else 0)\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert result.stdout.startswith("devices: ["), result.stdout[:300]
  report = json.loads((tmp_path / "gpu_small.json").read_text())
  assert report["small"] and report["errors"] == [] and report["skipped"] == []
  assert set(report["matmul_peak_gflops"]) == {"bfloat16", "float32"}
  assert all(_positive(v) for v in report["matmul_peak_gflops"].values())
  rows = {(r["model"], r["dtype"], r["family"]): r for r in report["rows"]}
  assert set(rows) == {(m, d, f) for m in ("s32", "b16") for d in ("bfloat16", "float32")
                       for f in FAMILIES}
  for key, row in rows.items():
    numbers = NUMBERS + (SPARSE_NUMBERS if key[2] != "dense" else ())
    bad = {name: row.get(name) for name in numbers if not _positive(row.get(name))}
    assert not bad, (key, bad)
    assert row["mfu"] < 1, (key, row["mfu"])
    assert len(row["train_step_ms_per_round"]) >= report["rounds"]
  # The table the run prints has a line per model.
  assert result.stdout.count("| s32 |") == result.stdout.count("| b16 |") == 8


def test_a_spent_budget_skips_every_model_and_still_writes_the_result(tmp_path, capsys):
  report = gpu.main(["--small", "--budget-s", "0", "--output-dir", str(tmp_path)])
  assert report["rows"] == [] and report["errors"] == []
  assert len(report["skipped"]) == 2 * 2 * len(FAMILIES)
  assert json.loads((tmp_path / "gpu_small.json").read_text())["skipped"] == report["skipped"]
  assert "s32/bfloat16/dense: skipped" in capsys.readouterr().out


def test_dropless_is_measured_when_named(tmp_path):
  """`--families dropless`: token-choice dropless beside the dense twin (not in the default run,
  whose families the test above checks)."""
  report = gpu.main(["--small", "--models", "s32", "--dtypes", "float32", "--families",
                     "dropless", "--output-dir", str(tmp_path)])
  assert report["errors"] == [] and report["skipped"] == []
  rows = {r["family"]: r for r in report["rows"]}
  assert set(rows) == {"dense", "dropless"}
  assert all(_positive(rows["dropless"].get(name)) for name in NUMBERS + SPARSE_NUMBERS)
