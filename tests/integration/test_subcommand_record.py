"""A subcommand is one record (runner/config/subcommands.py): the example `vmoe params`
(example_subcommand.py), registered as a new subcommand is, appears in `vmoe --help`, is composed
by Hydra from its conf file, typed by its resolver, run, and judged by its main metric; its
summary is recognised by `vmoe summarize`'s stage detection."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
SCRIPT = """import sys
import example_subcommand
from runner import cli
from runner.config import subcommands
argv = sys.argv[1:]
code = cli.main(argv)
if code == 0 and argv[0] == "params":
  import json
  with open(argv[-1].partition("=")[2] + "/summary.json") as f:
    done = json.load(f)
  print("stage:", subcommands.stage_of(done), "metric:", subcommands.main_metric("params", done))
sys.exit(code)
"""


def _vmoe(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
  return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True,
                        env=env, timeout=300)


def test_an_example_subcommand_is_one_record(tmp_path):
  (tmp_path / "params.yaml").write_text("defaults:\n  - pretrain\n  - _self_\n")
  listed = _vmoe("--help")
  assert listed.returncode == 0 and "params     the parameter count of a model" in listed.stdout
  done = _vmoe("params", "-cd", str(tmp_path), "model=vmoe_tiny", f"workdir={tmp_path / 'run'}")
  assert done.returncode == 0, done.stderr[-3000:]
  count = json.loads((tmp_path / "run" / "summary.json").read_text())["params/count"]
  assert count > 10_000
  assert f"stage: params metric: {float(count)}" in done.stdout
