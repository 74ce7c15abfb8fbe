"""The process a command runs in: restarted once under jemalloc where it is available, with
TensorFlow and W&B quiet and XLA's compilation cache on, before any of those libraries loads, and
Python's cycle collector kept off the half million objects those libraries make at import."""
from __future__ import annotations

import gc
import os
import sys

# XLA on CPU allocates each step's temporaries (hundreds of MB) afresh; glibc maps and unmaps such
# blocks every step, so the step spends a third of its time in page faults. jemalloc keeps them
# mapped: a ViT/V-MoE train step runs 1.4-1.6x faster. See docs/speed.md.
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:60000,muzzy_decay_ms:60000"
_JEMALLOC_PATHS = ("{prefix}/lib/libjemalloc.so.2", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
                   "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
                   "/usr/lib/libjemalloc.so.2")


def reexec_with_jemalloc() -> None:
  """Restarts this command once with jemalloc preloaded, when it is available (Linux only)."""
  if (os.environ.get("VMOE_ALLOCATOR", "jemalloc") != "jemalloc"
      or "jemalloc" in os.environ.get("LD_PRELOAD", "") or not sys.platform.startswith("linux")):
    return
  paths = (pattern.format(prefix=sys.prefix) for pattern in _JEMALLOC_PATHS)
  library = next((path for path in paths if os.path.exists(path)), None)
  if library is None:
    return
  env = dict(os.environ, VMOE_ALLOCATOR="jemalloc",
             LD_PRELOAD=":".join(filter(None, [library, os.environ.get("LD_PRELOAD")])),
             MALLOC_CONF=os.environ.get("MALLOC_CONF", JEMALLOC_CONF))
  os.execve(sys.executable, [sys.executable, "-m", "runner.cli", *sys.argv[1:]], env)


def quiet_environment() -> None:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  os.environ.setdefault("WANDB_SILENT", "true")
  # Reuse XLA compilations across runs (a rerun, a resume, the next stage with the same model).
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(os.path.expanduser("~"), ".cache", "vmoe", "xla"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


# Python's cycle collector rescans every object it tracks at each full collection: while a command
# imports JAX, TensorFlow, Flax, Orbax and Hydra, a dozen scans of a growing heap, 1-2 s of its
# start on 2 CPU cores (docs/speed.md). What the imports make lives as long as the process, so it
# is frozen out of later scans, and full scans come every ~1M allocations rather than Python's
# ~70k: a run's arrays are freed by reference counting, not by the collector.
COLLECTOR_THRESHOLDS = (10000, 10, 10)
_collector_paused = False


def pause_collector() -> None:
  """At a `vmoe` process's entry, before the libraries load."""
  global _collector_paused
  if gc.isenabled():
    gc.disable()
    _collector_paused = True


def resume_collector() -> None:
  """As a job starts (libraries loaded): what exists is frozen, the collector resumed. Only where
  `pause_collector` paused it, once: a test or notebook calling the CLI keeps its collector."""
  global _collector_paused
  if not _collector_paused:
    return
  _collector_paused = False
  gc.collect()
  gc.freeze()
  gc.set_threshold(*COLLECTOR_THRESHOLDS)
  gc.enable()
