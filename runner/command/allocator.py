"""The process a command runs in: restarted once under jemalloc where it is available, with
TensorFlow and W&B quiet and XLA's compilation cache on, before any of those libraries loads."""
from __future__ import annotations

import os
import sys

# XLA on CPU allocates each step's temporaries (hundreds of MB) afresh; glibc maps and unmaps such
# blocks every step, so the step spends a third of its time in page faults. jemalloc keeps them
# mapped: a ViT/V-MoE train step runs 1.4-1.6x faster. See docs/speed.md.
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:60000,muzzy_decay_ms:60000"
_JEMALLOC_PATHS = ("{prefix}/lib/libjemalloc.so.2", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
                   "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
                   "/usr/lib/libjemalloc.so.2")


def find_jemalloc() -> str | None:
  for pattern in _JEMALLOC_PATHS:
    path = pattern.format(prefix=sys.prefix)
    if os.path.exists(path):
      return path
  return None


def reexec_with_jemalloc() -> None:
  """Restarts this command once with jemalloc preloaded, when it is available (Linux only)."""
  if (os.environ.get("VMOE_ALLOCATOR", "jemalloc") != "jemalloc"
      or "jemalloc" in os.environ.get("LD_PRELOAD", "") or not sys.platform.startswith("linux")):
    return
  library = find_jemalloc()
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
