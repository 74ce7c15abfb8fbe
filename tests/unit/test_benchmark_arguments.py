"""Every benchmark refuses a bad argument as bench-gpu does (benchmarks/arguments.py): one line on
stderr, `benchmarks.<script>: <flag> <value>: <what is valid>`, exit status 2, nothing on stdout,
and nothing measured, compiled, started or written; and each script's documented defaults pass
its own checks."""
from __future__ import annotations

import importlib
import os
import pathlib
import types

import jax
import pytest

from benchmarks import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORES = len(os.sched_getaffinity(0))

# What each script runs once its arguments are parsed: each fails the test if reached.
HEAVY = {
    "ab_commits": ("programs", "one_round"),
    "balance_step": ("study_models", "prepare_train_step"),
    "bpr_inference": ("model_configs", "build_model"),
    "command_start": ("_seconds",),
    "contrastive_memory": ("loss_rows", "train_step_rows", "rss_child", "measured_rss"),
    "device_scaling": ("_worker",),
    "dispatch_scaling": ("measure",),
    "dropless": ("ragged_dot_lowering", "measure_layer", "measure_train_step"),
    "eval_memory": ("_write_folder", "_peak_rss_mb"),
    "het_head": ("_prepare",),
    "image_folder_scan": ("_write_folder",),
    "input_pipeline": ("write_jpegs", "prepared_tfds", "stream_rate", "_pinned",
                       "uint8_against_float32_step", "loop_against_bare_step"),
    "pbe_step": ("measure",),
    "routing_analysis": ("measure",),
    "run_all": (),
    "train_step": ("measure",),
    "train_step_program": ("fingerprints",),
}
# Arguments a script needs to run at all (ab_commits: the other checkout; this one will do).
REQUIRED = {"ab_commits": ["--base", str(ROOT)]}


def _must_not_run(*_, **__):
  raise AssertionError("reached after the arguments were refused")


def _module(name: str, monkeypatch) -> types.ModuleType:
  """The script, with everything that measures, compiles, starts a process or writes made to
  fail the test if called."""
  module = importlib.import_module(f"benchmarks.{name}")
  for entry in HEAVY[name]:
    monkeypatch.setattr(module, entry, _must_not_run)
  for shared in ("machine", "matmul_peak_gflops", "interleaved_rounds_ms",
                 "interleaved_median_ms", "write"):
    monkeypatch.setattr(harness, shared, _must_not_run)
  for entry in ("devices", "default_backend", "device_count", "jit"):
    monkeypatch.setattr(jax, entry, _must_not_run)
  if hasattr(module, "subprocess"):
    monkeypatch.setattr(module, "subprocess", types.SimpleNamespace(run=_must_not_run))
  if hasattr(module, "tempfile"):
    monkeypatch.setattr(module, "tempfile", types.SimpleNamespace(
        mkdtemp=_must_not_run, TemporaryDirectory=_must_not_run))
  if name == "run_all":
    for script in ("train_step", "dispatch_scaling", "bpr_inference", "device_scaling",
                   "routing_analysis"):
      monkeypatch.setattr(getattr(module, script), "main", _must_not_run)
  return module


