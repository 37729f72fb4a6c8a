#!/usr/bin/env bash
# Validate AstrAI on one GPU in under 8 minutes (docs/benchmarks.md, "GPU check"); every phase is
# benchmarks/gpu_check.py's. Results (at most 5 files) go to $OUT, else runs/gpu_check/.
#   bash scripts/gpu_check.sh           # on the GPU machine: bf16, nccl, Qwen2.5-0.5B's shape
#   bash scripts/gpu_check.sh --cpu     # here: the same sequence on the CPU, fp32, gloo, a tiny shape (~1 min)
# Extra arguments go to benchmarks/gpu_check.py (--help). GPU_CHECK_CPU=1 is the same as --cpu.
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
echo "[gpu_check] $(date -u +%T) done, exit $status; results in $OUT_DIR"
exit "$status"
