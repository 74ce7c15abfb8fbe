"""Shared test set-up: a quiet, offline, self-contained environment for every test process.

Environment variables are set here, before any test module imports TensorFlow or JAX:
TFDS data and W&B's folders live under one temporary folder per pytest worker (W&B is disabled);
the XLA compilation cache is shared (below).
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import tempfile

from runner.command import allocator  # gc, os and sys only: before TensorFlow and JAX load

# Python's cycle collector rescans every object it tracks at each full collection: while JAX,
# TensorFlow, Flax and the test modules import, a dozen such scans of a growing heap (1-2 s per
# process), then, as tests run, scans of the half million objects those imports made and that
# live as long as the process. So it is paused until collection ends, then resumes with what
# exists frozen out of its scans, as `vmoe`'s does (runner/command/allocator.py).
allocator.pause_collector()
_ROOT = pathlib.Path(tempfile.mkdtemp(prefix=f"vmoe-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"))
os.environ.update({
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "TFDS_DATA_DIR": str(_ROOT / "tensorflow_datasets"),
    "WANDB_MODE": "disabled",
    "WANDB_SILENT": "true",
    "WANDB_DIR": str(_ROOT / "wandb"),
    "WANDB_CACHE_DIR": str(_ROOT / "wandb-cache"),
    "WANDB_CONFIG_DIR": str(_ROOT / "wandb-config"),
    "KERAS_HOME": str(_ROOT / "keras"),
})
# One XLA cache for the test processes (both xdist workers and the processes they start), kept in
# the system's temporary folder between sessions: identical tiny models in different tests compile
# once. Delete it to measure a cold suite.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(tempfile.gettempdir()) / "vmoe-tests-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# The suite compiles hundreds of tiny programs and runs each for a few steps: XLA's backend
# (LLVM) optimisation and its CPU fusion emitters cost more than they save there (together, half
# the CPU time of compile-heavy modules). XLA also splits each program's LLVM module into parts
# to compile on parallel threads, which two busy workers on 2 cores cannot use: one part cost
# 4-7 % less CPU time on the 8-device processes (test_multidevice.py) with test_model_heads.py.
# Subprocesses the tests start inherit them. The functions computed are the same.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import pytest  # noqa: E402


def pytest_configure(config):
  """In each process that runs tests (not xdist's controller, which runs none: the workers
  start seconds sooner), the built-in router families, evaluators, optimizers, schedules, ops and
  corruptions register their names and keys, then the schema is made and given to Hydra, as the
  CLI does."""
  if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
    return
  import absl.logging
  import runner.builtins
  import runner.command.config_store
  runner.builtins.register()
  runner.command.config_store.register_configs()
  # absl's root handler holds whatever sys.stderr was at import (pytest's capture stream) and
  # closes that stream when logging is reconfigured (Hydra does), unless it is the real stderr.
  absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__

# A model small enough that an end-to-end run compiles and trains in seconds on 2 CPU cores.
TINY_MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.mlp_dim=64",
              "model.num_heads=2", "model.image_size=16"]
# A text tower as small (one block of width 32, 16-dim embeddings), for image-text runs.
TINY_TEXT = ["text.width=32", "text.depth=1", "text.mlp_dim=64", "text.num_heads=2",
             "text.max_length=12", "objective.embedding_dim=16"]
# Options every test run of the CLI needs: no W&B, no progress bar, small batches and runs.
QUIET = ["logger.wandb.mode=disabled", "logger.progress=false", "logger.report=false"]


# Runs that several modules train identically, trained once per pytest session (shared_run):
# name -> the `vmoe` command, less its workdir.
SHARED_RUNS = {
    # A tiny V-MoE pretrained 2 steps on MNIST, with checkpoints at steps 1 and 2.
    "vmoe_2steps": ["pretrain", *TINY_MODEL, *QUIET, "train.steps=2", "schedule.warmup_steps=0",
                    "checkpoint.every_steps=1", "data.batch_size=16"],
    # A tiny dense ViT pretrained 1 step on MNIST.
    "vit_1step": ["pretrain", "model=vit_tiny", *TINY_MODEL, *QUIET, "train.steps=1",
                  "schedule.warmup_steps=0", "data.batch_size=16"],
    # A tiny Soft MoE pretrained 3 steps on MNIST, its one MoE layer on block 1.
    "softmoe_3steps": ["pretrain", "model=softmoe_tiny", *TINY_MODEL, *QUIET, "train.steps=3",
                       "schedule.warmup_steps=0", "data.batch_size=16", "eval.every_steps=0",
                       "checkpoint.every_steps=0", "model.moe.layers=[1]"],
}


def pytest_sessionstart(session):
  if session.config.pluginmanager.hasplugin("dsession"):  # xdist's controller collects nothing
    allocator.resume_collector()


def pytest_collection_finish(session):
  allocator.resume_collector()


_frozen_module = [None]


def pytest_runtest_setup(item):
  """As each test module starts, the garbage earlier modules left is collected and what lives on
  (compiled programs, JAX's and Flax's caches, session fixtures: most of a worker's heap by the
  end) is frozen out of the collector's scans, as `vmoe` freezes what its imports made. A full
  collection (Python's own, or the one after each failed checkpoint read, runner/checkpoints/checkpoint.py)
  then scans what this module made, not the whole heap; the one here scans what the module
  before made. Measured on six GC-heavy modules: 9-17 % less CPU time."""
  module = getattr(item, "module", None)
  if module is not _frozen_module[0]:
    _frozen_module[0] = module
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups into the node ids
def pytest_collection_modifyitems(items):
  """A test without an `xdist_group` joins its module's: under `--dist loadgroup` a module then
  runs in one worker, which builds its module fixtures and compiles its programs (JAX compiles
  each operation run eagerly once per process and shape) once instead of once per worker."""
  for item in items:
    if item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def tfds_dir() -> pathlib.Path:
  return pathlib.Path(os.environ["TFDS_DATA_DIR"])


@pytest.fixture(scope="session")
def shared_run(request, tmp_path_factory):
  """`shared_run(name)`: the workdir of SHARED_RUNS[name]. The first pytest worker to ask trains it
  (in its own process, as a module fixture would) while the others wait on a file lock; every
  worker of the session then reads the same folder. Tests only read it: one that resumes,
  extends or writes into a run (a lock included) works on a copy (shutil.copytree)."""
  from runner import cli
  base = tmp_path_factory.getbasetemp()
  # xdist workers' temporary folders are subfolders of the session's; a lone process's is its own.
  worker = hasattr(request.config, "workerinput")
  root = (base.parent if worker else base) / "shared_runs"
  root.mkdir(exist_ok=True)

  def get(name: str) -> pathlib.Path:
    workdir, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
      if not done.exists():
        shutil.rmtree(workdir, ignore_errors=True)  # what a failed attempt left
        assert cli.main([*SHARED_RUNS[name], f"workdir={workdir}"]) == 0, name
        done.touch()
    return workdir
  return get


@pytest.fixture
def run_cli(capsys):
  """Runs `vmoe <args>` in this process; returns (exit code, stdout, stderr)."""
  from runner import cli

  def run(*args: str):
    argv = sys.argv
    try:
      code = cli.main(list(args))
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else 1
    finally:
      sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err
  return run


def fails_clearly(result, *expected) -> str:
  """A CLI run (run_cli's result) that failed as bad input must: exit 2, one paragraph naming
  each of `expected`, no traceback. Returns the message."""
  code, out, err = result
  assert code == 2, (code, out, err)
  assert "Traceback" not in err and "Traceback" not in out
  message = err.strip().splitlines()
  assert len(message) == 1, err  # one paragraph
  for text in expected:
    assert text in err, (text, err)
  return err


def nothing_like_a_run(workdir: pathlib.Path) -> None:
  """Nothing a resume could take for a run: a refused command removes the workdir it created,
  and empties one that was an empty folder before (runner/workdirs/refused_workdir.py)."""
  for artefact in ("checkpoints", "wandb", "summary.json", "metrics.jsonl"):
    assert not (workdir / artefact).exists(), artefact
  assert not workdir.exists() or not any(workdir.iterdir()), sorted(workdir.iterdir())


EXAMPLE_PLUGINS = pathlib.Path(__file__).resolve().parents[1] / "examples" / "plugins"


def plugin_lab(tmp_path_factory, example: str) -> pathlib.Path:
  """A researcher's folder holding a copy of examples/plugins/<example>: the working directory
  of the commands that load it."""
  folder = tmp_path_factory.mktemp("lab")
  shutil.copy(EXAMPLE_PLUGINS / example, folder / example)
  return folder


def vmoe_in(cwd: pathlib.Path, *args: str) -> tuple[int, str, str]:
  """`vmoe <args>` in a fresh process in `cwd`, as a user runs it: (exit code, stdout, stderr).
  Plug-in tests use it: loading a plug-in changes the registries and the schema of the process
  that loads it, which must not leak into the other tests of a pytest worker."""
  proc = subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=600)
  return proc.returncode, proc.stdout, proc.stderr


class VmoeDriver:
  """`vmoe` commands of one plug-in module in one process of their own (tests/vmoe_driver.py),
  started once in `cwd`: calling it runs `vmoe <args>` there and returns (exit code, stdout,
  stderr), as vmoe_in does, without a process start (seconds of imports) per command. The
  plug-ins a command loads stay loaded for the next: a command that must not see them (one that
  names no plug-in, or runs where the plug-in cannot be imported) uses vmoe_in."""

  def __init__(self, cwd: pathlib.Path):
    self._log = tempfile.TemporaryFile()  # the driver's own stderr, for a driver that died
    self._proc = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).with_name(
        "vmoe_driver.py"))], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=self._log, text=True)

  def __call__(self, *args: str) -> tuple[int, str, str]:
    self._proc.stdin.write(json.dumps(list(args)) + "\n")
    self._proc.stdin.flush()
    ready, _, _ = select.select([self._proc.stdout], [], [], 600)
    line = self._proc.stdout.readline() if ready else ""
    if not line:
      self._proc.kill()
      self._log.seek(0)
      raise RuntimeError(f"the vmoe driver gave no answer to {args}: "
                         f"{self._log.read().decode(errors='replace')[-3000:]}")
    code, out, err = json.loads(line)
    return code, out, err

  def close(self) -> None:
    """Every command has answered, its files written: no need to wait for the interpreter's
    shutdown (seconds)."""
    self._proc.kill()
    self._proc.wait()
    self._proc.stdin.close()
    self._proc.stdout.close()
    self._log.close()


@contextlib.contextmanager
def vmoe_driver(cwd: pathlib.Path):
  """A VmoeDriver in `cwd` for the block (a module-scoped fixture's life)."""
  driver = VmoeDriver(cwd)
  try:
    yield driver
  finally:
    driver.close()
