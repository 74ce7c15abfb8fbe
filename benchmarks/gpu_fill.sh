#!/usr/bin/env bash
# The rows docs/speed.md's GPU tables still lack, in one call of at most 8 minutes on one NVIDIA
# GPU (H100 or H200), with no network and nothing installed: a CUDA JAX image with flax, optax and
# numpy, and this checkout (put on PYTHONPATH here).
#
#     bash benchmarks/gpu_fill.sh            # PYTHON=... to pick the interpreter (python3)
#
# Two invocations of benchmarks/gpu.py, each under `timeout` and with a --budget-s inside it, so
# the whole stays within GPU_FILL_TOTAL_S (470 s; at worst 300 + 10 s of --kill-after, 150 + 10,
# and the tables):
#   1. gpu_fill_b16 (timeout 300 s, --budget-s 250): V-MoE-B/16 in bfloat16: the dense twin,
#      token-choice and the reference (einsum dispatch) at routing group sizes 8 and 32, and the
#      A/B of xla_gpu_enable_cublaslt and xla_gpu_triton_gemm_any (each set True on an extra
#      dense row, timed in the same rounds as the dense twin without it); one profiled step of
#      each. The budget runs dense, token-choice and reference at 8 first, then at 32, then the
#      A/B rows, and skips (saying so) what would not fit.
#   2. gpu_fill_s32_dropless (timeout: what is left, at most 150 s; --budget-s 25 s less):
#      V-MoE-S/32 in bfloat16, dropless by every grouped matmul the GPU runs (blocks, ragged_dot,
#      pallas, cudnn) beside the dense twin; one profiled step of each.
# Each writes runs/benchmarks/<name>.json and its traces under runs/benchmarks/<name>_profile/;
# the console output also goes to runs/benchmarks/gpu_fill.log. At the end the tables of both
# are printed again. The exit status is 1 if an invocation failed or timed out, else 0.
set -u -o pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
TOTAL_S=${GPU_FILL_TOTAL_S:-470}
OUT=runs/benchmarks
LOG=$OUT/gpu_fill.log
mkdir -p "$OUT"
: > "$LOG"
START=$SECONDS
STATUS=0

say() { echo "$@" | tee -a "$LOG"; }

# Which JAX runs, without starting a backend (benchmarks/gpu.py prints cuDNN, cuBLAS and the
# driver once it has).
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.metadata as metadata
found = []
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "numpy"):
  try:
    found.append(f"{name} {metadata.version(name)}")
  except metadata.PackageNotFoundError:
    pass
print("gpu_fill: " + ", ".join(found))
EOF

# run NAME LIMIT_S MARGIN_S ARGS...: benchmarks.gpu --name NAME under `timeout LIMIT_S`, its own
# budget MARGIN_S shorter (a model already started may outlast its estimate; the JSON is written
# when the model and dtype are done).
run() {
  local name=$1 limit=$2 margin=$3
  shift 3
  local budget=$((limit - margin))
  say "== $name: timeout ${limit} s, --budget-s ${budget} ($((SECONDS - START)) s into gpu_fill)"
  timeout --signal=TERM --kill-after=10 "$limit" \
    "$PYTHON" -m benchmarks.gpu --name "$name" --budget-s "$budget" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    say "== $name: stopped by its timeout (${limit} s)"
  fi
  if [ "$status" -ne 0 ]; then
    say "== $name: exit status $status"
    STATUS=1
  fi
}

run gpu_fill_b16 300 50 --models b16 --dtypes bfloat16 --families vmoe --group-sizes 8,32 \
  --compiler-options-ab xla_gpu_enable_cublaslt,xla_gpu_triton_gemm_any --profile

# What is left, less 10 s for timeout's --kill-after and 10 s for the tables below.
LEFT=$((TOTAL_S - (SECONDS - START) - 20))
if [ "$LEFT" -gt 150 ]; then LEFT=150; fi
if [ "$LEFT" -ge 90 ]; then
  run gpu_fill_s32_dropless "$LEFT" 25 --models s32 --dtypes bfloat16 --families dropless --profile
else
  say "== gpu_fill_s32_dropless: not run, ${LEFT} s left of ${TOTAL_S} s"
  STATUS=1
fi

say "== gpu_fill: the tables again ($((SECONDS - START)) s)"
"$PYTHON" - "$OUT/gpu_fill_b16.json" "$OUT/gpu_fill_s32_dropless.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json
import pathlib
import sys

from benchmarks import gpu

for path in map(pathlib.Path, sys.argv[1:]):
  if not path.is_file():
    print(f"{path}: not written")
    continue
  report = json.loads(path.read_text())
  print(f"\n{path} ({report.get('elapsed_s', 0):.0f} s, {report['devices'][0]}):")
  gpu.print_report(report)
EOF
say "== gpu_fill: $((SECONDS - START)) s in all; written under $OUT/:" \
  "gpu_fill_*.json, gpu_fill_*_profile/, gpu_fill.log"
exit $STATUS