UNKNOWN = "unrecognized arguments: --nosuch (--help lists the options)"
DIVIDES_64 = "1, 2, 4, 8, 16, 32, 64"
DIVIDES_16384 = ", ".join(str(2**i) for i in range(15))
CASES = [
    ("ab_commits", ["--base", "/nonexistent/checkout"],
     "--base '/nonexistent/checkout': no such folder; valid: a folder holding "
     "benchmarks/train_step.py"),
    ("ab_commits", ["--base", str(ROOT / "benchmarks")],
     f"--base {str(ROOT / 'benchmarks')!r}: no benchmarks/train_step.py in it; valid: a folder "
     "holding benchmarks/train_step.py"),
    ("ab_commits", ["--base", str(ROOT), "--presets", "tiny,huge"],
     "--presets 'tiny,huge': no preset huge; valid: tiny, bigger, s32, b16"),
    ("ab_commits", ["--base", str(ROOT), "--rounds", "-1"],
     "--rounds '-1': valid: an integer >= 0"),
    ("ab_commits", ["--base", str(ROOT), "--families", "dense"],
     "--families 'dense': no family dense; valid: vmoe, experts_choice, soft"),
    ("ab_commits", [], "the following arguments are required: --base (--help lists the options)"),
    ("balance_step", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("balance_step", ["--rounds", "two"], "--rounds 'two': valid: an integer >= 1"),
    ("balance_step", ["--nosuch"], UNKNOWN),
    ("bpr_inference", ["--preset", "huge"], "--preset 'huge': valid: tiny, bigger, s32, b16"),
    ("bpr_inference", ["--ratios", "1.05,0"],
     "--ratios '1.05,0': '0' is not; valid: comma-separated numbers > 0"),
    ("bpr_inference", ["--ratios", ""], "--ratios '': valid: comma-separated numbers > 0"),
    ("command_start", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("command_start", ["--steps", "1.5"], "--steps '1.5': valid: an integer >= 1"),
    ("command_start", ["--nosuch"], UNKNOWN),
    ("command_start", ["--base", "/no/such/checkout"],
     "--base '/no/such/checkout': valid: a checkout of vmoe (a folder with runner/cli.py)"),
    ("contrastive_memory", ["--batches", "128,0"],
     "--batches '128,0': '0' is not; valid: comma-separated integers >= 1"),
    ("contrastive_memory", ["--samples", "x"],
     "--samples 'x': 'x' is not; valid: comma-separated integers >= 1"),
    ("contrastive_memory", ["--chunks", "0"],
     "--chunks '0': '0' is not; valid: comma-separated integers >= 1"),
    ("contrastive_memory", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("contrastive_memory", ["--rss-batches", "-5"],
     "--rss-batches '-5': '-5' is not; valid: comma-separated integers >= 1"),
    ("contrastive_memory", ["--time-limit-mb", "nan"],
     "--time-limit-mb 'nan': valid: a number >= 0"),
    ("contrastive_memory", ["--train-batch", "-1"], "--train-batch '-1': valid: an integer >= 0"),
    ("device_scaling", ["--devices", "1,3"],
     f"--devices '1,3': 3 does not divide the global batch of 64; valid: comma-separated "
     f"{DIVIDES_64}"),
    ("device_scaling", ["--devices", "0"],
     "--devices '0': '0' is not; valid: comma-separated integers >= 1"),
    ("device_scaling", ["--steps", "1"], "--steps '1': valid: an integer >= 2"),
    ("dispatch_scaling", ["--experts", "1"],
     "--experts '1': '1' is not; valid: comma-separated integers >= 2"),
    ("dispatch_scaling", ["--tokens", "1000"],
     f"--tokens '1000': 1000 does not divide the 16,384 tokens; valid: comma-separated "
     f"{DIVIDES_16384}"),
    ("dispatch_scaling", ["--dispatchers", "indices,gather"],
     "--dispatchers 'indices,gather': no dispatcher gather; valid: indices, einsum"),
    ("dropless", ["--experts", "1"],
     "--experts '1': '1' is not; valid: comma-separated integers >= 2"),
    ("dropless", ["--presets", "huge"],
     "--presets 'huge': no preset huge; valid: tiny, bigger, s32, b16"),
    ("dropless", ["--presets", ""], "--presets '': no preset given; valid: tiny, bigger, s32, b16"),
    ("dropless", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("eval_memory", ["--base", "0"], "--base '0': valid: an integer >= 1"),
    ("eval_memory", ["--factor", "1"], "--factor '1': valid: an integer >= 2"),
    ("het_head", ["--samples", "16,0"],
     "--samples '16,0': '0' is not; valid: comma-separated integers >= 1"),
    ("het_head", ["--classes", "1"],
     "--classes '1': '1' is not; valid: comma-separated integers >= 2"),
    ("het_head", ["--chunk", "0"], "--chunk '0': valid: an integer >= 1"),
    ("het_head", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("image_folder_scan", ["--images", "0"], "--images '0': valid: an integer >= 1"),
    ("image_folder_scan", ["--workers", "0"], "--workers '0': valid: an integer >= 1"),
    ("input_pipeline", ["--images", "0"], "--images '0': valid: an integer >= 20"),
    ("input_pipeline", ["--batches", "0"], "--batches '0': valid: an integer >= 1"),
    ("input_pipeline", ["--cores", "0"],
     f"--cores '0': '0' is not; valid: comma-separated integers from 1 to {CORES}"),
    ("input_pipeline", ["--cores", f"1,{CORES + 1}"],
     f"--cores '1,{CORES + 1}': '{CORES + 1}' is not; valid: comma-separated integers from 1 to "
     f"{CORES}"),
    ("input_pipeline", ["--loop-rounds", "-1"], "--loop-rounds '-1': valid: an integer >= 0"),
    ("input_pipeline", ["--step-rounds", "two"], "--step-rounds 'two': valid: an integer >= 0"),
    ("input_pipeline", ["--nosuch"], UNKNOWN),
    ("pbe_step", ["--preset", "huge"], "--preset 'huge': valid: tiny, bigger, s32, b16"),
    ("pbe_step", ["--dtype", "float64"], "--dtype 'float64': valid: float32, bfloat16, float16"),
    ("pbe_step", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("routing_analysis", ["--models", "vmoe_tiny,nosuch"],
     "--models 'vmoe_tiny,nosuch': no model nosuch; valid: models with experts, as model= names "
     "them (e.g. vmoe_tiny, ecmoe_tiny, softmoe_tiny)"),
    ("routing_analysis", ["--models", "vit_tiny"],
     "--models 'vit_tiny': vit_tiny has no experts; valid: models with experts, as model= names "
     "them (e.g. vmoe_tiny, ecmoe_tiny, softmoe_tiny)"),
    ("routing_analysis", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("run_all", ["--nosuch"], UNKNOWN),
    ("run_all", ["--presets", "tiny"],
     "unrecognized arguments: --presets tiny (--help lists the options)"),
    ("train_step", ["--presets", "tiny,huge"],
     "--presets 'tiny,huge': no preset huge; valid: tiny, bigger, s32, b16"),
    ("train_step", ["--dtype", "int8"], "--dtype 'int8': valid: float32, bfloat16, float16"),
    ("train_step", ["--rounds", "0"], "--rounds '0': valid: an integer >= 1"),
    ("train_step", ["--name", "../elsewhere"],
     "--name '../elsewhere': valid: a file name of letters, digits, _, - and . (not starting "
     "with . or -)"),
    ("train_step", ["--families", "vmoe,dense"],
     "--families 'vmoe,dense': no family dense; valid: vmoe, experts_choice, soft"),
    ("train_step", ["--rounds"], "argument --rounds: expected one argument (--help lists the "
                                 "options)"),
    ("train_step_program", ["--presets", "huge"],
     "--presets 'huge': no preset huge; valid: tiny, bigger, s32, b16"),
    ("train_step_program", ["--nosuch"], UNKNOWN),
]


def test_every_script_is_covered():
  scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {
      "__init__", "arguments", "gpu", "harness"}
  assert scripts == set(HEAVY)
  assert {name for name, _, _ in CASES} == scripts


@pytest.mark.parametrize("name, argv, line", CASES,
                         ids=[f"{name}:{' '.join(argv)}" for name, argv, _ in CASES])
def test_a_bad_argument_exits_2_with_one_line_before_anything_runs(name, argv, line, monkeypatch,
                                                                   capsys):
  module = _module(name, monkeypatch)
  with pytest.raises(SystemExit) as exit_:
    module.main(argv)
  assert exit_.value.code == 2
  assert capsys.readouterr() == ("", f"benchmarks.{name}: {line}\n")


@pytest.mark.parametrize("name", sorted(HEAVY))
def test_the_documented_defaults_pass_the_checks(name, monkeypatch, capsys):
  module = _module(name, monkeypatch)
  args = module.parse(REQUIRED.get(name, []))
  assert getattr(args, "record", False) is False  # the default: nothing tracked rewritten
  assert capsys.readouterr() == ("", "")
