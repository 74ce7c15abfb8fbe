"""What every study driver does: run real `vmoe` commands in this process, then write its table."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable

from runner import cli, report


def vmoe(study: str, sub: str, args: list[str], extra: list[str]) -> None:
  """`vmoe <sub> <args> <extra>`; stops the study, naming the stage, if it fails."""
  print(f"\n=== vmoe {sub} {' '.join(args + extra)}", file=sys.stderr, flush=True)
  try:
    code = cli.main([sub] + args + extra)
  except SystemExit as e:
    code = e.code
  if code:
    raise SystemExit(f"{study}: vmoe {sub} failed (exit {code})")


def job_dir(root: pathlib.Path, stage: str, experiment: str, seed: int) -> pathlib.Path:
  """Where a study's stage writes the run of one experiment overlay and seed (the upstream
  sweep's `<experiment>/seed_<seed>` subfolders, and the same below the later stages)."""
  return root / stage / experiment / f"seed_{seed}"


def finished(workdir: pathlib.Path) -> bool:
  """Whether the run in `workdir` ended (it wrote its summary): a rerun of the study skips it."""
  return (workdir / "summary.json").exists()


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A study over experiment overlays and seeds: each stage's run of one goes to
  `<root>/<stage>/<experiment>/seed_<seed>` (`job_dir`), and a rerun skips the runs that ended."""
  study: str  # names the study in a failure's message: "study-routers"
  root: pathlib.Path

  def vmoe(self, sub: str, args: list[str], extra: list[str]) -> None:
    vmoe(self.study, sub, args, extra)

  def dir(self, stage: str, experiment: str, seed: int) -> pathlib.Path:
    return job_dir(self.root, stage, experiment, seed)

  def stage(self, sub: str, experiment: str, seed: int, args: list[str], extra: list[str]) -> None:
    """`vmoe <sub> workdir=<its folder> <args> <extra>`, unless that run already ended."""
    workdir = self.dir(sub, experiment, seed)
    if not finished(workdir):
      self.vmoe(sub, [f"workdir={workdir}", *args], extra)

  def summary(self, stage: str, experiment: str, seed: int) -> dict:
    return json.loads((self.dir(stage, experiment, seed) / "summary.json").read_text())


def main(root: pathlib.Path, stages: Callable[[list[str]], None], table: Callable[[], str],
         extra: list[str], sweep_page: pathlib.Path | None = None) -> int:
  """Runs the stages (finished ones resume or are skipped), prints the table and writes it to
  `<root>/results.md`; with `sweep_page`, a sweep's folder, also writes its `vmoe report` page."""
  start = time.perf_counter()
  stages(extra)
  text = table()
  (root / "results.md").write_text(text + "\n")
  print("\n" + text + f"\n\n(also in {root / 'results.md'}; "
        f"{(time.perf_counter() - start) / 60:.1f} min)")
  if sweep_page is not None:
    print(f"The upstream sweep's page: {report.write_sweep_page(sweep_page)[-1]}")
  return 0
