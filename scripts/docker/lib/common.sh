# shellcheck shell=bash disable=SC2034,SC2154  # JOB_FILE is for the callers; plan_project comes from their eval
# Shared by scripts/train.sh and scripts/serve.sh (sourced, never run): paths, the host python that
# reads the job YAML, and the one way both call docker compose. The caller sets WRAPPER and `set -euo pipefail`.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
COMPOSE_FILE=$REPO/docker/docker-compose.yml
ENV_FILE=${TRAIN_ENV_FILE:-$REPO/.env.train}  # user-local settings; compose falls back to them
HOST_PYTHON=${ASTRAI_HOST_PYTHON:-python3}     # the host's python3 with PyYAML; AstrAI itself is not needed

die() { echo "$WRAPPER: $*" >&2; exit 2; }
warn() { echo "$WRAPPER: warning: $*" >&2; }

need_host_python() {
  command -v "$HOST_PYTHON" >/dev/null 2>&1 ||
    die "$HOST_PYTHON not found: the wrappers read the job YAML with python3 and PyYAML (Debian/Ubuntu: apt install python3 python3-yaml)"
}

# Sets JOB_FILE, absolute, from the argument or TRAIN_CONFIG_FILE; with `optional`, may leave it empty.
resolve_job_file() {
  local file=${1:-${TRAIN_CONFIG_FILE:-}}
  JOB_FILE=
  if [ -z "$file" ]; then
    [ "${2:-}" = optional ] && return 0
    die "no job YAML: give it as the last argument or set TRAIN_CONFIG_FILE"
  fi
  [ -f "$file" ] || die "job YAML $file not found"
  JOB_FILE=$(cd "$(dirname "$file")" && pwd)/$(basename "$file")
}

# Runs scripts/docker/<helper> and evals the shell it prints; its error (key named) ends the wrapper.
eval_runtime() {
  local helper=$1 output
  shift
  output=$("$HOST_PYTHON" "$REPO/scripts/docker/$helper" "$@") || die "cannot use the job YAML (see the error above)"
  eval "$output"
}

env_file_option() {
  if [ -f "$ENV_FILE" ]; then printf '%s\n' --env-file "$(cd "$(dirname "$ENV_FILE")" && pwd)/$(basename "$ENV_FILE")"; fi
}

# docker compose for this job's project. Shell variables beat --env-file in compose's interpolation:
# that is how the job YAML (exported by the caller) overrides .env.train.
compose() {
  # An empty CUDA_VISIBLE_DEVICES hides every GPU while an unset one shows them all: never pass it on empty.
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then unset CUDA_VISIBLE_DEVICES; fi
  local options=(-f "$COMPOSE_FILE" -p "$plan_project")
  local line
  while IFS= read -r line; do options+=("$line"); done < <(env_file_option)
  docker compose "${options[@]}" "$@"
}
