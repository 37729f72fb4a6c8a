#!/usr/bin/env bash
# Entry point of the trainer container (docker/Dockerfile): export the job's runtime.environment,
# then start `deepspeed astrai/train.py` on the job's GPUs. Extra arguments go to astrai/train.py.
#   TRAIN_CONFIG          the job YAML inside the container (compose mounts it at /job/job.yaml)
#   CUDA_VISIBLE_DEVICES  the job's GPUs (host indices; the container sees every GPU); unset: all
#   TRAIN_GPU_COUNT       ranks to start (default: every listed GPU, or every GPU)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
config=${TRAIN_CONFIG:-/job/job.yaml}
python=${ASTRAI_HOST_PYTHON:-python3}  # the image's python; tests point it at theirs

# An empty CUDA_VISIBLE_DEVICES hides every GPU; the wrapper means "all" by it, so drop it.
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then unset CUDA_VISIBLE_DEVICES; fi

# Exported here, not only in each rank (astrai/train.py does that too), so the launcher and anything
# read at import time (NCCL_*, OMP_NUM_THREADS, PYTORCH_CUDA_ALLOC_CONF) see it as well.
environment=$("$python" scripts/docker/train_runtime.py environment "$config")
eval "$environment"

launcher=()
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  # deepspeed drops CUDA_VISIBLE_DEVICES whenever --num_gpus is given and would start on GPUs 0..N-1:
  # --include keeps the ranks on this job's GPUs.
  IFS=, read -r -a devices <<<"$CUDA_VISIBLE_DEVICES"
  count=${TRAIN_GPU_COUNT:-${#devices[@]}}
  if [ "$count" -gt "${#devices[@]}" ]; then
    echo "train-entrypoint: TRAIN_GPU_COUNT=$count but CUDA_VISIBLE_DEVICES lists ${#devices[@]} GPUs" >&2
    exit 2
  fi
  launcher=(--include "localhost:$(IFS=,; echo "${devices[*]:0:count}")")
elif [ -n "${TRAIN_GPU_COUNT:-}" ]; then
  launcher=(--num_gpus "$TRAIN_GPU_COUNT")
fi
exec deepspeed ${launcher[@]+"${launcher[@]}"} astrai/train.py --config "$config" "$@"
