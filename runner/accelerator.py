"""Why JAX computes on the CPU where a GPU was meant, in one line; which of JAX's CUDA builds the
NVIDIA driver can run; what cuDNN's fused attention and the GPU grouped matmuls accept. JAX
itself only warns and carries on on the CPU, so a run, a benchmark or an install would otherwise
find out from its speed.

    python -m runner.accelerator build auto   # the build for this driver (stdout), and why
    python -m runner.accelerator check        # exit 1, saying why, where JAX sees no GPU

`make install GPU=...` runs both. Only the standard library and jax are imported (jax when a
function needs it), so this runs on a CUDA JAX image that has nothing of vmoe's other
dependencies (benchmarks/gpu.py)."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys

# JAX's CUDA builds, newest first, and the oldest NVIDIA driver (its major version) each runs on:
# JAX's installation page, CUDA 13 needing R580 or newer and CUDA 12 R525.
MIN_DRIVER = {"cuda13": 580, "cuda12": 525}


class NoGpu(Exception):
  """There is no NVIDIA GPU to use here; the message says what was found."""


class DriverError(NoGpu):
  """nvidia-smi is here but fails: a GPU whose driver does not work, not a machine without one."""


def driver() -> tuple[str, int]:
  """The NVIDIA driver's version and the number of GPUs, as nvidia-smi lists them."""
  try:
    proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=60)
  except FileNotFoundError:
    raise NoGpu("no NVIDIA GPU here (no nvidia-smi)") from None
  except (OSError, subprocess.TimeoutExpired) as err:
    raise DriverError(f"nvidia-smi does not answer ({err})") from None
  versions = re.findall(r"^\s*(\d+\.\d+(?:\.\d+)?)\s*$", proc.stdout, re.MULTILINE)
  if proc.returncode == 0 and versions:
    return versions[0], len(versions)
  said = (proc.stdout + proc.stderr).strip()
  if proc.returncode == 0 or "No devices were found" in said:
    raise NoGpu("no NVIDIA GPU here (nvidia-smi lists none)")
  first = said.splitlines()[0] if said else f"exit status {proc.returncode}"
  raise DriverError(f"the NVIDIA driver does not answer: nvidia-smi says {first.rstrip('.')}")


def _major(version: str) -> int:
  return int(version.split(".")[0])


def build_for(version: str) -> str:
  """The newest CUDA build a driver of this version runs; ValueError where it runs none."""
  for build, minimum in MIN_DRIVER.items():
    if _major(version) >= minimum:
      return build
  needs = ", ".join(f"{b} R{m}+" for b, m in reversed(MIN_DRIVER.items()))
  raise ValueError(f"NVIDIA driver {version} is too old for JAX's CUDA builds ({needs}): "
                   "update the driver")


def installed_build() -> tuple[str, str] | None:
  """(build, version) of the CUDA plugin installed beside JAX, or None for the CPU build."""
  for build in MIN_DRIVER:
    try:
      return build, importlib.metadata.version(f"jax-{build}-plugin")
    except importlib.metadata.PackageNotFoundError:
      pass
  return None


def _hidden_by_cuda_visible_devices(count: int) -> str | None:
  """CUDA_VISIBLE_DEVICES when it hides every GPU: CUDA reads it up to the first entry that is not a
  GPU's index or UUID, so an empty value, -1 or an index past the last GPU hides them all."""
  value = os.environ.get("CUDA_VISIBLE_DEVICES")
  if value is None:
    return None
  first = value.split(",")[0].strip()
  if first.startswith(("GPU-", "MIG-")) or (first.isdigit() and int(first) < count):
    return None
  return (f"CUDA_VISIBLE_DEVICES={value}{' (empty)' if not value else ''} hides the GPUs "
          f"(nvidia-smi lists {count}): unset it, or name one (CUDA_VISIBLE_DEVICES=0)")


