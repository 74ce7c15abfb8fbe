"""What every study driver does: run real `vmoe` commands in this process, then write its table.

Rerunning a study resumes or skips the runs that ended; its extra arguments go to every stage
(e.g. `logger.wandb.mode=disabled`)."""
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


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A study over experiment overlays and seeds: each stage's run of one goes to
  `<root>/<stage>/<experiment>/seed_<seed>` (the upstream sweep's subfolders, and the same below
  the later stages), and a rerun skips the runs that ended (that wrote their summary)."""
  study: str  # names the study in a failure's message: "study-routers"
  root: pathlib.Path

  def vmoe(self, sub: str, args: list[str], extra: list[str]) -> None:
    vmoe(self.study, sub, args, extra)

  def dir(self, stage: str, experiment: str, seed: int) -> pathlib.Path:
    return self.root / stage / experiment / f"seed_{seed}"

  def stage(self, sub: str, experiment: str, seed: int, args: list[str], extra: list[str],
            folder: str | None = None) -> None:
    """`vmoe <sub> workdir=<its folder> <args> <extra>`, unless that run already ended; the
    folder is named after `sub` unless `folder` names it (a second run of a subcommand)."""
    workdir = self.dir(folder or sub, experiment, seed)
    if not (workdir / "summary.json").exists():
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
