"""Sweeps through the CLI: what the basic and the parallel launchers' jobs are and record, the
table a sweep prints when it ends, what `--multirun --cfg job` shows and what a large sweep checks
before it runs. Each launcher runs one tiny 2-job sweep for the module; the parallel one's jobs are
processes of their own, pinned to a core each."""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import struct
import warnings

import jax
import pytest
import yaml
from wandb.proto import wandb_internal_pb2

from conftest import TINY_MODEL, fails_clearly
from runner import cli
from runner.command import arguments
from runner.config.subcommands import main_metric

pytestmark = pytest.mark.xdist_group("sweeps")

# W&B offline: each job's run is read back for its group and overrides.
SWEEP = ["pretrain", "--multirun", *TINY_MODEL, "train.steps=2", "data.batch_size=16",
         "schedule.warmup_steps=0", "logger.wandb.mode=offline", "logger.progress=false",
         "logger.report=false", "seed=0,1"]


def _sweep(args: list[str]) -> dict:
  """`vmoe <args>` in this process: its exit code, output and Python warnings."""
  out, err = io.StringIO(), io.StringIO()
  with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
      contextlib.redirect_stderr(err):
    warnings.simplefilter("always")
    try:
      code = cli.main(args)
    except SystemExit as e:
      code = e.code
  return {"code": code, "out": out.getvalue(), "err": err.getvalue(), "warnings": caught}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict:
  """The same 2-job sweep through the basic launcher and the parallel one: launcher -> result."""
  jax.devices()  # JAX's backend up in this process, as in a stage's: its at-fork warning is armed
  done = {}
  for launcher in ("basic", "parallel"):
    root = tmp_path_factory.mktemp(launcher) / "sweep"
    extra = ["hydra/launcher=parallel"] if launcher == "parallel" else []
    done[launcher] = {"root": root, **_sweep([*SWEEP, f"workdir={root}", *extra])}
    assert done[launcher]["code"] == 0, done[launcher]["err"]
  return done


def test_parallel_jobs_are_started_without_forking_the_launcher(sweeps):
  parallel = sweeps["parallel"]
  forks = [str(w.message) for w in parallel["warnings"] if "fork" in str(w.message)]
  assert not forks, forks
  assert "(cpus [" in parallel["err"] + parallel["out"]  # the jobs were pinned
  for job in ("0", "1"):
    assert (parallel["root"] / job / "summary.json").is_file()


