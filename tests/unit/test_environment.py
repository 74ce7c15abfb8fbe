"""What a stage says it runs on: the devices, and a CUDA install that found no GPU."""
from __future__ import annotations

import jax

from runner.tasks import environment


def test_devices_name_the_count_kind_and_backend():
  kinds = sorted({d.device_kind for d in jax.devices()})
  assert environment.devices() == (f"{jax.device_count()} x {', '.join(kinds)} "
                                   f"({jax.default_backend()})")


def test_a_cuda_plugin_on_the_cpu_is_said(monkeypatch):
  versions = {"jax-cuda12-plugin": "0.10.2"}
  monkeypatch.setattr(environment, "_version", versions.get)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  message = environment.gpu_not_found()
  assert message.startswith("jax-cuda12-plugin 0.10.2 is installed, but JAX found no GPU")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert environment.gpu_not_found() is None
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  versions.clear()  # a CPU-only install runs on the CPU as it should
  assert environment.gpu_not_found() is None
