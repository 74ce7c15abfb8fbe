"""Sweeps, multi-process jobs, preemption and searches on a real SLURM (tests/cluster/slurm_cluster.py)
and on this machine (the parallel launcher). Run by `make test-cluster`, not `make test`."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.mlp_dim=64", "model.num_heads=2",
        "model.image_size=16", "data.batch_size=16", "logger.wandb.mode=disabled",
        "logger.progress=false"]


def vmoe(*args: str, env: dict | None = None, timeout: float = 900, background: bool = False):
  """`vmoe <args>` as a user runs it, in its own process (cwd: the checkout)."""
  command = [sys.executable, "-m", "runner.cli", *args]
  environ = {**os.environ, "VMOE_ALLOCATOR": "system", **(env or {})}
  if background:
    return subprocess.Popen(command, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  done = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True,
                        timeout=timeout)
  return done.returncode, done.stdout + done.stderr


def _losses(workdir: pathlib.Path) -> dict[int, float]:
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _params(workdir: pathlib.Path):
  from runner.checkpoints import weights
  return weights.load(str(workdir))[0]


def test_a_sweep_runs_as_slurm_jobs_each_with_its_workdir(slurm, tmp_path):
  code, out = vmoe("pretrain", "--multirun", "hydra/launcher=slurm", "seed=0,1",
                   "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
                   f"workdir={tmp_path / 'sweep'}", *TINY, "train.steps=3",
                   "schedule.warmup_steps=0", env=slurm.env)
  assert code == 0, out[-3000:]
  for job in (0, 1):
    workdir = tmp_path / "sweep" / str(job)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["step"] == 3
    assert (workdir / "checkpoints" / "3").exists()
    overrides = yaml.safe_load((workdir / ".hydra" / "overrides.yaml").read_text())
    assert f"seed={job}" in overrides
  logs = list((tmp_path / "sweep" / ".submitit").rglob("*_log.out"))
  assert len(logs) == 2  # two tasks of one SLURM job array
  assert not slurm.drained()  # nothing left queued or running


def test_an_unknown_partition_is_refused_before_anything_is_submitted(slurm, tmp_path):
  code, out = vmoe("pretrain", "--multirun", "hydra/launcher=slurm",
                   "hydra.launcher.partition=gpu-nope", f"workdir={tmp_path / 'sweep'}", *TINY,
                   env=slurm.env)
  assert code == 2 and "Traceback" not in out, out[-3000:]
  assert "SLURM has no partition 'gpu-nope'" in out and "its partitions:" in out
  assert not (tmp_path / "sweep").exists() and not slurm.jobs()


def test_a_two_task_job_trains_through_jax_distributed_from_slurm(slurm, tmp_path):
  """tasks_per_node=2: both processes join jax.distributed from SLURM's environment (no
  distributed.* keys), one batch split over 2 devices; the losses match one process's reading
  the data in the same 2 shards (data.num_shards=2: the batches of a 2-process job)."""
  args = [*TINY, "train.steps=4", "schedule.warmup_steps=0", "train.log_every_steps=1",
          "checkpoint.every_steps=0",
          "data.num_shards=2"]
  code, out = vmoe("pretrain", f"workdir={tmp_path / 'one'}", *args)
  assert code == 0, out[-3000:]
  code, out = vmoe("pretrain", "--multirun", "hydra/launcher=slurm",
                   "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1",
                   "hydra.launcher.timeout_min=10", f"workdir={tmp_path / 'two'}", *args,
                   "logger.progress=true", env=slurm.env)
  assert code == 0, out[-3000:]
  two, one = _losses(tmp_path / "two" / "0"), _losses(tmp_path / "one")
  assert sorted(two) == sorted(one) == [1, 2, 3, 4]
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)],
                             atol=1e-4)
  logs = [p.read_text() for p in (tmp_path / "two" / ".submitit").rglob("*_0_log.*")]
  assert any("on 2 device(s)" in log for log in logs)  # one job over both processes' devices
  # One writer: metrics logged once per step, not once per process.
  records = [json.loads(l) for l in (tmp_path / "two" / "0" / "metrics.jsonl").read_text()
             .splitlines() if "train/loss" in l]
  assert [r["step"] for r in records] == [1, 2, 3, 4]


def _wait(predicate, timeout: float, what: str):
  deadline = time.time() + timeout
  while time.time() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(0.5)
  raise AssertionError(f"timed out waiting for {what}")


def _requeued(slurm, job_id: str, sweep: pathlib.Path):
  """The job's state once SLURM requeued it and its first run has ended (Restarts counts the
  requeues, and stays; a state such as PENDING can be passed between two polls). A job that ended
  without a requeue fails at once, with its logs."""
  info = slurm.job(job_id)
  if int(info.get("Restarts", 0)) >= 1:  # the checkpoint was committed before the requeue
    return info if info.get("JobState") != "COMPLETING" else None  # the first run still ends
  if info.get("JobState") in ("RUNNING", "COMPLETING"):
    return None
  logs = "\n".join(f"{p}:\n{p.read_text()[-1500:]}" for p in sorted(
      (sweep / ".submitit").rglob("*_log.*")))
  raise AssertionError(f"job {job_id} ended without being requeued ({info or 'gone'}):\n{logs}")


# Long enough that the signal, sent as soon as the job has logged a few steps, lands in the training
# loop on any machine: the job reacts to it there only (~5 ms a step on 2 CPU cores; with 60 steps
# a signal sent 0.3 s late found the run finished, and the job completed instead of requeueing).
STEPS = 1000


def test_scancel_term_checkpoints_and_the_requeued_job_resumes_exactly(slurm, tmp_path):
  args = [*TINY, f"train.steps={STEPS}", "schedule.warmup_steps=0", "train.log_every_steps=1",
          "checkpoint.every_steps=0",
          "eval.every_steps=0"]
  code, out = vmoe("pretrain", f"workdir={tmp_path / 'straight'}", *args)
  assert code == 0, out[-3000:]
  sweep = tmp_path / "sweep"
  launcher = vmoe("pretrain", "--multirun", "hydra/launcher=slurm",
                  "hydra.launcher.cpus_per_task=2", "hydra.launcher.timeout_min=10",
                  f"workdir={sweep}", *args, env=slurm.env, background=True)
  try:
    job = _wait(lambda: [j for j in slurm.jobs() if j["state"] == "RUNNING"], 300, "the job")[0]
    metrics = sweep / "0" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
      assert time.time() < deadline, "timed out waiting for the job to train a few steps"
      assert launcher.poll() is None, launcher.communicate()[0][-3000:]
      time.sleep(0.05)
    slurm.run("scancel", "--signal=TERM", job["id"])
    trained = len(metrics.read_text().splitlines())  # steps done before the signal arrived
    # The job saves a checkpoint and requeues itself (scontrol requeue); SLURM holds a requeued
    # job back for a while (Reason=BeginTime), which the test cuts short.
    info = _wait(lambda: _requeued(slurm, job["id"], sweep), 120, "the requeue")
    steps = sorted(int(p.name) for p in (sweep / "0" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and 5 <= trained <= steps[0] < STEPS, (trained, steps)  # saved where it stopped
    if info["JobState"] == "PENDING":
      slurm.run("scontrol", "update", f"JobId={job['id']}", "StartTime=now", check=False)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out[-3000:]
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.communicate()
  assert int(slurm.job(job["id"]).get("Restarts", 0)) == 1  # requeued once, then ran to the end
  resumed, straight = _params(sweep / "0"), _params(tmp_path / "straight")
  for a, b in zip(jax_leaves(resumed), jax_leaves(straight)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  losses = _losses(sweep / "0")
  assert sorted(losses)[-1] == STEPS


def jax_leaves(tree):
  import jax
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_the_parallel_launcher_runs_jobs_at_once_on_this_machine(tmp_path):
  code, out = vmoe("pretrain", "--multirun", "hydra/launcher=parallel", "hydra.launcher.jobs=2",
                   "seed=0,1", f"workdir={tmp_path / 'sweep'}", *TINY, "train.steps=20",
                   "schedule.warmup_steps=0")
  assert code == 0, out[-3000:]
  spans = []
  for job in (0, 1):
    workdir = tmp_path / "sweep" / str(job)
    assert json.loads((workdir / "summary.json").read_text())["step"] == 20
    spans.append(((workdir / "launcher.log").stat().st_ctime,
                  (workdir / "summary.json").stat().st_mtime))
  (start0, end0), (start1, end1) = spans
  assert start1 < end0 and start0 < end1  # both ran at the same time
  assert "cpus [0]" in out and "cpus [1]" in out or os.cpu_count() < 2  # pinned to a core each


def test_an_optuna_search_records_its_best_trial(tmp_path):
  code, out = vmoe("pretrain", "--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4",
                   "'optim.lr=tag(log,interval(1e-4,1e-1))'".strip("'"),
                   f"workdir={tmp_path / 'search'}", *TINY, "train.steps=3",
                   "schedule.warmup_steps=0")
  assert code == 0, out[-3000:]
  results = yaml.safe_load((tmp_path / "search" / "optimization_results.yaml").read_text())
  assert set(results["best_params"]) == {"optim.lr"}
  assert 1e-4 <= results["best_params"]["optim.lr"] <= 1e-1
  values = [json.loads((tmp_path / "search" / str(i) / "summary.json").read_text())["val/prec@1"]
            for i in range(4)]
  assert results["best_value"] == pytest.approx(max(values))  # maximised: the stage's main metric


def test_a_plugin_router_sweeps_on_slurm_and_in_parallel(slurm, tmp_path):
  """A router family from a user's module (examples/plugins/switch_router.py): each job, in a
  process of its own, loads the plug-in it was composed with."""
  plugin = ["plugins=[examples.plugins.switch_router]", "model.router.type=switch",
            "model.router.z_loss_weight=0.0,0.1", *TINY, "train.steps=2", "schedule.warmup_steps=0"]
  for launcher, extra in (("slurm", ["hydra.launcher.cpus_per_task=1",
                                     "hydra.launcher.timeout_min=10"]),
                          ("parallel", ["hydra.launcher.jobs=2"])):
    code, out = vmoe("pretrain", "--multirun", f"hydra/launcher={launcher}", *extra, *plugin,
                     f"workdir={tmp_path / launcher}", env=slurm.env)
    assert code == 0, out[-3000:]
    for job, weight in ((0, 0.0), (1, 0.1)):
      config = yaml.safe_load((tmp_path / launcher / str(job) / "config.yaml").read_text())
      assert config["plugins"] == ["examples.plugins.switch_router"]
      assert config["model"]["router"]["type"] == "switch"
      assert config["model"]["router"]["z_loss_weight"] == weight
      assert json.loads((tmp_path / launcher / str(job) / "summary.json").read_text())["step"] == 2
