"""Starts a job's W&B run, falling back to offline when an online run cannot reach the server. W&B
should never stop or stall training: alone, online mode without an API key fails at once (or prompts
on a terminal), and an unreachable server blocks for minutes. So online mode checks the key, probes
the server and gives `wandb.init` a deadline; any failure gives an offline run and one warning line
(`wandb sync` uploads it later). Worst case: 8 s probe + 12 s init + ~3 s offline."""
from __future__ import annotations

import socket
import sys
import threading
import urllib.parse

PROBE_TIMEOUT_S = 8.0  # the whole TCP probe, DNS lookup included
INIT_TIMEOUT_S = 12.0  # W&B's deadline for creating the run on the server (its default is 90 s)


def start_run(mode: str, workdir: str, **init_kwargs):
  """`wandb.init(mode=mode, dir=workdir, **init_kwargs)`, offline if online cannot start."""
  import wandb  # lazily: slow to import, and a run with logger.wandb.mode=disabled never needs it
  settings = dict(console="off")
  if mode == "online":
    url = wandb.setup().settings.base_url  # WANDB_BASE_URL, `wandb login --host`, or the default
    if not wandb.login(prompt=False, verify=False):  # offline, never prompting on a terminal
      problem = "W&B has no API key configured (run `wandb login` or set WANDB_API_KEY)"
    elif reason := _unreachable(url):
      problem = f"W&B server {url} is unreachable ({reason})"
    else:
      try:
        # silent: otherwise W&B looks the user up first, with a 10 s timeout of its own.
        return wandb.init(mode="online", dir=workdir, **init_kwargs, settings=wandb.Settings(
            **settings, init_timeout=INIT_TIMEOUT_S, silent=True))
      except Exception as e:  # noqa: BLE001 - any failure online falls back to offline
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        problem = f"W&B could not start an online run at {url} ({first_line})"
        wandb.teardown()  # W&B's service still holds the failed run's id, which is resumed next
    offline = f"{workdir}/wandb"
    print(f"warning: {problem}; logging offline to {offline} — upload later with "
          f"`wandb sync {offline}/offline-run-*`.", file=sys.stderr, flush=True)
    mode = "offline"
  return wandb.init(mode=mode, dir=workdir, **init_kwargs, settings=wandb.Settings(**settings))


def _unreachable(url: str) -> str | None:
  """Why no TCP connection to the server opens, or None; in a daemon thread, so that a DNS lookup
  (which has no timeout of its own) cannot hold the run longer than PROBE_TIMEOUT_S."""
  parts = urllib.parse.urlsplit(url)
  port = parts.port or (443 if parts.scheme == "https" else 80)
  outcome = [f"no connection within {PROBE_TIMEOUT_S:g} s"]

  def connect():
    try:
      socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT_S).close()
      outcome[0] = None
    except OSError as e:
      outcome[0] = (e.strerror or str(e) or type(e).__name__).lower()

  thread = threading.Thread(target=connect, name="wandb-probe", daemon=True)
  thread.start()
  thread.join(PROBE_TIMEOUT_S)
  return outcome[0]