def _wandb_run(folder: pathlib.Path) -> tuple[str, list[str]]:
  """(group, recorded overrides) of the job's offline W&B run, from its run-<id>.wandb records
  (a LevelDB-style log of protobuf records in 32 KiB blocks, after a 7-byte header)."""
  (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
  data, position, pending = path.read_bytes(), 7, b""
  while position + 7 <= len(data):
    left = 32768 - position % 32768
    _, length, kind = struct.unpack("<IHB", data[position:position + 7])
    if left < 7 or (length == 0 and kind == 0):  # a block's padding
      position += left
      continue
    pending += data[position + 7:position + 7 + length]
    position += 7 + length
    if kind in (1, 4):  # a whole record, or a record's last piece
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      if record.WhichOneof("record_type") == "run":
        config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        return record.run.run_group, config.get("overrides", [])
  raise AssertionError(f"{path} holds no run record")


def test_parallel_jobs_join_the_sweeps_wandb_group_as_basic_jobs_do(sweeps):
  for launcher in ("basic", "parallel"):
    root = sweeps[launcher]["root"]
    for job in ("0", "1"):
      group, overrides = _wandb_run(root / job)
      assert group == str(root), (launcher, job)
      basic = _wandb_run(sweeps["basic"]["root"] / job)[1]
      assert overrides == [o.replace(str(sweeps["basic"]["root"]), str(root)) for o in basic]
      assert f"seed={job}" in overrides and f"workdir={root}" in overrides, overrides


@pytest.mark.parametrize("launcher", ["basic", "parallel"])
def test_a_sweep_ends_with_its_jobs_table(sweeps, launcher):
  root, out = sweeps[launcher]["root"], sweeps[launcher]["out"]
  assert f"Sweep {root}: 2 job(s), 2 ok, 0 failed" in out
  assert "| job | seed | status | val/prec@1 |" in out
  for job in ("0", "1"):
    summary = json.loads((root / job / "summary.json").read_text())
    assert f"| {job} | {job} | ok | {main_metric('pretrain', summary):.4f} |" in out
  assert f"vmoe summarize {root}" in out and f"vmoe report {root}" in out


def test_a_sweep_stopped_by_a_failed_job_still_prints_its_table(tmp_path):
  from runner.command import sweep_table
  root = tmp_path / "sweep"
  (root / "1" / "metrics.jsonl").mkdir(parents=True)  # job 1 cannot write its metrics
  result = _sweep([*SWEEP, f"workdir={root}", "logger.wandb.mode=disabled"])
  assert result["code"] != 0
  with contextlib.redirect_stdout(io.StringIO()) as out:
    sweep_table.print_stopped_sweep()  # what the CLI does as it exits (runner/cli.py main)
  table = result["out"] + out.getvalue()
  assert f"Sweep {root}: 2 job(s), 1 ok, 1 failed" in table
  assert re.search(r"^\| 0 \| 0 \| ok \| \d\.\d{4} \|$", table, re.M)
  assert "| 1 | 1 | failed | - |" in table


def test_cfg_job_shows_the_folder_each_job_writes_into(tmp_path, run_cli):
  code, out, err = run_cli("pretrain", "--multirun", f"workdir={tmp_path / 'lr'}",
                           "optim.lr=1e-3,3e-3", "--cfg", "job")
  assert code == 0, err
  configs = [yaml.safe_load(part) for part in re.split(r"^# job .*$", out, flags=re.M)[1:]]
  assert [c["workdir"] for c in configs] == [str(tmp_path / "lr" / "0"),
                                             str(tmp_path / "lr" / "1")]
  # A study's own sub-folders (sweeps/routers.yaml: <experiment>/seed_<seed>).
  code, out, err = run_cli("pretrain", "-cd", "sweeps", "-cn", "routers", "--multirun",
                           f"workdir={tmp_path / 'routers'}", "--cfg", "job")
  assert code == 0, err
  assert out.startswith("# job 0 of 10: experiment=router_vit seed=0\n"), out[:200]
  configs = [yaml.safe_load(part) for part in re.split(r"^# job .*$", out, flags=re.M)[1:3]]
  assert [c["workdir"] for c in configs] == [str(tmp_path / "routers" / "router_vit" / "seed_0"),
                                             str(tmp_path / "routers" / "router_vit" / "seed_1")]
  assert not (tmp_path / "lr").exists() and not (tmp_path / "routers").exists()


def test_beyond_64_jobs_every_value_is_checked_before_any_job_runs(run_cli, tmp_path):
  # 33 seeds x 2 learning rates: the bad value is neither the first of its key nor in job 0.
  workdir = tmp_path / "sweep"
  fails_clearly(run_cli(*SWEEP[:-1], "logger.wandb.mode=disabled", f"workdir={workdir}",
                        "seed=range(0,33)", "optim.lr=1e-3,-1", "train.steps=1"),
                "in the sweep job", "optim.lr=-1")
  assert not workdir.exists()  # nothing ran, nothing was written


def test_the_jobs_checked_beyond_64_take_every_value_of_every_key():
  lrs, seeds, heads = ["0.001", "-1"], [str(s) for s in range(40)], ["a", "b", "c"]
  overrides = ["train.steps=3", f"optim.lr={','.join(lrs)}", f"seed={','.join(seeds)}",
               f"model.head.type={','.join(heads)}"]
  jobs = arguments.jobs(overrides, {})
  assert len(jobs) == 40 and all(job[0] == "train.steps=3" for job in jobs)
  for key, values in (("optim.lr", lrs), ("seed", seeds), ("model.head.type", heads)):
    assert {o.split("=", 1)[1] for job in jobs for o in job if o.startswith(key + "=")} \
        == set(values), key
