"""`vmoe <subcommand> [hydra overrides]`: compose the subcommand's config with Hydra, run its task.

Before Hydra runs (and creates the workdir), every job's overrides (each combination of a sweep's
values) are composed and validated against the schema (runner/config): a typo or a bad value is
one paragraph naming what is valid, and nothing is written. Errors that stop a run
(runner/errors.py) print one paragraph and exit with their code; only debug=true shows
tracebacks. The parts are runner/command's, one job per module; `vmoe --help` and an unknown
subcommand are answered from the subcommands' table (runner/config/subcommands.py) alone, before
any of them loads."""
from __future__ import annotations

import importlib
import sys

from runner.command import allocator
from runner.config.subcommands import SUBCOMMANDS

USAGE = """usage: vmoe <subcommand> [overrides ...] [--multirun] [--cfg job] [--help]

Sparse Vision Mixture-of-Experts experiments in JAX.

subcommands:
{lines}

Overrides are Hydra's: key=value (optim.lr=3e-3), group=option (model=vit_s32, data=cifar10),
comma lists with --multirun (optim.lr=1e-3,3e-3 seed=0,1). `vmoe <subcommand> --help` lists the
config groups and options; `vmoe <subcommand> --cfg job` prints the composed config (with
--multirun, every job's).
Studies: `vmoe finetune -cd sweeps -cn <study>` (see sweeps/README.md). Add debug=true to see
Python tracebacks.
"""


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    lines = "\n".join(f"  {name:<10} {sub.help}" for name, sub in SUBCOMMANDS.items())
    print(USAGE.format(lines=lines))
    return 0
  sub, rest = argv[0], argv[1:]
  if sub not in SUBCOMMANDS:
    print(f"vmoe: error: unknown subcommand {sub!r}; valid: {', '.join(SUBCOMMANDS)} "
          "(`vmoe --help` describes each).", file=sys.stderr)
    return 2
  if not SUBCOMMANDS.get(sub).is_stage:
    return importlib.import_module(SUBCOMMANDS.get(sub).module).main(rest)
  from runner.command import launch  # lazily: Hydra, JAX and TensorFlow load only for a stage
  return launch.run(sub, rest)


def answers_at_once(argv: list[str]) -> bool:
  """`vmoe`, `vmoe --help` and an unknown subcommand: printed from the table, with no
  library loaded (and no restart with jemalloc)."""
  return not argv or argv[0] in ("-h", "--help", "help") or argv[0] not in SUBCOMMANDS


def entry() -> None:
  """The `vmoe` console script."""
  if not answers_at_once(sys.argv[1:]):
    allocator.reexec_with_jemalloc()
    allocator.pause_collector()
  sys.exit(main())


if __name__ == "__main__":
  allocator.pause_collector()
  sys.exit(main())
