#!/usr/bin/env bash
# Validate AstrAI on one GPU in under 10 minutes (docs/benchmarks.md, "GPU check"); benchmarks/gpu_check.py's phases,
# then the long-context phase (benchmarks/long_context_gpu.py). Results (at most 7 files) go to $OUT, else
# runs/gpu_check/.
#   bash scripts/gpu_check.sh           # on the GPU machine: bf16, nccl, Qwen2.5-0.5B's shape
#   bash scripts/gpu_check.sh --cpu     # here: the same sequence on the CPU, fp32, gloo, a tiny shape (~1 min)
# Extra arguments go to benchmarks/gpu_check.py (--help). GPU_CHECK_CPU=1 is the same as --cpu.
# The long-context phase gets what is left of GPU_CHECK_TOTAL_S (default 560: the device tool's 600 s a command, less
# a margin) when gpu_check.py ends, and is skipped with less than 120 s; LONG_CONTEXT_BUDGET_S fixes it (0 skips it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-runs/gpu_check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1

# The device machines have their own torch and no network: the wheels scripts/gpu_wheels.sh put in .whl/
# (cp312) are installed beside it, as /work/.library/device/README.md says. Elsewhere the installed packages run.
if ls .whl/*.whl >/dev/null 2>&1 && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  echo "[gpu_check] installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "[gpu_check] installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # Its torch (2.11) is below pyproject.toml's floor (2.13.0) and too large to carry: astrai/versions.py warns
  # instead of refusing for torch alone; env.txt records the version every number was measured with.
  export ASTR_ALLOW_BELOW_FLOOR=torch
else
  echo "[gpu_check] no .whl/ for this Python: using the installed packages"
fi

# Environment report: what every number in the results was measured with.
{
  date -u
  uname -a
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv && nvidia-smi topo -m 2>/dev/null | head -5
  "$PY" - <<'PY'
import sys
from importlib import metadata

print("python", sys.version.split()[0], sys.executable)
names = ("torch", "deepspeed", "transformers", "tokenizers", "accelerate", "peft", "datasets", "pydantic",
         "huggingface-hub", "pyarrow", "safetensors", "regex", "numpy", "flash-attn", "triton")
for name in names:
    try:
        print(f"{name:16} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name:16} not installed")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
  echo "--- pip check"
  "$PY" -m pip check 2>&1 | head -20
} > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

echo "[gpu_check] $(date -u +%T) phases start"
"$PY" benchmarks/gpu_check.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/console.log"
status=${PIPESTATUS[0]}

# Long context (issue 39): the 0.5B shape, sft packed into one row per step, gradient checkpointing, sp=1 (one
# device), at the longest length `python -m astrai plan` says fits this GPU's free memory; 2 steps, the measured
# peak (torch.cuda.max_memory_allocated) against the plan; out of memory is reported and retried at half the length.
# Writes long_context_gpu.json and .md beside the others.
cpu_flag=
[ "${GPU_CHECK_CPU:-}" = 1 ] && cpu_flag=--cpu
for arg in "$@"; do [ "$arg" = --cpu ] && cpu_flag=--cpu; done
long_budget=${LONG_CONTEXT_BUDGET_S:-$(( ${GPU_CHECK_TOTAL_S:-560} - SECONDS ))}
long_status=0
if [ "$long_budget" -ge 120 ] || { [ -n "${LONG_CONTEXT_BUDGET_S:-}" ] && [ "$long_budget" != 0 ]; }; then
  echo "[gpu_check] $(date -u +%T) long_context starts (${long_budget} s)"
  "$PY" benchmarks/long_context_gpu.py $cpu_flag --budget-s "$long_budget" \
    --results-dir "$OUT_DIR" --name long_context_gpu 2>&1 | tee -a "$OUT_DIR/console.log"
  long_status=${PIPESTATUS[0]}
else
  echo "[gpu_check] long_context skipped: ${long_budget} s left of GPU_CHECK_TOTAL_S" | tee -a "$OUT_DIR/console.log"
fi

echo "[gpu_check] $(date -u +%T) done, exit $status (long_context $long_status); results in $OUT_DIR"
[ "$status" = 0 ] && status=$long_status
exit "$status"
