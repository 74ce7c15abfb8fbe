"""One process that runs many `vmoe` commands, for the plug-in tests (conftest.VmoeDriver).

A plug-in changes the registries and the schema of the process that loads it, so its commands run
away from pytest's process; starting `vmoe` afresh for each costs seconds of imports. This process
starts once, in the folder it is given (searched for plug-ins first, as `python -m runner.cli`
searches its working directory), and reads one JSON list a line on stdin: the arguments of `vmoe`
(or `-c <code> <args>`, as `python -c`). It runs each as a fresh `vmoe` process would run it, with
its output at the file descriptors 1 and 2 captured, and answers one JSON line
[exit code, stdout, stderr]. A plug-in stays loaded from one command to the next, as in the jobs
of one sweep: only commands that load the same plug-ins (or fail before loading any) belong to one
driver.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback


def _run(args: list[str]) -> int:
  """The exit status of `vmoe <args>` (or `python -c`), as the interpreter would set it."""
  try:
    if args[:1] == ["-c"]:
      sys.argv = args[:1] + args[2:]
      exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
      return 0
    from runner import cli
    sys.argv = [cli.__file__, *args]
    return cli.main(args)
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except BaseException:  # noqa: BLE001 (what the interpreter prints for an uncaught exception)
    traceback.print_exc()
    return 1


def _captured(args: list[str]) -> tuple[int, str, str]:
  """Runs one command with file descriptors 1 and 2 (and so its subprocesses') in files."""
  saved = os.dup(1), os.dup(2)
  environ, cwd, argv = dict(os.environ), os.getcwd(), list(sys.argv)
  importlib.invalidate_caches()  # a module written since the last command is found, as afresh
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    try:
      code = _run(args)
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      os.close(saved[0])
      os.close(saved[1])
      os.environ.clear()
      os.environ.update(environ)
      os.chdir(cwd)
      sys.argv = argv
    out.seek(0)
    err.seek(0)
    return code, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def main() -> None:
  sys.path[0] = os.getcwd()  # `python -m` puts the working directory first, not this file's
  replies = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # anything printed between commands goes to the log, not into the replies
  for line in sys.stdin:
    replies.write(json.dumps(_captured(json.loads(line))) + "\n")
    replies.flush()


if __name__ == "__main__":
  from runner.command import allocator
  allocator.pause_collector()  # as `vmoe` does at its entry, until its first job starts
  main()
