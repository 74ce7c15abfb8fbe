"""What a stage's process drops of its libraries' noise (runner/command/job.quiet_library_noise):
the one-paragraph error says it all."""
from __future__ import annotations

import asyncio
import gc
import logging

from runner.command import job


def test_an_abandoned_read_collected_late_logs_nothing(caplog):
  """Orbax abandons the concurrent reads of a damaged checkpoint; asyncio logs "exception was
  never retrieved" at ERROR for each future whenever the cycle collector reaches it, which may be
  after a refused run's workdir (and the job.log that Hydra's handler writes to) is gone."""
  job.quiet_library_noise()
  loop = asyncio.new_event_loop()
  future = loop.create_future()
  future.set_exception(OSError("a read of the damaged checkpoint"))
  loop.close()
  with caplog.at_level(logging.DEBUG):
    del future
    gc.collect()
  assert [r for r in caplog.records if r.name == "asyncio"] == []
