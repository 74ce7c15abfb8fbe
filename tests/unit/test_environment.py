"""What a stage says it runs on: the devices, and a CUDA install that found no GPU."""
from __future__ import annotations

import jax

from runner import accelerator
from runner.logging import environment


def test_devices_name_the_count_kind_and_backend():
  kinds = sorted({d.device_kind for d in jax.devices()})
  assert environment.devices() == (f"{jax.device_count()} x {', '.join(kinds)} "
                                   f"({jax.default_backend()})")


def test_a_cuda_plugin_on_the_cpu_is_said_with_the_reason(monkeypatch):
  installed = [("cuda12", "0.10.2")]
  monkeypatch.setattr(accelerator, "installed_build", lambda: installed[0] if installed else None)
  monkeypatch.setattr(accelerator, "gpu_problem", lambda: "no NVIDIA GPU here (no nvidia-smi)")
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert environment.gpu_not_found() == ("jax-cuda12-plugin 0.10.2 is installed, but JAX found no "
                                         "GPU and runs on the CPU: no NVIDIA GPU here (no "
                                         "nvidia-smi)")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert environment.gpu_not_found() is None
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  installed.clear()  # a CPU-only install runs on the CPU as it should
  assert environment.gpu_not_found() is None
