"""Console progress: a bar with step, loss, images/s, ETA on a terminal; plain lines elsewhere."""
from __future__ import annotations

import sys
import time

import jax
from tqdm import tqdm


def say(text: str, enabled: bool = True) -> None:
  """`text` on stderr, from the first process alone (and only when `enabled`)."""
  if enabled and jax.process_index() == 0:
    print(text, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
  """Images/s and ETA count from the first completed step, so compilation does not skew them."""

  def __init__(self, total_steps: int, start_step: int, batch_size: int, *, desc: str = "train",
               enabled: bool = True):
    self.total, self.start, self.batch_size, self.desc = total_steps, start_step, batch_size, desc
    self.enabled = enabled and jax.process_index() == 0
    self.bar, self.t0, self.step0 = None, None, start_step
    if self.enabled and sys.stderr.isatty():
      self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step",
                      dynamic_ncols=True, leave=True)

  def step_done(self, step: int) -> None:
    """Call after each step; the first call starts the clock."""
    if self.t0 is None:
      self.t0, self.step0 = time.perf_counter(), step
    if self.bar is not None:
      self.bar.update(step - self.bar.n)

  def images_per_second(self, step: int) -> float:
    if self.t0 is None or step <= self.step0:
      return 0.0
    return (step - self.step0) * self.batch_size / (time.perf_counter() - self.t0)

  def report(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    rate = self.images_per_second(step)
    labels = {"train/loss": "loss", "train/prec@1": "prec@1", "train/i2t_prec@1": "i2t prec@1",
              "val/prec@1": "val prec@1", "val/nll": "val nll",
              "val/zero_shot_prec@1": "val zero-shot prec@1", "val/i2t_prec@1": "val i2t prec@1"}
    text = " ".join(f"{label} {metrics[k]:.4g}" for k, label in labels.items() if k in metrics)
    if self.bar is not None:
      self.bar.set_postfix_str(f"{text} {rate:.0f} img/s", refresh=True)
    else:
      eta = _duration((self.total - step) * self.batch_size / rate) if rate else "?"
      print(f"[{self.desc}] step {step}/{self.total} {text} {rate:.0f} img/s ETA {eta}",
            file=sys.stderr, flush=True)

  def message(self, text: str) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.write(text, file=sys.stderr)
    else:
      print(text, file=sys.stderr, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