def _one_line(text: str) -> str:
  return " ".join(text.split()).rstrip(".")


def _plugin_error(build: str) -> str | None:
  """The CUDA plugin's own reason for not starting, as JAX reports it."""
  import jax
  module = f"jax_plugins.xla_{build}"
  try:
    importlib.import_module(module)
  except Exception as err:  # the plugin's import error is the answer, whatever its type
    return f"{module} does not import: {type(err).__name__}: {_one_line(str(err))}"
  try:
    jax.devices("cuda")
  except RuntimeError as err:
    found = re.match(r"Backend 'cuda' failed to initialize: (.*?)\.? Available backends",
                     _one_line(str(err)))
    if found:
      return f"JAX's CUDA backend failed to start: {found.group(1)}"
  else:
    return None
  # The plugin did not register its backend (its initialize() failed, which JAX only logs): JAX
  # raises the reason when told to use CUDA alone, in a fresh process.
  proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                        env={**os.environ, "JAX_PLATFORMS": "cuda"}, capture_output=True,
                        text=True, timeout=300)
  errors = re.findall(r"^(\w*(?:Error|Exception): .*)$", proc.stderr, re.MULTILINE)
  if proc.returncode and errors:
    return "JAX's CUDA backend does not start: " + _one_line(
        re.sub(r" \(set JAX_PLATFORMS=.*", "", errors[0]))
  return None


def gpu_problem() -> str | None:
  """None when JAX computes on a GPU, else why not, as specifically as can be found."""
  import jax
  if jax.default_backend() == "gpu":
    return None
  try:
    version, count = driver()
  except NoGpu as err:
    return str(err)
  installed = installed_build()
  if installed is None:
    return "JAX's CPU build is installed: make install GPU=auto"
  build, plugin_version = installed
  platforms = jax.config.jax_platforms
  if platforms and platforms.split(",")[0] not in ("cuda", "gpu"):
    return f"JAX_PLATFORMS={platforms} keeps JAX off the GPU: unset it"
  if hidden := _hidden_by_cuda_visible_devices(count):
    return hidden
  if _major(version) < MIN_DRIVER[build]:
    try:
      remedy = f"make install GPU=auto installs {build_for(version)} for it, or update the driver"
    except ValueError:
      remedy = "update the driver"
    return (f"NVIDIA driver {version} is older than JAX's {build} build needs "
            f"(R{MIN_DRIVER[build]} or newer): {remedy}")
  return _plugin_error(build) or (
      f"JAX {jax.__version__} found no GPU though jax-{build}-plugin {plugin_version} is "
      f"installed and nvidia-smi lists {count} (driver {version}); "
      "JAX_PLATFORMS=cuda python -c 'import jax; jax.devices()' shows JAX's error")


def _choose(gpu: str) -> str | None:
  """The build `make install GPU=...` installs, saying why on stderr; None: the CPU one stays."""
  if gpu in MIN_DRIVER:
    return gpu
  if gpu != "auto":
    raise SystemExit(f"GPU={gpu} is not one of auto, {', '.join(MIN_DRIVER)} (docs/scaling.md)")
  try:
    version, _ = driver()
  except DriverError as err:
    raise SystemExit(f"GPU=auto: {err}; fix the driver, or force a build: GPU=cuda12 or "
                     "GPU=cuda13") from None
  except NoGpu as err:
    print(f"GPU=auto: {err}; the CPU install stays as it is", file=sys.stderr)
    return None
  try:
    build = build_for(version)
  except ValueError as err:
    raise SystemExit(f"GPU=auto: {err}") from None
  newest = next(iter(MIN_DRIVER))
  why = (f"runs CUDA {newest[4:]}" if build == newest else
         f"is older than R{MIN_DRIVER[newest]}, which CUDA {newest[4:]} needs")
  print(f"GPU=auto: NVIDIA driver {version} {why}: installing JAX's {build} build", file=sys.stderr)
  return build


