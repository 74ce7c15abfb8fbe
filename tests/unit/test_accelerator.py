"""Why JAX sees no GPU, and the CUDA build `make install GPU=auto` picks, from a fake nvidia-smi on
a PATH of its own: each cause has its own line. JAX itself runs on the CPU here; where a test needs
JAX to believe otherwise, it says so through monkeypatch."""
from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shlex
import subprocess
import sys
import textwrap

import jax
import pytest

from runner import accelerator

ROOT = pathlib.Path(__file__).resolve().parents[2]
CANNOT_REACH = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                "Make sure that the latest NVIDIA driver is installed and running.")


@pytest.fixture
def smi(tmp_path, monkeypatch):
  """smi(stdout, status=0): an nvidia-smi that answers so; smi(None): none on PATH."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  monkeypatch.setenv("PATH", str(bin_dir))
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

  def make(stdout: str | None, status: int = 0):
    if stdout is not None:
      script = bin_dir / "nvidia-smi"
      # Shell builtins only: the PATH has nothing else.
      script.write_text(f"#!/bin/sh\nprintf '%s\\n' {shlex.quote(stdout)}\nexit {status}\n")
      script.chmod(0o755)
  return make


@pytest.fixture
def on_cpu_with(monkeypatch):
  """on_cpu_with(build): JAX runs on the CPU with that CUDA plugin installed (None: none)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")

  def install(build: str | None):
    def version(package):
      if build and package == f"jax-{build}-plugin":
        return "0.10.2"
      raise importlib.metadata.PackageNotFoundError(package)
    monkeypatch.setattr(importlib.metadata, "version", version)
  return install


@pytest.fixture
def fake_plugin(tmp_path, monkeypatch):
  """fake_plugin(build, code): a jax_plugins.xla_<build> module of that source on sys.path, in
  place of any real one."""
  for name in [n for n in sys.modules if n == "jax_plugins" or n.startswith("jax_plugins.")]:
    monkeypatch.delitem(sys.modules, name)

  def make(build: str, code: str):
    package = tmp_path / "plugins" / "jax_plugins" / f"xla_{build}"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    return tmp_path / "plugins"
  yield make
  for name in [n for n in sys.modules if n == "jax_plugins" or n.startswith("jax_plugins.")]:
    del sys.modules[name]


@pytest.mark.parametrize("version, build, why", [
    ("580.65.06", "cuda13", "runs CUDA 13"),
    ("575.57.08", "cuda12", "is older than R580, which CUDA 13 needs"),
    ("525.60.13", "cuda12", "is older than R580, which CUDA 13 needs"),
])
def test_auto_picks_the_newest_build_the_driver_runs(smi, capsys, version, build, why):
  smi(f"{version}\n{version}")
  assert accelerator.main(["build", "auto"]) == 0
  out, err = capsys.readouterr()
  assert out == f"{build}\n"
  assert err == f"GPU=auto: NVIDIA driver {version} {why}: installing JAX's {build} build\n"


@pytest.mark.parametrize("stdout, status, found", [
    (None, 0, "no NVIDIA GPU here (no nvidia-smi)"),
    ("No devices were found", 6, "no NVIDIA GPU here (nvidia-smi lists none)"),
    ("", 0, "no NVIDIA GPU here (nvidia-smi lists none)"),
])
def test_auto_without_a_gpu_keeps_the_cpu_install(smi, capsys, stdout, status, found):
  smi(stdout, status)
  assert accelerator.main(["build", "auto"]) == 0
  assert capsys.readouterr() == ("\n", f"GPU=auto: {found}; the CPU install stays as it is\n")


def test_auto_refuses_a_driver_too_old_or_broken(smi):
  smi("470.82.01")
  with pytest.raises(SystemExit, match=r"^GPU=auto: NVIDIA driver 470\.82\.01 is too old for "
                                       r"JAX's CUDA builds \(cuda12 R525\+, cuda13 R580\+\): "
                                       r"update the driver$"):
    accelerator.main(["build", "auto"])
  smi(CANNOT_REACH, 9)
  with pytest.raises(SystemExit, match=r"^GPU=auto: the NVIDIA driver does not answer: "
                                       r"nvidia-smi says NVIDIA-SMI has failed because .* "
                                       r"running; fix the driver, or force a build"):
    accelerator.main(["build", "auto"])


def test_a_named_build_is_kept_and_an_unknown_one_refused(smi, capsys):
  smi(None)
  assert accelerator.main(["build", "cuda12"]) == 0
  assert capsys.readouterr() == ("cuda12\n", "")
  with pytest.raises(SystemExit, match=r"^GPU=cuda11 is not one of auto, cuda13, cuda12"):
    accelerator.main(["build", "cuda11"])


