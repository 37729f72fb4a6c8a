#!/usr/bin/env bash
# scripts/serve.sh {up|run|down|logs|status} [JOB_YAML]   (or TRAIN_CONFIG_FILE=JOB_YAML)
#
# Serves a Hugging Face export of a job with vLLM's OpenAI-compatible server (the `server` service of
# docker/docker-compose.yml). The YAML's serve: section names the folder, image, port and model name;
# infra.gpu.devices picks the GPUs, as for training. Guide: docs/developer/docker-training.md.
#   up      start the server in the background (then logs, status, down)
#   run     run it in the foreground; the container is removed when it ends
#   down    stop and remove the server
#   logs    follow the server's output
#   status  show the server's container
# plan_* variables come from `eval` of the runtime helpers' output, which shellcheck cannot follow.
# shellcheck disable=SC2154
set -euo pipefail
WRAPPER=serve.sh
# shellcheck source-path=SCRIPTDIR source=docker/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/docker/lib/common.sh"

usage() { sed -n '2,11s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

# Exports SERVE_* and the GPU choice, then the resolved folder and name, and sets plan_*.
load_serve() {
  eval_runtime serve_runtime.py exports "$JOB_FILE"
  eval_runtime serve_runtime.py plan "$JOB_FILE" --env-file "$ENV_FILE"
  export SERVE_MODEL_DIR=$plan_model_dir SERVE_MODEL_NAME=$plan_model_name
}

main() {
  local command=${1:-}
  case $command in
    up | run | down | logs | status) shift ;;
    -h | --help) usage; return 0 ;;
    *) usage >&2; return 2 ;;
  esac
  [ $# -le 1 ] || die "$command takes one job YAML at most, got: $*"
  need_host_python
  resolve_job_file "${1:-}"
  load_serve
  case $command in
    up)
      compose up -d server
      echo "$WRAPPER: serving $plan_model_name from $plan_model_dir at http://localhost:$plan_port/v1 ($plan_project)" ;;
    run) compose run --rm --service-ports server ;;
    down) compose down ;;
    logs) compose logs -f server ;;
    status) compose ps -a server ;;
  esac
}

main "$@"