def compute_device() -> dict:
  """The platform this process computes on ("cuda" for an NVIDIA GPU, with its compute
  capability), as `cudnn_attention_problem` and the grouped matmul's check take it."""
  import jax
  device = jax.devices()[0]
  if device.platform != "gpu":
    return {"platform": device.platform}
  if "cuda" not in str(getattr(device.client, "platform_version", "")).lower():
    return {"platform": "rocm"}
  major, minor = str(device.compute_capability).split(".")[:2]
  return {"platform": "cuda", "capability": (int(major), int(minor))}


def cudnn_attention_problem(dtype: str, head_dim: int, *, dropout: bool, tokens: int = 0,
                            masked: bool = False, platform: str | None = None,
                            capability: tuple[int, int] | None = None) -> str | None:
  """Why model.attention=cudnn cannot run an attention layer as JAX 0.10 and cuDNN accept it, or
  None. Stated once for the config (`platform` None: not known before launch) and for the model,
  which decides when traced, where its device is known (runner/models/vit.py). `masked`: cuDNN
  takes a padding mask as a bias, whose gradient needs an even number of `tokens`."""
  widest = 256 if capability is None or capability >= (9, 0) else 128
  if dtype not in ("bfloat16", "float16"):
    why = f"it takes bfloat16 or float16 inputs, and model.dtype={dtype}"
  elif dropout:
    why = ("jax.nn.dot_product_attention has no attention dropout, and "
           "model.attention_dropout_rate > 0")
  elif head_dim % 8 or head_dim > widest:
    why = (f"its head dimension must be a multiple of 8 of at most {widest}, and "
           f"model.hidden_size / model.num_heads = {head_dim}")
  elif masked and tokens % 2:
    why = f"a masked attention needs an even number of tokens, not {tokens}"
  elif platform is not None and platform != "cuda":
    why = f"it needs an NVIDIA GPU, and this process computes on {platform}"
  elif capability is not None and capability < (8, 0):
    why = (f"it needs compute capability 8.0 (Ampere) or newer, and this GPU has "
           f"{capability[0]}.{capability[1]}")
  else:
    return None
  return (f"model.attention=cudnn asks for cuDNN's fused attention, but {why}: use "
          "model.attention=auto (the fused kernel where it can run, XLA elsewhere) or xla.")


GPU_GROUPED_MATMULS = ("pallas", "cudnn")  # model.moe.grouped_matmul's NVIDIA-only methods


def grouped_matmul_problem(method: str, dtype: str, platform: str | None = None) -> str | None:
  """Why `model.moe.grouped_matmul=method` cannot run a `dtype` model on `platform` ("cuda",
  "cpu", ...; None: not known yet, as before launch), or None. Stated once for the config and for
  the MoE layer, which checks its device when traced (runner/models/moe/grouped_matmul.py)."""
  if method == "cudnn" and dtype != "bfloat16":
    why = f"cuDNN's grouped matmul takes bfloat16 inputs, and model.dtype={dtype}"
  elif method in GPU_GROUPED_MATMULS and platform is not None and platform != "cuda":
    why = f"it needs an NVIDIA GPU, and this process computes on {platform}"
  else:
    return None
  return (f"model.moe.grouped_matmul={method} cannot run here: {why}. Use "
          "model.moe.grouped_matmul=auto (blocks unless measured otherwise), blocks or ragged_dot, "
          "which run on any device.")


def main(argv: list[str]) -> int:
  if argv[:1] == ["build"] and len(argv) == 2:
    print(_choose(argv[1]) or "")
    return 0
  if argv == ["check"]:
    import jax
    if problem := gpu_problem():
      print(f"JAX {jax.__version__} sees no GPU: {problem}", file=sys.stderr)
      return 1
    print(f"JAX {jax.__version__} sees {jax.devices()}")
    return 0
  print("usage: python -m runner.accelerator build auto|cuda13|cuda12 | check", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