def test_jax_on_the_gpu_is_no_problem(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert accelerator.gpu_problem() is None


@pytest.mark.parametrize("build, stdout, status, problem", [
    ("cuda13", None, 0, "no NVIDIA GPU here (no nvidia-smi)"),
    ("cuda13", "No devices were found", 6, "no NVIDIA GPU here (nvidia-smi lists none)"),
    ("cuda13", CANNOT_REACH, 9, "the NVIDIA driver does not answer: nvidia-smi says "
                                + CANNOT_REACH.rstrip(".")),
    (None, "580.65.06", 0, "JAX's CPU build is installed: make install GPU=auto"),
    ("cuda13", "575.57.08", 0, "NVIDIA driver 575.57.08 is older than JAX's cuda13 build needs "
                               "(R580 or newer): make install GPU=auto installs cuda12 for it, "
                               "or update the driver"),
    ("cuda12", "470.82.01", 0, "NVIDIA driver 470.82.01 is older than JAX's cuda12 build needs "
                               "(R525 or newer): update the driver"),
])
def test_each_cause_has_its_line(smi, on_cpu_with, build, stdout, status, problem):
  smi(stdout, status)
  on_cpu_with(build)
  assert accelerator.gpu_problem() == problem


@pytest.mark.parametrize("value, said", [("-1", "-1"), ("", " (empty)"), ("1", "1")])
def test_cuda_visible_devices_that_hide_the_gpu(smi, on_cpu_with, monkeypatch, value, said):
  smi("580.65.06")  # one GPU: index 1 is past it
  on_cpu_with("cuda13")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
  assert accelerator.gpu_problem() == (f"CUDA_VISIBLE_DEVICES={said} hides the GPUs (nvidia-smi "
                                       "lists 1): unset it, or name one (CUDA_VISIBLE_DEVICES=0)")


def test_jax_platforms_without_cuda(smi, on_cpu_with):
  smi("580.65.06")
  on_cpu_with("cuda13")
  before = jax.config.jax_platforms
  jax.config.update("jax_platforms", "cpu")
  try:
    assert accelerator.gpu_problem() == "JAX_PLATFORMS=cpu keeps JAX off the GPU: unset it"
  finally:
    jax.config.update("jax_platforms", before)


def test_the_plugins_import_error(smi, on_cpu_with, fake_plugin, monkeypatch):
  smi("580.65.06")
  on_cpu_with("cuda13")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # names the one GPU: hides nothing
  fake_plugin("cuda13", """
      raise ImportError("libcudart.so.13: cannot open shared object file: No such file")
  """)
  assert accelerator.gpu_problem() == ("jax_plugins.xla_cuda13 does not import: ImportError: "
                                       "libcudart.so.13: cannot open shared object file: No such "
                                       "file")


def test_the_backends_start_up_error(smi, on_cpu_with, fake_plugin, monkeypatch):
  smi("580.65.06")
  on_cpu_with("cuda13")
  fake_plugin("cuda13", "")

  def devices(backend=None):
    raise RuntimeError("Backend 'cuda' failed to initialize: INTERNAL: CUDA_ERROR_NO_DEVICE: no "
                       "CUDA-capable device is detected. Available backends are ['cpu']")
  monkeypatch.setattr(jax, "devices", devices)
  assert accelerator.gpu_problem() == ("JAX's CUDA backend failed to start: INTERNAL: "
                                       "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected")


def test_make_installs_check_says_the_plugins_own_error(smi, fake_plugin, tmp_path):
  """`python -m runner.accelerator check` as `make install GPU=...` runs it, in a process whose
  jax-cuda13-plugin (a fake, on PYTHONPATH) fails to start: JAX only logs that, and computes on
  the CPU; the check exits 1 with the plugin's reason as its last line."""
  smi("580.65.06")
  plugins = fake_plugin("cuda13", """
      def initialize():
        raise RuntimeError("Found CUDA version 12090, but JAX was built against version 13050")
  """)
  info = plugins / "jax_cuda13_plugin-0.10.2.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jax-cuda13-plugin\n"
                                 "Version: 0.10.2\n")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT)])}
  proc = subprocess.run([sys.executable, "-m", "runner.accelerator", "check"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr
  assert proc.stdout == ""
  assert proc.stderr.splitlines()[-1] == (
      f"JAX {jax.__version__} sees no GPU: JAX's CUDA backend does not start: RuntimeError: Found "
      "CUDA version 12090, but JAX was built against version 13050")
